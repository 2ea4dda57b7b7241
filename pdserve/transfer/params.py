"""kv_transfer_params: a request's P/D coordinates, parsed once at the HTTP edge into frozen values.

The wire format is vLLM's (a JSON object under `kv_transfer_params` in request and response bodies), so
vLLM-style proxies fit; every key is named once below, `decode`/`decode_answer` read it and `encode` writes
it. Past the edge only the typed values travel (server -> engine -> Request -> connector -> transfer thread).
A vLLM prefill instance's answer decodes too (its per-KV-group `remote_block_ids` with one group, extra keys
such as dcp_size ignored), so pdserve's router can check it before relaying it verbatim to a vLLM decode
instance (docs/architecture.md, "Working with vLLM").

What a request carries (`KVTransferParams`):
  RemoteDecode  P: hand this request's KV to a decode instance (`do_remote_decode`; push adds `transfer_id`)
  PullSource    D (pull): P's pinned blocks to READ (`do_remote_prefill` + P's coordinates)
  PushSource    D (push): the producer to register with (`do_remote_prefill` + `transfer_id` + P's address)
What a finished P request answers (`KVAnswer`): a PullSource (pull), a PushAnswer (push) or a Refusal.

Each value is checked here (types, ranges, lengths), so a malformed set is a KVParamsError (a ValueError
naming the key: the server's 400) before the engine allocates anything. A later field (a capability's MAC,
an expiry) is one key constant, one field, one line in decode and one in encode.
Pure Python: the router imports it too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

# ---- the wire format: vLLM's key names ----------------------------------------------------------------------------
DO_REMOTE_DECODE = "do_remote_decode"  # P: the KV goes to a decode instance
DO_REMOTE_PREFILL = "do_remote_prefill"  # D: the KV comes from a prefill instance
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_HOST = "remote_host"  # P's side channel
REMOTE_PORT = "remote_port"
REMOTE_BLOCK_IDS = "remote_block_ids"  # pull: P's blocks, in token order (windowed model: every group's live ones)
REMOTE_BLOCK_TABLES = "remote_block_tables"  # pull, windowed model (pdserve's): P's table per KV group, -1 = STALE
REMOTE_REQUEST_ID = "remote_request_id"  # pull: P's request id (the release names it)
REMOTE_NUM_TOKENS = "remote_num_tokens"  # pull: tokens whose KV P holds
REMOTE_BLOCK_SIZE = "remote_block_size"  # pull: P's tokens per block
TP_SIZE = "tp_size"  # P's tensor-parallel size
TRANSFER_ID = "transfer_id"  # push: pairs P's prefill with D's registration (the router's)
TRANSFER_MODE = "transfer_mode"  # "pull" | "push"
ERROR = "error"  # P's answer when it cannot hand the KV over
CAPABILITY = "kv_capability"  # pdserve's: {"expires_at", "mac", "prompt_digest"} (transfer/capability.py)

# ---- limits (a bad peer or client cannot make an instance allocate or loop on them) -------------------------------
MAX_PORT = 65535
MAX_ID_LEN = 256  # engine ids, transfer ids, host names
MAX_REQUEST_ID_LEN = 1024
MAX_BLOCKS = 1 << 20  # entries in remote_block_ids
MAX_BLOCK_ID = (1 << 31) - 1
MAX_TOKENS = (1 << 31) - 1
MAX_BLOCK_SIZE = 1 << 16
MAX_TP_SIZE = 1024
MAX_MAC_LEN = 128  # hex characters of a capability's MAC or prompt digest


class Mode(enum.Enum):
    """How the KV moves: D READs P's pinned blocks, or P WRITEs into D's registered blocks."""

    PULL = "pull"
    PUSH = "push"


class KVParamsError(ValueError):
    """A malformed kv_transfer_params value; `key` names it (the server answers 400 with the message)."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"kv_transfer_params{'.' + key if key else ''}: {problem}")
        self.key, self.problem = key, problem

    def __reduce__(self) -> tuple[type[KVParamsError], tuple[str, str]]:  # picklable across processes
        return KVParamsError, (self.key, self.problem)


@dataclass(frozen=True)
class Capability:
    """Proof that the coordinates next to it were issued (P for pull, the router for push) by a holder of
    the deployment secret: transfer/capability.py says which fields its MAC covers and checks it."""

    expires_at: float  # time.time() after which the coordinates are refused
    mac: str  # HMAC-SHA256 (hex) over what the coordinates name, this expiry and prompt_digest
    prompt_digest: str | None = None  # pull: auth.prompt_digest of the tokens whose KV P holds


@dataclass(frozen=True)
class RemoteDecode:
    """P: this request's KV goes to a decode instance once it finished."""

    mode: Mode | None  # None: not said (a vLLM-style proxy); the instance's own mode applies
    transfer_id: str | None  # push: the router's id pairing this prefill with D's registration
    capability: Capability | None = None  # push: the router's, over transfer id and this P (None: unsigned)


@dataclass(frozen=True)
class PullSource:
    """D (pull): P's pinned blocks to READ. Also P's answer to the router, which relays it to D unchanged."""

    host: str  # P's side channel
    port: int  # 1..65535
    engine_id: str | None  # P's engine id; None: not checked against the handshake
    request_id: str  # P's request id, named by D's release
    block_ids: tuple[int, ...]  # P's blocks covering tokens [0, num_tokens), in order
    num_tokens: int  # tokens whose KV P holds
    block_size: int | None  # P's tokens per block; None: taken from the handshake
    tp_size: int = 1  # P's tensor-parallel size
    capability: Capability | None = None  # P's, over all of the above and the prompt digest (None: unsigned)
    # windowed model: P's table per KV group (-1: STALE, freed); block_ids then holds every group's live blocks
    # (the pin's identity, named by D's release). (): one group, block_ids
    block_tables: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class PushSource:
    """D (push): the producer to register with, built by the router from P's GET /kv_transfer/info."""

    transfer_id: str  # the router's id; P pairs D's registration with its prefill by it
    host: str  # P's side channel
    port: int  # 1..65535
    engine_id: str | None  # P's engine id; None: not checked against the handshake
    tp_size: int = 1  # P's tensor-parallel size: the completions D counts (issue 12: take it from the handshake)
    capability: Capability | None = None  # the router's, over transfer id and P (None: unsigned)


@dataclass(frozen=True)
class PushAnswer:
    """P (push): the transfer it will write, returned to the router."""

    transfer_id: str
    engine_id: str


@dataclass(frozen=True)
class Refusal:
    """P could not hand the KV over (the router reports it and does not send the D leg)."""

    error: str


KVTransferParams = RemoteDecode | PullSource | PushSource  # what a request carries
KVAnswer = PullSource | PushAnswer | Refusal  # what a finished P request answers


# ---- decode -------------------------------------------------------------------------------------------------------
def decode(raw: object) -> KVTransferParams | None:
    """A request's kv_transfer_params (parsed JSON) -> a typed value; None when they ask for no transfer
    (absent, empty, or neither do_remote_* flag set). Raises KVParamsError naming the first bad key."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise KVParamsError("", f"must be a JSON object, got {_show(raw)}")
    decode_kv = _flag(raw, DO_REMOTE_DECODE)
    prefill = _flag(raw, DO_REMOTE_PREFILL)
    mode = _mode(raw)
    if decode_kv and prefill:
        raise KVParamsError(DO_REMOTE_DECODE, f"cannot be set together with {DO_REMOTE_PREFILL}")
    if decode_kv:
        return RemoteDecode(mode, _opt_str(raw, TRANSFER_ID, MAX_ID_LEN), _capability(raw))
    if not prefill:
        return None
    if mode is None:  # vLLM's pull answers carry no mode; the router's push params always do
        mode = Mode.PULL if REMOTE_BLOCK_IDS in raw or TRANSFER_ID not in raw else Mode.PUSH
    if mode is Mode.PULL:
        return _pull_source(raw)
    return PushSource(
        _str(raw, TRANSFER_ID, MAX_ID_LEN),
        _str(raw, REMOTE_HOST, MAX_ID_LEN),
        _int(raw, REMOTE_PORT, 1, MAX_PORT),
        _opt_str(raw, REMOTE_ENGINE_ID, MAX_ID_LEN),
        _opt_int(raw, TP_SIZE, 1, MAX_TP_SIZE) or 1,
        _capability(raw),
    )


def decode_answer(raw: object) -> KVAnswer | None:
    """P's answer (the kv_transfer_params of its response) -> a typed value; None when P sent none.
    Raises KVParamsError naming the first bad key."""
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict):
        raise KVParamsError("", f"must be a JSON object, got {_show(raw)}")
    if ERROR in raw:
        return Refusal(_str(raw, ERROR, 1 << 16))
    if _flag(raw, DO_REMOTE_PREFILL):
        value = decode(raw)
        if not isinstance(value, PullSource):
            raise KVParamsError(TRANSFER_MODE, "a prefill instance answers do_remote_prefill only in pull mode")
        return value
    if _mode(raw) is not Mode.PUSH:
        raise KVParamsError(DO_REMOTE_PREFILL, "missing (a pull answer) and transfer_mode is not push")
    return PushAnswer(_str(raw, TRANSFER_ID, MAX_ID_LEN), _str(raw, REMOTE_ENGINE_ID, MAX_ID_LEN))


def _pull_source(raw: dict[str, Any]) -> PullSource:
    ids = _block_ids(raw)  # first: the key a pull cannot do without, named before the peer's address
    src = PullSource(
        _str(raw, REMOTE_HOST, MAX_ID_LEN),
        _int(raw, REMOTE_PORT, 1, MAX_PORT),
        _opt_str(raw, REMOTE_ENGINE_ID, MAX_ID_LEN),
        _str(raw, REMOTE_REQUEST_ID, MAX_REQUEST_ID_LEN),
        ids,
        _int(raw, REMOTE_NUM_TOKENS, 0, MAX_TOKENS),
        _opt_int(raw, REMOTE_BLOCK_SIZE, 1, MAX_BLOCK_SIZE),
        _opt_int(raw, TP_SIZE, 1, MAX_TP_SIZE) or 1,
        _capability(raw),
        _block_tables(raw),
    )
    tables = src.block_tables or (src.block_ids,)
    if src.block_size is not None and min(len(t) for t in tables) * src.block_size < src.num_tokens:
        raise KVParamsError(
            REMOTE_BLOCK_IDS,
            f"{min(len(t) for t in tables)} blocks of {src.block_size} tokens cannot hold {src.num_tokens} tokens",
        )
    return src


def _block_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """remote_block_ids: a list of block ids, or vLLM's per-KV-group form (a list of one such list, as vLLM's
    NixlConnector answers; several groups, a hybrid vLLM model, are refused: pdserve names its groups in
    remote_block_tables with other semantics)."""
    if REMOTE_BLOCK_IDS not in raw:
        raise KVParamsError(REMOTE_BLOCK_IDS, "missing (needed for a pull)")
    ids = raw[REMOTE_BLOCK_IDS]
    if isinstance(ids, list) and ids and all(isinstance(group, list) for group in ids):
        if len(ids) != 1:
            raise KVParamsError(
                REMOTE_BLOCK_IDS,
                f"vLLM's per-KV-group form with {len(ids)} groups (a hybrid or sliding-window vLLM model) is not "
                "supported; one group is",
            )
        ids = ids[0]
    if not isinstance(ids, list) or len(ids) > MAX_BLOCKS:
        raise KVParamsError(REMOTE_BLOCK_IDS, f"must be a list of at most {MAX_BLOCKS} block ids, got {_show(ids)}")
    if any(type(b) is not int or not 0 <= b <= MAX_BLOCK_ID for b in ids):
        bad = next(b for b in ids if type(b) is not int or not 0 <= b <= MAX_BLOCK_ID)
        raise KVParamsError(REMOTE_BLOCK_IDS, f"must hold block ids in [0, {MAX_BLOCK_ID}], got {_show(bad)}")
    return tuple(ids)


def _block_tables(raw: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    """remote_block_tables: a list of lists of block ids or -1 (STALE), at most MAX_BLOCKS entries in all."""
    tables = raw.get(REMOTE_BLOCK_TABLES)
    if tables is None:
        return ()
    if (
        not isinstance(tables, list)
        or not all(isinstance(t, list) for t in tables)
        or sum(len(t) for t in tables) > MAX_BLOCKS
        or any(type(b) is not int or not -1 <= b <= MAX_BLOCK_ID for t in tables for b in t)
    ):
        raise KVParamsError(
            REMOTE_BLOCK_TABLES,
            f"must be lists of block ids in [-1, {MAX_BLOCK_ID}], at most {MAX_BLOCKS} in all, got {_show(tables)}",
        )
    return tuple(tuple(t) for t in tables)


def _capability(raw: dict[str, Any]) -> Capability | None:
    cap = raw.get(CAPABILITY)
    if cap is None:
        return None
    if not isinstance(cap, dict):
        raise KVParamsError(CAPABILITY, f"must be a JSON object, got {_show(cap)}")
    expires_at: Any = cap.get("expires_at")
    if type(expires_at) not in (int, float) or not 0 <= expires_at < 1e12:
        raise KVParamsError(
            CAPABILITY, f"expires_at must be a number of seconds since the epoch, got {_show(expires_at)}"
        )
    try:
        mac = _str(cap, "mac", MAX_MAC_LEN)
        digest = _opt_str(cap, "prompt_digest", MAX_MAC_LEN)
    except KVParamsError as e:
        raise KVParamsError(CAPABILITY, f"{e.key} {e.problem}") from None
    return Capability(float(expires_at), mac, digest)


def _encode_capability(cap: Capability | None) -> dict[str, Any] | None:
    if cap is None:
        return None
    out: dict[str, Any] = {"expires_at": cap.expires_at, "mac": cap.mac}
    if cap.prompt_digest is not None:
        out["prompt_digest"] = cap.prompt_digest
    return out


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _flag(raw: dict[str, Any], key: str) -> bool:
    value = raw.get(key, False)
    if value is None:
        return False
    if type(value) is not bool:
        raise KVParamsError(key, f"must be true or false, got {_show(value)}")
    return value


def _mode(raw: dict[str, Any]) -> Mode | None:
    value = raw.get(TRANSFER_MODE)
    if value is None:
        return None
    try:
        return Mode(value)
    except ValueError:
        raise KVParamsError(TRANSFER_MODE, f"must be 'pull' or 'push', got {_show(value)}") from None


def _str(raw: dict[str, Any], key: str, max_len: int) -> str:
    if key not in raw:
        raise KVParamsError(key, "missing")
    value = raw[key]
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise KVParamsError(key, f"must be a string of 1 to {max_len} characters, got {_show(value)}")
    return value


def _opt_str(raw: dict[str, Any], key: str, max_len: int) -> str | None:
    return None if raw.get(key) is None else _str(raw, key, max_len)


def _int(raw: dict[str, Any], key: str, lo: int, hi: int) -> int:
    if key not in raw:
        raise KVParamsError(key, "missing")
    value = raw[key]
    if type(value) is not int:  # bool, float and numeric strings are refused too
        raise KVParamsError(key, f"must be an integer, got {_show(value)}")
    if not lo <= value <= hi:
        raise KVParamsError(key, f"must be in [{lo}, {hi}], got {value}")
    return value


def _opt_int(raw: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    return None if raw.get(key) is None else _int(raw, key, lo, hi)


# ---- encode -------------------------------------------------------------------------------------------------------
def encode(value: KVTransferParams | KVAnswer) -> dict[str, Any]:
    """A typed value -> its JSON object (keys as vLLM names them); decode(encode(v)) == v."""
    if isinstance(value, RemoteDecode):
        out: dict[str, Any] = {DO_REMOTE_DECODE: True}
        if value.transfer_id is not None:
            out[TRANSFER_ID] = value.transfer_id
        if value.mode is not None:
            out[TRANSFER_MODE] = value.mode.value
        if value.capability is not None:
            out[CAPABILITY] = _encode_capability(value.capability)
        return out
    if isinstance(value, PullSource):
        out = {
            DO_REMOTE_PREFILL: True,
            REMOTE_ENGINE_ID: value.engine_id,
            REMOTE_HOST: value.host,
            REMOTE_PORT: value.port,
            REMOTE_BLOCK_IDS: list(value.block_ids),
            REMOTE_REQUEST_ID: value.request_id,
            REMOTE_NUM_TOKENS: value.num_tokens,
            REMOTE_BLOCK_SIZE: value.block_size,
            TP_SIZE: value.tp_size,
            TRANSFER_MODE: Mode.PULL.value,
            CAPABILITY: _encode_capability(value.capability),
            REMOTE_BLOCK_TABLES: [list(t) for t in value.block_tables] or None,
        }
        return {k: v for k, v in out.items() if v is not None}
    if isinstance(value, PushSource):
        out = {
            DO_REMOTE_PREFILL: True,
            TRANSFER_ID: value.transfer_id,
            REMOTE_ENGINE_ID: value.engine_id,
            REMOTE_HOST: value.host,
            REMOTE_PORT: value.port,
            TP_SIZE: value.tp_size,
            TRANSFER_MODE: Mode.PUSH.value,
            CAPABILITY: _encode_capability(value.capability),
        }
        return {k: v for k, v in out.items() if v is not None}
    if isinstance(value, PushAnswer):
        return {TRANSFER_ID: value.transfer_id, TRANSFER_MODE: Mode.PUSH.value, REMOTE_ENGINE_ID: value.engine_id}
    return {ERROR: value.error}
