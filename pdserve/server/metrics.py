"""Prometheus metrics of one instance, read from the engine's stats at scrape time.

The names are a contract (tests, dashboards and the reliability work read them); do not rename:
gauges   pdserve_kv_blocks_total, pdserve_kv_blocks_free, pdserve_requests_running,
         pdserve_requests_waiting, pdserve_requests_waiting_for_kv, pdserve_kv_prepared_writes
counters pdserve_kv_sent_bytes_total, pdserve_kv_received_bytes_total, pdserve_kv_transfers_total{result},
         pdserve_requests_started_total, pdserve_prompt_tokens_total, pdserve_prefix_cache_hit_tokens_total,
         pdserve_side_channel_refused_total{reason},
         pdserve_engine_steps_total, pdserve_engine_step_failures_total, pdserve_engine_transfer_hook_seconds_total
histos   pdserve_time_to_first_token_seconds, pdserve_kv_transfer_seconds, pdserve_kv_transfer_descriptors
         (per posted READ/WRITE: many means a fragmented cache), pdserve_kv_transfer_post_seconds (NIXL's time
         to accept a transfer: grows with descriptors)

Each app gets its own CollectorRegistry (no process-global state, so several apps can live in one test
process). Gauges and counters are the engine's own cumulative numbers, read on each scrape; the histograms
are fed with the observations `stats()` drained since the previous scrape, so this collector must be the
only caller of `stats()` that uses those lists.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.client import EngineStats

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
POST_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

GAUGES = (  # metric name, EngineStats field, help
    ("pdserve_kv_blocks_total", "num_blocks_total", "KV cache blocks of this instance"),
    ("pdserve_kv_blocks_free", "num_blocks_free", "KV blocks free or held only by the prefix cache (evictable)"),
    ("pdserve_requests_running", "num_running", "Requests in the running batch"),
    ("pdserve_requests_waiting", "num_waiting", "Requests waiting to be scheduled"),
    ("pdserve_requests_waiting_for_kv", "num_waiting_for_kv", "Requests parked until their remote KV lands"),
    (
        "pdserve_kv_prepared_writes",
        "num_prepared_writes",
        "Push WRITEs laid out before their prefill ended and not yet posted (0 when idle: more is a leak)",
    ),
)
COUNTERS = (  # metric name without _total, EngineStats field, help
    ("pdserve_kv_sent_bytes", "kv_sent_bytes", "KV bytes this instance sent (pushed or had read by a peer)"),
    ("pdserve_kv_received_bytes", "kv_received_bytes", "KV bytes this instance received"),
    (
        "pdserve_requests_started",
        "num_requests_started",
        "Requests that left the waiting queue (scheduled, or parked for remote KV); each counted once",
    ),
    ("pdserve_prompt_tokens", "num_prompt_tokens", "Prompt tokens of the requests started here"),
    (
        "pdserve_prefix_cache_hit_tokens",
        "num_prefix_hit_tokens",
        "Of those prompt tokens, the ones this instance's own prefix cache served (received KV is not a hit)",
    ),
    ("pdserve_engine_steps", "num_engine_steps", "Engine loop steps"),
    ("pdserve_engine_step_failures", "num_step_failures", "Engine steps that raised (their requests failed)"),
    (
        "pdserve_kv_checksum_failures",
        "kv_checksum_failures",
        "Received KV that did not match the prefill's checksum (--kv-checksum; the request failed or recomputed)",
    ),
    (
        "pdserve_engine_transfer_hook_seconds",
        "transfer_hook_seconds",
        "Engine-loop time spent handing work to and taking results from the KV transfer thread",
    ),
)
TRANSFER_RESULTS = (("ok", "transfers_ok"), ("failed", "transfers_failed"), ("expired", "transfers_expired"))


class EngineCollector(Collector):
    """Collects the pdserve_* metrics from `stats_fn()` (an EngineStats) on every scrape."""

    def __init__(self, stats_fn: Callable[[], EngineStats]) -> None:
        self._stats_fn = stats_fn
        self._lock = threading.Lock()  # scrapes may run concurrently in the thread pool
        self._ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Time from arrival to the first generated token",
            buckets=TTFT_BUCKETS,
            registry=None,
        )
        self._transfer = Histogram(
            "pdserve_kv_transfer_seconds",
            "Duration of one KV transfer, from posting to completion",
            buckets=TRANSFER_BUCKETS,
            registry=None,
        )

        self._descs = Histogram(
            "pdserve_kv_transfer_descriptors",
            "NIXL descriptors of one posted KV READ or WRITE (one per contiguous run of blocks)",
            buckets=DESCRIPTOR_BUCKETS,
            registry=None,
        )
        self._post = Histogram(
            "pdserve_kv_transfer_post_seconds",
            "Time NIXL took to accept one KV READ or WRITE (grows with its descriptors)",
            buckets=POST_BUCKETS,
            registry=None,
        )

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            try:
                stats = self._stats_fn()
            except Exception:  # engine not started yet, or shut down: export nothing from it
                log.debug("engine stats unavailable", exc_info=True)
                stats = None
            if stats is not None:
                for value in stats.ttft_seconds:
                    self._ttft.observe(value)
                for value in stats.transfer_seconds:
                    self._transfer.observe(value)
                for count in stats.transfer_descriptors:
                    self._descs.observe(count)
                for value in stats.transfer_post_seconds:
                    self._post.observe(value)
                yield from self._from_stats(stats)
            yield from self._ttft.collect()
            yield from self._transfer.collect()
            yield from self._descs.collect()
            yield from self._post.collect()

    @staticmethod
    def _from_stats(stats: EngineStats) -> Iterator[Metric]:
        for name, field, help_text in GAUGES:
            yield GaugeMetricFamily(name, help_text, value=getattr(stats, field))
        for name, field, help_text in COUNTERS:
            yield CounterMetricFamily(name, help_text, value=getattr(stats, field))
        transfers = CounterMetricFamily("pdserve_kv_transfers", "KV transfers by result", labels=["result"])
        for result, field in TRANSFER_RESULTS:
            transfers.add_metric([result], getattr(stats, field))
        yield transfers
        refused = CounterMetricFamily(
            "pdserve_side_channel_refused",
            "Side-channel connections and requests refused, by reason (transfer/thread/side_admission.py)",
            labels=["reason"],
        )
        for reason, count in sorted(stats.side_channel_refused.items()):
            refused.add_metric([reason], count)
        yield refused


def make_registry(stats_fn: Callable[[], EngineStats]) -> CollectorRegistry:
    """A fresh registry holding the engine collector (one per app)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats_fn))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text exposition of `registry`."""
    return generate_latest(registry)
