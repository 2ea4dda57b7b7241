"""Build the scheduler and worker halves of the connector for a TransferConfig."""

from __future__ import annotations

from pdserve.config import TransferConfig
from pdserve.kv.groups import KVGroups
from pdserve.transfer.base import ConnectorScheduler, ConnectorWorker
from pdserve.transfer.faults import NO_FAULTS, Faults
from pdserve.transfer.nop import NopScheduler, NopWorker


def make_connectors(
    cfg: TransferConfig, block_size: int, tp_size: int = 1, rank_ports: tuple[int, ...] = (),
    kv_groups: KVGroups | None = None, faults: Faults = NO_FAULTS,
) -> tuple[ConnectorScheduler, ConnectorWorker]:  # fmt: skip
    """The connector pair for cfg. For kv role prefill/decode this binds the side-channel socket now
    (cfg.side_channel_port; 0 picks a free port, reported by scheduler.info() with kv_groups' structure) and
    raises OSError if it cannot; rank_ports: the side-channel ports of tensor-parallel ranks 1..
    (scheduler.info() lists them all); the worker serves it from start() and closes it in shutdown(). faults:
    a test's (faults.py), handed over by whoever builds the connectors; NO_FAULTS otherwise."""
    if cfg.role == "both":
        return NopScheduler(block_size), NopWorker()
    from pdserve.transfer.thread.handshake import SideChannel

    side = SideChannel(cfg.side_channel_host, cfg.side_channel_port, cfg.auth_secret)
    if cfg.mode == "pull":
        from pdserve.transfer.scheduler.pull import PullScheduler
        from pdserve.transfer.thread.pull import PullWorker

        pull = PullScheduler(cfg, block_size, side.host, side.port, tp_size, rank_ports, kv_groups)
        return pull, PullWorker(cfg, side, faults)
    from pdserve.transfer.scheduler.push import PushScheduler
    from pdserve.transfer.thread.push import PushWorker

    push = PushScheduler(cfg, block_size, side.host, side.port, tp_size, rank_ports, kv_groups)
    return push, PushWorker(cfg, side, faults)


def make_rank_worker(cfg: TransferConfig, faults: Faults = NO_FAULTS) -> tuple[ConnectorWorker, int]:
    """A tensor-parallel rank's worker half (rank > 0; kv role prefill/decode) and its side channel's port,
    bound now on cfg's host (any free port: rank 0 announces it in its handshake)."""
    from dataclasses import replace

    from pdserve.transfer.thread.handshake import SideChannel

    side = SideChannel(cfg.side_channel_host, 0, cfg.auth_secret)
    rank_cfg = replace(cfg, side_channel_port=0)
    if cfg.mode == "pull":
        from pdserve.transfer.thread.pull import PullWorker

        return PullWorker(rank_cfg, side, faults), side.port
    from pdserve.transfer.thread.push import PushWorker

    return PushWorker(rank_cfg, side, faults), side.port
