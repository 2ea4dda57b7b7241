"""Per-request sampling settings (validated at construction; the server maps OpenAI fields onto them).

Every value is checked here, where a request enters, so nothing the engine step receives can make the sampler
raise: non-finite or out-of-range values are a ValueError naming the field (the server answers 400), and
temperatures below GREEDY_TEMPERATURE sample greedily instead of dividing logits by almost nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Below this temperature sampling is greedy: softmax(logits / t) is one-hot to float32 precision long before
# t reaches 1e-5 for any realistic logit gap, and dividing by 1e-40 overflows to inf.
GREEDY_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # generated tokens at most
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) = greedy; finite, >= 0
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None  # per-request generator seed
    stop: tuple[str, ...] = ()  # stop strings (not included in the output text)
    stop_token_ids: tuple[int, ...] = ()  # stop tokens besides EOS (included in token_ids, not in text)
    ignore_eos: bool = False  # keep going past EOS until max_tokens

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a finite number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer: -1, 0 or positive, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))  # normalise a single string, once, at construction
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {list(self.stop_token_ids)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @classmethod
    def greedy(cls, max_tokens: int = 16, **kw: Any) -> SamplingParams:
        return cls(max_tokens=max_tokens, temperature=0.0, **kw)
