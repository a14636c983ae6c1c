"""Await a stage-runtime call on the process's compute thread (``skippy.runtime.compute_thread``:
why every ggml call of a node runs on one thread).

Like ``trio.to_thread.run_sync`` without abandoning: a cancelled caller still waits for the
call to finish (a ggml graph cannot be interrupted, and the stage must not be touched while it
runs), and the cancellation is delivered when it has. The hand-off is one queue put and, on
return, one ``run_sync_soon`` wake-up of the loop: no thread cache, no per-call thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import outcome
import trio

from skippy.runtime.compute_thread import compute_thread

T = TypeVar("T")


async def run_compute(fn: Callable[[], T]) -> T:
    """``fn()`` on the compute thread; its result or exception here."""
    token = trio.lowlevel.current_trio_token()
    task = trio.lowlevel.current_task()

    def job() -> None:
        result = outcome.capture(fn)
        # the loop may be gone (RunFinishedError): then nobody is waiting any more
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    await trio.lowlevel.checkpoint_if_cancelled()
    compute_thread().submit(job)

    def abort(_: object) -> trio.lowlevel.Abort:
        return trio.lowlevel.Abort.FAILED  # wait for the call; cancelled at the next checkpoint

    return await trio.lowlevel.wait_task_rescheduled(abort)  # type: ignore[no-any-return]
