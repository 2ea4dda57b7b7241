"""Two phases of bench/phases.py split into their steps: "router -> P" (the client's send to P's engine taking the
request) and pull's "relay" (P's first token to D's engine taking the request, and on to D's READ), from the
router's and the instances' HTTP-edge events (pdserve/http_timeline.py) around the engines' own.

A split is a chain of events; each step is the time from one event of the chain to the next and is labelled by
the event it ends at ("R body_parsed": the router parsing the body's JSON). A request's steps add up to its phase
when every event is present; a step whose events are missing or out of order is left out for that request.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

from pdserve.bench.timeline import RequestTimeline

Event = tuple[str, str]  # (where: "C" client, "R" router, "P", "D"; event name)


def _edge(where: str) -> tuple[Event, ...]:
    """An instance's (or the router's) steps from its HTTP edge up to a validated request."""
    return tuple((where, e) for e in ("http_received", "body_read", "body_parsed", "body_validated"))


def _instance(where: str) -> tuple[Event, ...]:
    """An instance's edge, then its prompt, its checks and the engine thread taking it ("arrival")."""
    return _edge(where) + ((where, "prompt_ready"), (where, "admitted"), (where, "arrival"))


ROUTER_TO_P: tuple[Event, ...] = (("C", "sent"), *_edge("R"), ("R", "prefill_sent"), *_instance("P"))
RELAY: tuple[Event, ...] = (
    ("P", "first_token"),
    ("P", "answer_ready"),  # the engine's output on P's event loop
    ("P", "answer_encoded"),
    ("R", "prefill_answered"),  # P's answer written, sent, and its head read by the router
    ("R", "prefill_read"),
    ("R", "decode_sent"),  # D chosen, D's body built and encoded
    *_instance("D"),
    ("D", "transfer_posted"),
)
# push's hand-over: the engine handing the finished prefill to the transfer thread, then that thread posting the
# WRITE (laid out before the prefill ended when P's "write_prepared" precedes "send_taken", transfer/thread/
# push_prepare.py; else laid out after "send_taken", between "write_segments" and "write_descriptors")
HANDOVER: tuple[Event, ...] = (("P", "first_token"), ("P", "send_taken"), ("P", "transfer_posted"))
SPLITS: dict[str, dict[str, tuple[Event, ...]]] = {  # mode -> phase -> chain
    "pull": {"router->P": ROUTER_TO_P, "relay": RELAY},
    "push": {"router->P": ROUTER_TO_P, "hand-over": HANDOVER},
}


def label(event: Event) -> str:
    return f"{event[0]} {event[1]}"


def request_steps(chain: tuple[Event, ...], tl: RequestTimeline, client: Mapping[str, float]) -> dict[str, float]:
    """One request's steps of `chain`, seconds, by the label of the event each ends at."""
    times = [client.get(name) if where == "C" else tl.event(where, name) for where, name in chain]
    out = {}
    for i in range(1, len(chain)):
        t0, t1 = times[i - 1], times[i]
        if t0 is not None and t1 is not None and t1 >= t0:
            out[label(chain[i])] = t1 - t0
    return out


def split_medians(
    mode: str, timelines: Iterable[tuple[RequestTimeline, Mapping[str, float]]]
) -> dict[str, dict[str, float]]:
    """phase -> step label -> median ms over the requests that have it, for (timeline, client events) pairs
    (client events: {"sent": unix time} where known, else {})."""
    out: dict[str, dict[str, float]] = {}
    pairs = list(timelines)
    for phase, chain in SPLITS.get(mode, {}).items():
        steps: dict[str, list[float]] = {label(e): [] for e in chain[1:]}
        for tl, client in pairs:
            for name, seconds in request_steps(chain, tl, client).items():
                steps[name].append(seconds)
        medians = {name: 1000 * statistics.median(v) for name, v in steps.items() if v}
        if medians:
            out[phase] = medians
    return out


def split_table(mode: str, medians: Mapping[str, Mapping[str, float]]) -> str:
    """split_medians as text: one line per step ("ms until EVENT"), a total per phase."""
    lines = []
    for phase, steps in medians.items():
        lines.append(f"{mode} {phase}, split (median ms until each event; total {sum(steps.values()):.2f}):")
        lines += [f"  {name:24} {ms:8.2f}" for name, ms in steps.items()]
    return "\n".join(lines)
