"""How a lab run ends, whatever ends it, in every mode of ``mesh-node lab``.

A signal (SIGINT, SIGTERM, SIGHUP) cancels the run wherever it is, bring-up included: every
``finally`` on the way out runs (``open_lab`` stops every node and removes its folder), then
the command exits 128 + the signal (130, 143, 129). The receiver is opened explicitly, so a
lab started in the background by a shell, which inherits SIGINT ignored, still stops on
``kill -INT`` (an ignored SIGHUP stays ignored: ``nohup`` asked for that). The coordinator's
exit ends the run too (``supervised``): nothing the lab does can go on without it. What no
handler can catch, the lab's own SIGKILL, the nodes notice by themselves (their lifeline,
``mesh_node.lifeline``).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final, TypeVar

import trio

from mesh_node.lab.cluster import LabCluster, LabError
from skippy.errors import Interrupted

T = TypeVar("T")
log = logging.getLogger("mesh_node.lab")

SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)
WATCH_S: Final = 0.5  # how often the lab looks at its nodes' processes


async def run_until_signal(body: Callable[[], Awaitable[None]]) -> int | None:
    """Run ``body`` to its end (``None``) or until a signal cancels it (the signal's number).
    Signals that come while ``body`` is torn down wait for the teardown, which is bounded
    (``LabCluster.stop``)."""
    stopped_by: list[int] = []
    # SIGHUP (the terminal went away) too, unless it is ignored: `nohup` asked for that.
    hangup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    with trio.open_signal_receiver(*SIGNALS, *hangup) as signals:
        try:
            async with trio.open_nursery() as nursery:

                async def cancel_on_signal() -> None:
                    async for signum in signals:
                        stopped_by.append(signum)
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(cancel_on_signal)
                await body()
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if not stopped_by:
                raise
            # The user asked to stop: that is the outcome, whatever failed in the teardown.
            log.warning("while the lab stopped: %r", group.exceptions)
    return stopped_by[0] if stopped_by else None


def interrupted(signum: int, keep: bool, root: Path | None) -> Interrupted:
    """The error a signalled lab exits with (128 + ``signum``), saying what became of its
    folder (``root``: ``None`` when the signal came before it was made)."""
    cleaned = "every node was stopped and the lab folder removed"
    if keep:
        cleaned = "every node was stopped; the lab folder was kept" + (f": {root}" if root else "")
    return Interrupted(signum, signal.Signals(signum).name, cleaned)


async def supervised(cluster: LabCluster, body: Callable[[], Awaitable[T]]) -> T:
    """``body``'s result, unless the coordinator exits first: then a ``LabError``. Looking
    at the processes also reaps a worker that died (no defunct process waits for the end)."""
    result: list[T] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_coordinator, cluster)
        result.append(await body())
        nursery.cancel_scope.cancel()
    return result[0]


async def _watch_coordinator(cluster: LabCluster) -> None:
    coordinator = cluster.coordinator
    while True:
        for node in cluster.nodes:
            if node.process is not None:
                node.process.poll()
        proc = coordinator.process
        if proc is None or proc.returncode is not None:
            code = None if proc is None else proc.returncode
            how = "was stopped" if code is None else _exit_text(code)
            raise LabError(
                f"the coordinator ({coordinator.spec.name}, {coordinator.node_id[:12]}) {how}: "
                f"the lab cannot go on without it\n{coordinator.log_tail(5)}".rstrip(),
                code="lab_coordinator_exited",
                remediation="see its log (--keep keeps the lab folder)",
            )
        await trio.sleep(WATCH_S)


def _exit_text(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
