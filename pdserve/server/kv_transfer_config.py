"""vLLM's `--kv-transfer-config` JSON, read into TransferConfig fields, so vLLM launch lines carry over.

    {"kv_connector": "NixlConnector" | "NixlPushConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
     "engine_id": "...", "kv_buffer_device": "cuda" | "cpu", "kv_connector_extra_config": {...}}

kv_connector_extra_config may carry pdserve's own transfer settings under their TransferConfig names
(side_channel_host, side_channel_port, lease_s, push_registration_timeout_s, recv_timeout_s,
load_failure_policy, heartbeat_s, peer_timeout_s); vLLM-only keys (backends, ...) are ignored with a warning.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pdserve.config import ConfigError

log = logging.getLogger(__name__)

CONNECTOR_MODES = {"NixlConnector": "pull", "NixlPushConnector": "push"}
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
BUFFER_DEVICES = {"cuda": "device", "device": "device", "cpu": "cpu"}
EXTRA_KEYS = {  # kv_connector_extra_config key -> TransferConfig field
    "side_channel_host": "side_channel_host",
    "side_channel_port": "side_channel_port",
    "lease_s": "lease_s",
    "kv_lease_s": "lease_s",
    "push_registration_timeout_s": "push_registration_timeout_s",
    "recv_timeout_s": "recv_timeout_s",
    "kv_recv_timeout_s": "recv_timeout_s",
    "load_failure_policy": "load_failure_policy",
    "kv_load_failure_policy": "load_failure_policy",
    "heartbeat_s": "heartbeat_s",
    "peer_timeout_s": "peer_timeout_s",
}
IGNORED_KEYS = {"kv_rank", "kv_parallel_size", "kv_ip", "kv_port", "kv_buffer_size", "kv_connector_module_path"}


def parse_kv_transfer_config(text: str) -> dict[str, Any]:
    """TransferConfig keyword arguments from the JSON `text`; raises ConfigError naming what is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--kv-transfer-config is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError("--kv-transfer-config must be a JSON object")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "kv_connector":
            if value not in CONNECTOR_MODES:
                raise ConfigError(f"kv_connector {value!r} is not supported; use one of {', '.join(CONNECTOR_MODES)}")
            out["mode"] = CONNECTOR_MODES[value]
        elif key == "kv_role":
            if value not in ROLES:
                raise ConfigError(f"kv_role {value!r} is not one of {', '.join(ROLES)}")
            out["role"] = ROLES[value]
        elif key == "engine_id":
            out["engine_id"] = str(value)
        elif key == "kv_buffer_device":
            if value not in BUFFER_DEVICES:
                raise ConfigError(f"kv_buffer_device {value!r} is not one of {', '.join(BUFFER_DEVICES)}")
            out["kv_buffer_device"] = BUFFER_DEVICES[value]
        elif key == "kv_connector_extra_config":
            out.update(_extra(value))
        elif key in IGNORED_KEYS:
            log.warning("--kv-transfer-config: %s is a vLLM setting pdserve does not use; ignored", key)
        else:
            raise ConfigError(f"--kv-transfer-config: unknown key {key!r}")
    return out


def _extra(extra: Any) -> dict[str, Any]:
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config must be a JSON object")
    out = {}
    for key, value in extra.items():
        if key in EXTRA_KEYS:
            out[EXTRA_KEYS[key]] = value
        else:
            log.warning("--kv-transfer-config: kv_connector_extra_config.%s is not used by pdserve; ignored", key)
    return out
