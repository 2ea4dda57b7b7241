"""One scrape of an instance's /metrics as plain numbers, for benchmarks, the soak and tests that read counters."""

from __future__ import annotations

import httpx


def scrape_metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """GET url/metrics as {"name{labels}": value} (comment lines dropped; no proxy from the environment)."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=10, trust_env=False).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
