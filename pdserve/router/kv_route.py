"""KV-aware instance choice: each candidate's cost weighs the prompt's cached prefix there against its load.

    cost(instance) = kv_load_weight * outstanding legs - kv_hit_weight * cached tokens / 1,024

`cached tokens` are the instance's leading prompt blocks its prefix index holds (router/kv_index.py, stopping
at the first miss) times its block size, counting at most (prompt tokens - 1) // block size whole blocks: the
engine always computes the last prompt token and reuses whole blocks only (prefix_cache.take_hits). So
kv_hit_weight is what 1,024 cached tokens are worth in outstanding legs: the hit is counted in tokens, what a
miss there would cost to prefill, not as a fraction of the prompt. With the defaults (hit 1, load 1) an instance
holding a 12k-token history keeps its conversation until it has 12 more legs in flight than one holding none,
while a 1k-token shared prefix is worth one leg. (A fraction, the first form, valued a 13k-token history at two
legs at most: on one H200 that sent 12% of later turns away from the instance holding their history, each then
prefilling ~10k tokens elsewhere at ~3x the TTFT: docs/benchmarks.md, "Long histories".)
Ties rotate (policy.Pool.choose). A prompt the router cannot hash (text without a tokenizer, a batch) is
routed by load alone, and so is one holding a token id beyond int64 (router/prompt_tokens.py: the instance
answers its 400). A wrong guess costs a prefix miss (a longer prefill), never a wrong answer: the instance
computes whatever it does not hold.

Selective disaggregation (`--colocate-below N`, orchestrate.py) uses the same numbers: a request whose uncached
suffix at the chosen decode instance (prompt tokens - its cached tokens) is below N runs whole there. With
least-loaded or round-robin routing the cached tokens are 0, so the rule is the prompt length, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.kv.block_hashes import BlockHash, prompt_block_hashes
from pdserve.router.kv_index import KVIndex
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import Backend, Pool

DEFAULT_HIT_WEIGHT = 1.0  # outstanding legs HIT_UNIT_TOKENS cached tokens are worth (docs/benchmarks.md)
DEFAULT_LOAD_WEIGHT = 1.0  # per outstanding leg
HIT_UNIT_TOKENS = 1024  # the hit term's unit: kv_hit_weight is per this many cached prompt tokens
INLINE_HASH_TOKENS = 2048  # longer prompts are hashed in a worker thread (16k tokens: ~15 ms on a loaded 2-core host)


@dataclass(frozen=True)
class KVWeights:
    """The cost's weights (module docstring)."""

    hit_weight: float = DEFAULT_HIT_WEIGHT  # per HIT_UNIT_TOKENS cached prompt tokens
    load_weight: float = DEFAULT_LOAD_WEIGHT  # per outstanding leg through this router

    def __post_init__(self) -> None:
        for name, value in (("--kv-hit-weight", self.hit_weight), ("--kv-load-weight", self.load_weight)):
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


@dataclass
class PromptKeys:
    """One request's prompt token ids and their block keys, hashed once per block size asked for."""

    token_ids: Sequence[int]  # the prompt as the instance will see it
    _by_size: dict[int, list[BlockHash]] = field(default_factory=dict)  # block size -> keys of full blocks

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def hash_all(self, block_sizes: set[int]) -> None:
        for block_size in block_sizes:
            self.hashes(block_size)

    def hashes(self, block_size: int) -> list[BlockHash]:
        keys = self._by_size.get(block_size)
        if keys is None:
            keys = self._by_size[block_size] = prompt_block_hashes(self.token_ids, block_size)
        return keys


@dataclass(frozen=True)
class Choice:
    """An instance chosen for a leg, and what the router believes it holds of the prompt."""

    backend: Backend  # the instance
    hit_tokens: int = 0  # leading prompt tokens cached there (0: unknown, or not kv-aware)
    hit_blocks: int = 0  # the same in its blocks
    prompt_tokens: int | None = None  # the prompt's tokens when it was scored by cache (kv-aware), else None


class KVRoute:
    """Chooses instances by cache and load (kv-aware pools) or by the pool's policy alone (others)."""

    def __init__(self, index: KVIndex, weights: KVWeights, metrics: RouterMetrics) -> None:
        self.index = index  # the instances' prefix indexes, fed by router/kv_stream.py
        self.weights = weights
        self.metrics = metrics

    def is_kv_aware(self, pool: Pool) -> bool:
        return pool.policy == "kv-aware"

    async def prepare(self, prompt: PromptKeys) -> None:
        """Hash `prompt` at every block size the instances use, off the event loop when it is long."""
        sizes = {i.block_size for i in self.index.instances.values() if i.usable and i.block_size is not None}
        if prompt.num_tokens > INLINE_HASH_TOKENS:
            await asyncio.to_thread(prompt.hash_all, sizes)
        else:
            prompt.hash_all(sizes)

    def hit(self, url: str, prompt: PromptKeys) -> tuple[int, int]:
        """(cached blocks, cached tokens) of `prompt` at instance `url`: (0, 0) when its index is unusable."""
        inst = self.index.get(url)
        if inst is None or not inst.usable or inst.block_size is None:
            return 0, 0
        blocks = inst.hit_blocks(prompt.hashes(inst.block_size))
        blocks = min(blocks, max(prompt.num_tokens - 1, 0) // inst.block_size)  # as prefix_cache.take_hits
        return blocks, blocks * inst.block_size

    def choose(self, pool: Pool, prompt: PromptKeys | None) -> Choice:
        """An instance of `pool` for `prompt` (None: not hashable); `used` records it in /metrics once the
        caller sends a leg there (a choice made only to decide whether to skip P is not counted twice)."""
        if pool.policy != "kv-aware" or prompt is None or prompt.num_tokens == 0:
            return Choice(pool.choose())
        hits: dict[str, tuple[int, int]] = {}
        w = self.weights

        def cost(b: Backend) -> float:
            hits[b.url] = self.hit(b.url, prompt)
            return w.load_weight * b.num_outstanding - w.hit_weight * hits[b.url][1] / HIT_UNIT_TOKENS

        backend = pool.choose(cost)
        blocks, tokens = hits[backend.url]
        return Choice(backend, tokens, blocks, prompt.num_tokens)

    def used(self, pool: Pool, choice: Choice) -> Backend:
        """Count a choice whose leg is sent (kv-aware choices only) and return its instance."""
        if choice.prompt_tokens is not None:
            self.metrics.kv_choice(pool.role, choice.hit_blocks, choice.hit_tokens, choice.prompt_tokens)
        return choice.backend
