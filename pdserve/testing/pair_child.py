"""The child side of a connector pair (pdserve/testing/transfer_pair.py): one process holding a KV cache, the
connectors' scheduler and worker halves, and an engine-like loop that obeys the parent's commands."""

from __future__ import annotations

import multiprocessing.connection
import os
from dataclasses import asdict
from typing import Any

import numpy as np

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 2, 4  # the tests' tiny cache


def shape(num_blocks: int, block_size: int, dims: tuple[int, int, int] = (NUM_LAYERS, NUM_HEADS, HEAD_DIM)) -> tuple:
    """The cache tensor's shape: [num_blocks, layers, 2 (K, V), heads, block_size, head_dim]; dims = (layers,
    heads, head_dim)."""
    layers, heads, head_dim = dims
    return (num_blocks, layers, 2, heads, block_size, head_dim)


def run_child(
    conn: Any, cfg_kwargs: dict[str, Any], block_size: int, num_blocks: int, fill: str, model: str, dims: tuple,
    env: dict[str, str], device: str, windows: tuple[int | None, ...] = (), dtype: str = "float32",
) -> None:  # fmt: skip
    """The child process: builds its connectors from cfg_kwargs (TransferConfig's fields; "faults" goes to the
    factory), registers a cache of `shape` filled per `fill`, answers ("ready", the scheduler's info) on `conn`,
    then runs the engine's loop and answers each command with ("ok", reply) until "shutdown"."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(env)
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING, format="%(process)d %(name)s %(levelname)s %(message)s")
    from pdserve.config import TransferConfig
    from pdserve.kv.decode import decode
    from pdserve.kv.geometry import CacheGeometry
    from pdserve.kv.groups import KVGroups
    from pdserve.kv.params import PullSource, PushSource, encode
    from pdserve.transfer.base import KVCacheSpec
    from pdserve.transfer.factory import make_connectors
    from pdserve.transfer.faults import NO_FAULTS

    torch.set_num_threads(1)
    faults = cfg_kwargs.pop("faults", NO_FAULTS)  # a test's Faults go to the connector factory, not the config
    cfg = TransferConfig(**cfg_kwargs)
    # windows: per model layer (kv/groups.py); every group must hold dims' layers per block
    groups = KVGroups.of(windows, len(windows)) if windows else None
    assert groups is None or groups.layers_per_block == dims[0], groups
    sched, worker = make_connectors(cfg, block_size, kv_groups=groups, faults=faults)
    kv_shape = shape(num_blocks, block_size, dims)
    torch_dtype = getattr(torch, dtype)
    if fill == "values":  # unique values (exact in float32 up to 2**24 elements)
        kv = (torch.arange(int(np.prod(kv_shape)), dtype=torch.float32) + 1.0).reshape(kv_shape).to(torch_dtype)
        kv = kv.to(device)
    elif fill == "random":  # a model-sized cache: made on its device
        kv = torch.empty(kv_shape, dtype=torch_dtype, device=device).normal_()
    else:
        kv = torch.full(kv_shape, -1.0, dtype=torch_dtype, device=device)
    layers, heads, head_dim = dims
    memory, dev_id = ("VRAM", kv.device.index or 0) if kv.is_cuda else ("DRAM", 0)
    geometry = CacheGeometry(num_blocks, block_size, heads, heads, head_dim, kv.element_size(),
                             groups or KVGroups.of((), layers))  # fmt: skip
    spec = KVCacheSpec(geometry, kv.data_ptr(), memory, dev_id, model, dtype)
    worker.register_kv_cache(kv, spec)
    # Sleep on the parent's pipe and the worker's wakeup, as the engine does: a child that polled every 0.5 ms
    # cost 12% of a core idle, and the fault suite's 19 children saturated a 2-core machine, starving P past
    # the 1 s peer_timeout_s its Ds judge it by (CI's false "prefill instance is gone").
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)

    def wakeup() -> None:
        try:
            os.write(wake_w, b"w")
        except BlockingIOError:  # the pipe is full: a wakeup is pending anyway
            pass

    worker.start(wakeup)
    results: dict[str, list] = {"finished_recvs": [], "failed_recvs": [], "cancelled_recvs": [],
                                "finished_sends": [], "events": [], "landed_from": []}  # fmt: skip
    conn.send(("ready", sched.info()))
    params: dict[str, Any] = {}  # request id -> parsed kv_transfer_params (the engine's Request owns them)
    while True:
        ready = multiprocessing.connection.wait([conn, wake_r], timeout=0.05)  # the timeout only bounds a missed wakeup
        if wake_r in ready:
            os.read(wake_r, 4096)  # what is left over wakes the next wait at once
        if conn in ready:
            cmd, *args = conn.recv()
            if cmd == "shutdown":
                worker.shutdown()
                conn.send(("ok", None))
                return
            reply: Any = None
            if cmd == "needs":  # (request id, kv_transfer_params as JSON), parsed as the server does
                try:
                    params[args[0]] = decode(args[1])
                    reply = sched.needs_remote_kv(args[0], params[args[0]])
                except ValueError as e:  # the server's 400: the test's call() raises it
                    reply = e
            elif cmd == "alloc":  # (request id, blocks, local tokens, prompt tokens[, a table per KV group])
                rid, blocks, num_local, num_prompt = args[:4]
                tables = args[4] if args[4:] else ()
                sched.on_blocks_allocated(rid, blocks, num_local, num_prompt, params.pop(rid), block_tables=tables)
            elif cmd == "scheduled":  # P: its last prompt chunk scheduled (id, blocks, tokens, params[, tables])
                rid, blocks, num_tokens = args[:3]
                tables = args[4] if args[4:] else ()
                sched.on_prefill_scheduled(rid, blocks, num_tokens, decode(args[3]), block_tables=tables)
            elif cmd == "finish":  # -> (keep blocks, the response's kv_transfer_params as JSON)
                tables = args[4] if args[4:] else ()  # a table per KV group (windowed models)
                rid, blocks, num_tokens = args[:3]
                keep = sched.on_request_finished(rid, blocks, num_tokens, decode(args[3]), block_tables=tables)
                answer = sched.take_answer(args[0])
                reply = keep, None if answer is None else encode(answer)
            elif cmd == "abort":
                sched.on_recv_aborted(*args)
            elif cmd == "release":  # P: the engine gives a finished request's pin up (abort, /kv_transfer/release)
                sched.on_pin_released(*args)
            elif cmd == "abort_request":  # P: a request ended without finishing (Scheduler.finish, abort/error)
                sched.on_request_aborted(*args)
            elif cmd == "refuse":  # D: a request carrying these params (JSON) was refused before admission
                source = decode(args[0])
                assert isinstance(source, PullSource | PushSource)
                sched.on_refused(source)
            elif cmd == "results":
                reply = {k: list(v) for k, v in results.items()}
            elif cmd == "kv":
                reply = kv.cpu().numpy().copy()
            elif cmd == "block_sums":  # [len(block ids)] float64 sums over each listed block
                reply = kv[args[0]].double().sum(dim=(1, 2, 3, 4, 5)).tolist()
            elif cmd == "stats":
                reply = asdict(worker.stats())
            meta = sched.build_step_meta()  # like the engine: a step's outputs leave after its submit()
            if meta:
                worker.submit(meta)
            conn.send(("ok", reply))
        meta = sched.build_step_meta()
        if meta:
            worker.submit(meta)
        res = worker.poll_results()
        for k in results:
            got = getattr(res, k)
            results[k].extend(got.items() if isinstance(got, dict) else got)  # landed_from: (request id, firsts)
