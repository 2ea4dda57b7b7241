"""The combination matrix (issue 25): every case of matrix.py is a real 1P1D deployment (P, D and the router,
real NIXL over UCX, tiny random models) that serves a run of requests, checked after each case:

- every answer token for token equal to a colocated TP 1 instance of the same model (greedy);
- every KV block free again on P and on D (their /metrics) within a few seconds;
- P's timeline shows one transfer part per request and (P rank, D rank) pair that moves heads (push: the WRITE;
  pull: D rank's release to every P rank) and D's timeline the matching confirmations;
- D's timeline shows the first token (P's, handed over with the KV) before D's first step on the request.

The requests go through one deployment, so state that outlives a request (handshake and peer caches, attempt
counters, pins, prefix caches) is exercised: a prompt longer than 4 blocks, two prompts sharing two blocks'
worth of prefix, the long prompt again (whole-prefix hit on both sides), a prompt of one token (its KV alone
moves, with P's first token), a prompt of exactly one P block, and a prompt ending mid-block.

Servers are shared across cases that start them with the same flags (a case is still a fresh *pair* of them,
and each case's prompts start with its own marker, so no case hits another's prefix cache); a server is
stopped as soon as no later case needs it. The GPU variant (`pytest -m gpu tests/e2e/test_matrix.py`, one
CUDA device) runs the same generator at TP 1 in bfloat16 against a bfloat16 colocated instance.
"""

from __future__ import annotations

import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import matrix
import pytest
import torch
from helpers import Launcher, Proc, wait_idle
from matrix import Case

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECRET = "matrix-deployment-secret-0123456789"
KV_HEADS = {"qwen3": 2, "llama1kv": 1, "gemma3": 2}  # the tiny models' KV heads (tests/conftest.py; below)
MAX_TOKENS = 8
CPU_CASES = matrix.cases()
_DEFAULT = CPU_CASES[-1]  # pull, P TP 2, D TP 2, every other dimension at its default
LONG_RUNS = [replace(_DEFAULT, mode="push", p_tp=p, d_tp=d) for p, d in (("2", "1"), ("1", "2"))]
# requests in a row in test_hundreds_in_a_row: state that outlives a request must be reused many times over. The
# instances have 96 blocks of 16 tokens; these prompts make ~3.3 blocks a request, so D's pool has been reused
# after ~30 requests, and P's prefix cache (~1.9 new full blocks a request) is full after ~50 and evicts from then
# on: 100 requests go through each about twice
NUM_IN_A_ROW = 100
GPU_CASES = matrix.cases({**matrix.DIMENSIONS, "p_tp": ("1",), "d_tp": ("1",)})
matrix.check_coverage(CPU_CASES)


# ---- what D rank d receives from which P rank (an independent statement of docs/architecture.md's mapping) ------
def _rank_heads(heads: int, tp: int, rank: int) -> list[int]:
    if heads % tp == 0:
        n = heads // tp
        return list(range(rank * n, (rank + 1) * n))
    return [rank // (tp // heads)]  # tp / heads ranks replicate each head


def expected_parts(case: Case) -> set[tuple[int, int]]:
    """(P rank, D rank) pairs with a transfer part: pull, every pair (each D rank releases every P rank); push,
    the pairs where P rank q sends D rank d heads (a head's only holder, or replica d mod replicas)."""
    heads, p_tp, d_tp = KV_HEADS[case.model], int(case.p_tp), int(case.d_tp)
    if case.mode == "pull":
        return {(q, d) for q in range(p_tp) for d in range(d_tp)}
    parts = set()
    for d in range(d_tp):
        for h in _rank_heads(heads, d_tp, d):
            holders = [q for q in range(p_tp) if h in _rank_heads(heads, p_tp, q)]
            parts.add((holders[d % len(holders)], d))
    return parts


# ---- the servers, shared across cases while a later case needs them ----------------------------------------------
def _server_keys(case: Case, device: str) -> dict[str, tuple[str, ...]]:
    p_block, d_block = case.block_sizes
    both = (device, case.mode, case.model, case.auth, case.buffer)
    return {
        "ref": (device, "ref", case.model),
        "p": (*both, "prefill", case.p_tp, str(p_block)),
        "d": (*both, "decode", case.d_tp, str(d_block), case.d_prefix),
    }


class Pool:
    """Starts each server a case needs once and stops it after the last case that needs it."""

    def __init__(self, launcher: Launcher, models: dict[str, Path], cases: list[Case], device: str) -> None:
        self.launcher, self.models, self.device = launcher, models, device
        self.uses = Counter(k for c in cases for k in _server_keys(c, device).values())
        self.procs: dict[tuple[str, ...], Proc] = {}

    def _args(self, key: tuple[str, ...]) -> list[str]:
        args = ["--num-gpu-blocks", "96"]
        if self.device == "cuda":
            args += ["--device", "cuda", "--dtype", "bfloat16"]
        if key[1] == "ref":
            return args
        _, mode, _, auth, buffer, role, tp, block, *rest = key
        args += ["--kv-role", role, "--kv-transfer", mode, "--tensor-parallel-size", tp, "--block-size", block]
        args += ["--kv-buffer-device", buffer] + (["--kv-auth-secret", SECRET] if auth == "on" else [])
        if rest == ["off"]:
            args.append("--no-enable-prefix-caching")
        return args

    def servers(self, case: Case) -> dict[str, Proc]:
        keys = _server_keys(case, self.device)
        for key in keys.values():
            if key not in self.procs:
                model = self.models[key[2]]
                self.procs[key] = self.launcher.serve(model, *self._args(key), name="-".join(key))
        self.launcher.wait_ready()
        return {role: self.procs[key] for role, key in keys.items()}

    def done(self, case: Case) -> None:
        for key in _server_keys(case, self.device).values():
            self.uses[key] -= 1
            if self.uses[key] == 0 and key in self.procs:
                self.procs.pop(key).stop()


@pytest.fixture(scope="module")
def matrix_models(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """qwen3 and gemma3 of tests/conftest.py, and a tiny llama with one KV head (replicated at TP 2)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("matrix") / "llama1kv"
    shutil.copytree(tiny_model_dirs["llama"], path)  # its byte-level tokenizer (adds BOS)
    config = LlamaConfig.from_pretrained(path)
    config.num_key_value_heads = 1
    torch.manual_seed(25)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(25)
    with torch.no_grad():
        for name, p in model.named_parameters():  # as tests/conftest.py: no parameter is trivial
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    return {"qwen3": tiny_model_dirs["qwen3"], "gemma3": tiny_model_dirs["gemma3"], "llama1kv": path}


@pytest.fixture(scope="module")
def cpu_pool(launcher: Launcher, matrix_models: dict[str, Path]) -> Iterator[Pool]:
    yield Pool(launcher, matrix_models, LONG_RUNS + CPU_CASES, "cpu")


@pytest.fixture(scope="module")
def gpu_pool(launcher: Launcher, matrix_models: dict[str, Path]) -> Iterator[Pool]:
    yield Pool(launcher, matrix_models, GPU_CASES, "cuda")


# ---- one case ------------------------------------------------------------------------------------------------------
def requests_for(index: int) -> list[tuple[str, str | list[int]]]:
    """(name, prompt) in the order sent; text prompts start with the case's own marker (byte tokenizer: one
    token per byte, so lengths in characters are lengths in tokens, plus BOS for llama and gemma3)."""
    mark = f"<case {index:02d}> "
    shared = mark + "A shared system prompt that spans two blocks of thirty-two tokens. "  # 77 tokens
    long = mark + "The quick brown fox jumps over the lazy dog while the band plays on; " * 2  # 150 tokens
    return [
        ("long", long),  # > 4 blocks of 32
        ("shared-a", shared + "First, name a colour."),
        ("shared-b", shared + "Then, a number between one and nine?"),
        ("long-again", long),  # whole-prefix hit on P and D (where D caches)
        ("one-token", [5 + 40 + index % 40]),  # a single prompt token: its KV alone moves (with P's first token)
        ("one-block", [5 + (i * 7 + index) % 250 for i in range(16)]),  # exactly one block of 16
        ("mid-block", mark + "ends mid-block"),
    ]


def _body(prompt: str | list[int], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip


def _events(proc: Proc, client_id: str) -> dict[str, float]:
    for t in httpx.get(proc.url + "/timeline", timeout=10, trust_env=False).json():
        if t.get("client_request_id") == client_id:
            return dict(t["events"])
    raise AssertionError(f"{proc.name}: no timeline for {client_id}")


def _parts(events: dict[str, float], prefix: str, p_first: bool) -> set[tuple[int, int]]:
    """{(P rank, D rank)} from events named prefix + 'pQ.rD' (P's) or 'rD.pQ' (D's)."""
    out = set()
    for name in events:
        if name.startswith(prefix):
            a, b = name[len(prefix) :].split(".")
            x, y = int(a[1:]), int(b[1:])
            out.add((x, y) if p_first else (y, x))
    return out


@contextmanager
def routed(pool: Pool, case: Case, name: str) -> Iterator[tuple[Proc, Proc, Proc, Proc]]:
    """(P, D, colocated reference, router) of the case; after the block, every KV block free on P and D."""
    procs = pool.servers(case)
    extra = ["--kv-auth-secret", SECRET] if case.auth == "on" else []
    router = pool.launcher.proxy(case.mode, [procs["p"]], [procs["d"]], *extra, name=f"router-{name}")
    try:
        pool.launcher.wait_ready()
        yield procs["p"], procs["d"], procs["ref"], router
        for inst in (procs["p"], procs["d"]):
            m = wait_idle(inst.url, timeout_s=10)
            assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], (case.id, inst.name, m)
            assert m["pdserve_kv_prepared_writes"] == 0, (case.id, inst.name, m)  # push: each laid-out WRITE freed
    finally:
        router.stop()
        pool.done(case)


def check_same_tokens(client: httpx.Client, ref: Proc, router: Proc, body: dict[str, Any], rid: str) -> None:
    """The routed answer is 200 and token for token the colocated instance's."""
    want = client.post(ref.url + "/v1/completions", json=body)
    assert want.status_code == 200, want.text
    got = client.post(router.url + "/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert got.status_code == 200, f"{rid}: {got.status_code} {got.text}"
    want_ids, got_ids = want.json()["choices"][0]["token_ids"], got.json()["choices"][0]["token_ids"]
    assert got_ids == want_ids, f"{rid}: {got_ids} != colocated {want_ids}"


def run_case(pool: Pool, case: Case, index: int) -> None:
    p_prefix, d_prefix = ("write.", "push_done.") if case.mode == "push" else ("pull_release.", "pull_ack.")
    want_parts = expected_parts(case)
    with routed(pool, case, f"{index:02d}") as (p, d, ref, router), httpx.Client(timeout=120, trust_env=False) as c:
        for name, prompt in requests_for(index):
            rid = f"m{index:02d}-{name}"
            check_same_tokens(c, ref, router, _body(prompt), rid)
            # D emitted P's first token when the KV landed, before its first step on the request (issue 28 item 4)
            d_ev = _events(d, rid)
            assert d_ev["kv_received"] <= d_ev["first_token"] < d_ev["scheduled"], f"{case.id} {name}: {d_ev}"
            want_d = want_parts
            deadline = time.monotonic() + 10  # P's part may be recorded just after D answered
            while True:
                p_parts = _parts(_events(p, rid), p_prefix, True)
                d_parts = _parts(_events(d, rid), d_prefix, False)
                if (p_parts, d_parts) == (want_parts, want_d) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert p_parts == want_parts, f"{case.id} {name}: P's parts {sorted(p_parts)}, want {sorted(want_parts)}"
            assert d_parts == want_d, f"{case.id} {name}: D's parts {sorted(d_parts)}, want {sorted(want_d)}"


@pytest.mark.parametrize("case", LONG_RUNS, ids=[c.id for c in LONG_RUNS])
def test_hundreds_in_a_row(cpu_pool: Pool, case: Case) -> None:
    """Issue 25's reproduction (push with P at TP 2 served its first request and 502'd the rest) and its
    mirror: NUM_IN_A_ROW requests through one deployment, each equal to colocated, every block free after."""
    rng = random.Random(200)
    lengths = (1, 2, 15, 16, 17, 31, 33, 64, 100, 140)
    prompts: list[list[int]] = []
    for i in range(NUM_IN_A_ROW):
        body = [5 + rng.randrange(250) for _ in range(lengths[i % len(lengths)])]
        if i % 4 == 3:  # a later turn of an earlier prompt: its prefix cached on P (and on D)
            body = prompts[rng.randrange(len(prompts))][:48] + body[:40]
        prompts.append(body)
    with routed(cpu_pool, case, case.id) as (_, _, ref, router), httpx.Client(timeout=120, trust_env=False) as c:
        for i, prompt in enumerate(prompts):
            check_same_tokens(c, ref, router, _body(prompt, 4), f"row-{i + 1}-of-{NUM_IN_A_ROW}")


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.id for c in CPU_CASES])
def test_matrix(cpu_pool: Pool, case: Case) -> None:
    run_case(cpu_pool, case, CPU_CASES.index(case))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id for c in GPU_CASES])
def test_matrix_gpu(gpu_pool: Pool, case: Case) -> None:
    run_case(gpu_pool, case, GPU_CASES.index(case))


def test_case_list_covers_the_dimensions() -> None:
    """The selection's promise (matrix.check_coverage), also for a dimension added later; and the check is not
    vacuous: a selection missing a value, a pair or a product case is refused."""
    matrix.check_coverage(CPU_CASES)
    assert len(CPU_CASES) < 24, "the selection grew: keep `make test` under 30 minutes"
    with pytest.raises(AssertionError, match="never appear"):
        matrix.check_coverage([c for c in CPU_CASES if c.auth == "off"])
    pairwise = CPU_CASES[: len(matrix.pairwise(matrix.DIMENSIONS, matrix.PAIRED))]
    with pytest.raises(AssertionError, match="pairs never covered"):
        matrix.check_coverage([c for c in CPU_CASES if (c.model, c.blocks) != ("gemma3", "32/16")])
    with pytest.raises(AssertionError, match="full product"):
        matrix.check_coverage(pairwise)
