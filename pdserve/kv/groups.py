"""Layer groups of the KV cache (pure Python: the scheduler imports it, so no torch here).

Layers that share an attention type (the same sliding window, or the whole context) share block tables. Every
group holds the same number of layers, `layers_per_block` (the gcd of the per-type layer counts), so one block
of the cache, [layers_per_block, 2, num_kv_heads, block_size, head_dim], serves any group and one block pool
serves them all; a type with more layers has several groups (Gemma 3 12B: 40 local and 8 global layers make
six groups of 8, five local and one global). A model whose layers all share one type has one group of every
layer: the cache, its block tables and the transfer layout are exactly those of a full-attention model.

A windowed group needs, once tokens [0, n) are computed, only the blocks from `first_live_block(n)` on: the
next query (position >= n) sees keys at positions > n - window. The scheduler frees the blocks before it
(their table entries become STALE) while the request runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

STALE = -1  # table entry of a windowed group's block that left every query's window (freed)


def first_live_block(window: int | None, num_computed: int, block_size: int) -> int:
    """First block a query at a position >= num_computed reads, for a layer of this window (0: whole context)."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # keys a query sees, itself included; None = the whole context
    layers: tuple[int, ...]  # model layer indices, in order; layer layers[j] lives in slot j of a block


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]
    layers_per_block: int  # layers one block holds (= len(g.layers) for every group)

    @classmethod
    def of(cls, layer_windows: tuple[int | None, ...], num_layers: int) -> KVGroups:
        """Groups for per-layer windows (empty: every layer sees the whole context)."""
        windows = layer_windows or (None,) * num_layers
        by_type: dict[int | None, list[int]] = {}
        for i, w in enumerate(windows):
            by_type.setdefault(w, []).append(i)
        size = 0
        for layers in by_type.values():
            size = gcd(size, len(layers))
        groups = [  # full-attention groups first: group 0 is the one transfers and P/D address
            KVGroup(w, tuple(layers[j : j + size]))
            for w, layers in sorted(by_type.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))
            for j in range(0, len(layers), size)
        ]
        return cls(tuple(groups), size)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_windowed(self) -> bool:
        return any(g.window is not None for g in self.groups)

    def layer_slots(self) -> list[tuple[int, int]]:
        """(group, slot in the block) of every model layer, by layer index."""
        out: dict[int, tuple[int, int]] = {}
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                out[layer] = (g, j)
        return [out[i] for i in range(len(out))]

    def first_live_block(self, group: int, num_computed: int, block_size: int) -> int:
        """First block of `group` a query at a position >= num_computed can read (0 for full attention)."""
        return first_live_block(self.groups[group].window, num_computed, block_size)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window (None: the whole context), in group order."""
        return tuple(g.window for g in self.groups)

    def describe(self) -> list[dict[str, object]]:
        """The structure as plain data (for /kv_transfer/info, logs and refusals)."""
        return [{"window": g.window, "layers": list(g.layers)} for g in self.groups]
