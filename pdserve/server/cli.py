"""`pdserve serve MODEL`: one engine instance behind the OpenAI-compatible HTTP API (flags follow vLLM's)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.arg_types import non_negative_int, port, positive_float, positive_int
from pdserve.auth import unauthenticated_listen_error
from pdserve.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pdserve.credentials import add_internal_key_arguments, credentials_from
from pdserve.http_port import STARTUP_FAILURE, bind_port_zero
from pdserve.server.transfer_args import add_transfer_arguments, transfer_config_from

if TYPE_CHECKING:
    from pdserve.engine.async_engine import AsyncEngine

log = logging.getLogger("pdserve.server")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_num_threads(role: str) -> int:
    """Torch threads when --num-threads is not given: every core for a colocated instance, half of them for
    a prefill or decode instance (a 1P1D pair usually shares one machine)."""
    cores = available_cores()
    return cores if role == "both" else max(1, cores // 2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in/preset name (e.g. smollm2-135m), Hugging Face model folder, or .gguf file")
    g = p.add_argument_group("HTTP")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; 0.0.0.0 for all); a prefill or decode instance listens beyond "
        "loopback only with a deployment secret (--kv-auth-secret-file) or --insecure-no-kv-auth",
    )
    g.add_argument(
        "--port", type=port, default=8000, help="HTTP port (default 8000; 0: the kernel picks one, printed on stderr)"
    )
    g.add_argument(
        "--served-model-name", nargs="+", default=None, help="name(s) clients use in `model` (default: MODEL)"
    )
    g.add_argument(
        "--max-body-mb",
        type=positive_float,
        default=32.0,
        help="refuse request bodies larger than this many MiB with HTTP 413 (default 32)",
    )
    g.add_argument(
        "--max-inflight-requests",
        type=non_negative_int,
        default=1024,
        help="requests this instance holds at once (running, queued or streaming); past it new requests get "
        "HTTP 503 with Retry-After (default 1024; 0 = no limit)",
    )
    g.add_argument(
        "--max-queue-wait-s",
        type=positive_float,
        default=None,
        help="a request still queued after this many seconds (the engine has not started computing it, nor, on "
        "a decode instance, receiving its KV) is aborted and answered 503 with Retry-After; one that has started "
        "runs to its end (default: no deadline)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="the client key: require `Authorization: Bearer KEY` on every route but /health (/v1/*, /metrics; "
        "also /timeline and /kv_transfer/* unless --internal-api-key is set); default: no key",
    )
    add_internal_key_arguments(g, is_router=False)
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")

    g = p.add_argument_group("model")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights/KV dtype")
    g.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 (default cpu)")
    g.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"], help="dummy = random weights for a preset shape"
    )
    g.add_argument(
        "--max-model-len", type=positive_int, default=None, help="context length (default: the model's, <= 8192)"
    )
    g.add_argument("--seed", type=int, default=0, help="seed for dummy weights (default 0)")
    g.add_argument(
        "--num-threads",
        type=positive_int,
        default=None,
        help="torch intra-op threads on the CPU, per rank (default: all cores for --kv-role both, half for "
        "prefill/decode; divided among tensor-parallel ranks)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run every step eagerly (no captured decode graphs); slower, for comparison and debugging",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        help="split the model over this many ranks, one process each (rank 0 serves HTTP and schedules; the "
        "others are spawned and joined at shutdown); gloo on the CPU, NCCL on CUDA (rank r uses GPU r; every rank "
        "replays the same decode CUDA graphs); attention heads must divide; with --kv-role prefill/decode "
        "each rank transfers its KV heads "
        "(default 1)",
    )

    g = p.add_argument_group("KV cache and scheduler")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    g.add_argument(
        "--num-gpu-blocks", type=positive_int, default=None, help="KV blocks (default: from --kv-cache-memory-gib)"
    )
    g.add_argument(
        "--kv-cache-memory-gib",
        type=positive_float,
        default=1.0,
        help="memory for the KV cache when --num-gpu-blocks is unset",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of identical prompt prefixes (default on; --no-enable-prefix-caching turns it off)",
    )
    g.add_argument("--max-num-seqs", type=positive_int, default=64, help="requests running at once (default 64)")
    g.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=2048, help="token budget per engine step (default 2048)"
    )
    add_transfer_arguments(p)


def build_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed flags; raises ConfigError naming the bad value."""
    transfer_config = transfer_config_from(args)
    tp = args.tensor_parallel_size
    if args.num_threads is not None:
        num_threads = args.num_threads
    else:
        num_threads = max(1, default_num_threads(transfer_config.role) // max(tp, 1))
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            load_format=args.load_format,
            max_model_len=args.max_model_len,
            seed=args.seed,
            num_threads=num_threads,
            enforce_eager=args.enforce_eager,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_gpu_blocks,
            kv_cache_memory_gib=args.kv_cache_memory_gib,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
        transfer=transfer_config,
        parallel=ParallelConfig(tensor_parallel_size=tp),
    )


def run(args: argparse.Namespace, make_engine: Callable[[EngineConfig], AsyncEngine] | None = None) -> int:
    """Serve until stopped. `make_engine` builds the engine from the config (default AsyncEngine); a test
    passes one with its faults (tests/e2e/serve_with_faults.py)."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        config = build_config(args)
        credentials = credentials_from(args)
    except (ConfigError, ValueError, OSError) as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    if config.transfer.is_disaggregated and config.transfer.auth_secret is None:
        listens = {"--host": args.host, "--kv-side-channel-host": config.transfer.side_channel_host}
        refusal = None if args.insecure_no_kv_auth else unauthenticated_listen_error(listens)
        if refusal is not None:
            print(f"pdserve serve: {refusal}", file=sys.stderr)
            return 2
        log.warning(
            "no --kv-auth-secret: kv_transfer_params and side-channel peers are NOT authenticated; anyone who "
            "reaches this instance can read or write KV through it (docs/deploy.md)"
        )

    try:  # --port 0: bound now, before the model loads, and printed (http_port.py); else uvicorn binds it later
        sockets = bind_port_zero("serve", args.host, args.port)
    except OSError as e:
        print(f"pdserve serve: cannot listen on {args.host}: {e}", file=sys.stderr)
        return STARTUP_FAILURE
    port = args.port if sockets is None else sockets[0].getsockname()[1]

    import uvicorn

    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.kv.capability import KVAuth
    from pdserve.server.api import build_app
    from pdserve.server.state import Limits
    from pdserve.web import MAX_REQUEST_HEAD_BYTES

    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_start_failure(e: BaseException) -> None:
        failed.append(e)
        if server is not None:
            server.should_exit = True  # read by uvicorn's main loop; safe from another thread

    engine = (make_engine or AsyncEngine)(config)
    app = build_app(
        engine,
        args.served_model_name,
        on_start_failure,
        max_body_bytes=int(args.max_body_mb * 2**20),
        credentials=credentials,
        limits=Limits(args.max_inflight_requests, args.max_queue_wait_s),
        kv_auth=KVAuth(config.transfer.auth_secret, allow_unsigned_remote=args.insecure_no_kv_auth),
    )
    t = config.transfer
    log.info(
        "serving %s on http://%s:%d (kv role %s, transfer %s, engine id %s, %d torch threads, tensor parallel %d)",
        args.model, args.host, port, t.role, t.mode, t.engine_id, config.model.num_threads,
        config.parallel.tensor_parallel_size,
    )  # fmt: skip
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=port,
        log_level=args.log_level,
        access_log=False,
        http="h11",
        h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,  # streams still open at shutdown are cut after this long
    )
    server = uvicorn.Server(uv_config)
    server.run(sockets=sockets)
    if failed:
        print(f"pdserve serve: engine failed to start: {failed[0]}", file=sys.stderr)
        return 1
    return 0
