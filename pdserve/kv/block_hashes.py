"""The prefix cache's block keys: chained blake2b digests of full blocks of token ids.

One definition for everything that names a cached block: the engine's prefix cache (engine/prefix_cache.py,
block_pool.py), the KV event log it publishes (GET /kv_events) and a consumer that hashes prompts the same way to
predict an instance's prefix hits (a router; it may import kv/, never the engine).

The scheme (HASH_SCHEME, carried in every /kv_events snapshot so a consumer can check it):
- block i of a prompt is its tokens [i * block_size, (i + 1) * block_size); only full blocks have a key;
- key(0) = blake2b(b"root" + tokens(0), digest_size=16); key(i) = blake2b(key(i - 1) + tokens(i), digest_size=16),
  where tokens(i) are the block's token ids as int64 little-endian, so equal keys mean equal tokens from
  position 0 up to the block's end (a collision is as likely as guessing a 128-bit key);
- a block of KV group g > 0 (a sliding-window group, kv/groups.py) is cached under g as uint16 little-endian
  followed by the key; group 0 (full attention, every model has it) under the key itself.
Pure Python.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Any

BlockHash = bytes  # 16-byte chained digest of a full block (hash_block)

ROOT = b"root"  # what the first block's digest starts from, in place of a parent digest
HASH_SCHEME: dict[str, Any] = {  # the scheme above, as /kv_events states it (compare for equality)
    "name": "blake2b-128-chain",
    "root": ROOT.hex(),
    "token_ids": "int64-le",
    "group_prefix": "uint16-le",
}
_SWAP = sys.byteorder == "big"  # array("q") is in machine order; the scheme is little-endian


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained digest of one full block: equal digests mean equal tokens from position 0 up to this block's end."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash if parent_hash is not None else ROOT)
    tokens = array("q", token_ids)
    if _SWAP:
        tokens.byteswap()
    h.update(tokens.tobytes())
    return h.digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The keys of the full blocks of these token ids, in order (a trailing partial block has none)."""
    out: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        out.append(hash_block(out[-1] if out else None, token_ids[start : start + block_size]))
    return out


def group_key(group: int, block_hash: BlockHash) -> bytes:
    """The prefix-cache key of a block of KV group `group` (group 0 keeps the plain chained hash)."""
    return block_hash if group == 0 else group.to_bytes(2, "little") + block_hash
