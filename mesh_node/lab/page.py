"""``mesh-node lab --http`` (and ``--serve``): the lab with its coordinator's status page
, and with ``--serve`` the OpenAI API beside it.

The coordinator runs with ``--http``; its page address is announced as soon as it listens (so
the split can be watched while artifacts move), the report follows, and the lab stays up
until SIGINT or SIGTERM (at any point) or its coordinator's exit, then is torn down like any
lab (``mesh_node.lab.lifetime``).
"""

from __future__ import annotations

import dataclasses
import math
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import trio

from mesh_node.lab.cluster import LabError, LabNode
from mesh_node.lab.lifetime import interrupted, run_until_signal, supervised
from mesh_node.lab.run import LabOptions, experiment, open_lab

PAGE_PREFIX: Final = "status-page "  # the line `mesh-node run --http` prints when serving
PAGE_TIMEOUT_S: Final = 30.0


async def page_url(node: LabNode, timeout_s: float = PAGE_TIMEOUT_S) -> str:
    """The status page address a lab node printed (its stdout, after ``listening ...``)."""
    stdout = node.root / "stdout"
    with trio.move_on_after(timeout_s):
        while True:
            for line in stdout.read_text(errors="replace").splitlines():
                if line.startswith(PAGE_PREFIX):
                    return line.removeprefix(PAGE_PREFIX).strip()
            if node.process is None or node.process.poll() is not None:
                break
            await trio.sleep(0.05)
    raise LabError(f"{node.spec.name} printed no status page address:\n{node.log_tail()}")


async def run_lab_with_page(
    options: LabOptions,
    http: str,
    *,
    on_page: Callable[[str], None],
    on_report: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Bring the lab up with the coordinator serving its page on ``http``, split, report, and
    keep it up until SIGINT/SIGTERM. The report gains ``status_page``."""
    previous = options.run_args

    def run_args(index: int) -> tuple[str, ...]:
        extra = previous(index) if previous else ()
        return (*extra, "--http", http) if index == 0 else extra

    options = dataclasses.replace(options, run_args=run_args)
    reports: list[dict[str, Any]] = []  # the report, once made (a signal may come first)
    root: list[Path] = []

    async def body() -> None:
        async with open_lab(options) as lab:  # stops every node, however the body ends
            root.append(lab.cluster.root)

            async def until_stopped() -> None:
                url = await page_url(lab.cluster.coordinator)
                on_page(url)
                report = await experiment(lab)
                report["status_page"] = url
                report["root"] = str(lab.cluster.root) if options.keep else None
                reports.append(report)
                on_report(report)
                await trio.sleep(math.inf)  # until a signal, or the coordinator's exit

            await supervised(lab.cluster, until_stopped)

    signum = await run_until_signal(body)
    if signum is None or not reports:
        raise interrupted(signum or signal.SIGINT, options.keep, root[0] if root else None)
    if options.serve and signum == signal.SIGINT:
        # Ctrl-C of a serving lab: exit 130 like a plain lab's; the report was
        # printed when it was made. A page-only lab (--http) exits 0 on a good report.
        raise KeyboardInterrupt
    return reports[0]
