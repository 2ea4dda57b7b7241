"""The architecture, executable: each module is imported in a fresh interpreter, which fails the test if it
loads a module its layer must not.

Layers (docs/architecture.md, "Pieces and dependencies"):
- the block pool, the scheduler, the connectors' scheduler halves and the P/D contract (kv/) are pure Python: no
  torch, numpy or nixl;
- the engine facade the server holds (engine/client.py), the server's HTTP modules and the shared web
  module load no torch;
- transfer/ never imports the engine, the server or the model (the cache geometry and KV groups are kv/'s);
- the router and the bench speak HTTP only: no torch, no engine, no model, no server, no transfer (the P/D
  contract they need is kv/);
- the server imports nothing of transfer/ either (it reaches the data plane only through the engine).
"""

from __future__ import annotations

import importlib.util
import json
import pkgutil
import subprocess
import sys

import pytest
from test_import_graph import import_graph

import pdserve

HEAVY = ("torch", "numpy", "nixl", "nixl_cu12")


def loaded_after_import(*modules: str) -> set[str]:
    """pdserve's modules and the HEAVY packages loaded after importing `modules` in a fresh interpreter."""
    code = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        + f"{HEAVY!r} or m.startswith('pdserve'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def all_modules(package: str) -> list[str]:
    pkg = __import__(package, fromlist=["__path__"])
    return sorted(m.name for m in pkgutil.walk_packages(pkg.__path__, package + "."))


def heavy(loaded: set[str]) -> set[str]:
    return {m for m in loaded if m.split(".")[0] in HEAVY}


def scheduler_halves() -> list[str]:
    """The connectors' engine-thread halves, wherever the transfer package keeps them."""
    return [m for m in all_modules("pdserve.transfer") if ".scheduler" in m or m.endswith(".nop")]


PURE = [
    "pdserve.engine.block_pool",
    "pdserve.engine.scheduler",
    "pdserve.engine.remote_kv_wait",
    "pdserve.engine.scheduler_output",
    "pdserve.engine.block_tables",
    "pdserve.engine.prefix_cache",
    "pdserve.engine.kv_events",
    "pdserve.engine.request",
    "pdserve.sampling_params",
    "pdserve.auth",
    "pdserve.credentials",
    "pdserve.model.token_chars",
    "pdserve.transfer.base",
    "pdserve.kv.params",
    "pdserve.kv.decode",
    "pdserve.transfer.faults",
    "pdserve.transfer.factory",
]
NO_TORCH = [
    "pdserve.engine.client",
    "pdserve.web",
    "pdserve.openai_request",
    "pdserve.server.api",
    "pdserve.server.routes",
    "pdserve.server.answer",
    "pdserve.server.state",
    "pdserve.server.streams",
    "pdserve.server.metrics",
    "pdserve.server.kv_events",
]


@pytest.mark.parametrize("module", PURE + all_modules("pdserve.kv") + scheduler_halves())
def test_pure_python_layers_load_no_torch_numpy_or_nixl(module: str) -> None:
    assert heavy(loaded_after_import(module)) == set()


@pytest.mark.parametrize("module", NO_TORCH)
def test_engine_facade_and_http_modules_load_no_torch(module: str) -> None:
    assert "torch" not in loaded_after_import(module)


CUDA_ONLY = ("pdserve.transfer.checksum_kernel",)  # Triton kernels: imported only where a CUDA cache is summed


def test_transfer_imports_neither_engine_server_nor_model() -> None:
    has_triton = importlib.util.find_spec("triton") is not None
    modules = [m for m in all_modules("pdserve.transfer") if has_triton or m not in CUDA_ONLY]
    loaded = loaded_after_import(*modules)
    assert {m for m in loaded if m.startswith(("pdserve.engine", "pdserve.server", "pdserve.model"))} == set()


def test_server_and_router_import_nothing_of_transfer() -> None:
    """The P/D contract they share with the engine is kv/'s; the data plane is the engine's business. Every
    import statement counts (deferred and TYPE_CHECKING ones too): the server reaches transfer/ only through
    the engine it builds."""
    in_transfer = lambda m: m == "pdserve.transfer" or m.startswith("pdserve.transfer.")
    edges = {
        (m, t)
        for m, targets in import_graph().items()
        if m.startswith(("pdserve.server.", "pdserve.router."))
        for t in targets
        if in_transfer(t)
    }
    assert edges == set()


def test_nothing_in_the_product_imports_the_test_drivers() -> None:
    """pdserve/testing/ drives the transfer tests and benchmarks (a connector pair in a child process); no other
    module imports it. Every import statement counts."""
    in_testing = lambda m: m == "pdserve.testing" or m.startswith("pdserve.testing.")
    edges = {(m, t) for m, targets in import_graph().items() if not in_testing(m) for t in targets if in_testing(t)}
    assert edges == set()


def test_router_and_bench_speak_http_only() -> None:
    loaded = loaded_after_import(*all_modules("pdserve.router"), *all_modules("pdserve.bench"), "pdserve.web")
    bad = {m for m in loaded if m.startswith(("pdserve.engine", "pdserve.model", "pdserve.server", "pdserve.transfer"))}
    assert bad == set() and "torch" not in loaded


def test_layer_rules_cover_the_package() -> None:
    assert pdserve.__file__ is not None
    assert all_modules("pdserve.router") and all_modules("pdserve.bench") and all_modules("pdserve.transfer")
    assert all_modules("pdserve.kv")
