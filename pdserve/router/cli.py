"""`pdserve proxy --mode pull|push --prefill URL... --decode URL...` (the P/D router) or
`pdserve proxy --mode colocated --instance URL...` (a load balancer over `--kv-role both` instances)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from pdserve.arg_types import non_negative_float, port, positive_float, positive_int
from pdserve.auth import INSECURE_FLAG, unauthenticated_listen_error
from pdserve.credentials import add_internal_key_arguments, load_key
from pdserve.router.kv_index import DEFAULT_MAX_KEYS
from pdserve.router.kv_route import DEFAULT_HIT_WEIGHT, DEFAULT_LOAD_WEIGHT
from pdserve.router.policy import MODES, POLICIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=list(MODES),
        default="pull",
        help="pull or push: split each request into a prefill and a decode leg (KV transfer orchestration); "
        "colocated: send each whole request to one --instance (no KV transfer) (default pull)",
    )
    p.add_argument(
        "--prefill", nargs="+", default=[], metavar="URL", help="prefill instance base URL(s) (pull and push: required)"
    )
    p.add_argument(
        "--decode", nargs="+", default=[], metavar="URL", help="decode instance base URL(s) (pull and push: required)"
    )
    p.add_argument(
        "--instance",
        nargs="+",
        default=[],
        metavar="URL",
        help="colocated mode: base URL(s) of instances started with --kv-role both; each request goes whole to one, "
        "chosen by --policy (required with --mode colocated)",
    )
    p.add_argument(
        "--colocate-below",
        type=positive_int,
        default=None,
        metavar="N",
        help="pull and push: selective disaggregation; a request whose uncached suffix at the chosen decode instance "
        "(prompt tokens minus the tokens the router believes that instance caches: 0 unless --routing kv-aware) is "
        "below N tokens goes to that decode instance alone (no kv_transfer_params) and D prefills it locally, P never "
        "sees it. Prompt tokens: token-id prompts exactly; text exactly with the router's tokenizer (kv-aware), else "
        "estimated as UTF-8 bytes / 4. The log line says route=whole and counts them (whole_total). Default: every "
        "request is disaggregated",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1); in pull or push mode beyond loopback only with the deployment "
        "secret (--kv-auth-secret-file) or --insecure-no-kv-auth",
    )
    p.add_argument(
        "--port", type=port, default=8000, help="HTTP port (default 8000; 0: the kernel picks one, printed on stderr)"
    )
    p.add_argument(
        "--routing",
        "--policy",
        dest="policy",
        choices=POLICIES,
        default="least-loaded",
        help="instance choice per leg (--policy is its older name): least-loaded (fewest outstanding legs through "
        "this router), round-robin, or kv-aware: the least kv-load-weight x outstanding legs - kv-hit-weight x the "
        "prompt tokens the instance caches / 1,024 (the router follows every instance's GET /kv_events; a "
        "prompt it cannot hash, or an instance whose events it lost, counts load only); pull and push choose P by "
        "its cache and load, D by its cache and load (a D caches KV it received only with the deployment secret, "
        "--kv-auth-secret-file) (default least-loaded)",
    )
    p.add_argument(
        "--kv-hit-weight",
        type=non_negative_float,
        metavar="W",
        default=DEFAULT_HIT_WEIGHT,
        help="kv-aware: how many outstanding legs 1,024 cached prompt tokens are worth (the hit counts what a miss "
        f"would cost to prefill) (default {DEFAULT_HIT_WEIGHT:g})",
    )
    p.add_argument(
        "--kv-load-weight",
        type=non_negative_float,
        metavar="W",
        default=DEFAULT_LOAD_WEIGHT,
        help=f"kv-aware: cost of one outstanding leg (default {DEFAULT_LOAD_WEIGHT:g})",
    )
    p.add_argument(
        "--kv-index-max-keys",
        type=positive_int,
        metavar="N",
        default=DEFAULT_MAX_KEYS,
        help="kv-aware: block keys the router keeps per instance; past it the least recently stored or hit go "
        f"(a forgotten block costs a prefix miss in the estimate, never a wrong answer) (default {DEFAULT_MAX_KEYS})",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="FOLDER",
        help="kv-aware: a Hugging Face model folder whose tokenizer.json (and chat template) the instances use, to "
        "hash text and chat prompts as they do; default: the folder the instances report in /v1/models when it "
        "exists on this machine, else text prompts are routed by load (token-id prompts need no tokenizer)",
    )
    p.add_argument(
        "--connect-timeout-s",
        type=positive_float,
        default=10.0,
        help="seconds to open a connection to a backend (default 10)",
    )
    p.add_argument(
        "--health-timeout-s",
        type=positive_float,
        default=5.0,
        help="seconds for a backend's /health or /kv_transfer/info to answer (default 5)",
    )
    p.add_argument(
        "--health-interval-s",
        type=positive_float,
        default=2.0,
        help="poll every instance's /health this often; an instance that fails is routed around until it "
        "answers again, and one that restarted (new epoch) has its cached coordinates dropped (default 2)",
    )
    p.add_argument(
        "--max-body-mb",
        type=positive_float,
        default=32.0,
        help="refuse request bodies larger than this many MiB with HTTP 413 (default 32)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="the client key: require `Authorization: Bearer KEY` on every route but /health (the router also "
        "sends it to the instances unless --internal-api-key is set, so start them with the same key); default: no key",
    )
    add_internal_key_arguments(p, is_router=True)
    p.add_argument(
        "--kv-auth-secret",
        default=None,
        metavar="VALUE",
        help="the deployment secret the instances were started with (signs push transfer params); prefer "
        "--kv-auth-secret-file (a flag value shows in ps); default: none",
    )
    p.add_argument(
        "--kv-auth-secret-file", default=None, metavar="PATH", help="read the deployment secret from this file"
    )
    p.add_argument(
        INSECURE_FLAG,
        action="store_true",
        help="INSECURE: in pull or push mode, listen on a non-loopback --host without a deployment secret (the "
        "instances behind it then take unsigned KV coordinates from anyone who reaches them). Default: refused at "
        "startup; give the deployment's --kv-auth-secret-file instead",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    import uvicorn

    from pdserve.auth import load_secret
    from pdserve.http_port import STARTUP_FAILURE, bind_port_zero
    from pdserve.router.config import RouterConfig
    from pdserve.router.proxy import build_app
    from pdserve.web import MAX_REQUEST_HEAD_BYTES

    try:
        secret = load_secret(args.kv_auth_secret, args.kv_auth_secret_file)
        config = RouterConfig(
            mode=args.mode,
            prefill_urls=tuple(args.prefill),
            decode_urls=tuple(args.decode),
            instance_urls=tuple(args.instance),
            colocate_below=args.colocate_below,
            policy=args.policy,
            kv_hit_weight=args.kv_hit_weight,
            kv_load_weight=args.kv_load_weight,
            kv_index_max_keys=args.kv_index_max_keys,
            tokenizer=args.tokenizer,
            connect_timeout_s=args.connect_timeout_s,
            health_timeout_s=args.health_timeout_s,
            health_interval_s=args.health_interval_s,
            max_body_bytes=int(args.max_body_mb * 2**20),
            api_key=load_key(args.api_key, None, "--api-key"),
            internal_api_key=load_key(args.internal_api_key, args.internal_api_key_file, "--internal-api-key"),
            kv_auth_secret=secret,
        )
    except (ValueError, OSError) as e:
        print(f"pdserve proxy: {e}", file=sys.stderr)
        return 2
    if config.kv_auth_secret is None and config.mode != "colocated":
        refusal = None if args.insecure_no_kv_auth else unauthenticated_listen_error({"--host": args.host})
        if refusal is not None:
            print(f"pdserve proxy: {refusal}", file=sys.stderr)
            return 2
    if config.kv_auth_secret is None:
        logging.getLogger("pdserve.router").warning(
            "no --kv-auth-secret: push transfer params are not signed (instances with a secret refuse them)"
        )
    if config.mode == "colocated":
        backends = f"instances {', '.join(config.instance_urls)}"
    else:
        backends = f"prefill {', '.join(config.prefill_urls)}, decode {', '.join(config.decode_urls)}"
        if config.colocate_below is not None:
            backends += f"; uncached suffixes below {config.colocate_below} tokens go to decode alone"
    try:  # --port 0: bound now and printed (http_port.py); else uvicorn binds it, as uvicorn.run would
        sockets = bind_port_zero("proxy", args.host, args.port)
    except OSError as e:
        print(f"pdserve proxy: cannot listen on {args.host}: {e}", file=sys.stderr)
        return STARTUP_FAILURE
    port = args.port if sockets is None else sockets[0].getsockname()[1]
    logging.getLogger("pdserve.router").info(
        "router (%s mode, %s) on http://%s:%d: %s", config.mode, config.policy, args.host, port, backends
    )
    uv_config = uvicorn.Config(
        build_app(config),
        host=args.host,
        port=port,
        log_level=args.log_level,
        access_log=False,
        http="h11",
        h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES,
        timeout_graceful_shutdown=5,  # streams still open at shutdown are cut after this long
    )
    server = uvicorn.Server(uv_config)
    with contextlib.suppress(KeyboardInterrupt):  # what uvicorn.run did: Ctrl-C is a normal stop
        server.run(sockets=sockets)
    return 0 if server.started else STARTUP_FAILURE
