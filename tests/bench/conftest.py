"""Fixtures of the bench tests: a live tiny 1P1D deployment, and a way to find processes a test started."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdserve.bench.deploy import Deployment, ServerOptions

MARKER_VAR = "PDSERVE_BENCH_TEST_MARKER"  # set in a subprocess's environment; inherited by all it starts


def processes_with_marker(marker: str) -> list[int]:
    """Pids of live processes whose environment carries MARKER_VAR=marker (Linux /proc)."""
    needle = f"{MARKER_VAR}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # a zombie has exited; only its parent's wait is missing
        except OSError:
            continue
        found.append(int(entry))
    return found


@pytest.fixture
def marked_processes() -> tuple[str, Callable[[str], list[int]]]:
    """(name of the marker environment variable, function: marker -> pids of live processes carrying it)."""
    return MARKER_VAR, processes_with_marker


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dirs: dict[str, Path]) -> Path:
    """A tiny random Llama folder with a byte-level tokenizer (vocab 320, 256 positions)."""
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def pull_deployment(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """1P1D + router in pull mode on the tiny model, one torch thread per server; stopped after the module."""
    logs = tmp_path_factory.mktemp("deployment-logs")
    options = ServerOptions(model=str(tiny_model), num_threads=1)
    with Deployment(options, "pull", logs, startup_timeout_s=240) as deployment:
        yield deployment
