"""The multi-turn dataset: users in conversation, one shared system prompt, a history that grows every turn.

Turn 0's prompt is the system prompt (the same for every user) + the user's first tokens. Turn k+1's prompt
is turn k's prompt + turn k's answer (the token ids the server streamed back) + the user's next tokens, so
every turn's prompt starts with exactly the previous turn's prompt and answer: what a prefix cache, and a
router that knows what is cached where, can reuse.

An answer is known only once it has arrived, so a `Conversation` holds what is fixed in advance (the system
prompt, each turn's new tokens and max_tokens) and `next_request` builds turn k+1 from turn k's request and
answer. The runner plays a conversation (runner.py): it sends turn k+1 only after turn k's answer arrived and
the think time passed; the arrival process starts conversations, not requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.bench.dataset import SampleRequest, distinct_starts, prompt_candidates, sample_lengths
from pdserve.bench.tokenizer import Vocab


@dataclass(frozen=True)
class MultiTurnConfig:
    """The shape of a multi-turn run (lengths in tokens)."""

    num_users: int  # conversations, each started by one arrival of the arrival process
    num_turns: int  # requests per conversation
    system_prompt_len: int  # tokens of the system prompt every conversation starts with; 0 = none
    turn_len: int  # the user's new tokens per turn (spread by range_ratio)
    output_len: int  # max_tokens per turn (spread by range_ratio)
    think_time_s: float  # seconds from a turn's answer to the user's next turn
    range_ratio: float = 0.0  # turn and output lengths uniform in [len*(1-r), len*(1+r)]

    def __post_init__(self) -> None:
        for name in ("num_users", "num_turns", "turn_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_prompt_len < 0:
            raise ValueError(f"system_prompt_len must be >= 0, got {self.system_prompt_len}")
        if not (math.isfinite(self.think_time_s) and self.think_time_s >= 0):
            raise ValueError(f"think time must be a finite number of seconds >= 0, got {self.think_time_s}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range ratio must be in [0, 1), got {self.range_ratio}")

    @property
    def num_requests(self) -> int:
        return self.num_users * self.num_turns

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt the run can send: the last turn when every answer is as long as allowed."""
        high = 1.0 + self.range_ratio
        turns = self.num_turns * math.ceil(self.turn_len * high)
        answers = (self.num_turns - 1) * math.ceil(self.output_len * high)
        return self.system_prompt_len + turns + answers


@dataclass(frozen=True)
class Conversation:
    """One user's turns, fixed in advance except for the answers."""

    user: int  # 0-based, unique within the run
    id_prefix: str  # request ids are `<id_prefix>-<user>-<turn>`
    system_ids: list[int]  # [system_prompt_len] the shared system prompt
    turn_ids: list[list[int]]  # [num_turns][this turn's length] the user's new tokens per turn
    output_lens: list[int]  # [num_turns] max_tokens per turn
    think_time_s: float  # seconds from an answer's arrival to the next turn's send

    @property
    def num_turns(self) -> int:
        return len(self.turn_ids)

    def first_request(self) -> SampleRequest:
        """Turn 0: the system prompt + the user's first tokens."""
        return self._request(0, [*self.system_ids, *self.turn_ids[0]])

    def next_request(self, previous: SampleRequest, answer_ids: Sequence[int]) -> SampleRequest:
        """Turn k+1 from turn k's request and the token ids of its answer: previous prompt + answer + new tokens."""
        if not isinstance(previous.prompt, list) or previous.user != self.user:
            raise ValueError(f"{previous.request_id} is not a token-id turn of user {self.user}")
        turn = previous.turn + 1
        if turn >= self.num_turns:
            raise ValueError(f"user {self.user} has {self.num_turns} turns; no turn {turn}")
        return self._request(turn, [*previous.prompt, *answer_ids, *self.turn_ids[turn]])

    def request_id(self, turn: int) -> str:
        return f"{self.id_prefix}-{self.user}-{turn}"

    def _request(self, turn: int, ids: list[int]) -> SampleRequest:
        return SampleRequest(self.request_id(turn), ids, len(ids), self.output_lens[turn], user=self.user, turn=turn)


def conversations(vocab: Vocab, cfg: MultiTurnConfig, seed: int = 0, id_prefix: str = "bench") -> list[Conversation]:
    """`cfg.num_users` conversations of random token ids; equal arguments give equal conversations.

    Every user's first tokens start with an id no other user's do (while the vocabulary allows it), so two
    users share exactly the system prompt.
    """
    rng = np.random.default_rng(seed)
    candidates = prompt_candidates(vocab)
    system_ids = [int(t) for t in rng.choice(candidates, size=cfg.system_prompt_len)]
    turn_lens = sample_lengths(rng, cfg.num_requests, cfg.turn_len, cfg.range_ratio)  # user-major
    output_lens = sample_lengths(rng, cfg.num_requests, cfg.output_len, cfg.range_ratio)
    first_turns = distinct_starts(rng, candidates, turn_lens[:: cfg.num_turns])  # each user's turn 0
    result = []
    for user in range(cfg.num_users):
        lens = turn_lens[user * cfg.num_turns : (user + 1) * cfg.num_turns]
        later = [[int(t) for t in rng.choice(candidates, size=n)] for n in lens[1:]]
        result.append(
            Conversation(
                user=user,
                id_prefix=id_prefix,
                system_ids=system_ids,
                turn_ids=[first_turns[user], *later],
                output_lens=output_lens[user * cfg.num_turns : (user + 1) * cfg.num_turns],
                think_time_s=cfg.think_time_s,
            )
        )
    return result


def ttft_turn_medians_ms(turns: Sequence[int], ttfts: Sequence[float | None]) -> list[float | None]:
    """Per-request turn index and TTFT in seconds (None: failed) -> the median TTFT in ms of each turn,
    index = turn; None for a turn without a successful request."""
    by_turn: list[list[float]] = [[] for _ in range(max(turns, default=-1) + 1)]
    for turn, ttft in zip(turns, ttfts, strict=True):
        if ttft is not None:
            by_turn[turn].append(ttft)
    return [float(np.median(values)) * 1000.0 if values else None for values in by_turn]
