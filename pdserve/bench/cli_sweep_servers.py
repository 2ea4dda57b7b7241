"""`pdserve sweep`'s flags for the deployments it starts (server flags passed to `pdserve serve`, instance counts,
the routings compared and router flags), and the ServerOptions they make; the grid's, the load's and the goodput
search's flags are cli_sweep.py's."""

from __future__ import annotations

import argparse

from pdserve.arg_types import positive_int
from pdserve.bench.deploy import ServerOptions
from pdserve.bench.sweep_config import ROUTINGS


def _routings(text: str) -> tuple[str, ...]:
    routings = tuple(r.strip() for r in text.split(",") if r.strip())
    for r in routings:
        if r not in ROUTINGS:
            raise argparse.ArgumentTypeError(f"routing {r!r} is not one of {', '.join(ROUTINGS)}")
    return routings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The group "servers started by the sweep"."""
    server = parser.add_argument_group("servers started by the sweep (passed to `pdserve serve`)")
    server.add_argument("--dtype", default=None, help="server --dtype")
    server.add_argument("--load-format", default=None, help="server --load-format (dummy: random weights)")
    server.add_argument("--block-size", type=positive_int, default=None, help="server --block-size")
    server.add_argument("--num-threads", type=positive_int, default=None, help="torch threads per server")
    server.add_argument("--max-model-len", type=positive_int, default=None, help="server --max-model-len")
    server.add_argument("--device", default=None, help="cpu or cuda")
    server.add_argument(
        "--prefill-gpu",
        type=int,
        default=None,
        help="CUDA_VISIBLE_DEVICES of prefill (colocated: of the first instance)",
    )
    server.add_argument(
        "--decode-gpu",
        type=int,
        default=None,
        help="CUDA_VISIBLE_DEVICES of decode (colocated: of the second instance)",
    )
    server.add_argument("--server-arg", action="append", default=[], help="extra flag for both servers (repeat)")
    server.add_argument(
        "--num-prefill",
        type=positive_int,
        default=1,
        help="prefill instances per pull/push deployment (colocated: --num-prefill + --num-decode instances, those "
        "past the prefill count on --decode-gpu) (default 1)",
    )
    server.add_argument(
        "--num-decode", type=positive_int, default=1, help="decode instances per pull/push deployment (default 1)"
    )
    server.add_argument(
        "--decode-prefix-caching",
        action="store_true",
        help="keep the decode instances' prefix cache on (kv-aware routing needs it); default: off, so D never "
        "shortcuts a transfer, as in the reference push/pull runs",
    )
    server.add_argument(
        "--routings",
        type=_routings,
        default=(),
        help="comma-separated `pdserve proxy --routing` values to compare (least-loaded,kv-aware): one deployment "
        "per mode and routing, named MODE-ROUTING in results (`pull-kv-aware`; the JSONs add transfer_mode and "
        "routing); colocated routers get --routing too; with --interleave all run at once, points alternating. "
        "Default: one deployment per mode with the router's default",
    )
    server.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="extra `pdserve proxy` flag for the pull and push routers (repeat), e.g. "
        "--router-arg=--colocate-below=256 "
        "to measure selective disaggregation",
    )


def server_options(args: argparse.Namespace) -> ServerOptions | None:
    """The servers' options; None without a model (every mode attached)."""
    if not args.model:
        return None
    return ServerOptions(
        model=args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        block_size=args.block_size,
        num_threads=args.num_threads,
        max_model_len=args.max_model_len,
        device=args.device,
        prefill_gpu=args.prefill_gpu,
        decode_gpu=args.decode_gpu,
        extra_args=tuple(args.server_arg),
        decode_prefix_caching=args.decode_prefix_caching,
    )
