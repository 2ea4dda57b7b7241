"""The Prometheus text of one instance: exact names, cumulative values, drained histogram observations."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.client import EngineStats
from pdserve.server.metrics import make_registry, render


def stats(**kw: object) -> EngineStats:
    base = dict(
        num_blocks_total=100,
        num_blocks_free=90,
        num_running=2,
        num_waiting=1,
        num_waiting_for_kv=3,
        kv_sent_bytes=1000,
        kv_received_bytes=2000,
        transfers_ok=4,
        transfers_failed=1,
        transfers_expired=2,
    )
    return EngineStats(**{**base, **kw})  # type: ignore[arg-type]


def samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_names_and_values() -> None:
    registry = make_registry(
        lambda: stats(
            ttft_seconds=[0.05, 0.2],
            transfer_seconds=[0.001],
            transfer_descriptors=[1, 300],
            transfer_post_seconds=[0.0001, 0.002],
        )
    )
    text = render(registry).decode()
    got = samples(text)
    assert got["pdserve_kv_blocks_total"] == 100 and got["pdserve_kv_blocks_free"] == 90
    assert got["pdserve_requests_running"] == 2 and got["pdserve_requests_waiting"] == 1
    assert got["pdserve_requests_waiting_for_kv"] == 3
    assert got["pdserve_kv_sent_bytes_total"] == 1000 and got["pdserve_kv_received_bytes_total"] == 2000
    assert got['pdserve_kv_transfers_total{result="ok"}'] == 4
    assert got['pdserve_kv_transfers_total{result="failed"}'] == 1
    assert got['pdserve_kv_transfers_total{result="expired"}'] == 2
    assert got["pdserve_time_to_first_token_seconds_count"] == 2
    assert abs(got["pdserve_time_to_first_token_seconds_sum"] - 0.25) < 1e-9
    assert got["pdserve_kv_transfer_seconds_count"] == 1
    assert got["pdserve_kv_transfer_descriptors_count"] == 2 and got["pdserve_kv_transfer_descriptors_sum"] == 301
    assert got['pdserve_kv_transfer_descriptors_bucket{le="1.0"}'] == 1
    assert got["pdserve_kv_transfer_post_seconds_count"] == 2
    assert "# TYPE pdserve_kv_sent_bytes_total counter" in text
    assert "# TYPE pdserve_requests_waiting_for_kv gauge" in text
    assert "# TYPE pdserve_kv_transfer_seconds histogram" in text


def test_histograms_accumulate_drained_observations() -> None:
    batches = iter([[1.0], [], [2.0, 3.0]])
    registry = make_registry(lambda: stats(ttft_seconds=next(batches)))
    counts = [samples(render(registry).decode())["pdserve_time_to_first_token_seconds_count"] for _ in range(3)]
    assert counts == [1, 1, 3]


def test_registries_are_independent_and_survive_a_failing_engine() -> None:
    def broken() -> EngineStats:
        raise RuntimeError("engine not started")

    text = render(make_registry(broken)).decode()
    assert "pdserve_kv_blocks_total" not in text  # nothing invented
    assert "pdserve_time_to_first_token_seconds_count 0.0" in text
    assert "pdserve_kv_blocks_total 100.0" in render(make_registry(stats)).decode()


def test_engine_loop_counters() -> None:
    got = samples(render(make_registry(lambda: stats(num_engine_steps=7, transfer_hook_seconds=0.25))).decode())
    assert got["pdserve_engine_steps_total"] == 7
    assert got["pdserve_engine_transfer_hook_seconds_total"] == 0.25


def test_admission_counters() -> None:
    admitted = stats(num_requests_started=3, num_prompt_tokens=120, num_prefix_hit_tokens=32)
    text = render(make_registry(lambda: admitted)).decode()
    got = samples(text)
    assert got["pdserve_requests_started_total"] == 3 and got["pdserve_prompt_tokens_total"] == 120
    assert got["pdserve_prefix_cache_hit_tokens_total"] == 32
    assert "# TYPE pdserve_prefix_cache_hit_tokens_total counter" in text
