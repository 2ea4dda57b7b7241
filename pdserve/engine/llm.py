"""Offline API: `LLM(model, ...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, cast

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams


class LLM:
    """Runs the engine in the calling thread. Prompts are strings (tokenized with the model's tokenizer) or
    lists of token ids; generate() returns one finished output per prompt, in order. With
    tensor_parallel_size N > 1 it spawns N - 1 rank processes: call shutdown() to join them."""

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        device: str = "cpu",
        load_format: Literal["auto", "dummy"] = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_gib: float = 1.0,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        num_threads: int | None = None,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
    ) -> None:
        config = EngineConfig(
            model=ModelConfig(model, dtype, device, load_format, max_model_len, seed, num_threads, enforce_eager),
            cache=CacheConfig(block_size, num_blocks, kv_cache_memory_gib, enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
            parallel=ParallelConfig(tensor_parallel_size),
        )
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        params = params or SamplingParams()
        order: dict[str, int] = {}
        for i, p in enumerate(_as_batch(prompts)):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("this model has no tokenizer (dummy weights): pass token-id lists")
                token_ids = self.tokenizer.encode(p)
            else:
                token_ids = list(p)
            self._counter += 1
            request_id = f"offline-{self._counter}"
            self.engine.add_request(request_id, token_ids, params)
            order[request_id] = i
        finished: dict[int, RequestOutput] = {}
        while len(finished) < len(order):
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    finished[order[out.request_id]] = out
        return [finished[i] for i in range(len(order))]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights)")
        return self.generate([self.tokenizer.apply_chat_template(messages)], params)[0]

    def shutdown(self) -> None:
        self.engine.shutdown()


def _as_batch(prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]) -> list[str | list[int]]:
    """One prompt (text or token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and isinstance(items[0], int):
        return [[int(t) for t in cast(Sequence[int], items)]]
    return [p if isinstance(p, str) else [int(t) for t in cast(Sequence[int], p)] for p in items]
