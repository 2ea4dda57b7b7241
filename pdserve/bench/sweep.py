"""The push-vs-pull(-vs-colocated) sweep: per mode, a 1P1D deployment (or two colocated instances; started or
attached), one bench per grid point.

With goodput SLOs every point's JSON has `request_goodput` and `slo_attainment`. The max-goodput search
(`find_max_goodput`) climbs the request rates in increasing order and, per mode and (input, output), stops
after the first rate whose SLO attainment (pooled over its iterations) falls below the threshold.

Every point writes `<results_dir>/<mode>_qps<q>_in<in>_out<out>_iter<i>.json` (the bench result plus `mode`,
`qps`, `iteration`; per instance its prefix hits and KV bytes over the point: bench/instances.py) and a `.log`
beside it. Servers' own logs go to `<results_dir>/servers/`. Points of
both modes use the same seeds, so push and pull see the same prompts; within a mode every point has its
own prompts and request ids, so the prefill instance's prefix cache never shortcuts a run. The grid, the arms
and a point's names and bench flags are sweep_config.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

from pdserve.bench import cli_bench
from pdserve.bench.deploy import Deployment
from pdserve.bench.instances import PointCounters, instances_of
from pdserve.bench.metrics import format_quarters
from pdserve.bench.phases import PHASES, phase_medians
from pdserve.bench.sweep_config import Arm, Endpoints, SweepConfig, bench_argv, format_qps, point_stem
from pdserve.bench.timeline import fetch, save
from pdserve.bench.tokenizer import Vocab, load_vocab


def _parse_bench(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench")
    cli_bench.add_arguments(parser)
    return parser.parse_args(argv)


class Sweep:
    """Runs a SweepConfig; `log` receives one progress line per stage and point.

    Sequential (default): one mode's deployment at a time, all its points, then the next mode.
    Interleaved: every mode's deployment up at once, and each point run for every mode before the next
    point, so slow drift of the machine (other load, thermals) hits both modes alike.
    """

    def __init__(self, cfg: SweepConfig, log: Callable[[str], None] = print):
        self.cfg = cfg
        self.log = log
        self.written: list[Path] = []  # result JSONs, in run order
        self._vocab: Vocab | None = None
        # max-goodput search: (mode, input, output) -> rate -> [(slo_attainment, num_prompts) per iteration]
        self._attained: dict[tuple[str, int, int], dict[float, list[tuple[float, int]]]] = {}

    def vocab(self) -> Vocab:
        if self._vocab is None:
            name = self.cfg.tokenizer or (self.cfg.server.model if self.cfg.server else None)
            if name is None:
                raise ValueError("attached sweeps need --tokenizer (or --model) to build prompts")
            self._vocab = load_vocab(name)
        return self._vocab

    def run(self) -> list[Path]:
        self.cfg.results_dir.mkdir(parents=True, exist_ok=True)
        self.vocab()  # fail before starting any server
        arms = self.cfg.arms()
        groups = [arms] if self.cfg.interleave else [[arm] for arm in arms]
        for group in groups:
            with ExitStack() as stack:
                ends = {arm: self._bring_up(arm, stack) for arm in group}
                for arm in group:
                    self._warm_up(arm.label, ends[arm][0])
                for index, point in enumerate(self.cfg.points()):
                    for arm in group:
                        self._run_point(arm, *ends[arm], index, point)
                for arm in group:
                    self._save_timeline(arm, ends[arm][0])
            for arm in group:
                if arm.mode not in self.cfg.attach:
                    self.log(f"[{arm.label}] stopped")
        return self.written

    def _bring_up(self, arm: Arm, stack: ExitStack) -> tuple[Endpoints, Deployment | None]:
        """The arm's endpoints: attached, or a deployment started now and stopped when `stack` closes."""
        mode, label, cfg = arm.mode, arm.label, self.cfg
        if mode in cfg.attach:
            self.log(f"[{label}] attached to {cfg.attach[mode].router_url}")
            return cfg.attach[mode], None
        assert cfg.server is not None
        num_p, num_d = cfg.num_prefill, cfg.num_decode
        parts = (
            f"{num_p + num_d} --kv-role both instances" if mode == "colocated" else f"{num_p} prefill + {num_d} decode"
        )
        self.log(f"[{label}] starting {parts} + router ({cfg.server.model})")
        start = time.monotonic()
        router_args = () if mode == "colocated" else cfg.router_args
        if arm.routing is not None:
            router_args = (*router_args, "--routing", arm.routing)
        deployment = Deployment(
            cfg.server,
            mode,
            cfg.results_dir / "servers",
            startup_timeout_s=cfg.startup_timeout_s,
            router_args=router_args,
            num_prefill=num_p,
            num_decode=num_d,
            label=label,
        )
        stack.enter_context(deployment)
        self.log(f"[{label}] healthy after {time.monotonic() - start:.1f} s: router {deployment.router_url}")
        if mode == "colocated":  # no prefill/decode pair: no P/D timeline
            return Endpoints(deployment.router_url, instance_urls=tuple(deployment.instance_urls)), deployment
        ends = Endpoints(
            deployment.router_url,
            deployment.prefill_url,
            deployment.decode_url,
            more_prefill_urls=tuple(deployment.prefill_urls[1:]),
            more_decode_urls=tuple(deployment.decode_urls[1:]),
        )
        return ends, deployment

    def _warm_up(self, mode: str, ends: Endpoints) -> None:
        cfg = self.cfg
        if cfg.num_warmups <= 0:
            return
        _, input_len, output_len, _ = cfg.points()[0]
        warm = (math.inf, input_len, output_len, 0)
        args = _parse_bench(bench_argv(cfg, ends.router_url, warm, cfg.seed + 999_983, f"{mode}-warmup"))
        args.num_prompts, args.dataset = cfg.num_warmups, "random"  # warm-ups: random, whatever the dataset
        self.log(f"[{mode}] warming up with {cfg.num_warmups} requests")
        asyncio.run(cli_bench.benchmark(args, self.vocab(), log=lambda _: None))

    def is_past_max(self, mode: str, point: tuple[float, int, int, int]) -> bool:
        """Searching: whether a lower rate of this mode and (input, output) already missed the threshold."""
        qps, input_len, output_len, _ = point
        for rate, runs in self._attained.get((mode, input_len, output_len), {}).items():
            if rate < qps and pooled_attainment(runs) < self.cfg.goodput_threshold:
                return True
        return False

    def _run_point(self, arm: Arm, ends: Endpoints, deployment: Deployment | None, index: int, point: tuple) -> None:
        cfg = self.cfg
        mode = arm.label  # results, files and the goodput search name the arm; phases need the transfer mode
        if cfg.find_max_goodput and self.is_past_max(mode, point):
            return
        for proc in deployment.procs if deployment else ():
            if not proc.is_alive():
                raise RuntimeError(f"{proc.name} died (code {proc.proc.returncode}):\n{proc.log_tail()}")
        stem = point_stem(mode, *point)
        seed = cfg.seed + 1000 * index  # equal across modes: push and pull get the same prompts
        argv = bench_argv(cfg, ends.router_url, point, seed, f"{mode}-{index}")
        args = _parse_bench(argv)
        instances = instances_of(ends.prefill_urls, ends.decode_urls, ends.instance_urls)
        counters = PointCounters(instances, lambda line: self.log(f"[{mode}] {line}"))
        counters.start()  # every instance's counters right before the point (bench/instances.py)
        with open(cfg.results_dir / f"{stem}.log", "w") as log_file:
            log_file.write("$ pdserve bench " + " ".join(argv) + "\n")
            result = asyncio.run(cli_bench.benchmark(args, self.vocab(), log=lambda s: print(s, file=log_file)))
        qps, _, _, iteration = point
        result.update(mode=mode, qps=format_qps(qps), iteration=iteration)
        if arm.routing is not None:
            result.update(transfer_mode=arm.mode, routing=arm.routing)
        result.update(self._phases(arm.mode, ends, result))
        result.update(counters.finish(result["completed"]))
        path = cfg.results_dir / f"{stem}.json"
        path.write_text(json.dumps(result, indent=1))
        self.written.append(path)
        drift = result["ttft_drift"]
        goodput = ""
        if result.get("slo_attainment") is not None:
            attained = self._attained.setdefault((mode, point[1], point[2]), {})
            attained.setdefault(point[0], []).append((result["slo_attainment"], cfg.num_prompts))
            goodput = f", goodput {result['request_goodput']:.2f} req/s, SLO attainment {result['slo_attainment']:.0%}"
        self.log(
            f"[{mode}] {stem}: {result['completed']}/{cfg.num_prompts} ok, "
            f"median TTFT {result['median_ttft_ms']:.1f} ms, TPOT {result['median_tpot_ms']:.1f} ms, "
            f"TTFT per quarter {format_quarters(result['ttft_quarter_medians_ms'])} ms, "
            f"drift {'-' if drift is None else f'{drift:.2f}'}{goodput}"
        )

    def _phases(self, mode: str, ends: Endpoints, result: dict) -> dict:
        """Where this point's TTFT went (bench/phases.py), from the servers' /timeline; {} when they are not
        known (attached without their URLs) or do not answer."""
        if mode == "colocated":
            sources = [list(ends.instance_urls), []]
        else:
            sources = [ends.prefill_urls, ends.decode_urls]
        if not sources[0] or mode not in PHASES:
            return {}
        try:
            entries = [[e for url in urls for e in fetch(url)] for urls in sources]
        except (OSError, ValueError) as e:
            self.log(f"[{mode}] no phases: {e}")
            return {}
        return phase_medians(mode, result, entries[0], entries[1])

    def _save_timeline(self, arm: Arm, ends: Endpoints) -> None:
        if not self.cfg.save_timeline or not (ends.prefill_url or ends.decode_url):
            return
        path = self.cfg.results_dir / f"timeline_{arm.label}.json"
        try:
            p_entries = [e for url in ends.prefill_urls for e in fetch(url)]
            d_entries = [e for url in ends.decode_urls for e in fetch(url)]
            save(path, arm.mode, p_entries, d_entries, _router_entries(ends.router_url))
            self.log(f"[{arm.label}] timeline written to {path}")
        except OSError as e:
            self.log(f"[{arm.label}] no timeline: {e}")


def _router_entries(url: str) -> list[dict]:
    """The router's /timeline (its edge events split router->P and the relay: bench/phase_split.py); [] from a
    router without one (an older pdserve, another proxy)."""
    try:
        return fetch(url)
    except (OSError, ValueError):
        return []


def pooled_attainment(runs: Sequence[tuple[float, int]]) -> float:
    """[(slo_attainment, num_requests) per iteration] -> the fraction of all their requests within the SLOs."""
    total = sum(n for _, n in runs)
    return sum(a * n for a, n in runs) / total if total else 0.0


def summary_table(paths: Sequence[Path]) -> str:
    """The modes side by side, one row per (qps, input, output): median TTFT and TPOT over every request of
    every iteration, goodput and SLO attainment when SLOs were given, and per mode TTFT's median per quarter of
    the run with its drift (last / first quarter)."""
    from pdserve.bench.plot import summary_rows
    from pdserve.bench.points import load_results

    return summary_rows(load_results(paths))
