"""Bad flags are refused at parse time, naming the flag and its range; `pdserve --version`; a KV cache smaller
than max_model_len is refused at startup with both numbers."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import arg_types
from pdserve.cli import SUBCOMMANDS, add_subcommand_arguments, main

REPO_ROOT = Path(__file__).resolve().parents[2]


def parse(name: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"pdserve {name}", exit_on_error=False)
    add_subcommand_arguments(parser, name)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "name, argv, words",
    [
        ("serve", ["m", "--port", "65536"], "--port: must be an integer in [0, 65535], got '65536'"),
        ("serve", ["m", "--port", "-1"], "--port"),
        ("serve", ["m", "--port", "http"], "--port: must be an integer in [0, 65535], got 'http'"),
        ("serve", ["m", "--max-model-len", "0"], "--max-model-len: must be an integer >= 1"),
        ("serve", ["m", "--block-size", "0"], "--block-size"),
        ("serve", ["m", "--num-gpu-blocks", "-5"], "--num-gpu-blocks"),
        ("serve", ["m", "--kv-cache-memory-gib", "nan"], "--kv-cache-memory-gib: must be a finite number > 0"),
        ("serve", ["m", "--kv-cache-memory-gib", "inf"], "--kv-cache-memory-gib"),
        ("serve", ["m", "--max-num-seqs", "1.5"], "--max-num-seqs"),
        ("serve", ["m", "-tp", "0"], "--tensor-parallel-size/-tp"),
        ("serve", ["m", "--max-inflight-requests", "-1"], "--max-inflight-requests: must be an integer >= 0"),
        ("serve", ["m", "--max-queue-wait-s", "0"], "--max-queue-wait-s"),
        ("serve", ["m", "--kv-side-channel-port", "99999"], "--kv-side-channel-port"),
        ("serve", ["m", "--kv-lease-s", "-1"], "--kv-lease-s"),
        ("proxy", ["--port", "70000"], "--port"),
        ("proxy", ["--colocate-below", "0"], "--colocate-below"),
        ("proxy", ["--health-interval-s", "0"], "--health-interval-s"),
        ("proxy", ["--max-body-mb", "-1"], "--max-body-mb"),
        ("bench", ["--num-prompts", "0"], "--num-prompts"),
        ("bench", ["--request-rate", "0"], "--request-rate: must be a number > 0 or inf"),
        ("bench", ["--random-range-ratio", "1"], "--random-range-ratio: must be a number in [0, 1)"),
        ("bench", ["--temperature", "-1"], "--temperature"),
        ("sweep", ["--qps", "1,-2"], "--qps: each item must be a number > 0 or inf, got '-2'"),
        ("sweep", ["--input-lens", "512,x"], "--input-lens: each item must be an integer >= 1, got 'x'"),
        ("sweep", ["--input-lens", ","], "--input-lens: must be a comma-separated list"),
        ("sweep", ["--goodput-threshold", "150"], "--goodput-threshold: must be a percentage in (0, 100]"),
    ],
)
def test_out_of_range_flags_are_refused_at_parse_time(name: str, argv: list[str], words: str) -> None:
    with pytest.raises(argparse.ArgumentError) as e:
        parse(name, *argv)
    assert words in str(e.value)


def test_values_in_range_parse() -> None:
    args = parse("serve", "m", "--port", "0", "--kv-cache-memory-gib", "0.5", "--max-inflight-requests", "0")
    assert (args.port, args.kv_cache_memory_gib, args.max_inflight_requests) == (0, 0.5, 0)
    args = parse("sweep", "--qps", "0.5,inf", "--input-lens", "128, 256")
    assert args.qps == (0.5, float("inf")) and args.input_lens == (128, 256)
    assert parse("bench", "--request-rate", "inf").request_rate == float("inf")


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_default_is_in_the_help(name: str) -> None:
    parser = argparse.ArgumentParser(prog=f"pdserve {name}")
    add_subcommand_arguments(parser, name)
    for action in parser._actions:
        if action.default not in (None, [], argparse.SUPPRESS, False, True) and action.help:
            assert "default" in action.help.lower(), f"pdserve {name} {action.option_strings}: {action.help}"
    parser.format_help()  # every help string still formats ("%" escaped)


def test_document_defaults_formats_lists_and_keeps_stated_defaults() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--qps", type=arg_types.comma_list(arg_types.rate), default=(1.0, 2.5), help="rates")
    parser.add_argument("--port", type=arg_types.port, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--share", default="5%", help="a share")
    arg_types.document_defaults(parser)
    text = parser.format_help()
    assert "rates (default 1,2.5)" in text and "(default 8000)" in text and "(default 8000) (" not in text
    assert "a share (default 5%)" in text  # the default's "%" is escaped for argparse


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("pdserve ")


@pytest.mark.slow
def test_cache_smaller_than_max_model_len_is_refused_at_startup(tiny_model_dirs: dict[str, Path]) -> None:
    argv = [str(tiny_model_dirs["llama"]), "--port", "0", "--num-threads", "1", "--num-gpu-blocks", "4"]
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr
    assert "holds 64 tokens (4 blocks of 16), fewer than max_model_len 256" in out.stderr
