"""Build the scheduler and worker halves of the connector for a TransferConfig."""

from __future__ import annotations

from pdserve.config import TransferConfig
from pdserve.transfer.base import ConnectorScheduler, ConnectorWorker
from pdserve.transfer.nop import NopScheduler, NopWorker


def make_connectors(
    cfg: TransferConfig, block_size: int, tp_size: int = 1
) -> tuple[ConnectorScheduler, ConnectorWorker]:
    """The connector pair for cfg. For kv role prefill/decode this binds the side-channel socket now
    (cfg.side_channel_port; 0 picks a free port, reported by scheduler.info()) and raises OSError if it
    cannot; the worker serves it from start() and closes it in shutdown()."""
    if cfg.role == "both":
        return NopScheduler(block_size), NopWorker()
    from pdserve.transfer.thread.handshake import SideChannel

    side = SideChannel(cfg.side_channel_host, cfg.side_channel_port, cfg.auth_secret)
    if cfg.mode == "pull":
        from pdserve.transfer.scheduler.pull import PullScheduler
        from pdserve.transfer.thread.pull import PullWorker

        return PullScheduler(cfg, block_size, side.host, side.port, tp_size), PullWorker(cfg, side)
    from pdserve.transfer.scheduler.push import PushScheduler
    from pdserve.transfer.thread.push import PushWorker

    return PushScheduler(cfg, block_size, side.host, side.port, tp_size), PushWorker(cfg, side)
