"""A connector pair (scheduler + worker half) in its own process, driven like the engine drives it: the one driver
of the transfer tests (tests/transfer/, tests/gpu/) and the transfer benchmarks (scripts/bench_transfer.py).

The child runs an engine-like loop (build_step_meta -> submit, poll_results) and obeys commands from the
parent over a pipe. Its KV cache is a block-major tensor [blocks, layers, 2, heads, block_size, head_dim]
(engine/kv_cache.py): for tests a tiny float32 one where a producer's holds known, unique values and a
consumer's starts at -1 so any stray byte shows; for benchmarks a model-sized one (`dtype`, fill "random").
`move` carries one request's KV from P to D the way P's and D's engines would, and times it from the
instances' own timeline events.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from pdserve.testing.pair_child import HEAD_DIM, NUM_HEADS, NUM_LAYERS, run_child, shape

__all__ = ["Instance", "close_all", "events", "expected_kv", "move", "push_params", "shape", "start_all"]


@functools.cache
def _context() -> Any:
    """A forkserver that has imported torch and nixl once: children fork from it in milliseconds instead of
    importing torch for seconds each. No NIXL agent or torch thread exists in the server before the fork."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "nixl._api", "numpy", "msgpack", "pdserve.transfer.factory", "pdserve.testing.pair_child"]
    )
    return ctx


class Instance:
    """A connector pair in a child process."""

    def __init__(self, role: str, mode: str, block_size: int = 4, num_blocks: int = 16, model: str = "tiny",
                 dims: tuple[int, int, int] = (NUM_LAYERS, NUM_HEADS, HEAD_DIM), env: dict[str, str] | None = None,
                 device: str = "cpu", windows: tuple[int | None, ...] = (), dtype: str = "float32",
                 fill: str | None = None, **cfg: Any) -> None:  # fmt: skip
        """fill: "values" (unique), "random" or "empty" (-1); by default "values" for a producer, else "empty".
        dims: (layers, KV heads, head dim); cfg: TransferConfig's fields beyond role and mode."""
        self.block_size, self.num_blocks = block_size, num_blocks
        ctx = _context()
        self.conn, child = ctx.Pipe()
        kwargs = dict(role=role, mode=mode, side_channel_port=0, engine_id=f"{role}-{os.getpid()}-{id(self)}", **cfg)
        fill = fill or ("values" if role == "prefill" else "empty")
        self.proc = ctx.Process(
            target=run_child,
            args=(child, kwargs, block_size, num_blocks, fill, model, dims, env or {}, device, windows, dtype),
            daemon=True,
        )
        self.proc.start()
        self.info: dict[str, Any] | None = None

    def wait_ready(self, timeout: float = 60.0) -> Instance:
        if self.info is None:
            if not self.conn.poll(timeout):
                raise TimeoutError("instance did not start")
            _, self.info = self.conn.recv()
        return self

    def call(self, *cmd: Any, timeout: float = 30.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer to {cmd[0]}")
        reply = self.conn.recv()[1]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def results(self) -> dict[str, list]:
        return self.call("results")

    def wait_result(self, request_id: str, timeout: float = 10.0) -> tuple[str, Any]:
        """(kind, value) of the first recv result for request_id: finished / failed (reason) / cancelled."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.results()
            if request_id in r["finished_recvs"]:
                return "finished", None
            for rid, reason in r["failed_recvs"]:
                if rid == request_id:
                    return "failed", reason
            if request_id in r["cancelled_recvs"]:
                return "cancelled", None
            time.sleep(0.005)
        raise TimeoutError(f"no recv result for {request_id} within {timeout} s")

    def wait_send(self, request_id: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if request_id in self.results()["finished_sends"]:
                return
            time.sleep(0.005)
        raise TimeoutError(f"send of {request_id} not finished within {timeout} s")

    def count(self, kind: str, request_id: str) -> int:
        r = self.results()[kind]
        return sum(1 for x in r if (x[0] if isinstance(x, tuple | list) else x) == request_id)

    def kv(self) -> np.ndarray:
        return self.call("kv")

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("shutdown", timeout=15)
            except (TimeoutError, EOFError, BrokenPipeError, OSError):
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()


def expected_kv(d_before: np.ndarray, p_kv: np.ndarray, d_blocks: list[int], p_blocks: list[int], start: int,
                num_tokens: int, staged: bool = False) -> np.ndarray:  # fmt: skip
    """D's cache after tokens [start, start + num_tokens) were copied from P's blocks into D's; with equal block
    sizes the last block is copied whole (layout.pad_last_blocks: its rows past the range are D's to overwrite),
    unless D is staged (staging.py copies exactly the transferred tokens from its mirror into its cache)."""
    out = d_before.copy()
    dbs, pbs = d_before.shape[4], p_kv.shape[4]
    end = start + num_tokens
    if dbs == pbs and num_tokens > 0 and not staged:
        end = -(-end // dbs) * dbs
    for t in range(start, end):
        out[d_blocks[t // dbs], :, :, :, t % dbs] = p_kv[p_blocks[t // pbs], :, :, :, t % pbs]
    return out


def start_all(**instances: Instance) -> dict[str, Instance]:
    """Wait for instances started in parallel (each child imports torch and creates an agent: seconds)."""
    try:
        for inst in instances.values():
            inst.wait_ready()
    except BaseException:
        close_all(instances)
        raise
    return instances


def close_all(instances: dict[str, Instance]) -> None:
    for inst in instances.values():
        inst.close()


def push_params(p: Instance, transfer_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(P's, D's) kv_transfer_params for one push request, as the router builds them from P's info."""
    assert p.info is not None
    d_params = {"do_remote_prefill": True, "transfer_id": transfer_id, "remote_engine_id": p.info["engine_id"],
                "remote_host": p.info["side_channel_host"], "remote_port": p.info["side_channel_port"],
                "tp_size": p.info["tp_size"], "transfer_mode": "push"}  # fmt: skip
    return {"do_remote_decode": True, "transfer_id": transfer_id, "transfer_mode": "push"}, d_params


def events(inst: Instance, request_id: str) -> dict[str, float]:
    return {name: t for rid, name, t in inst.results()["events"] if rid == request_id}


def move(mode: str, p: Instance, d: Instance, rid: str, p_blocks: list[int], d_blocks: list[int], tokens: int,
         timeout: float = 60.0) -> tuple[float, float]:  # fmt: skip
    """One request's KV from P's blocks to D's, as the engines would hand it over: a prompt of tokens + 1 (D
    computes the last one itself, so `tokens` tokens move); both block lists hold the prompt. Returns seconds
    (transfer, ready): from the READ/WRITE being posted (pull: D's event, push: P's) to D's "kv_received", and
    from the driver handing over the last piece (pull: D's allocation; push: P's finished prefill, D registered
    long before) to the same."""
    if mode == "pull":
        _, params = p.call("finish", f"p-{rid}", p_blocks, tokens + 1, {"do_remote_decode": True})
        d.call("needs", rid, params)
        t0 = time.time()
        d.call("alloc", rid, d_blocks, 0, tokens + 1)
    else:
        p_params, d_params = push_params(p, rid)
        d.call("needs", rid, d_params)
        d.call("alloc", rid, d_blocks, 0, tokens + 1)
        deadline = time.monotonic() + timeout
        while "registration_sent" not in events(d, rid) and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.02)  # let the registration reach P: the WRITE then starts at P's finish
        t0 = time.time()
        p.call("finish", f"p-{rid}", p_blocks, tokens + 1, p_params)
    result = d.wait_result(rid, timeout)
    if result != ("finished", None):
        raise RuntimeError(f"{mode} {rid}: {result}")
    p.wait_send(f"p-{rid}", timeout)
    received = events(d, rid)["kv_received"]
    posted = events(d if mode == "pull" else p, rid if mode == "pull" else f"p-{rid}")["transfer_posted"]
    return received - posted, received - t0
