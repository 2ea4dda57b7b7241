"""What `pdserve sweep` runs: its modes and routings (arms), the grid of points, where each arm's deployment
answers, and the names and `pdserve bench` flags of one point. Pure data: sweep.py runs it."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.deploy import ServerOptions
from pdserve.bench.metrics import parse_goodput
from pdserve.router.policy import POLICIES

MODES = ("push", "pull", "colocated")
DEFAULT_MODES = ("push", "pull")
ROUTINGS = POLICIES  # `pdserve proxy --routing` values (router/policy.py: pure, no HTTP)


@dataclass(frozen=True)
class Arm:
    """One deployment the sweep compares: a mode, and the router's --routing when the sweep compares routings."""

    mode: str  # push | pull | colocated
    routing: str | None = None  # None: the router's default (or what --router-arg says)

    @property
    def label(self) -> str:
        """What results and file names call it: the mode, or mode-routing (`pull-kv-aware`)."""
        return self.mode if self.routing is None else f"{self.mode}-{self.routing}"


@dataclass(frozen=True)
class Endpoints:
    """Where one mode's deployment answers."""

    router_url: str  # what the bench loads
    prefill_url: str | None = None  # for /timeline; None when unknown (attached without it)
    decode_url: str | None = None
    instance_urls: tuple[str, ...] = ()  # colocated: the instances behind the router (their /timeline)
    more_prefill_urls: tuple[str, ...] = ()  # prefill instances after the first (their /timeline too)
    more_decode_urls: tuple[str, ...] = ()  # decode instances after the first

    @property
    def prefill_urls(self) -> list[str]:
        return ([self.prefill_url] if self.prefill_url else []) + list(self.more_prefill_urls)

    @property
    def decode_urls(self) -> list[str]:
        return ([self.decode_url] if self.decode_url else []) + list(self.more_decode_urls)


@dataclass(frozen=True)
class SweepConfig:
    """The grid and how each point is benchmarked."""

    modes: tuple[str, ...]
    qps: tuple[float, ...]
    input_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    iterations: int
    num_prompts: int
    results_dir: Path
    server: ServerOptions | None  # None when every mode is attached
    attach: dict[str, Endpoints] = field(default_factory=dict)  # mode -> running deployment
    tokenizer: str | None = None  # default: the server model
    max_concurrency: int | None = None
    burstiness: float = 1.0
    ignore_eos: bool = True
    random_range_ratio: float = 0.0
    num_warmups: int = 2  # per deployment, before its first point
    seed: int = 0
    endpoint: str = "/v1/completions"
    save_timeline: bool = False  # write <results_dir>/timeline_<mode>.json from the servers' /timeline
    interleave: bool = False  # all modes' deployments up at once, points alternating between modes
    startup_timeout_s: float = 600.0
    goodput: tuple[str, ...] = ()  # SLOs as `pdserve bench --goodput` takes them: ("ttft:1000", "tpot:25")
    find_max_goodput: bool = False  # climb the rates per mode until attainment < goodput_threshold
    goodput_threshold: float = 0.9  # SLO attainment (fraction) a rate must reach to count as sustained
    router_args: tuple[str, ...] = ()  # extra `pdserve proxy` flags for the routers of the pull/push modes
    dataset_args: tuple[str, ...] = ()  # `pdserve bench` dataset flags (workload.bench_argv); () = random
    routings: tuple[str, ...] = ()  # compare these `pdserve proxy --routing` values per mode; () = one arm per mode
    num_prefill: int = 1  # prefill instances of each started P/D deployment
    num_decode: int = 1  # decode instances (colocated: num_prefill + num_decode instances)

    def __post_init__(self) -> None:
        for mode in self.modes:
            if mode not in MODES:
                raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        if self.server is None and any(m not in self.attach for m in self.modes):
            raise ValueError("a model is needed to start the modes that are not attached")
        for routing in self.routings:
            if routing not in ROUTINGS:
                raise ValueError(f"routing {routing!r} is not one of {', '.join(ROUTINGS)}")
        if self.routings and self.attach:
            raise ValueError("--routings compares deployments the sweep starts; it cannot be combined with --attach")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("num_prefill and num_decode must be >= 1")
        if self.iterations < 1 or self.num_prompts < 1:
            raise ValueError("iterations and num_prompts must be >= 1")
        parse_goodput(self.goodput)  # raises ValueError on a malformed SLO
        if self.find_max_goodput and not self.goodput:
            raise ValueError("the max-goodput search needs SLOs: --goodput ttft:MS tpot:MS")
        if not 0 < self.goodput_threshold <= 1:
            raise ValueError(f"goodput threshold must be in (0, 1], got {self.goodput_threshold}")

    def arms(self) -> list[Arm]:
        """The deployments compared, in run order: every mode, times every routing when routings are given."""
        return [Arm(mode, routing) for mode in self.modes for routing in (self.routings or (None,))]

    def points(self) -> list[tuple[float, int, int, int]]:
        """(qps, input_len, output_len, iteration) in run order (rates ascending when searching)."""
        rates = sorted(self.qps) if self.find_max_goodput else self.qps
        grid = itertools.product(rates, self.input_lens, self.output_lens, range(self.iterations))
        return [(q, i, o, it) for q, i, o, it in grid]


def format_qps(qps: float) -> str:
    """1.0 -> "1", 0.5 -> "0.5", inf -> "inf": the qps part of result file names."""
    if math.isinf(qps):
        return "inf"
    return str(int(qps)) if qps == int(qps) else f"{qps:g}"


def point_stem(mode: str, qps: float, input_len: int, output_len: int, iteration: int) -> str:
    return f"{mode}_qps{format_qps(qps)}_in{input_len}_out{output_len}_iter{iteration}"


def bench_argv(
    cfg: SweepConfig, base_url: str, point: tuple[float, int, int, int], seed: int, prefix: str
) -> list[str]:
    """The `pdserve bench` flags of one point (also written to its log, so a point can be rerun by hand)."""
    qps, input_len, output_len, _ = point
    argv = ["--base-url", base_url, "--endpoint", cfg.endpoint, "--num-prompts", str(cfg.num_prompts)]
    argv += ["--request-rate", str(qps), "--burstiness", str(cfg.burstiness), "--seed", str(seed)]
    argv += ["--input-len", str(input_len), "--output-len", str(output_len), "--request-id-prefix", prefix]
    argv += ["--random-range-ratio", str(cfg.random_range_ratio), "--disable-tqdm", *cfg.dataset_args]
    if cfg.max_concurrency:
        argv += ["--max-concurrency", str(cfg.max_concurrency)]
    if cfg.ignore_eos:
        argv.append("--ignore-eos")
    if cfg.tokenizer:
        argv += ["--tokenizer", cfg.tokenizer]
    if cfg.goodput:
        argv += ["--goodput", *cfg.goodput]
    return argv
