"""`pdserve demo`: the main job on the built-in model, on this CPU.

Stages: start 1P1D + router in push mode; ask one chat question and print the answer; start a pull
deployment beside it and sweep a small grid with the two modes interleaved point by point (so drift of this
shared machine hits both alike); print the push/pull table; write the plots and a timeline PNG and print
their paths. Every process it starts is stopped on the way out, also on
Ctrl-C or failure (see pdserve.bench.deploy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.bench.cli_sweep import terminate_as_interrupt
from pdserve.bench.deploy import Deployment, ServerOptions
from pdserve.bench.plot import plot_metric, summary_rows
from pdserve.bench.points import load_results
from pdserve.bench.sweep import Sweep
from pdserve.bench.sweep_config import Endpoints, SweepConfig
from pdserve.bench.timeline import draw, load_saved

QUESTION = "What is the capital of France? Answer in one sentence."
NUM_STAGES = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model for both servers (default: the built-in)")
    parser.add_argument("--question", default=QUESTION, help="the chat question asked first")
    parser.add_argument("--results-dir", type=Path, default=Path("results/demo"), help="where result JSONs and PNGs go")
    # sized for 2 busy cores: one 256-token prefill takes 0.5-2 s here, so these rates stay below saturation
    parser.add_argument("--qps", default="0.25,0.5", help="comma-separated request rates of the sweep")
    parser.add_argument("--input-lens", default="64,256", help="comma-separated prompt lengths of the sweep")
    parser.add_argument("--output-len", type=int, default=16, help="output tokens per sweep request")
    parser.add_argument("--num-prompts", type=int, default=6, help="requests per sweep point")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per server")
    parser.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for the servers to be healthy"
    )


def stage(index: int, text: str) -> None:
    print(f"[{index}/{NUM_STAGES}] {text}", flush=True)


def ask(router_url: str, model: str, question: str, max_tokens: int = 48) -> str:
    """One non-streaming chat completion through the router; returns the answer text."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    request = urllib.request.Request(
        router_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": "demo-question"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        data = json.loads(response.read())
    return data["choices"][0]["message"]["content"].strip()


def served_model(router_url: str) -> str:
    with urllib.request.urlopen(router_url + "/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def demo(args: argparse.Namespace) -> int:
    out_dir: Path = args.results_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    options = ServerOptions(model=args.model, num_threads=args.num_threads)
    qps = tuple(float(x) for x in args.qps.split(","))
    input_lens = tuple(int(x) for x in args.input_lens.split(","))
    sweep_cfg = dict(
        qps=qps,
        input_lens=input_lens,
        output_lens=(args.output_len,),
        iterations=1,
        num_prompts=args.num_prompts,
        results_dir=out_dir,
        server=options,
        num_warmups=2,
        save_timeline=True,
        interleave=True,
        startup_timeout_s=args.startup_timeout,
    )
    started = time.monotonic()
    stage(1, f"starting prefill + decode + router in push mode on {args.model} (logs in {out_dir / 'servers'})")
    with Deployment(options, "push", out_dir / "servers", startup_timeout_s=args.startup_timeout) as push:
        print(f"      router {push.router_url} (prefill {push.prefill_url}, decode {push.decode_url})", flush=True)
        stage(2, f"asking: {args.question}")
        t0 = time.monotonic()
        answer = ask(push.router_url, served_model(push.router_url), args.question)
        print(f"      answer ({time.monotonic() - t0:.1f} s): {answer}", flush=True)
        grid = f"qps {args.qps} x input {args.input_lens}, output {args.output_len}, {args.num_prompts} requests"
        stage(3, f"push vs pull sweep, modes interleaved ({grid}); starting a pull deployment beside push")
        attach = {"push": Endpoints(push.router_url, push.prefill_url, push.decode_url)}
        paths = Sweep(SweepConfig(modes=("push", "pull"), attach=attach, **sweep_cfg), log=_indent).run()

    stage(4, "push vs pull")
    points = load_results(paths)
    print(summary_rows(points, metrics=("ttft", "tpot", "e2el")))
    pngs = [plot_metric(points, metric, out_dir / f"{metric}.png") for metric in ("ttft", "tpot", "itl", "e2el")]
    saved = [out_dir / f"timeline_{mode}.json" for mode in ("push", "pull")]
    panels = [load_saved(path) for path in saved if path.exists()]
    last = f"-{len(qps) * len(input_lens) - 1}-"  # request ids are <mode>-<point>-<i>
    panels = [(mode, [t for t in tls if t.request_id.startswith(mode + last)]) for mode, tls in panels]
    panels = [(mode, tls) for mode, tls in panels if tls]  # the last point's requests
    if panels:
        pngs.append(draw(panels, out_dir / "timeline.png"))
    for png in pngs:
        print(f"wrote {png}")
    print(f"demo finished in {time.monotonic() - started:.0f} s; every server stopped", flush=True)
    return 0


def _indent(line: str) -> None:
    print(f"      {line}", flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        with terminate_as_interrupt():
            return demo(args)
    except KeyboardInterrupt:
        print("pdserve demo: interrupted; every server was stopped", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError, ValueError) as e:
        print(f"pdserve demo: {e}", file=sys.stderr)
        return 1
