"""bench/phases.py: a request's phases follow one another from the client's send to its first token, so they add
up to its TTFT exactly when every event is known; a missing or out-of-order event drops that phase only; the
medians join a bench result with the servers' timelines by request id."""

from __future__ import annotations

import pytest

from pdserve.bench.phases import PHASES, phase_medians, phases_summary, request_phases
from pdserve.bench.timeline import RequestTimeline

T0 = 1_700_000_000.0


def _push_timeline(rid: str, shift: float = 0.0) -> RequestTimeline:
    p = {"arrival": 0.001, "prefill_start": 0.002, "first_token": 0.010, "transfer_posted": 0.012}
    d = {"arrival": 0.0015, "kv_received": 0.014, "first_token": 0.0145, "scheduled": 0.015}  # token before step
    return RequestTimeline(rid, {k: T0 + shift + v for k, v in p.items()}, {k: T0 + shift + v for k, v in d.items()})


def test_push_phases_add_up_to_the_ttft() -> None:
    got = request_phases("push", _push_timeline("a"), {"sent": T0, "first_token": T0 + 0.018})
    assert list(got) == [label for label, _, _ in PHASES["push"]]
    assert got["hand-over"] == pytest.approx(0.002, abs=1e-5) and got["transfer"] == pytest.approx(0.002, abs=1e-5)
    assert got["KV->D token"] == pytest.approx(0.0005, abs=1e-5)  # D's first step is not on the path any more
    assert sum(got.values()) == pytest.approx(0.018, abs=1e-5)


def test_missing_or_reversed_events_drop_only_their_phase() -> None:
    tl = _push_timeline("a")
    del tl.prefill["transfer_posted"]
    tl.decode["kv_received"] = T0 + 0.020  # after D's first token: clocks or events out of order
    got = request_phases("push", tl, {})
    assert "hand-over" not in got and "transfer" not in got and "KV->D token" not in got
    assert "router->P" not in got and "D->client" not in got  # no client times given
    assert got["prefill"] == pytest.approx(0.008, abs=1e-5)


def test_medians_join_the_bench_result_by_request_id() -> None:
    entries_p = [{"request_id": "x", "client_request_id": f"cmpl-r{i}", "role": "prefill",
                  "events": _push_timeline(f"r{i}", i).prefill} for i in range(3)]  # fmt: skip
    entries_d = [{"request_id": "y", "client_request_id": f"r{i}", "role": "decode",
                  "events": _push_timeline(f"r{i}", i).decode} for i in range(3)]  # fmt: skip
    result = {"request_ids": ["r0", "r1", "r2", "r3"], "start_times": [T0, T0 + 1, T0 + 2, T0 + 3],
              "ttfts": [0.018, 0.020, 0.019, 0.0], "errors": ["", "", "", "refused"],
              "itls": [[0.005, 0.004], [0.007], [0.006, 0.1], []]}  # fmt: skip
    out = phase_medians("push", result, entries_p, entries_d)
    assert out["phase_counts"]["prefill"] == 3 and out["phase_counts"]["D->client"] == 3
    assert out["phase_medians_ms"]["D->client"] == pytest.approx(4.5, abs=1e-3)  # 3.5, 5.5, 4.5 ms
    assert out["median_first_itl_ms"] == pytest.approx(6.0, abs=1e-3) and out["p99_first_itl_ms"] == pytest.approx(
        7.0, abs=1e-3
    )
    text = phases_summary([{**out, "mode": "push", "qps": "1", "input_len": 16, "output_len": 4, "iteration": 0}])
    assert "hand-over 2.00" in text and "= " in text


def test_colocated_phases_use_the_instance_for_both_roles() -> None:
    tl = RequestTimeline("c", {"arrival": T0 + 0.001, "prefill_start": T0 + 0.002, "first_token": T0 + 0.009})
    got = request_phases("colocated", tl, {"sent": T0, "first_token": T0 + 0.010})
    assert sum(got.values()) == pytest.approx(0.010, abs=1e-5) and len(got) == 4


def test_push_hand_over_split_and_prepared_writes() -> None:
    """The hand-over's two steps (phase_split.HANDOVER) add up to it, printed under the push row, not in its sum; a
    request whose WRITE was laid out before its prefill ended ("write_prepared" before "send_taken") is counted."""
    tls = [_push_timeline(f"r{i}", i) for i in range(2)]
    for i, tl in enumerate(tls):
        tl.prefill["send_taken"] = tl.prefill["first_token"] + 0.0005
        tl.prefill["write_prepared" if i == 0 else "write_descriptors"] = tl.prefill["prefill_start"] + 0.001
    entries_p = [{"request_id": tl.request_id, "role": "prefill", "events": tl.prefill} for tl in tls]
    entries_d = [{"request_id": tl.request_id, "role": "decode", "events": tl.decode} for tl in tls]
    result = {"request_ids": ["r0", "r1"], "start_times": [T0, T0 + 1], "ttfts": [0.018, 0.018], "errors": ["", ""],
              "itls": [[0.005], [0.005]]}  # fmt: skip
    out = phase_medians("push", result, entries_p, entries_d)
    assert out["num_write_prepared"] == 1
    split = out["phase_splits_ms"]["hand-over"]
    assert split["P send_taken"] == pytest.approx(0.5, abs=1e-3) and split["P transfer_posted"] == pytest.approx(
        1.5, abs=1e-3
    )
    assert sum(split.values()) == pytest.approx(out["phase_medians_ms"]["hand-over"], abs=1e-3)
    text = phases_summary([{**out, "mode": "push", "qps": "1", "input_len": 16, "output_len": 4, "iteration": 0}])
    assert "hand-over: to P send_taken 0.50 | to P transfer_posted 1.50" in text and text.count("= ") == 1
