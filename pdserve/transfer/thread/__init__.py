"""The connectors' worker halves: everything that runs on the transfer thread (and the side-channel thread)."""
