"""`pdserve bench`: load-test any OpenAI-compatible server; flags and result JSON as `vllm bench serve`."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections.abc import Callable
from datetime import datetime
from typing import Any

import aiohttp

from pdserve.arg_types import non_negative_float, non_negative_int, positive_float, positive_int, rate, unit_interval
from pdserve.bench import workload
from pdserve.bench.client import ClientConfig
from pdserve.bench.dataset import random_requests
from pdserve.bench.metrics import calculate_metrics, format_quarters, format_summary, parse_goodput
from pdserve.bench.multiturn import ttft_turn_medians_ms
from pdserve.bench.runner import LoadConfig, run_load
from pdserve.bench.tokenizer import Vocab, load_vocab

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server or router URL")
    parser.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS, help="API path to load")
    parser.add_argument("--model", default=None, help="model name in requests (default: the server's first)")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer for prompts (default: --model; smollm2-135m is built in)"
    )
    parser.add_argument(
        "--num-prompts",
        type=positive_int,
        default=None,
        help=f"requests to send after warm-ups (default {workload.DEFAULT_NUM_PROMPTS}; multiturn: users x turns)",
    )
    parser.add_argument(
        "--request-rate",
        type=rate,
        default=math.inf,
        help="requests/s (multiturn: conversations started/s), Poisson arrivals; inf = all at once",
    )
    parser.add_argument(
        "--burstiness", type=positive_float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson"
    )
    parser.add_argument("--max-concurrency", type=positive_int, default=None, help="requests in flight at most")
    parser.add_argument(
        "--input-len",
        "--random-input-len",
        dest="input_len",
        type=positive_int,
        default=None,
        help="new prompt tokens per request: the whole prompt (random, default 1024), the user's tokens added "
        "each turn (multiturn, default 256), the question after the document (shared-prefix, default 128)",
    )
    parser.add_argument(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=positive_int,
        default=128,
        help="max_tokens per request",
    )
    parser.add_argument(
        "--random-range-ratio", type=unit_interval, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    parser.add_argument(
        "--temperature", type=non_negative_float, default=0.0, help="sampling temperature sent with each request"
    )
    parser.add_argument(
        "--no-return-token-ids",
        dest="return_token_ids",
        action="store_false",
        help="do not ask for per-chunk token ids (for servers that refuse vLLM's return_token_ids)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for prompts and arrival times")
    parser.add_argument(
        "--num-warmups",
        type=non_negative_int,
        default=0,
        help="untimed requests sent first, excluded from every figure (per-quarter medians included)",
    )
    parser.add_argument("--goodput", nargs="+", default=None, metavar="SLO:MS", help="e.g. ttft:500 tpot:50")
    parser.add_argument("--metric-percentiles", default="90,99", help="comma-separated percentiles to report")
    parser.add_argument("--save-result", action="store_true", help="write the result JSON (implied by below)")
    parser.add_argument("--result-dir", default=None, help="folder for the result JSON (none: not saved)")
    parser.add_argument("--result-filename", default=None, help="result file name (default: derived from the run)")
    parser.add_argument("--label", default="pdserve", help="prefix of the default result file name")
    parser.add_argument("--request-id-prefix", default=None, help="X-Request-Id prefix (default bench<seed>)")
    parser.add_argument("--timeout", type=positive_float, default=6 * 3600.0, help="seconds per request")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    workload.add_arguments(parser)


async def first_model(base_url: str) -> tuple[str, str]:
    """The id (and root, when given) of the first model the server lists."""
    async with aiohttp.ClientSession() as session, session.get(f"{base_url}/v1/models") as response:
        response.raise_for_status()
        data = (await response.json())["data"]
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return data[0]["id"], data[0].get("root") or data[0]["id"]


def result_path(args: argparse.Namespace, model: str) -> str | None:
    """Where the JSON goes, or None when no result is to be saved."""
    if not (args.save_result or args.result_dir or args.result_filename):
        return None
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = (
        args.result_filename
        or f"{args.label}-{args.request_rate}qps{concurrency}-{os.path.basename(model)}-{stamp}.json"
    )
    return os.path.join(args.result_dir, name) if args.result_dir else name


async def benchmark(args: argparse.Namespace, vocab: Vocab | None = None, log: Callable[[str], None] = print) -> dict:
    """Run one benchmark as the flags say and return its result dict (also saved when asked)."""
    base_url = args.base_url.rstrip("/")
    if args.model is None:
        args.model, root = await first_model(base_url)
    else:
        root = args.model
    is_chat = args.endpoint == "/v1/chat/completions"
    if vocab is None:
        vocab = load_vocab(args.tokenizer or root)
    percentiles = [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
    goodput = parse_goodput(args.goodput)
    load = LoadConfig(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        timeout_s=args.timeout,
        show_progress=not args.disable_tqdm,
    )
    prefix = args.request_id_prefix or f"bench{args.seed}"
    args.num_prompts = workload.resolve_num_prompts(args)
    args.input_len = workload.input_len(args)
    work = workload.build(args, vocab, is_chat, prefix)
    warmups = []
    if args.num_warmups > 0:  # random prompts of their own: they warm the server without seeding its prefix cache
        warmups = random_requests(
            vocab,
            args.num_warmups,
            work.warmup_input_len,
            args.output_len,
            0.0,
            args.seed + 7919,
            is_chat,
            prefix + "-warmup",
        )
    client = ClientConfig(
        api_url=base_url + args.endpoint,
        model=args.model,
        is_chat=is_chat,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        return_token_ids=args.return_token_ids,
    )
    log(
        f"bench: {args.num_prompts} requests to {client.api_url}, dataset {args.dataset} {work.params}, "
        f"rate {args.request_rate} {'conversations' if args.dataset == 'multiturn' else 'req'}/s (burstiness "
        f"{args.burstiness}), max concurrency {args.max_concurrency}, {args.num_warmups} warmups"
    )
    outputs, duration = await run_load(client, work.arrivals, load, warmups)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if is_chat else "openai",
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model_id": args.model,
        "tokenizer_id": vocab.name,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "random_range_ratio": args.random_range_ratio,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "goodput_slos_ms": goodput or None,
        "dataset": args.dataset,
        "dataset_params": work.params,
    }
    result.update(calculate_metrics(outputs, duration, goodput, percentiles))
    if args.dataset == "multiturn":  # TTFT by place in the conversation: later turns resend longer histories
        ttfts = [o.ttft if o.success else None for o in outputs]
        result["ttft_turn_medians_ms"] = ttft_turn_medians_ms(result["turns"], ttfts)
    log(format_summary(result, percentiles))
    if "ttft_turn_medians_ms" in result:
        log(f"median TTFT per turn (ms): {format_quarters(result['ttft_turn_medians_ms'])}")
    path = result_path(args, args.model)
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        log(f"result written to {path}")
    return result


def run(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(benchmark(args))
    except (ValueError, RuntimeError, aiohttp.ClientError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    return 0 if result["completed"] > 0 else 1
