"""TPGroup: rank 0's handle on the other tensor-parallel ranks of an instance (their processes and pipes).

Owned by LLMEngine. Life cycle, in this order (every wait has a deadline, and a rank process that exits
ends the wait at once):
  TPGroup(config)      opens rank 0's rendezvous store (a TCPStore on a port the kernel picks), then
                       spawns ranks 1..N-1 (multiprocessing spawn, rank.py), one pipe each;
  connect()            waits for every rank's hello, then joins the process group as rank 0 (gloo on the
                       CPU, NCCL on CUDA) -> the collectives rank 0's decoder uses; starts the watch
                       thread ("pdserve-tp-watch", joined in shutdown()): the moment a rank process
                       exits it marks the group broken and aborts rank 0's NCCL communicator, so a step
                       waiting inside a collective for the dead rank returns (and raises TPGroupError);
  wait_ready(n)        waits until every rank loaded its shard; refuses a rank whose block count is not n;
  run_step(plan, f)    sends the step plan to every rank, then runs f (rank 0's forward pass) on it;
  shutdown()           sends SHUTDOWN, joins every rank (terminate, then kill, past the deadline), leaves
                       the process group. Always called (LLMEngine.shutdown, or a failed start in
                       rank_zero.start_rank_zero).
Plans go over the pipes as explicit int64 words (step_plan.py), never pickle; activations and
logits go through the process group. After any failed step the group is broken for good (the ranks may
be out of step): every later step raises TPGroupError at once, and the engine reports itself unhealthy.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TypeVar

import torch.distributed as dist

from pdserve.config import EngineConfig
from pdserve.engine.tp.bring_up import rank_device
from pdserve.engine.tp.rank import RankSpec, decode_status, join_process_group, run_rank
from pdserve.engine.tp.step_plan import SHUTDOWN, Chunk, PlanKind, StepPlan, encode
from pdserve.model.parallel import NcclCollectives, ProcessGroupCollectives, collectives_for
from pdserve.transfer.faults import NO_FAULTS, Faults

HELLO_TIMEOUT_S = 120.0  # a spawned rank imports torch (slow on a busy machine)
READY_TIMEOUT_S = 1800.0  # a rank loads its shard of the checkpoint (large models: minutes)
JOIN_TIMEOUT_S = 10.0  # shutdown: a rank leaves after SHUTDOWN within this long, or is terminated

T = TypeVar("T")


class TPGroupError(RuntimeError):
    """A tensor-parallel rank died or a step failed: the instance cannot compute any more."""


class TPGroup:
    def __init__(self, config: EngineConfig, faults: Faults = NO_FAULTS) -> None:
        self.size = config.parallel.tensor_parallel_size
        self.device = config.model.device
        # Rank 0's rendezvous store listens before any rank is spawned, on a port the kernel picks: a port
        # chosen by probing and opened later can be taken meanwhile (two instances starting at once did).
        self._store: dist.TCPStore | None = dist.TCPStore(
            "127.0.0.1", 0, self.size, True, timeout=timedelta(seconds=HELLO_TIMEOUT_S), wait_for_workers=False
        )
        self.init_method = f"tcp://127.0.0.1:{self._store.port}"
        self.broken: str | None = None  # why the group cannot run steps any more
        self.procs: list[BaseProcess] = []  # rank r is procs[r - 1]
        self.conns: list[Connection] = []  # rank 0's end of rank r's pipe is conns[r - 1]
        self._joined_group = False
        self.side_ports: tuple[int, ...] = ()  # ranks 1..N-1's side-channel ports (kv role prefill/decode)
        self._reader: threading.Thread | None = None  # reads ranks' transfer results (start_reader())
        self._stop_reader = threading.Event()  # also stops the watch thread
        self._watch: threading.Thread | None = None  # sees a rank exit (connect())
        self._comm: ProcessGroupCollectives | NcclCollectives | None = None
        ctx = multiprocessing.get_context("spawn")
        try:
            for rank in range(1, self.size):
                mine, theirs = ctx.Pipe()
                spec = RankSpec(config, rank, self.init_method, os.getpid(), faults)
                proc = ctx.Process(target=run_rank, args=(spec, theirs), name=f"pdserve-tp-rank{rank}", daemon=True)
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(mine)
        except BaseException:
            self.shutdown()
            raise

    def connect(self) -> ProcessGroupCollectives | NcclCollectives:
        """Wait for every rank's hello and join the process group as rank 0."""
        self._wait_all("hello", HELLO_TIMEOUT_S)
        if dist.is_initialized():
            raise TPGroupError("a tensor-parallel engine already runs in this process (one per process)")
        if self._store is None:
            raise TPGroupError("the tensor-parallel group was shut down")
        device = rank_device(self.device, 0)
        if device.startswith("cuda"):
            import torch

            torch.cuda.set_device(device)  # NCCL binds rank 0 to this GPU
        join_process_group(device, 0, self.size, self._store)
        self._joined_group = True
        self._comm = collectives_for(device, self.size, 0)
        self._watch = threading.Thread(target=self._watch_ranks, name="pdserve-tp-watch", daemon=True)
        self._watch.start()
        return self._comm

    def wait_ready(self, num_blocks: int) -> None:
        """Wait until every rank loaded its shard and allocated a KV cache of `num_blocks` blocks."""
        ready = self._wait_all("ready", READY_TIMEOUT_S)
        for rank, msg in enumerate(ready, start=1):
            if msg.get("num_blocks") != num_blocks:
                raise TPGroupError(
                    f"tensor-parallel rank {rank} has {msg.get('num_blocks')} KV blocks, rank 0 has {num_blocks}"
                )
        self.side_ports = tuple(int(msg.get("side_port", 0)) for msg in ready)

    def send_transfer(self, payload: bytes) -> None:
        """Hand a StepMeta (transfer/ranks.py bytes) to every rank's ConnectorWorker; TPGroupError on failure."""
        if self.broken is not None:
            raise TPGroupError(self.broken)
        data = encode(StepPlan(PlanKind.TRANSFER, [], payload))
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:
            self.broken = self._describe_failure(e)
            raise TPGroupError(self.broken) from e

    def start_reader(self, on_results: Callable[[int, bytes], None], on_broken: Callable[[], None]) -> None:
        """After wait_ready: a thread ("tp-results", joined in shutdown()) reads every rank's pipe; each
        results message goes to on_results(rank, bytes); a rank that errors or exits breaks the group (its
        reason in `broken`) and calls on_broken(). Rank 0's main thread only writes the pipes from now on."""

        def run() -> None:
            by_conn = {id(c): r for r, c in enumerate(self.conns, start=1)}
            live = list(self.conns)
            while live and not self._stop_reader.is_set():
                for conn in wait(live, timeout=0.2):
                    assert isinstance(conn, Connection)
                    rank = by_conn[id(conn)]
                    try:
                        msg = decode_status(conn.recv_bytes())
                    except (EOFError, OSError, ValueError) as e:
                        live.remove(conn)
                        if not self._stop_reader.is_set():
                            self.broken = self.broken or self._describe_failure(e)
                            on_broken()
                        continue
                    if msg["type"] == "results":
                        on_results(rank, msg["data"])
                    elif msg["type"] == "error":
                        self.broken = self.broken or f"tensor-parallel rank {rank} failed: {msg.get('message')}"
                        on_broken()

        self._reader = threading.Thread(target=run, name="pdserve-tp-results", daemon=True)
        self._reader.start()

    def run_step(self, plan: StepPlan, forward: Callable[[Sequence[Chunk]], T]) -> T:
        """Send `plan` to every rank, then run rank 0's `forward` on its chunks; TPGroupError on any failure."""
        if self.broken is not None:
            raise TPGroupError(self.broken)
        try:
            self._check_alive()
            data = encode(plan)
            for conn in self.conns:
                conn.send_bytes(data)
            out = forward(plan.chunks)
            self.check()
            return out
        except Exception as e:
            self.broken = self._describe_failure(e)
            raise TPGroupError(self.broken) from e

    def shutdown(self) -> None:
        """Stop every rank and join it (then the results reader); leave the process group. Idempotent."""
        self._stop_reader.set()
        for conn in self.conns:
            try:
                conn.send_bytes(encode(SHUTDOWN))
            except OSError:
                pass  # that rank is gone already
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        if self._reader is not None:
            self._reader.join()
            self._reader = None
        if self._watch is not None:
            self._watch.join()
            self._watch = None
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        if self._joined_group and dist.is_initialized():
            dist.destroy_process_group()
        self._joined_group = False
        self._store = None  # stops listening

    def check(self) -> None:
        """Raise TPGroupError if the group broke (call after reading a step's results: an aborted collective
        returns garbage without an error of its own)."""
        if self.broken is not None:
            raise TPGroupError(self.broken)

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _watch_ranks(self) -> None:
        """The watch thread: wait for any rank process to exit; unless shutting down, break the group and abort
        rank 0's collectives, which may be waiting on the dead rank inside a step."""
        by_sentinel = {p.sentinel: (r, p) for r, p in enumerate(self.procs, start=1)}
        while not self._stop_reader.is_set():
            ready = wait(list(by_sentinel), timeout=0.5)
            if not ready or self._stop_reader.is_set():
                continue
            sentinel = ready[0]
            assert isinstance(sentinel, int)  # wait() returns the objects it was given: process sentinels
            rank, proc = by_sentinel[sentinel]
            proc.join(1.0)  # reap it, for its exit code
            self.broken = (
                self.broken or f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
            )
            if self._comm is not None:
                self._comm.abort()
            return

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                raise TPGroupError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def _describe_failure(self, error: Exception) -> str:
        time.sleep(0.2)  # a rank that just died: let its exit be seen, so the message names it
        dead = [
            f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
            for r, p in enumerate(self.procs, start=1)
            if not p.is_alive()
        ]
        cause = f"{type(error).__name__}: {error}"
        if dead:
            return f"tensor-parallel {', '.join(dead)} ({cause}); the instance cannot run steps any more"
        return f"tensor-parallel step failed ({cause}); the instance cannot run steps any more"

    def _wait_all(self, kind: str, timeout_s: float) -> list[dict]:
        """Every rank's next status message, which must be `kind`; TPGroupError on an error, exit or timeout."""
        deadline = time.monotonic() + timeout_s
        out = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            while not conn.poll(0.2):
                if not proc.is_alive():
                    raise TPGroupError(
                        f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} "
                        f"before it was {kind}"
                    )
                if time.monotonic() > deadline:
                    raise TPGroupError(f"tensor-parallel rank {rank} not {kind} after {timeout_s:.0f} s")
            try:
                msg = decode_status(conn.recv_bytes())
            except (EOFError, OSError) as e:
                raise TPGroupError(f"tensor-parallel rank {rank} closed its pipe before it was {kind}") from e
            if msg["type"] == "error":
                raise TPGroupError(f"tensor-parallel rank {rank} failed: {msg.get('message')}")
            if msg["type"] != kind:
                raise TPGroupError(f"tensor-parallel rank {rank} sent {msg['type']!r}, expected {kind!r}")
            out.append(msg)
        return out
