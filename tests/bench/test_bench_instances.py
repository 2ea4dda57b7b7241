"""bench/instances.py: a point's per-instance deltas, KV bytes per request, pooled hit rate, and their table."""

from __future__ import annotations

from pdserve.bench.instances import COUNTERS, instances_of, instances_table, is_settled, point_counts


def scrape(**values: float) -> dict[str, float]:
    return {COUNTERS[k]: v for k, v in values.items()}


def test_deltas_bytes_per_request_and_pooled_hit_rate() -> None:
    instances = instances_of(["http://p"], ["http://d0", "http://d1"], [])
    names = ("requests", "prompt_tokens", "prefix_hit_tokens", "kv_sent_bytes", "kv_received_bytes")
    before = {
        "http://p": scrape(**dict(zip(names, (5, 500, 0, 1000, 0), strict=True))),
        "http://d0": scrape(**dict(zip(names, (0, 0, 0, 0, 1000), strict=True))),
        "http://d1": scrape(**dict(zip(names, (0, 0, 0, 0, 0), strict=True))),
    }
    after = {
        "http://p": scrape(**dict(zip(names, (9, 900, 100, 5000, 0), strict=True))),
        "http://d0": scrape(**dict(zip(names, (2, 200, 150, 0, 3000), strict=True))),
        "http://d1": scrape(**dict(zip(names, (2, 200, 0, 0, 2000), strict=True))),
    }
    got = point_counts(instances, before, after, completed=4)
    p, d0, d1 = got["instances"]
    assert (p["role"], p["requests"], p["prompt_tokens"], p["prefix_hit_tokens"]) == ("prefill", 4, 400, 100)
    assert p["hit_rate"] == 0.25 and p["kv_sent_bytes"] == 4000
    assert (d0["role"], d0["hit_rate"], d0["kv_received_bytes"]) == ("decode", 0.75, 2000)
    assert d1["hit_rate"] == 0.0 and d1["kv_received_bytes"] == 2000
    assert got["kv_bytes_per_request"] == 1000.0  # (2000 + 2000) bytes D received / 4 completed
    assert got["prefix_hit_rate"] == 250 / 800
    table = instances_table([{"qps": "inf", "input_len": 16, "output_len": 4, "mode": "pull", **got}])
    assert "KV/req 1.0 KiB, hit 31%" in table and "P0 4 req, hit 25%, out 3.9 KiB" in table
    assert "D1 2 req, hit 75%, in 2.0 KiB" in table


def test_an_instance_without_the_counters_and_nothing_completed() -> None:
    instances = instances_of([], [], ["http://a"])
    old = {"http://a": {"pdserve_kv_received_bytes_total": 0.0}}  # an older server: no admission counters
    got = point_counts(instances, old, old, completed=0)
    (a,) = got["instances"]
    assert a["role"] == "both" and a["prompt_tokens"] is None and a["hit_rate"] is None
    assert got["kv_bytes_per_request"] is None and got["prefix_hit_rate"] is None
    assert instances_table([{"qps": "1", "input_len": 8, "output_len": 2, "mode": "colocated"}]) == ""


def test_settled_means_idle_with_every_block_free() -> None:
    idle = {"pdserve_kv_blocks_total": 64.0, "pdserve_kv_blocks_free": 64.0, "pdserve_requests_running": 0.0}
    assert is_settled(idle)
    assert not is_settled({**idle, "pdserve_kv_blocks_free": 60.0})  # P still pins a finished prefill's KV
    assert not is_settled({**idle, "pdserve_requests_waiting_for_kv": 1.0})
