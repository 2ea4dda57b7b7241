"""D, both modes (transfer thread): what happens once a recv's KV has landed in the registered buffer."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.transfer.base import RecvTask
from pdserve.transfer.faults import FaultPoint
from pdserve.transfer.layout import group_ranges
from pdserve.transfer.thread.context import TransferContext


def land(
    ctx: TransferContext, task: RecvTask, is_current: Callable[[], bool], end: Callable[[str | None], None]
) -> None:
    """The KV for task landed. Without staging it is in the KV cache already: end(None) now. With staging it is
    in the host mirror: copy exactly the received tokens into the KV cache (after a test's STAGE_IN delay),
    then end(None), or end(reason) if the copy failed. Skipped if is_current() says the recv ended meanwhile
    (a cancel: nothing more lands, the copy is not needed). The caller marks the recv as staging first."""
    stager = ctx.stager
    if stager is None:
        end(None)
        return

    # per KV group, the tokens that landed (equal block sizes on both sides for windowed models: wire.py)
    ranges = group_ranges(ctx.spec.windows, task.start_token, task.num_tokens, ctx.layout.block_size)

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

    ctx.cfg.faults.defer(FaultPoint.STAGE_IN, ctx.thread.call_at, copy_in)
