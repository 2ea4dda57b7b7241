"""bench/phase_split.py: the steps of "router -> P" and pull's relay from the router's and instances' events."""

from __future__ import annotations

from pdserve.bench.phase_split import RELAY, ROUTER_TO_P, label, request_steps, split_medians, split_table
from pdserve.bench.timeline import RequestTimeline, join


def _timeline(offset: float) -> RequestTimeline:
    """A pull request whose chains' events are 1 ms apart (relay) and 2 ms apart (router -> P), from `offset`."""
    tl = RequestTimeline("r1")
    for i, (where, name) in enumerate(ROUTER_TO_P[1:]):
        {"R": tl.router, "P": tl.prefill}[where][name] = offset + 0.002 * (i + 1)
    for i, (where, name) in enumerate(RELAY):
        {"R": tl.router, "P": tl.prefill, "D": tl.decode}[where][name] = offset + 1.0 + 0.001 * i
    return tl


def test_steps_follow_the_chain_and_sum_to_the_phase() -> None:
    tl = _timeline(100.0)
    relay = request_steps(RELAY, tl, {})
    assert list(relay) == [label(e) for e in RELAY[1:]]
    assert all(abs(v - 0.001) < 1e-9 for v in relay.values())
    to_p = request_steps(ROUTER_TO_P, tl, {"sent": 100.0})
    assert abs(sum(to_p.values()) - (tl.prefill["arrival"] - 100.0)) < 1e-9
    assert "R http_received" in to_p  # the client's send -> the router's first stamp


def test_missing_or_out_of_order_events_leave_their_steps_out() -> None:
    tl = _timeline(100.0)
    del tl.router["decode_sent"]
    tl.decode["body_read"] = tl.decode["http_received"] - 0.5  # another clock, or a wrong event: not a step
    steps = request_steps(RELAY, tl, {})
    assert "R decode_sent" not in steps and "D http_received" not in steps and "D body_read" not in steps
    assert "D body_parsed" in steps  # from the moved body_read, still before it
    assert "P answer_ready" in steps


def test_medians_and_table() -> None:
    medians = split_medians("pull", [(_timeline(100.0), {"sent": 99.99}), (_timeline(200.0), {"sent": 199.99})])
    assert set(medians) == {"router->P", "relay"}
    assert abs(medians["relay"]["D arrival"] - 1.0) < 1e-6
    assert abs(medians["router->P"]["R http_received"] - 12.0) < 1e-6  # 99.99 -> 100.002
    text = split_table("pull", medians)
    assert "pull relay" in text and "D arrival" in text
    assert split_medians("colocated", [(_timeline(1.0), {})]) == {}


def test_router_entries_join_requests_the_instances_saw() -> None:
    p = [{"request_id": "cmpl-a", "client_request_id": "a", "role": "prefill", "events": {"arrival": 1.0}}]
    r = [
        {"request_id": "a", "client_request_id": "a", "role": "router", "events": {"http_received": 0.5}},
        {"request_id": "b", "client_request_id": "b", "role": "router", "events": {"http_received": 0.7}},
    ]
    (tl,) = join(p, [], r)
    assert tl.router == {"http_received": 0.5} and tl.event("R", "http_received") == 0.5
