"""Fixtures for end-to-end tests: real pdserve processes on loopback (see helpers.py), always torn down,
their logs printed when a test of the module failed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import Launcher  # tests/e2e is on sys.path (rootdir conftest, no __init__.py)

FAILED_MODULES = pytest.StashKey[set[str]]()  # node ids of modules with a failed test


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.failed:
        item.config.stash.setdefault(FAILED_MODULES, set()).add(item.nodeid.split("::")[0])
    return report


def _module_failed(request: pytest.FixtureRequest) -> bool:
    return request.node.nodeid.split("::")[0] in request.config.stash.get(FAILED_MODULES, set())


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs: dict[str, Path]) -> Path:
    """A tiny random Llama folder with a byte-level tokenizer and a chat template (tests/conftest.py)."""
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def launcher(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """Processes for the whole module; stopped after its last test, logs printed if one of its tests failed."""
    launch = Launcher(tmp_path_factory.mktemp("e2e-logs"))
    try:
        yield launch
    finally:
        launch.close(dump_logs=_module_failed(request))


@pytest.fixture
def fresh_launcher(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Launcher]:
    """Processes for one test only."""
    launch = Launcher(tmp_path / "logs")
    try:
        yield launch
    finally:
        launch.close(dump_logs=_module_failed(request))
