"""1P1D for sliding-window models, pull and push through the router: prompts past the window, disaggregated ==
colocated token for token; the transfer metrics show the windowed groups moved only their window's blocks; every
block is free afterwards. Tiny Gemma 3 (layers 0, 2: window 6; layers 1, 3: full; two groups of two layers) and
tiny Mistral with a window of 10 (one windowed group of both layers), block size 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import Launcher, Proc, post, scrape_metrics, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BS = 4
# per family: (window per windowed group, bytes of one token's K and V in one group: 2 layers x 2 x heads x dim x 4)
SHAPES = {"gemma3": (6, 2 * 2 * 2 * 16 * 4), "mistral_swa": (10, 2 * 2 * 1 * 16 * 4)}
MODES = ("pull", "push")
GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "max_tokens": 12}
# byte tokens + BOS; the second is 56 tokens, so D's cached blocks (the window before token 55 and every full
# group's) make a prefix hit of 14 blocks for EXTENDED, which moves only the rest
PROMPTS = ["The quick brown fox jumps over the lazy dog, twice.", "sliding windows: " + "abcdefgh" * 4 + "abcdef"]
EXTENDED = PROMPTS[1] + " and then some more"
AUTH = ("--kv-auth-secret", "windowed-test-deployment-secret-0123456789")


@dataclass
class Family:
    ref: Proc
    p: dict[str, Proc]  # mode -> P
    d: dict[str, Proc]  # mode -> D
    routers: dict[str, Proc]


@pytest.fixture(scope="module")
def families(launcher: Launcher, tiny_model_dirs: dict[str, Path]) -> dict[str, Family]:
    # with a deployment secret: D caches received KV only when it is proven to be of its prompt (issue 26), and
    # EXTENDED's prefix hit on D is part of what is checked
    def serve(model: Path, name: str, *args: str) -> Proc:
        return launcher.serve(model, "--num-gpu-blocks", "64", "--block-size", str(BS), *args, *AUTH, name=name)

    out = {}
    for fam, modes in (("gemma3", ("pull", "push")), ("mistral_swa", ("pull",))):
        model = tiny_model_dirs[fam]
        p = {m: serve(model, f"{fam}-P-{m}", "--kv-role", "prefill", "--kv-transfer", m) for m in modes}
        d = {m: serve(model, f"{fam}-D-{m}", "--kv-role", "decode", "--kv-transfer", m) for m in modes}
        out[fam] = Family(serve(model, f"{fam}-ref", "--kv-role", "both"), p, d, {})
    for fam, f in out.items():  # started with the instances (a router is ready once its instances answer /health)
        f.routers = {m: launcher.proxy(m, [f.p[m]], [f.d[m]], *AUTH, name=f"router-{fam}-{m}") for m in f.p}
    launcher.wait_ready()
    return out


def completion(url: str, prompt: str) -> tuple[list[int], list[int]]:
    resp = post(url, "/v1/completions", {"prompt": prompt, **GREEDY})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def expected_bytes(fam: str, num_prompt: int, start: int = 0) -> int:
    """P hands its first token over, so D computes no prompt token: tokens [start, end = num_prompt) move for a full
    group (D has [0, start)), and for a windowed group only those of the blocks holding what the query at `end`
    (the first output token) reads, keys (end - window, end]; P and D have equal block sizes, so each group's
    partial last block moves whole (layout.pad_last_blocks)."""
    window, token_bytes = SHAPES[fam]
    end = num_prompt
    first = max(start, max(0, end - window + 1) // BS * BS)
    sent_end = -(-end // BS) * BS  # the last block whole
    moved_windowed = sent_end - first if end > first else 0
    if fam == "gemma3":  # one full group + one windowed group
        return ((sent_end - start if end > start else 0) + moved_windowed) * token_bytes
    return moved_windowed * token_bytes  # mistral: one windowed group


@pytest.mark.parametrize("fam,mode", [("gemma3", "pull"), ("gemma3", "push"), ("mistral_swa", "pull")])
def test_disaggregated_equals_colocated_moving_only_the_window(families: dict[str, Family], fam: str, mode: str):
    f = families[fam]
    p, d = f.p[mode], f.d[mode]
    for prompt in [*PROMPTS, EXTENDED]:
        received = scrape_metrics(d.url)["pdserve_kv_received_bytes_total"]
        sent = scrape_metrics(p.url)["pdserve_kv_sent_bytes_total"]
        prompt_ids, tokens = completion(f.routers[mode].url, prompt)
        assert len(prompt_ids) > SHAPES[fam][0] + 2 * BS  # past the window
        assert (prompt_ids, tokens) == completion(f.ref.url, prompt)
        for proc in (p, d):
            m = wait_idle(proc.url)  # P counts its bytes when the transfer is over (pull: at D's release)
            assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"] == 64, (proc.name, m)
        got = scrape_metrics(d.url)["pdserve_kv_received_bytes_total"] - received
        if prompt == EXTENDED:  # D's prefix hit: tokens [0, 56) are not moved
            assert got == expected_bytes(fam, len(prompt_ids), start=56), (prompt, len(prompt_ids))
        else:
            assert got == expected_bytes(fam, len(prompt_ids)), (prompt, len(prompt_ids))
        assert scrape_metrics(p.url)["pdserve_kv_sent_bytes_total"] - sent == got


def test_info_carries_the_groups(families: dict[str, Family]) -> None:
    import httpx

    info = httpx.get(families["gemma3"].p["pull"].url + "/kv_transfer/info", timeout=10, trust_env=False).json()
    assert info["kv_groups"] == [{"window": None, "layers": [1, 3]}, {"window": 6, "layers": [0, 2]}]


def test_one_windowed_group_under_tensor_parallelism(
    families: dict[str, Family], fresh_launcher: Launcher, tiny_model_dirs: dict[str, Path]
):
    """Mistral-SWA (one windowed group) from P TP 2 (KV head replicated) to the module's D TP 1, pull: each P
    rank's pin is named by the same live blocks (transfer/ranks.py carries the tables), == colocated (the module's
    reference), every block free. The prompt is new to D (no prefix hit: the whole window moves)."""
    f = families["mistral_swa"]
    common = ("--num-gpu-blocks", "64", "--block-size", str(BS), "--kv-transfer", "pull", *AUTH)
    p = fresh_launcher.serve(tiny_model_dirs["mistral_swa"], *common, "--kv-role", "prefill",
                             "--tensor-parallel-size", "2", name="p")  # fmt: skip
    router = fresh_launcher.proxy("pull", [p], [f.d["pull"]], *AUTH)
    fresh_launcher.wait_ready()
    d = f.d["pull"]
    prompt = "tensor parallel, " + PROMPTS[1]
    assert completion(router.url, prompt) == completion(f.ref.url, prompt)
    for proc in (p, d):
        m = wait_idle(proc.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"] == 64, (proc.name, m)


def moved_bytes(num_prompt: int, p_bs: int, d_bs: int, start: int = 0) -> int:
    """Tiny Gemma 3, P and D of different block sizes: the full group moves [start, end); the windowed group moves
    [max(start, P's window block start, D's), end), where each side's window block holds key end - window + 1
    (P freed the blocks before its own, D never allocated the ones before its own); nothing is padded. end is the
    prompt's length: P hands its first token over, D computes no prompt token."""
    window, token_bytes = SHAPES["gemma3"]
    end = num_prompt
    first = max(start, *((end - window + 1) // bs * bs for bs in (p_bs, d_bs)))
    return (max(0, end - start) + max(0, end - first)) * token_bytes


def test_windowed_between_different_block_sizes(
    families: dict[str, Family], fresh_launcher: Launcher, tiny_model_dirs: dict[str, Path]
):
    """Tiny Gemma 3 (window 6) from P to D of (16, 4), (4, 16), (8, 16) tokens per block, pull and push through
    the router: == colocated; per request the metrics count exactly moved_bytes (only the window's tokens for the
    windowed group, on both sides); every block free afterwards. PROMPTS[0] (52 tokens) puts D's 16-token window
    block partly before what P still held (keys 40.. or 44.. of block 32..47): D must not register it, so the
    same prompt again is no prefix hit and moves everything again (a hit there would read rows D never got).
    The module's Gemma 3 reference and its P of 4-token blocks serve here too (what P caches changes no byte D
    receives); every D is new, as what D caches does."""
    model = tiny_model_dirs["gemma3"]
    pairs = [(16, 4), (4, 16), (8, 16)]

    def serve(name: str, bs: int, *args: str) -> Proc:
        return fresh_launcher.serve(model, "--num-gpu-blocks", "64", "--block-size", str(bs), *args, name=name)

    ref = families["gemma3"].ref
    # with the deployment secret, as D caches received KV (the EXTENDED prompt's prefix hit) only then (issue 26)
    p = {(m, bs): serve(f"P{bs}-{m}", bs, "--kv-role", "prefill", "--kv-transfer", m, *AUTH)
         for m in MODES for bs in (8, 16)}  # fmt: skip
    p |= {(m, BS): families["gemma3"].p[m] for m in MODES}
    d = {(m, bs): serve(f"D{bs}-{m}", bs, "--kv-role", "decode", "--kv-transfer", m, *AUTH)
         for m in MODES for bs in (4, 16)}  # fmt: skip
    routers = {  # started with the instances (a router is ready once its instances answer /health too)
        (m, pb, db): fresh_launcher.proxy(m, [p[m, pb]], [d[m, db]], *AUTH, name=f"router-{m}-{pb}-{db}")
        for m in MODES
        for pb, db in pairs
    }
    fresh_launcher.wait_ready()
    for (mode, p_bs, d_bs), router in routers.items():
        pp, dd = p[mode, p_bs], d[mode, d_bs]
        # EXTENDED after PROMPTS[1]: D of 4-token blocks has tokens [0, 56) of both groups (the window's blocks 12,
        # 13 came whole); with 16-token blocks the window before token 48 would need block 2, which D never held
        for prompt, start in [*((q, 0) for q in PROMPTS), (EXTENDED, 56 if d_bs == 4 else 0), (PROMPTS[0], 0)]:
            received = scrape_metrics(dd.url)["pdserve_kv_received_bytes_total"]
            sent = scrape_metrics(pp.url)["pdserve_kv_sent_bytes_total"]
            prompt_ids, tokens = completion(router.url, prompt)
            assert len(prompt_ids) > SHAPES["gemma3"][0] + 2 * 16  # well past the window
            assert (prompt_ids, tokens) == completion(ref.url, prompt), (mode, p_bs, d_bs, prompt)
            for proc in (pp, dd):
                m = wait_idle(proc.url)
                assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"] == 64, (proc.name, m)
            got = scrape_metrics(dd.url)["pdserve_kv_received_bytes_total"] - received
            want = moved_bytes(len(prompt_ids), p_bs, d_bs, start)
            assert got == want, (mode, p_bs, d_bs, prompt, len(prompt_ids))
            assert scrape_metrics(pp.url)["pdserve_kv_sent_bytes_total"] - sent == got
