"""D, both modes (transfer thread): what happens once a recv's KV has landed in the registered buffer."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.transfer.base import RecvTask
from pdserve.transfer.faults import FaultPoint
from pdserve.transfer.layout import group_ranges
from pdserve.transfer.thread.context import TransferContext


def landed_ranges(ctx: TransferContext, task: RecvTask, peer_block_size: int) -> list[tuple[int, int]]:
    """Per KV group, the tokens [first, end) a recv writes into D's blocks: layout.group_ranges over both sides'
    block sizes, the ones the READ/WRITE's descriptors were built from. A windowed group whose first block on D
    starts before `first` (P's blocks are smaller: P had freed the rows before its own block's start) has rows
    D never received there; D reads none of them (they lie before its window), and the engine must not register
    that block in its prefix cache (TransferResults.landed_from)."""
    return group_ranges(
        ctx.geometry.windows, task.start_token, task.num_tokens, ctx.geometry.block_size, peer_block_size
    )


def landed_from(ctx: TransferContext, task: RecvTask, peer_block_size: int) -> tuple[int, ...]:
    """Per KV group, the first token whose KV landed (what a finished recv reports, TransferResults.landed_from)."""
    return tuple(first for first, _ in landed_ranges(ctx, task, peer_block_size))


def land(
    ctx: TransferContext,
    task: RecvTask,
    peer_block_size: int,
    is_current: Callable[[], bool],
    end: Callable[[str | None], None],
) -> None:
    """The KV for task landed. Without staging it is in the KV cache already: end(None) now. With staging it is
    in the host mirror: copy exactly the received tokens into the KV cache (after a test's STAGE_IN delay),
    then end(None), or end(reason) if the copy failed. Skipped if is_current() says the recv ended meanwhile
    (a cancel: nothing more lands, the copy is not needed). The caller marks the recv as staging first."""
    stager = ctx.stager
    if stager is None:
        end(None)
        return

    ranges = landed_ranges(ctx, task, peer_block_size)

    def copy_in() -> None:
        if not is_current():
            return
        try:
            for table, (first, stop) in zip(task.tables, ranges, strict=True):
                stager.stage_in(table, first, stop - first)
        except Exception as e:  # noqa: BLE001 - a failed copy fails this recv, not the thread
            end(f"copy from the host staging buffer failed: {e}")
            return
        end(None)

    ctx.faults.defer(FaultPoint.STAGE_IN, ctx.thread.call_at, copy_in)
