"""One scrape of an instance's /metrics as plain numbers, for benchmarks, the soak and tests that read counters."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default TLS context, built once: a bare httpx.get builds one per call (~40 ms of CPU reading the CA
    bundle), which a caller polling /metrics every few tens of milliseconds pays on every scrape."""
    return httpx.create_ssl_context(trust_env=False)


def scrape_metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """GET url/metrics as {"name{labels}": value} (comment lines dropped; no proxy from the environment)."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=10, trust_env=False, verify=_tls_context()).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
