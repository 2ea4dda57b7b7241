"""kv_transfer_params in: decode and decode_answer, the edge's validation of what a client or a peer sent.

Every key (params.py names them) is checked here for its type, range and length, so a malformed set is a
KVParamsError naming the key (the server's 400; the router's refusal of P's answer) before the engine
allocates anything, and a bad peer or client cannot make an instance allocate or loop (the limits below). The
typed values and their one encode are params.py's; the checks live here because they are most of the code and
all of the untrusted input.
Pure Python: the router imports it too.
"""

from __future__ import annotations

from typing import Any

from pdserve.kv.params import (
    CAPABILITY,
    DECODE_MAX_TOKENS,
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    ERROR,
    FIRST_TOKEN_ID,
    REMOTE_BLOCK_IDS,
    REMOTE_BLOCK_SIZE,
    REMOTE_BLOCK_TABLES,
    REMOTE_ENGINE_ID,
    REMOTE_HOST,
    REMOTE_NUM_TOKENS,
    REMOTE_PORT,
    REMOTE_REQUEST_ID,
    TP_SIZE,
    TRANSFER_ID,
    TRANSFER_MODE,
    Capability,
    KVAnswer,
    KVParamsError,
    KVTransferParams,
    Mode,
    PullSource,
    PushAnswer,
    PushSource,
    Refusal,
    RemoteDecode,
)

# ---- limits (a bad peer or client cannot make an instance allocate or loop on them) -------------------------------
MAX_PORT = 65535
MAX_ID_LEN = 256  # engine ids, transfer ids, host names
MAX_REQUEST_ID_LEN = 1024
MAX_BLOCKS = 1 << 20  # entries in remote_block_ids
MAX_BLOCK_ID = (1 << 31) - 1
MAX_TOKENS = (1 << 31) - 1
MAX_TOKEN_ID = (1 << 31) - 1  # first_token_id (D's engine checks it against its vocabulary)
MAX_BLOCK_SIZE = 1 << 16
MAX_TP_SIZE = 1024
MAX_MAC_LEN = 128  # hex characters of a capability's MAC or prompt digest


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
        max_tokens = _opt_int(raw, DECODE_MAX_TOKENS, 1, MAX_TOKENS)
        return RemoteDecode(mode, _opt_str(raw, TRANSFER_ID, MAX_ID_LEN), _capability(raw), max_tokens)
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
        _opt_int(raw, FIRST_TOKEN_ID, 0, MAX_TOKEN_ID),
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
