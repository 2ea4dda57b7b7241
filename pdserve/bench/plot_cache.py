"""What the caches did, per arm: the prefix hit rate, the KV moved per request and the TTFT per conversation turn
(`pdserve plot`; the keys bench/instances.py and bench/multiturn.py write into each result JSON).

These are how KV-aware routing is judged against least-loaded (docs/benchmarks.md, "KV-aware routing"): a
higher hit rate, less KV moved and a TTFT that stays flat as a conversation's history grows. Results without
the keys (a sweep without instance scrapes, an attached deployment) print "-" and are left out of the panels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.points import MODE_COLORS, Point

MIB = float(1 << 20)


def _has_cache_keys(p: Point) -> bool:
    return not math.isnan(p.prefix_hit_rate()) or not math.isnan(p.kv_bytes_per_request())


def cache_lines(points: Sequence[Point]) -> list[str]:
    """Lines like `qps 1 in 2048 out 64 push-kv-aware: prefix hit 73%, KV moved 13.1 MiB/request, TTFT per
    turn 35/59/72/78/94/107 ms`; none for points without cache keys or turns."""
    lines = []
    for p in points:
        turns = p.turn_medians_ms()
        if not _has_cache_keys(p) and not turns:
            continue
        hit, moved = p.prefix_hit_rate(), p.kv_bytes_per_request()
        parts = [
            "prefix hit -" if math.isnan(hit) else f"prefix hit {100 * hit:.0f}%",
            "KV moved -" if math.isnan(moved) else f"KV moved {moved / MIB:.1f} MiB/request",
        ]
        if turns:
            parts.append("TTFT per turn " + "/".join("-" if math.isnan(t) else f"{t:.0f}" for t in turns) + " ms")
        lines.append(f"qps {p.qps:g} in {p.input_len} out {p.output_len} {p.mode}: " + ", ".join(parts))
    return lines


def plot_cache(points: Sequence[Point], out: Path, title: str | None = None) -> Path | None:
    """Bars of the prefix hit rate and the KV moved per request per arm and grid point, and (multi-turn) the
    median TTFT per turn per arm; None (nothing written) when no point has any of them."""
    cached = [p for p in points if _has_cache_keys(p)]
    with_turns = [p for p in points if p.turn_medians_ms()]
    if not cached and not with_turns:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (2 if cached else 0) + (1 if with_turns else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.0 * panels + 0.6, 4.0), squeeze=False)
    ax_iter = iter(axes[0])
    if cached:
        labels = [f"{p.mode} {p.qps:g}/s in {p.input_len}" for p in cached]
        colors = [MODE_COLORS.get(p.mode.split("-")[0], "tab:gray") for p in cached]
        for ax, values, ylabel in (
            (next(ax_iter), [100 * p.prefix_hit_rate() for p in cached], "prefix hit rate (%, every instance)"),
            (next(ax_iter), [p.kv_bytes_per_request() / MIB for p in cached], "KV moved per request (MiB)"),
        ):
            ax.bar(range(len(cached)), [0.0 if math.isnan(v) else v for v in values], color=colors)
            ax.set_xticks(range(len(cached)), labels, fontsize="small", rotation=40, ha="right")
            ax.set_ylabel(ylabel)
            ax.grid(True, axis="y", alpha=0.3)
    if with_turns:
        ax = next(ax_iter)
        for p in with_turns:
            turns = p.turn_medians_ms()
            ax.plot(range(1, len(turns) + 1), turns, marker="o", label=f"{p.mode} {p.qps:g}/s in {p.input_len}")
        ax.set_xlabel("turn of the conversation")
        ax.set_ylabel("median TTFT (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title or "caches per arm: prefix hits, KV moved, TTFT by turn")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
