"""A tensor-parallel rank other than 0: a spawned process that runs the model on its shard, step by step.

Life cycle (rank 0's group.py drives it): say hello (torch imported), join the process group, load this
rank's shard and allocate its KV cache slice (bring_up.py, as rank 0 does), say ready (with its block
count), build its model runner (on CUDA: capture decode graphs in step with rank 0, engine/runner.py), then
run every STEP plan rank 0 sends until SHUTDOWN, rank 0's death, or an error. It ignores SIGINT (rank 0
decides when ranks stop) and leaves when rank 0's process is gone, so no rank outlives its engine: between
steps its loop sees that; inside a step (a CUDA collective waiting for the dead rank 0 forever) its one
thread, "pdserve-tp-parent", aborts the NCCL communicator and ends the process.

Status messages to rank 0 are msgpack maps {"v": STATUS_VERSION, "type": "hello" | "ready" | "error", ...}.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgpack

from pdserve.config import EngineConfig
from pdserve.kv.groups import KVGroups
from pdserve.transfer.faults import NO_FAULTS, Faults

if TYPE_CHECKING:  # the rank imports torch only once spawned
    import torch.distributed

    from pdserve.model.parallel import NcclCollectives, ProcessGroupCollectives

log = logging.getLogger(__name__)

# 1: hello, ready (num_blocks), error (message); 2: ready.side_port, results (a KV connector's, transfer/ranks.py)
STATUS_VERSION = 2
PARENT_POLL_S = 0.5  # an idle rank checks this often that rank 0 is alive
COLLECTIVE_TIMEOUT_S = 120.0  # the process group's deadline for joining and for every collective


@dataclass(frozen=True)
class RankSpec:
    """What a spawned rank needs to know (passed once, at spawn, on this host)."""

    config: EngineConfig  # the instance's configuration (parallel.tensor_parallel_size = size)
    rank: int  # 1 .. size - 1
    init_method: str  # "tcp://127.0.0.1:PORT": rank 0's rendezvous store
    parent_pid: int  # rank 0's process: the rank leaves when it is gone
    faults: Faults = NO_FAULTS  # a test's transfer faults (transfer/faults.py), for this rank's connector worker

    @property
    def size(self) -> int:
        return self.config.parallel.tensor_parallel_size


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def encode_status(kind: str, **fields: Any) -> bytes:
    return msgpack.packb({"v": STATUS_VERSION, "type": kind, **fields})


def decode_status(data: bytes) -> dict[str, Any]:
    """A status map; ValueError for anything else."""
    msg = msgpack.unpackb(data)
    if (
        not isinstance(msg, dict)
        or msg.get("v") != STATUS_VERSION
        or msg.get("type") not in ("hello", "ready", "error", "results")
    ):
        raise ValueError(f"not a rank status message of version {STATUS_VERSION}: {msg!r:.200}")
    return msg


def join_process_group(device: str, rank: int, size: int, store: torch.distributed.Store) -> None:
    """Join the instance's process group through rank 0's rendezvous store (rank 0 opened it, the other
    ranks hold a client of it: connect_store)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size, timeout=timeout)


def connect_store(init_method: str, size: int, timeout_s: float) -> torch.distributed.TCPStore:
    """A client of rank 0's rendezvous store at init_method ("tcp://HOST:PORT")."""
    import torch.distributed as dist

    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return dist.TCPStore(host, int(port), size, False, timeout=timedelta(seconds=timeout_s))


def run_rank(spec: RankSpec, conn: Connection) -> None:
    """The process's target (multiprocessing spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{spec.rank}: %(message)s")
    try:
        code = _serve(spec, conn)
    except BaseException as e:
        log.exception("rank %d failed", spec.rank)
        try:
            conn.send_bytes(encode_status("error", message=f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        code = 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)


def _serve(spec: RankSpec, conn: Connection) -> int:
    import torch

    from pdserve.engine.runner import ModelRunner
    from pdserve.engine.tp.bring_up import bring_up_rank, device_of
    from pdserve.engine.tp.step_plan import PlanKind, decode
    from pdserve.model.parallel import collectives_for
    from pdserve.transfer.ranks import decode_meta

    cfg = spec.config
    device = device_of(cfg, spec.rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    conn.send_bytes(encode_status("hello"))
    join_process_group(device, spec.rank, spec.size, connect_store(spec.init_method, spec.size, COLLECTIVE_TIMEOUT_S))
    comm = collectives_for(device, spec.size, spec.rank)
    threading.Thread(target=_watch_parent, args=(spec.parent_pid, comm), name="pdserve-tp-parent", daemon=True).start()
    compute = bring_up_rank(cfg, spec.rank, comm)
    loaded, kv_cache, num_blocks = compute.loaded, compute.kv_cache, compute.num_blocks
    worker, side_port = _start_worker(spec, conn, kv_cache, loaded.name, loaded.arch.num_kv_heads,
                                      loaded.decoder.kv_groups)  # fmt: skip
    conn.send_bytes(encode_status("ready", num_blocks=num_blocks, side_port=side_port))
    try:
        # after "ready": rank 0 builds its runner once every rank is ready, and CUDA graph captures
        # (runner.py) run collectives that must meet rank 0's
        runner = ModelRunner(
            loaded.decoder, kv_cache, compute.device, not cfg.model.enforce_eager, max_model_len=loaded.max_model_len
        )
        while True:
            data = _receive(conn, spec.parent_pid)
            if data is None:
                log.warning("rank 0 is gone; rank %d leaves", spec.rank)
                return 1
            plan = decode(data)
            if plan.kind == PlanKind.SHUTDOWN:
                return 0
            if plan.kind == PlanKind.TRANSFER:
                if worker is not None:
                    worker.submit(decode_meta(plan.payload))
                continue
            runner.step_logits(plan.chunks)
    finally:
        if worker is not None:
            worker.shutdown()  # its transfer thread and side channel (joined), then its NIXL agent


def _start_worker(
    spec: RankSpec,
    conn: Connection,
    kv_cache: Any,
    model_name: str,
    total_kv_heads: int,
    kv_groups: KVGroups | None = None,
) -> tuple[Any, int]:
    """P/D: this rank's ConnectorWorker over its KV slice (own NIXL agent, transfer thread, side channel),
    started, its results sent to rank 0 over the pipe whenever it has some; (None, 0) for kv role both."""
    cfg = spec.config
    if not cfg.transfer.is_disaggregated:
        return None, 0
    from pdserve.engine.kv_cache import kv_cache_spec
    from pdserve.transfer.factory import make_rank_worker
    from pdserve.transfer.ranks import encode_results

    worker, side_port = make_rank_worker(cfg.transfer, spec.faults)
    kv_spec = kv_cache_spec(kv_cache, model_name, cfg.model.dtype, spec.rank, spec.size, total_kv_heads,
                            kv_groups=kv_groups)  # fmt: skip
    worker.register_kv_cache(kv_cache, kv_spec)
    lock = threading.Lock()

    def forward_results() -> None:  # on the rank's transfer thread
        with lock:
            res = worker.poll_results()
            if res:
                conn.send_bytes(encode_status("results", data=encode_results(res, worker.stats())))

    worker.start(forward_results)
    return worker, side_port


def _watch_parent(parent_pid: int, comm: ProcessGroupCollectives | NcclCollectives) -> None:
    """Until rank 0's process is gone; then abort this rank's collectives and leave (the main thread may be
    inside a CUDA collective that would wait for rank 0 forever)."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    log.warning("rank 0 is gone; this rank aborts its collectives and leaves")
    comm.abort()
    os._exit(1)


def _receive(conn: Connection, parent_pid: int) -> bytes | None:
    """The next message from rank 0, or None once rank 0's process or pipe is gone."""
    while not conn.poll(PARENT_POLL_S):
        if os.getppid() != parent_pid:
            return None
    try:
        return conn.recv_bytes()
    except (EOFError, OSError):
        return None
