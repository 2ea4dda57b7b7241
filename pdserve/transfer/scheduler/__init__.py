"""The connectors' scheduler halves: engine thread only, pure Python (no torch, numpy or nixl; a test checks)."""
