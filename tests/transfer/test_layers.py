"""The transfer package's layout is a rule: the scheduler halves (engine thread) and the pure shared modules
load no torch, numpy or nixl; each is imported in a fresh interpreter, so nothing imported earlier hides a leak."""

import subprocess
import sys

import pytest

PURE = [
    "pdserve.transfer.base",
    "pdserve.transfer.params",
    "pdserve.transfer.faults",
    "pdserve.transfer.nop",
    "pdserve.transfer.factory",
    "pdserve.transfer.scheduler.base",
    "pdserve.transfer.scheduler.pull",
    "pdserve.transfer.scheduler.push",
    "pdserve.engine.scheduler",
]
HEAVY = ("torch", "numpy", "nixl")


@pytest.mark.parametrize("module", PURE)
def test_scheduler_side_loads_no_torch_numpy_or_nixl(module: str) -> None:
    code = f"import sys, {module}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"{module} loads {out}"
