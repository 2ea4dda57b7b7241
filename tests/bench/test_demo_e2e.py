"""`pdserve demo` end to end on a tiny model: answer, table, PNGs, and no process left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_demo_runs_and_cleans_up(
    tiny_model: Path, tmp_path: Path, marked_processes: tuple[str, Callable[[str], list[int]]]
) -> None:
    marker_var, find = marked_processes
    marker = uuid.uuid4().hex
    out = tmp_path / "demo"
    argv = [sys.executable, "-m", "pdserve.cli", "demo", "--model", str(tiny_model), "--results-dir", str(out)]
    argv += ["--qps", "inf", "--input-lens", "16,24", "--output-len", "4", "--num-prompts", "2"]
    env = {**os.environ, marker_var: marker, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for stage in ("[1/4]", "[2/4]", "[3/4]", "[4/4]", "answer (", "push/pull"):
        assert stage in proc.stdout
    for name in ("ttft.png", "tpot.png", "itl.png", "e2el.png", "timeline.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name
        assert f"wrote {out / name}" in proc.stdout
    results = sorted(p.name for p in out.glob("*_iter0.json"))
    assert results == sorted(f"{m}_qpsinf_in{n}_out4_iter0.json" for m in ("push", "pull") for n in (16, 24))
    deadline = time.monotonic() + 10
    while find(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert find(marker) == []
