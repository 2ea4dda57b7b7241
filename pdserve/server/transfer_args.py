"""`pdserve serve`'s KV transfer flags (P/D disaggregation) and the TransferConfig they make.

Lives apart from the serve command (cli.py) because it is the largest group of flags and the only one with
two sources: vLLM's --kv-transfer-config JSON (kv_transfer_config.py) and the flags, which override it; the
deployment secret is read here, from a flag or a file.
"""

from __future__ import annotations

import argparse

from pdserve.arg_types import port, positive_float
from pdserve.auth import INSECURE_FLAG, load_secret
from pdserve.config import TransferConfig
from pdserve.server.kv_transfer_config import parse_kv_transfer_config


def add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    """The "KV transfer" argument group."""
    g = parser.add_argument_group("KV transfer (P/D disaggregation); flags override --kv-transfer-config")
    g.add_argument("--kv-role", choices=["prefill", "decode", "both"], default=None, help="both = colocated (default)")
    g.add_argument("--kv-transfer", choices=["pull", "push"], default=None, help="transfer mode (default pull)")
    g.add_argument("--engine-id", default=None, help="this instance's id in the transfer (default: generated)")
    g.add_argument(
        "--kv-side-channel-host", default=None, help="address peers reach the handshake side channel at (127.0.0.1)"
    )
    g.add_argument(
        "--kv-side-channel-port",
        type=port,
        default=None,
        help="handshake side-channel port (5600; 0: a free port, which peers learn from P's answer and "
        "/kv_transfer/info; two instances on one host need different ones)",
    )
    g.add_argument(
        "--kv-buffer-device", choices=["device", "cpu"], default=None, help="where transferred KV lives (device)"
    )
    g.add_argument(
        "--kv-lease-s",
        type=positive_float,
        default=None,
        help="P frees KV nobody consumed after this many seconds (30)",
    )
    g.add_argument(
        "--push-registration-timeout-s",
        type=positive_float,
        default=None,
        help="push: P drops a registration for a prefill it has not been asked for after this many seconds (30; "
        "a prefill P has queued or running keeps its registration)",
    )
    g.add_argument(
        "--kv-recv-timeout-s",
        type=positive_float,
        default=None,
        help="D fails (or recomputes) a request whose KV has not arrived after this many seconds (60; in push mode "
        "counted from P's last notice that the prefill is queued or running)",
    )
    g.add_argument(
        "--kv-heartbeat-s",
        type=positive_float,
        default=None,
        help="ping peers this instance holds state for this often (1)",
    )
    g.add_argument(
        "--kv-peer-timeout-s",
        type=positive_float,
        default=None,
        help="a peer silent this long is dead: its requests fail or recompute, its blocks are freed (4)",
    )
    g.add_argument(
        "--kv-load-failure-policy",
        choices=["fail", "recompute"],
        default=None,
        help="on a failed or timed-out receive: fail the request, or prefill it locally (default fail)",
    )
    g.add_argument(
        "--kv-checksum",
        action="store_true",
        default=None,
        help="sum every transferred KV block on both sides; a mismatch fails the request (or recomputes it, by "
        "--kv-load-failure-policy). Prefill and decode instances must both set it (default off)",
    )
    g.add_argument(
        "--kv-auth-secret",
        default=None,
        metavar="VALUE",
        help="the deployment secret (>= 16 bytes; the same on every instance and the router): signs "
        "kv_transfer_params and authenticates the side channel. Prefer --kv-auth-secret-file (a flag value shows "
        "in ps). Default: none (transfer params and peers are not authenticated; docs/deploy.md)",
    )
    g.add_argument(
        "--kv-auth-secret-file", default=None, metavar="PATH", help="read the deployment secret from this file"
    )
    g.add_argument(
        INSECURE_FLAG,
        action="store_true",
        help="INSECURE: with --kv-role prefill/decode and no deployment secret, listen on a non-loopback --host or "
        "--kv-side-channel-host and dial a prefill instance at a non-loopback address a client names. Anyone who "
        "reaches this instance can then read other requests' KV and make it dial out. Default: refused at startup "
        "(listen) or with 403 (dial); give a --kv-auth-secret-file instead",
    )
    g.add_argument(
        "--kv-net-devices",
        default=None,
        help="UCX_NET_DEVICES for the KV data plane, e.g. mlx5_0:1 (default: the interface holding "
        "--kv-side-channel-host, unless UCX_NET_DEVICES is set; docs/deploy.md)",
    )
    g.add_argument(
        "--kv-transfer-config",
        default=None,
        help='vLLM\'s JSON form, e.g. \'{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}\' '
        "(NixlConnector = pull, NixlPushConnector = push; kv_producer/kv_consumer/kv_both)",
    )


def transfer_config_from(args: argparse.Namespace) -> TransferConfig:
    """TransferConfig from --kv-transfer-config overridden by the flags that are set."""
    transfer = parse_kv_transfer_config(args.kv_transfer_config) if args.kv_transfer_config else {}
    flags = {
        "role": args.kv_role,
        "mode": args.kv_transfer,
        "engine_id": args.engine_id,
        "side_channel_host": args.kv_side_channel_host,
        "side_channel_port": args.kv_side_channel_port,
        "kv_buffer_device": args.kv_buffer_device,
        "lease_s": args.kv_lease_s,
        "push_registration_timeout_s": args.push_registration_timeout_s,
        "recv_timeout_s": args.kv_recv_timeout_s,
        "load_failure_policy": args.kv_load_failure_policy,
        "heartbeat_s": args.kv_heartbeat_s,
        "peer_timeout_s": args.kv_peer_timeout_s,
        "kv_checksum": args.kv_checksum,
    }
    transfer.update({k: v for k, v in flags.items() if v is not None})
    secret = load_secret(args.kv_auth_secret, args.kv_auth_secret_file)
    return TransferConfig(**transfer, auth_secret=secret, net_devices=args.kv_net_devices)
