""""delta": a revision changing one layer moves only that layer's bytes.

``mesh-node lab --nodes 3 --package <gemma3 package> --revision-change 9`` (real processes on
loopback, through ``mesh_node.lab.run.run_lab``): the first split moves every worker's stage,
the second (layer 9 changed) only that layer; the rest is linked from the first revision in
each worker's cache. Bytes are exact (the lab's report); times are side by side in one run.
"""

from __future__ import annotations

import statistics
from typing import Any

import trio
from benchlib import BenchContext, Row, gemma_package, spread  # type: ignore[import-not-found]

from mesh_node.lab.run import LabOptions, run_lab

LAYER = 9
MB = 1e6


def _once(ctx: BenchContext, pkg: str) -> dict[str, Any]:
    options = LabOptions(nodes=3, package=pkg, revision_change=LAYER, timeout_s=600.0)
    report: dict[str, Any] = trio.run(run_lab, options)
    if not report["ok"]:
        raise SystemExit(f"delta bench: the lab failed: {report['problems']}")
    return report


def rows(ctx: BenchContext) -> list[Row]:
    pkg = str(gemma_package(ctx))
    reports = [_once(ctx, pkg) for _ in range(max(1, min(ctx.runs, 3)))]
    first = [r["first_revision"] for r in reports]
    change = reports[-1]["revision_change"]
    moved1 = first[-1]["totals"]["peer_bytes"] + first[-1]["totals"]["hub_bytes"]
    moved2 = [r["revision_change"]["moved_bytes"] for r in reports]
    t1 = [f["seconds"] for f in first]
    t2 = [r["seconds"] for r in reports]
    label = "gemma3, 3 nodes"
    met = all(r["revision_change"]["only_the_change_moved"] for r in reports)
    return [
        (
            label,
            f"delta: workers received, revision 1 vs revision 2 (layer {LAYER} changed)",
            f"{moved1 / MB:.1f} MB vs {statistics.median(moved2) / MB:.2f} MB (+ manifest)",
            f"layer {LAYER} is {change['changed_bytes'] / MB:.2f} MB on "
            f"{change['workers_holding_it']} worker(s): only that layer's bytes moved: "
            + ("**met**" if met else "**not met**"),
        ),
        (
            label,
            "delta: split ready, revision 1 vs revision 2 (s)",
            f"{spread(t1, fmt='{:.2f}')} vs {spread(t2, fmt='{:.2f}')}",
            f"{statistics.median(t2) / statistics.median(t1):.2f}x; other artifacts "
            f"'cache (revision {', '.join(change['cached_from_revisions'])})'",
        ),
    ]
