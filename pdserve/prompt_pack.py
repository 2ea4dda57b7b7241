"""A prompt's token ids packed for the router's legs to pdserve instances: base64 of little-endian uint32.

A 16k-token prompt as a JSON list is ~100 KB of digits that the router encodes and every instance parses and
validates id by id (~1-2 ms per hop on the first token's path). Packed, it is one ~87 KB string: the JSON parser
copies it, `unpack` turns it into a numpy int64 array at once, and the instance validates (range, vocabulary),
digests (auth.prompt_digest reads the array's buffer) and hands it to its engine from that array.

The field (FIELD, in a /v1/completions body instead of `prompt`): `"pdserve_prompt_ids": "v1:<base64>"`.
- the version prefix names the element encoding: v1 = little-endian uint32, standard base64 with padding, no
  line breaks. An instance refuses a version it does not read (400 naming it);
- ids are >= 0 by construction; ids of 2**32 or more cannot be packed (no vocabulary holds them): the router
  sends such a prompt as a JSON list, and the instance answers its vocabulary 400;
- a body with both `prompt` and FIELD, a bad base64, a length that is not a whole number of ids, or no ids is a
  400 whose message names the field.
Clients send plain OpenAI JSON; only the router packs, and only for an instance whose GET /health says it reads
this version (HEALTH_KEY; a vLLM instance does not), so a mixed or foreign pool keeps getting JSON lists. A client
that sends FIELD to the router anyway is served as if it sent the list: the router validates it as an instance does
(400s above), counts, hashes and routes the ids, and passes its value on to the instances that read it (a JSON list
to the others: router/call.py).
"""

from __future__ import annotations

import array
import base64
import binascii
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import numpy as np
import numpy.typing as npt
from pydantic import PlainValidator
from pydantic_core import PydanticCustomError

FIELD = "pdserve_prompt_ids"  # the packed prompt's key in a completion body (instead of "prompt")
VERSION = 1  # the wire version this code writes and reads
HEALTH_KEY = "prompt_ids_packed"  # GET /health: the packed version an instance reads (absent: none)
_PREFIX = f"v{VERSION}:"
UINT32_BYTES = 4  # one packed id

TokenArray = npt.NDArray[np.int64]  # a prompt's ids as the instance holds them once unpacked (read-only)


def pack(token_ids: Sequence[int]) -> str | None:
    """FIELD's value for these ids; None when one is negative, 2**32 or more, or not an int (send the JSON list)."""
    try:
        packed = array.array("I", token_ids)  # C unsigned int: 4 bytes on every platform numpy runs on
    except (OverflowError, TypeError):
        return None
    if packed.itemsize != UINT32_BYTES:
        return None
    if sys.byteorder == "big":
        packed.byteswap()
    return _PREFIX + base64.b64encode(packed.tobytes()).decode("ascii")


def unpack(value: str) -> TokenArray:
    """The ids FIELD's value holds, as a read-only int64 array; raises ValueError with a client's message."""
    version, sep, data = value.partition(":")
    if not sep or not version.startswith("v"):
        raise ValueError(f"{FIELD} must be 'v{VERSION}:' followed by base64 of little-endian uint32 ids")
    if version != f"v{VERSION}":
        raise ValueError(f"{FIELD} version {version[1:]!r} is not read by this instance (it reads {VERSION})")
    try:
        raw = binascii.a2b_base64(data, strict_mode=True)  # one pass: refuses any byte outside the alphabet
    except (binascii.Error, ValueError):
        raise ValueError(f"{FIELD} is not valid base64") from None
    if len(raw) % UINT32_BYTES:
        raise ValueError(f"{FIELD} holds {len(raw)} bytes, not a whole number of 4-byte token ids")
    if not raw:
        raise ValueError("prompt is empty")
    ids = np.frombuffer(raw, dtype="<u4").astype(np.int64)
    ids.flags.writeable = False
    return ids


def to_list(token_ids: Sequence[int] | TokenArray) -> list[int]:
    """Python ints, as the engine's Request holds them (one conversion from an array; a list is copied)."""
    return token_ids.tolist() if isinstance(token_ids, np.ndarray) else list(token_ids)


def as_array(value: Any) -> TokenArray:
    """A request model's `prompt` once into_prompt() put the unpacked ids there: only such an array (JSON never
    yields one)."""
    if not isinstance(value, np.ndarray) or value.dtype != np.int64:
        raise PydanticCustomError("union", "not token ids")
    return value


UnpackedIds = Annotated[TokenArray, PlainValidator(as_array)]  # `prompt` as into_prompt() leaves it


def into_prompt(data: Any) -> Any:
    """A completion body (before validation) with FIELD: its ids unpacked as `prompt`, or the 400 of a bad value
    (openai_request.CompletionRequest runs it first)."""
    if not isinstance(data, dict) or data.get(FIELD) is None:
        return data
    packed = data[FIELD]
    if data.get("prompt") is not None:
        raise PydanticCustomError("both", "give the prompt once: prompt or {field}, not both", {"field": FIELD})
    if not isinstance(packed, str):
        raise PydanticCustomError("packed", "{field} must be a string", {"field": FIELD})
    try:
        ids = unpack(packed)
    except ValueError as e:
        raise PydanticCustomError("packed", "{message}", {"message": str(e)}) from None
    return {**{k: v for k, v in data.items() if k != FIELD}, "prompt": ids}
