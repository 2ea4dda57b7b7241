"""`pdserve serve` flags -> EngineConfig, including vLLM's --kv-transfer-config JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from pdserve.config import ConfigError, TransferConfig
from pdserve.server import cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(["some-model", *argv])


def test_defaults() -> None:
    args = parse()
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    config = cli.build_config(args)
    assert config.model.model == "some-model" and config.model.device == "cpu"
    assert config.transfer.role == "both" and config.transfer.mode == "pull"
    assert config.transfer.side_channel_port == 5600 and config.transfer.lease_s == 30
    assert config.cache.block_size == 16 and config.cache.enable_prefix_caching
    assert config.model.num_threads == cli.available_cores()


def test_every_flag_reaches_the_config() -> None:
    args = parse(
        "--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--block-size", "32",
        "--no-enable-prefix-caching", "--dtype", "bfloat16", "--device", "cuda:1", "--load-format", "dummy",
        "--seed", "7", "--num-threads", "3", "--num-gpu-blocks", "100", "--kv-cache-memory-gib", "2.5",
        "--kv-role", "decode", "--kv-transfer", "push", "--engine-id", "d0", "--kv-side-channel-host", "10.0.0.2",
        "--kv-side-channel-port", "0", "--kv-buffer-device", "cpu", "--kv-lease-s", "5",
        "--push-registration-timeout-s", "6", "--kv-recv-timeout-s", "7", "--kv-load-failure-policy", "recompute",
    )  # fmt: skip
    c = cli.build_config(args)
    assert (c.model.max_model_len, c.model.dtype, c.model.device, c.model.load_format) == (
        1024, "bfloat16", "cuda:1", "dummy"
    )  # fmt: skip
    assert (c.model.seed, c.model.num_threads) == (7, 3)
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (8, 512)
    assert (c.cache.block_size, c.cache.num_blocks, c.cache.kv_cache_memory_gib) == (32, 100, 2.5)
    assert not c.cache.enable_prefix_caching
    t = c.transfer
    assert (t.role, t.mode, t.engine_id, t.side_channel_host, t.side_channel_port) == (
        "decode", "push", "d0", "10.0.0.2", 0
    )  # fmt: skip
    assert (t.kv_buffer_device, t.lease_s, t.push_registration_timeout_s, t.recv_timeout_s) == ("cpu", 5, 6, 7)
    assert t.load_failure_policy == "recompute"


def test_faults_are_no_flag_and_no_config() -> None:
    """Test-only faults are neither a flag nor a config field: a test hands them to the engine it builds
    (run's make_engine, tests/e2e/serve_with_faults.py), which hands them to the connector factory."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    text = parser.format_help()
    assert "--debug-" not in text and "faults" not in text and "delay" not in text
    assert "faults" not in {f.name for f in dataclasses.fields(TransferConfig)}


def test_disaggregated_instances_default_to_half_the_cores() -> None:
    config = cli.build_config(parse("--kv-role", "prefill"))
    assert config.model.num_threads == max(1, cli.available_cores() // 2)


def test_vllm_kv_transfer_config() -> None:
    raw = {
        "kv_connector": "NixlPushConnector",
        "kv_role": "kv_producer",
        "engine_id": "p0",
        "kv_buffer_device": "cuda",
        "kv_connector_extra_config": {"side_channel_port": 5700, "backends": ["UCX"]},
    }
    t = cli.build_config(parse("--kv-transfer-config", json.dumps(raw))).transfer
    assert (t.mode, t.role, t.engine_id, t.kv_buffer_device, t.side_channel_port) == (
        "push", "prefill", "p0", "device", 5700
    )  # fmt: skip


def test_flags_override_kv_transfer_config() -> None:
    raw = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
    t = cli.build_config(parse("--kv-transfer-config", raw, "--kv-role", "prefill", "--kv-transfer", "push")).transfer
    assert (t.role, t.mode) == ("prefill", "push")


@pytest.mark.parametrize(
    "raw, words",
    [
        ("{not json", "not valid JSON"),
        ('{"kv_connector": "LMCacheConnector"}', "LMCacheConnector"),
        ('{"kv_role": "kv_decoder"}', "kv_decoder"),
        ('{"kv_whatever": 1}', "kv_whatever"),
        ("[1]", "JSON object"),
    ],
)
def test_bad_kv_transfer_config(raw: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        cli.build_config(parse("--kv-transfer-config", raw))


def test_bad_values_are_refused_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--block-size", "0"], ["--kv-lease-s", "0"], ["--num-threads", "0"], ["--kv-role", "producer"]):
        with pytest.raises(SystemExit):  # at parse time (pdserve/arg_types.py, choices)
            parse(*argv)
        assert argv[0] in capsys.readouterr().err
    with pytest.raises(ConfigError, match="peer_timeout_s"):  # what needs two flags at once: the config
        cli.build_config(parse("--kv-heartbeat-s", "5", "--kv-peer-timeout-s", "4"))


def test_run_returns_2_on_a_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(parse("--kv-heartbeat-s", "5", "--kv-peer-timeout-s", "4")) == 2
    assert "peer_timeout_s (4.0) must exceed heartbeat_s (5.0)" in capsys.readouterr().err


def test_every_flag_has_help() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for action in parser._actions:
        if action.dest != "help":
            assert action.help, action.dest
