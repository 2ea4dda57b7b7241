"""kv_transfer_params: a request's P/D coordinates, parsed once at the HTTP edge into frozen values.

The wire format is vLLM's (a JSON object under `kv_transfer_params` in request and response bodies), so
vLLM-style proxies fit; every key is named once below, `decode`/`decode_answer` (decode.py) read it and
`encode` writes it. Past the edge only the typed values travel (server -> engine -> Request -> connector ->
transfer thread). A vLLM prefill instance's answer decodes too (its per-KV-group `remote_block_ids` with one
group, extra keys such as dcp_size ignored), so pdserve's router can check it before relaying it verbatim to a
vLLM decode instance (docs/architecture.md, "Working with vLLM").

What a request carries (`KVTransferParams`):
  RemoteDecode  P: hand this request's KV to a decode instance (`do_remote_decode`; push adds `transfer_id`)
  PullSource    D (pull): P's pinned blocks to READ (`do_remote_prefill` + P's coordinates)
  PushSource    D (push): the producer to register with (`do_remote_prefill` + `transfer_id` + P's address)
What a finished P request answers (`KVAnswer`): a PullSource (pull), a PushAnswer (push) or a Refusal.

Each value is checked by decode (types, ranges, lengths; decode.py), so a malformed set is a
KVParamsError (a ValueError naming the key: the server's 400) before the engine allocates anything. A later
field (a capability's MAC, an expiry) is one key constant, one field, one line in decode and one in encode.
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
DECODE_MAX_TOKENS = "decode_max_tokens"  # P (pdserve's router): the client's max_tokens for the decode leg
CAPABILITY = "kv_capability"  # pdserve's: {"expires_at", "mac", "prompt_digest"} (kv/capability.py)
FIRST_TOKEN_ID = "first_token_id"  # pull (pdserve's): the token P sampled after its remote_num_tokens tokens


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
    the deployment secret: kv/capability.py says which fields its MAC covers and checks it."""

    expires_at: float  # time.time() after which the coordinates are refused
    mac: str  # HMAC-SHA256 (hex) over what the coordinates name, this expiry and prompt_digest
    prompt_digest: str | None = None  # pull: auth.prompt_digest of the tokens whose KV P holds


@dataclass(frozen=True)
class RemoteDecode:
    """P: this request's KV goes to a decode instance once it finished."""

    mode: Mode | None  # None: not said (a vLLM-style proxy); the instance's own mode applies
    transfer_id: str | None  # push: the router's id pairing this prefill with D's registration
    capability: Capability | None = None  # push: the router's, over transfer id and this P (None: unsigned)
    # the output length the client asked of the decode leg: P refuses a prompt it does not fit beside before
    # prefilling it (None: not said, as from a vLLM-style proxy; D alone then checks it, after the prefill)
    decode_max_tokens: int | None = None


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
    # the token P sampled after its num_tokens tokens: D's first output token when D's prompt is exactly those
    # tokens (hands_first_token). None: not said (a vLLM prefill instance): D computes its last prompt token
    first_token_id: int | None = None


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


def hands_first_token(source: PullSource | PushSource, num_prompt_tokens: int) -> bool:
    """D: whether the prefill hands this request's first output token over with the KV of its whole prompt, so
    that D computes no prompt token and emits that token as soon as the KV landed (docs/architecture.md, "The
    engine"). Push: always (P sends it in the WRITE's PushDone when D's registration ends where P's KV ends; a
    recv that lands without it fails). Pull: when P's answer names it for exactly this prompt's tokens; a vLLM
    prefill instance's answer does not, and D then computes the last prompt token itself."""
    if isinstance(source, PushSource):
        return True
    return source.first_token_id is not None and source.num_tokens == num_prompt_tokens


def _encode_capability(cap: Capability | None) -> dict[str, Any] | None:
    if cap is None:
        return None
    out: dict[str, Any] = {"expires_at": cap.expires_at, "mac": cap.mac}
    if cap.prompt_digest is not None:
        out["prompt_digest"] = cap.prompt_digest
    return out


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
        if value.decode_max_tokens is not None:
            out[DECODE_MAX_TOKENS] = value.decode_max_tokens
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
            FIRST_TOKEN_ID: value.first_token_id,
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
