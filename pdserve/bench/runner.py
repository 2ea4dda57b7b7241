"""The load loop: send requests on a Poisson (or gamma) schedule, at most N at a time, and time the run.

An arrival is one request, or one conversation (multiturn.py) whose later turns each wait for the previous
answer and the think time: the schedule is open-loop across arrivals and closed-loop within a conversation.
Every task is created here and awaited here (`_send_all` gathers them all before it returns).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp
import numpy as np
from tqdm import tqdm

from pdserve.bench.client import PERF_TO_UNIX, ClientConfig, RequestOutput, send_request
from pdserve.bench.dataset import SampleRequest
from pdserve.bench.multiturn import Conversation


@dataclass(frozen=True)
class LoadConfig:
    """When requests are sent."""

    request_rate: float = math.inf  # requests per second; inf = all at once
    burstiness: float = 1.0  # gamma shape: 1 = Poisson, < 1 burstier, > 1 more regular
    max_concurrency: int | None = None  # requests in flight at once; None = unlimited
    seed: int = 0  # seeds the arrival schedule
    timeout_s: float = 6 * 3600.0  # per request, like vllm bench serve
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {self.max_concurrency}")


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send time of each request, seconds after the first, as `vllm bench serve` schedules them.

    Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)) (exponential when burstiness is 1); the
    cumulative times are then rescaled so the last send lands at num/rate, which keeps the offered load
    equal across seeds.
    """
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    if math.isinf(burstiness):
        gaps = np.full(num, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (num / request_rate) / offsets[-1]
    return [float(x) for x in offsets]


Arrival = SampleRequest | Conversation  # what one arrival starts: one request, or a conversation's turns
Send = Callable[[SampleRequest], Awaitable[RequestOutput]]
NOT_SENT = "not sent: "  # how the error of a turn that followed a failed one begins


def num_requests(arrivals: Sequence[Arrival]) -> int:
    return sum(a.num_turns if isinstance(a, Conversation) else 1 for a in arrivals)


async def play(conversation: Conversation, send: Send) -> list[RequestOutput]:
    """Send a conversation's turns in order: turn k+1 once turn k's answer arrived and the think time passed.

    A turn that failed (or whose answer came without token ids) ends the conversation: the turns after it
    are not sent and are reported as failed, so every turn of the run has one output.
    """
    outputs: list[RequestOutput] = []
    request = conversation.first_request()
    while True:
        out = await send(request)
        outputs.append(out)
        if request.turn + 1 == conversation.num_turns:
            return outputs
        reason = out.error if not out.success else ""
        if out.success and len(out.output_ids) != out.output_tokens:
            reason = f"its answer carried {len(out.output_ids)} token ids for {out.output_tokens} tokens"
        if reason:
            now = time.perf_counter() + PERF_TO_UNIX
            for turn in range(request.turn + 1, conversation.num_turns):
                error = f"{NOT_SENT}turn {request.turn} ({out.request_id}) failed: {reason}"
                rid = conversation.request_id(turn)
                outputs.append(RequestOutput(rid, start_time=now, error=error, user=out.user, turn=turn))
            return outputs
        await asyncio.sleep(conversation.think_time_s)
        request = conversation.next_request(request, out.output_ids)


async def _send_all(
    session: aiohttp.ClientSession,
    client: ClientConfig,
    arrivals: Sequence[Arrival],
    offsets: Sequence[float],
    max_concurrency: int | None,
    pbar: tqdm | None,
) -> list[RequestOutput]:
    """Start each arrival at its offset; every request's outputs, ordered by the time it was sent.

    Concurrency is capped per request, not per conversation: a user thinking holds no slot.
    """
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def send(req: SampleRequest) -> RequestOutput:
        async with semaphore:
            out = await send_request(session, client, req)
        if pbar is not None:
            pbar.update(1)
        return out

    async def one(arrival: Arrival) -> list[RequestOutput]:
        if not isinstance(arrival, Conversation):
            return [await send(arrival)]
        outputs = await play(arrival, send)
        if pbar is not None:  # the turns never sent are done too
            pbar.update(sum(out.error.startswith(NOT_SENT) for out in outputs))
        return outputs

    start = time.perf_counter()
    tasks = []
    for arrival, offset in zip(arrivals, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(arrival)))
    outputs = [out for outs in await asyncio.gather(*tasks) for out in outs]
    return sorted(outputs, key=lambda out: out.start_time)  # stable: single requests keep their arrival order


async def run_load(
    client: ClientConfig,
    requests: Sequence[Arrival],
    load: LoadConfig,
    warmups: Sequence[SampleRequest] = (),
) -> tuple[list[RequestOutput], float]:
    """Send `warmups` (untimed, all at once within max_concurrency), then `requests` on the schedule: each
    arrival sends one request or plays one conversation (its turns after it, each waiting for the last).

    Returns every request's output in send order and the run's wall time in seconds (first send to last
    finish).
    """
    connector = aiohttp.TCPConnector(limit=load.max_concurrency or 0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=load.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if warmups:
            await _send_all(session, client, warmups, [0.0] * len(warmups), load.max_concurrency, None)
        offsets = arrival_offsets(len(requests), load.request_rate, load.burstiness, load.seed)
        pbar = tqdm(total=num_requests(requests), desc="requests", disable=not load.show_progress)
        start = time.perf_counter()
        try:
            outputs = await _send_all(session, client, requests, offsets, load.max_concurrency, pbar)
        finally:
            pbar.close()
        duration = time.perf_counter() - start
    return outputs, duration
