"""The router's GET /metrics: its own counters in the Prometheus text format (no registry, no globals).

    pdserve_router_requests_total{route="whole"|"split"}   requests routed, by whether P was skipped
    pdserve_router_kv_choices_total{role}                   legs placed by the kv-aware cost
    pdserve_router_kv_hit_blocks_total{role}                cached blocks the chosen instances held (their sizes)
    pdserve_router_kv_hit_tokens_total{role}                the same in tokens
    pdserve_router_kv_prompt_tokens_total{role}             prompt tokens of those legs (hit rate = hit / prompt)
    pdserve_router_kv_stream_up{instance}                   1: its /kv_events stream is followed; 0: lost (load only)
    pdserve_router_kv_stream_failures_total{instance}       polls that failed (down, silent, malformed)
    pdserve_router_kv_stream_resyncs_total{instance}        snapshots after the first (gap, new epoch, after a loss)
    pdserve_router_kv_index_keys{instance}                  block keys the router holds for it
    pdserve_router_kv_index_evictions_total{instance}       keys dropped for --kv-index-max-keys
    pdserve_router_kv_events_ignored_total                  answers for an instance the router does not know

Single-threaded: written and read on the router's event loop.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pdserve.router.kv_index import KVIndex


@dataclass
class StreamState:
    """One instance's /kv_events stream as the router follows it."""

    up: bool = False  # the last poll was answered and applied
    num_failures: int = 0  # failed polls
    num_snapshots: int = 0  # snapshots applied (the first one is not a resync)
    last_error: str | None = None  # why the stream was last lost, for the log


@dataclass
class RouterMetrics:
    """Counters the router keeps; `render` writes them with the index's and the streams' state."""

    requests: Counter[str] = field(default_factory=Counter)  # "whole" | "split" -> requests
    kv_choices: Counter[str] = field(default_factory=Counter)  # role -> legs placed by the kv-aware cost
    kv_hit_blocks: Counter[str] = field(default_factory=Counter)  # role -> cached blocks at the chosen instance
    kv_hit_tokens: Counter[str] = field(default_factory=Counter)  # role -> cached tokens at the chosen instance
    kv_prompt_tokens: Counter[str] = field(default_factory=Counter)  # role -> prompt tokens of those legs
    streams: dict[str, StreamState] = field(default_factory=dict)  # instance URL -> its stream

    def kv_choice(self, role: str, hit_blocks: int, hit_tokens: int, prompt_tokens: int) -> None:
        self.kv_choices[role] += 1
        self.kv_hit_blocks[role] += hit_blocks
        self.kv_hit_tokens[role] += hit_tokens
        self.kv_prompt_tokens[role] += prompt_tokens

    def render(self, index: KVIndex | None) -> str:
        out: list[str] = []

        def family(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")
            out.extend(f"{name}{labels} {value:g}\n" for labels, value in samples)

        family(
            "pdserve_router_requests_total",
            "counter",
            "requests routed, whole (to one instance) or split (P and D)",
            [(_labels(route=r), self.requests[r]) for r in ("whole", "split")],
        )
        per_role = (
            ("kv_choices_total", "legs placed by the kv-aware cost", self.kv_choices),
            ("kv_hit_blocks_total", "prompt blocks cached at the chosen instance", self.kv_hit_blocks),
            ("kv_hit_tokens_total", "prompt tokens cached at the chosen instance", self.kv_hit_tokens),
            ("kv_prompt_tokens_total", "prompt tokens of legs placed by the kv-aware cost", self.kv_prompt_tokens),
        )
        for name, doc, counter in per_role:
            family(f"pdserve_router_{name}", "counter", doc, [(_labels(role=r), v) for r, v in sorted(counter.items())])
        streams = sorted(self.streams.items())
        family(
            "pdserve_router_kv_stream_up",
            "gauge",
            "1 while the instance's /kv_events stream is followed, 0 when lost (scored by load only)",
            [(_labels(instance=url), float(s.up)) for url, s in streams],
        )
        family(
            "pdserve_router_kv_stream_failures_total",
            "counter",
            "failed /kv_events polls",
            [(_labels(instance=url), s.num_failures) for url, s in streams],
        )
        family(
            "pdserve_router_kv_stream_resyncs_total",
            "counter",
            "snapshots taken after the first (gap, new epoch, after a lost stream)",
            [(_labels(instance=url), max(s.num_snapshots - 1, 0)) for url, s in streams],
        )
        instances = sorted(index.instances.items()) if index is not None else []
        family(
            "pdserve_router_kv_index_keys",
            "gauge",
            "block keys the router holds for the instance",
            [(_labels(instance=url), inst.num_keys) for url, inst in instances],
        )
        family(
            "pdserve_router_kv_index_evictions_total",
            "counter",
            "keys dropped for --kv-index-max-keys",
            [(_labels(instance=url), inst.num_evicted) for url, inst in instances],
        )
        ignored = index.num_ignored if index is not None else 0
        family(
            "pdserve_router_kv_events_ignored_total",
            "counter",
            "/kv_events answers for an instance the router does not know",
            [("", ignored)],
        )
        return "".join(out)


def _labels(**labels: str) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
