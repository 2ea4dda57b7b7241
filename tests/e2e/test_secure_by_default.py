"""Issue 26, items 1 and 2, as attacks against real 1P1D pairs on loopback, pull and push, with and without a
deployment secret (one deployment for the module: four pairs, each behind its router).

1. A flood of idle TCP connections to P's side channel, more than its limits and held open (each one the server
   closes is reopened), on every pair's P at once: routed requests stay 10/10 OK and equal to the colocated
   answer, D never declares P dead, and P's log does not grow by a line per refused connection
   (pdserve_side_channel_refused_total counts them).
2. Without a secret: `serve` and `proxy` refuse a non-loopback address unless --insecure-no-kv-auth; D dials only
   loopback addresses a client names; D registers no received KV in its prefix cache (the "Berlin for France"
   poisoning has no effect on later requests; with a secret D caches and moves only the suffix); a refused
   handshake carries no agent metadata, name, address or layout.
"""

from __future__ import annotations

import contextlib
import resource
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import REPO_ROOT, Launcher, Proc, post, scrape_metrics, wait_idle

from pdserve.auth import new_secret
from pdserve.kv.geometry import CacheGeometry
from pdserve.transfer import wire

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "max_tokens": 4}
GERMANY = "Question: what is the capital of Germany? Answer: the capital of Germany is"
FRANCE = "Question: what is the capital of France?? Answer: the capital of France is"  # as many tokens
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny llama: layers x (K, V) x kv heads x head dim x float32
CASES = [(mode, auth) for mode in ("pull", "push") for auth in ("secret", "open")]
FLOOD_CONNECTIONS = 300  # held open at once: past every limit (64 pending, 16 per source, 128 admitted)
FLOOD_RATE = 400  # reconnections per second at most, all floods together (not just a CPU hog on 2 cores)


@dataclass
class Pair:
    p: Proc
    d: Proc
    router: Proc


@dataclass
class Deployment:
    pairs: dict[tuple[str, str], Pair]  # (mode, "secret" | "open") -> its pair

    def open_pull(self) -> Pair:
        return self.pairs[("pull", "open")]


@pytest.fixture(scope="module")
def deployment(launcher: Launcher, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    path = tmp_path_factory.mktemp("secret") / "kv_auth_secret"
    path.write_text(new_secret() + "\n")
    path.chmod(0o600)
    auth = {"secret": ["--kv-auth-secret-file", str(path)], "open": []}
    procs = {}
    for mode, a in CASES:
        common = ("--num-gpu-blocks", "64", "--kv-transfer", mode, *auth[a])
        p = launcher.serve(tiny_llama, *common, "--kv-role", "prefill", "--block-size", "16", name=f"P_{mode}_{a}")
        d = launcher.serve(tiny_llama, *common, "--kv-role", "decode", "--block-size", "32", name=f"D_{mode}_{a}")
        procs[(mode, a)] = (p, d)
    pairs = {  # started with the instances (a router is ready once its instances answer /health too)
        key: Pair(p, d, launcher.proxy(key[0], [p], [d], *auth[key[1]], name=f"router_{key[0]}_{key[1]}"))
        for key, (p, d) in procs.items()
    }
    launcher.wait_ready()
    return Deployment(pairs)


def completion(url: str, prompt: str, kv: dict[str, Any] | None = None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"prompt": prompt, **GREEDY, **extra}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return post(url, "/v1/completions", body)


def tokens(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return list(resp.json()["choices"][0]["token_ids"])


def side_port(proc: Proc) -> int:
    return int(httpx.get(proc.url + "/kv_transfer/info", timeout=10, trust_env=False).json()["side_channel_port"])


def refused_total(proc: Proc) -> float:
    return sum(v for k, v in scrape_metrics(proc.url).items() if k.startswith("pdserve_side_channel_refused_total"))


# ---- 1. a flood of idle connections to P's side channel -------------------------------------------------------------
class Flood:
    """Holds `num` idle TCP connections to 127.0.0.1:port open (from the address D uses too), reopening each one
    the server closes, at most `rate` per second, until stop(); counts what it opened."""

    def __init__(self, port: int, num: int = FLOOD_CONNECTIONS, rate: int = FLOOD_RATE) -> None:
        self.port, self.num, self.rate = port, num, rate
        self.opened = self.closed_by_server = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        socks: list[socket.socket] = []
        budget, last = float(self.rate), time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                budget, last = min(float(self.rate), budget + (now - last) * self.rate), now
                while len(socks) < self.num and budget >= 1 and not self._stop.is_set():
                    try:
                        socks.append(socket.create_connection(("127.0.0.1", self.port), timeout=2))
                        self.opened += 1
                    except OSError:
                        pass
                    budget -= 1
                readable, _, _ = select.select(socks, [], [], 0.02) if socks else ([], [], [])
                for s in readable:  # readable on an idle connection: the server closed it
                    socks.remove(s)
                    s.close()
                    self.closed_by_server += 1
        finally:
            for s in socks:
                s.close()


def allow_open_files(needed: int) -> None:
    """Raise this process's soft limit on open files to `needed` (at most the hard limit) if it is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        new = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def test_idle_connection_floods_leave_routed_requests_ok(deployment: Deployment) -> None:
    """Every pair's P flooded at once (one flood's connection churn shared among them: FLOOD_RATE in all), for
    longer than D's peer timeout; then each router's requests, still under the flood."""
    prompts = {key: [f"[{key[0]} {key[1]} flood {i}] The quick brown fox jumps over the lazy dog." for i in range(10)]
               for key in CASES}  # fmt: skip
    expected = {}
    for key, pair in deployment.pairs.items():
        expected[key] = [tokens(completion(pair.p.url, prompt)) for prompt in prompts[key]]  # P alone: colocated's
        warm_up = "warm up: " + prompts[key][0]
        assert tokens(completion(pair.router.url, warm_up)) == tokens(completion(pair.p.url, warm_up))
    before = {
        key: (refused_total(pair.p), len(pair.p.log_text().splitlines()), len(pair.d.log_text().splitlines()))
        for key, pair in deployment.pairs.items()
    }
    allow_open_files(len(CASES) * FLOOD_CONNECTIONS + 512)  # every flood's sockets live in this process
    floods = {key: Flood(side_port(pair.p), rate=FLOOD_RATE // len(CASES)) for key, pair in deployment.pairs.items()}
    with contextlib.ExitStack() as stack:
        for flood in floods.values():
            stack.enter_context(flood)
        time.sleep(6.0)  # past D's peer timeout (4 s): before the fix D declared P dead after ~5 s
        got = {key: [tokens(completion(pair.router.url, prompt)) for prompt in prompts[key]]
               for key, pair in deployment.pairs.items()}  # fmt: skip
    for key, pair in deployment.pairs.items():
        name, opened = "-".join(key), floods[key].opened
        refused_before, p_lines, d_lines = before[key]
        tokens(completion(pair.p.url, "wake P's engine: its stats snapshot (and /metrics) is refreshed"))
        assert got[key] == expected[key], name
        assert opened > FLOOD_CONNECTIONS, name  # the server closed some and the flood reopened them: it went on
        refused = refused_total(pair.p) - refused_before
        assert refused >= opened - FLOOD_CONNECTIONS, (name, refused, opened)  # every connection P closed counts
        new_p = pair.p.log_text().splitlines()[p_lines:]
        print(f"{name}: flood opened {opened} connections, P refused {refused:.0f}, P's log +{len(new_p)} lines")
        side_lines = [line for line in new_p if "side channel" in line]
        assert len(side_lines) <= 3, (name, side_lines)  # a summary line at most every 10 s, not one per connection
        assert len(new_p) <= len(prompts[key]) + 9, (name, new_p[-20:])
        assert not [line for line in pair.d.log_text().splitlines()[d_lines:] if " is dead" in line], name
        for proc in (pair.p, pair.d):
            m = wait_idle(proc.url)
            assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], proc.name


# ---- 2. secure by default -------------------------------------------------------------------------------------------
def run_cli(*argv: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s
    )


def test_no_secret_refuses_a_non_loopback_address(tiny_llama: Path) -> None:
    serve = ["serve", str(tiny_llama), "--port", "0", "--kv-side-channel-port", "0"]
    for extra in (["--kv-role", "decode", "--host", "0.0.0.0"], ["--kv-role", "prefill", "--kv-side-channel-host",
                                                                 "0.0.0.0"]):  # fmt: skip
        out = run_cli(*serve, *extra)
        assert out.returncode == 2, out.stderr
        assert "no deployment secret" in out.stderr and "--insecure-no-kv-auth" in out.stderr, out.stderr
    proxy = [
        "proxy",
        "--mode",
        "pull",
        "--port",
        "0",
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
    ]
    out = run_cli(*proxy, "--host", "0.0.0.0")
    assert out.returncode == 2 and "--insecure-no-kv-auth" in out.stderr, out.stderr
    for command in ("serve", "proxy"):
        assert "--insecure-no-kv-auth" in run_cli(command, "--help").stdout


def test_the_opt_out_flag_starts_the_router(launcher: Launcher) -> None:
    router = launcher.proxy("pull", ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], "--insecure-no-kv-auth",
                            name="router_insecure", host="0.0.0.0", ready_statuses=(200, 503))  # fmt: skip
    router.host = "127.0.0.1"  # bound on every address; reached on loopback
    launcher.wait_ready(timeout_s=60)
    assert "no --kv-auth-secret" in router.log_text()


def test_d_dials_no_address_a_client_names_beyond_loopback(deployment: Deployment) -> None:
    for mode in ("pull", "push"):
        d = deployment.pairs[(mode, "open")].d
        params: dict[str, Any] = {"do_remote_prefill": True, "transfer_mode": mode, "remote_host": "10.0.0.9",
                                  "remote_port": 5600}  # fmt: skip
        if mode == "pull":
            params |= {"remote_block_ids": list(range(8)), "remote_request_id": "r", "remote_num_tokens": 100}
        else:
            params |= {"transfer_id": "attacker-chosen", "remote_engine_id": "p"}
        resp = completion(d.url, "x" * 30, params)
        assert resp.status_code == 403, resp.text
        assert "not a loopback address" in resp.json()["error"]["message"]
        m = scrape_metrics(d.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"] and m["pdserve_requests_waiting_for_kv"] == 0
    time.sleep(6.0)  # past a handshake's timeout (5 s): a dial to 10.0.0.9 (e.g. to give the KV back) would be logged
    for mode in ("pull", "push"):
        assert "10.0.0.9:5600" not in deployment.pairs[(mode, "open")].d.log_text()  # (the 403 names no port)


def test_unauthenticated_kv_never_enters_ds_prefix_cache(deployment: Deployment) -> None:
    """The poisoning attack of issue 26 without a secret: the client sends D its prompt (France) with P's
    coordinates of another prompt's KV (Germany). D serves that request (nothing can tell it otherwise), but
    registers none of it in its prefix cache: the next France request through the router gets the colocated
    answer and moves its whole prompt's KV."""
    pair = deployment.open_pull()
    leg = {**GREEDY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    germany = post(pair.p.url, "/v1/completions", {"prompt": GERMANY, **leg}).json()["kv_transfer_params"]
    assert tokens(completion(pair.d.url, FRANCE, germany))  # served (unauthenticated)
    received = scrape_metrics(pair.d.url)["pdserve_kv_received_bytes_total"]
    resp = completion(pair.router.url, FRANCE)
    assert tokens(resp) == tokens(completion(pair.p.url, FRANCE))
    num_prompt = len(resp.json()["choices"][0]["prompt_token_ids"])
    wait_idle(pair.p.url)
    moved = scrape_metrics(pair.d.url)["pdserve_kv_received_bytes_total"] - received
    assert moved == num_prompt * BYTES_PER_TOKEN  # no prefix hit on D: the whole prompt (P hands its first token over)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_replayed_or_made_up_pull_coordinates_are_the_clients_error(deployment: Deployment, stream: bool) -> None:
    """Issue 26 item 7: without a secret D's edge cannot tell replayed or made-up pull coordinates from genuine
    ones, but P can: it holds no pin for them and says so in its answer to D's release. D answers the client 400
    (invalid_request_error) naming that, streamed or not, instead of a 500 (a made-up id: after D's 4 s
    confirmation timeout); every block comes back on both sides."""
    pair = deployment.open_pull()
    prompt = f"[{'stream' if stream else 'whole'}] " + GERMANY
    leg = {**GREEDY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    answer = post(pair.p.url, "/v1/completions", {"prompt": prompt, **leg}).json()["kv_transfer_params"]
    assert tokens(completion(pair.d.url, prompt, answer))  # the genuine use
    for kv in (answer, {**answer, "remote_request_id": "req-made-up"}):
        resp = completion(pair.d.url, prompt, kv, stream=stream)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert "holds no KV under these coordinates" in error["message"], error
    for proc in (pair.p, pair.d):
        m = wait_idle(proc.url)
        assert m["pdserve_kv_blocks_free"] == m["pdserve_kv_blocks_total"], proc.name


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_d_caches_received_kv_only_with_a_secret(deployment: Deployment, mode: str) -> None:
    """The same prompt, then it extended: with a secret D's second request hits its prefix cache (only the suffix
    moves); without one everything moves again. Greedy answers equal the colocated ones either way."""
    first = f"[{mode}] The quick brown fox jumps over the lazy dog; " * 2  # 5 blocks of 16, 2 of 32
    for auth in ("secret", "open"):
        pair = deployment.pairs[(mode, auth)]
        moved = []
        for prompt in (f"[{auth}] " + first, f"[{auth}] " + first + "and then it ran home."):
            received = scrape_metrics(pair.d.url)["pdserve_kv_received_bytes_total"]
            resp = completion(pair.router.url, prompt)
            assert tokens(resp) == tokens(completion(pair.p.url, prompt))
            wait_idle(pair.p.url)
            num_prompt = len(resp.json()["choices"][0]["prompt_token_ids"])
            got = scrape_metrics(pair.d.url)["pdserve_kv_received_bytes_total"] - received
            moved.append((num_prompt, got // BYTES_PER_TOKEN))
        (n1, moved1), (n2, moved2) = moved
        assert moved1 == n1  # the whole prompt: P hands its first token over, D computes no prompt token
        hit = (n1 // 32) * 32 if auth == "secret" else 0  # D's blocks are of 32 tokens
        assert moved2 == n2 - hit, (auth, moved)


def test_a_refused_handshake_reveals_nothing_without_a_secret(deployment: Deployment) -> None:
    for mode in ("pull", "push"):
        p = deployment.pairs[(mode, "open")].p
        fake = wire.PeerInfo(
            engine_id="intruder", agent_name="intruder-agent", agent_metadata=b"\x00" * 64, model_name="other",
            dtype="float32", transfer_mode=mode, wire_version=wire.WIRE_VERSION,
            geometry=CacheGeometry.of((), 2, 2, 16, 4, 16, 1), base_addr=0, device_id=0, memory="DRAM", tp_rank=0,
            tp_size=1, rank_ports=[], compat_hash="0", epoch=1,
        )  # fmt: skip
        with socket.create_connection(("127.0.0.1", side_port(p)), timeout=10) as s:
            data = wire.encode(wire.HandshakeRequest(fake, True))
            s.sendall(struct.pack(">I", len(data)) + data)
            (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
            reply = wire.decode(s.recv(n, socket.MSG_WAITALL))
        assert isinstance(reply, wire.HandshakeReply) and not reply.ok
        assert "model_name" in reply.error  # the difference, named
        info = reply.peer  # only what lets the peer word the difference
        assert info is not None and info.agent_metadata == b"" and info.agent_name == "" and info.base_addr == 0
        assert info.rank_ports == [] and info.geometry.num_blocks == 0 and info.epoch == 0
