"""`pdserve sweep --routings ... --num-prefill/--num-decode --decode-prefix-caching` (issue 29): the arms it
compares, their labels, and the deployments' command lines (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.bench.deploy import Deployment, ServerOptions
from pdserve.bench.sweep_config import Arm, Endpoints, SweepConfig


def config(tmp_path: Path, **kw: object) -> SweepConfig:
    fields: dict = dict(
        modes=("pull", "colocated"), qps=(1.0,), input_lens=(64,), output_lens=(8,), iterations=1, num_prompts=4
    )
    fields.update(kw)
    return SweepConfig(results_dir=tmp_path, server=ServerOptions("smollm2-135m"), **fields)


def test_routings_multiply_the_modes_into_labelled_arms(tmp_path: Path) -> None:
    plain = config(tmp_path)
    assert [a.label for a in plain.arms()] == ["pull", "colocated"]
    cfg = config(tmp_path, routings=("least-loaded", "kv-aware"))
    assert [a.label for a in cfg.arms()] == [
        "pull-least-loaded",
        "pull-kv-aware",
        "colocated-least-loaded",
        "colocated-kv-aware",
    ]
    assert cfg.arms()[1] == Arm("pull", "kv-aware")
    with pytest.raises(ValueError, match="routing"):
        config(tmp_path, routings=("random",))
    with pytest.raises(ValueError, match="attach"):
        config(tmp_path, routings=("kv-aware",), attach={"pull": Endpoints("http://r")})


def test_a_deployment_with_several_instances_and_d_prefix_caching(tmp_path: Path) -> None:
    options = ServerOptions("smollm2-135m", decode_prefix_caching=True)
    d = Deployment(options, "pull", tmp_path, num_prefill=1, num_decode=2, label="pull-kv-aware")
    assert "--no-enable-prefix-caching" not in d._serve_argv("decode", 0, 0)
    default = Deployment(ServerOptions("smollm2-135m"), "pull", tmp_path)
    assert "--no-enable-prefix-caching" in default._serve_argv("decode", 0, 0)
    assert d.stem == "pull-kv-aware" and default.stem == "pull"
    ends = Endpoints("http://r", "http://p", "http://d0", more_decode_urls=("http://d1",))
    assert ends.decode_urls == ["http://d0", "http://d1"] and ends.prefill_urls == ["http://p"]
