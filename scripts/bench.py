"""Benchmarks for the issues' performance targets (run through scripts/bench).

Sections live in their own modules (``bench_<name>.py`` with ``rows(ctx) -> list[Row]``);
``--only a,b`` runs some of them. Every figure is a ratio measured side by side in one run
(these machines are noisy), the median of N runs with its spread. Peak RSS is measured in a
child process. Tests never time anything; this script is where speed is measured.
``--record`` appends the run (date, machine, sections, rows) to docs/perf/runs.jsonl and
redraws the charts docs/performance.md shows (``perf_history``); ``--charts`` only redraws them.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
from pathlib import Path

import perf_history  # type: ignore[import-not-found]
from benchlib import ROOT, BenchContext, Row, machine, render  # type: ignore[import-not-found]

# name -> module; order is the order of the table. A section needing the package rows' output
# (consumer reads the gemma3 package written by "package") comes after it.
SECTIONS: dict[str, str] = {
    "package": "bench_package",
    "consumer": "bench_consumer",
    "transfer": "bench_transfer",
    "mesh": "bench_mesh",
    "quantize": "bench_quantize",
    "stage": "bench_stage",
    "moe": "bench_moe",  # a mid-sized synthetic MoE's stage vs llama.cpp, and its 3-stage chain
    "families": "bench_families",  # the MoE giants' mid-sized synthetic stages vs llama.cpp
    "transfer-mesh": "bench_transfer_mesh",
    "link": "bench_link",  # mesh stream and verified transfer vs raw, each way
    "hop": "bench_hop",  # one 2.5 KiB decode frame's one-way latency vs raw
    "floor": "bench_floor",  # 3 stage processes over plain sockets vs one
    "serve": "bench_serve",  # reuses the stage section's gemma3 package
    "wan": "bench_wan",  # emulated WAN links (reuses the stage section's package)
    "threads": "bench_threads",  # threads = "auto" on one host
    "soak": "bench_soak",  # kills and restarts under load (--soak-s)
    "delta": "bench_delta",  # a revision changing one layer moves only that layer
    "adversary": "bench_adversary",  # hostile peers against one `mesh-node run`
    "speculative": "bench_speculative",  # n-gram speculation, exact vs batched verify
    "swarm": "bench_swarm",  # swarm fetch vs coordinator-only, chunk overhead
    "batch": "bench_batch",  # 4 sessions' decode step vs one, at the stage
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gemma", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--big-bytes", type=int, default=2 * 1024**3)
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated sections: " + ", ".join(SECTIONS))
    ap.add_argument(
        "--record",
        action="store_true",
        help="append the run to docs/perf/runs.jsonl and redraw the charts",
    )
    ap.add_argument(
        "--charts", action="store_true", help="only redraw docs/perf/*.png from the history"
    )
    ap.add_argument("--soak-s", type=float, default=1200.0, help="the soak's duration (s)")
    ap.add_argument(
        "--no-warm", action="store_true", help="skip touching free memory once before the sections"
    )
    args = ap.parse_args()
    if args.charts:
        for p in perf_history.draw_all():
            print(p.relative_to(ROOT))
        return 0
    os.environ["SKIPPY_SOAK_S"] = str(args.soak_s)
    wanted = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; known: {list(SECTIONS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    warmed = "" if args.no_warm else warm_memory()
    ctx = BenchContext(args.gemma, args.work, args.runs, args.big_bytes, args.skip_big)
    rows: list[Row] = []
    for name in wanted:
        module = importlib.import_module(SECTIONS[name])
        rows += module.rows(ctx)
        print(render(rows), flush=True)
    table = render(rows)
    header = (
        f"### {datetime.date.today().isoformat()} — {machine()}\n\n"
        f"Sections: {', '.join(wanted)}. Median of {args.runs} runs (spread min..max where "
        f"shown), warm page cache.{warmed}\n"
    )
    print("\n" + header + "\n" + table)
    if args.record:
        perf_history.append_run(
            {
                "date": datetime.date.today().isoformat(),
                "title": f"{machine()} — {', '.join(wanted)}",
                "notes": [
                    f"Median of {args.runs} runs (spread min..max where shown), warm page "
                    f"cache.{warmed}"
                ],
                "rows": [
                    {"model": a, "measurement": b, "value": c, "note": d} for a, b, c, d in rows
                ],
            }
        )
        perf_history.draw_all()
        print(f"\nrecorded in {perf_history.HISTORY}; charts redrawn in {perf_history.CHART_DIR}")
    print(json.dumps({"rows": rows}), file=sys.stderr)
    return 0


# A fresh VM backs its memory on first touch: new pages cost ~363 MB/s here until the guest has
# touched them once, then ~4 GB/s (docs/performance.md, "A fresh VM pays for the first touch").
# Touching free memory once, in a child that then exits, gives the sections memory the host has
# backed. The effect fades: this VM hands idle memory back (a DAMON kdamond runs a pageout
# scheme), so 14 GiB touched cost the full time again minutes later. Bounded: at most
# WARM_MAX_BYTES (~23 s on a fresh VM), leaving WARM_LEAVE_BYTES free.
WARM_MAX_BYTES = 8 * 2**30
WARM_LEAVE_BYTES = 3 * 2**30


def warm_memory() -> str:
    """Touch free memory once (a child process); the header's sentence about it."""
    import subprocess
    import time

    avail = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            avail = int(line.split()[1]) * 1024
    size = min(WARM_MAX_BYTES, avail - WARM_LEAVE_BYTES)
    if size <= 0:
        return ""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", f"import numpy; numpy.ones({size}, dtype=numpy.uint8)"],
        check=True,
        timeout=600,
    )
    took = time.perf_counter() - start
    print(f"==> warmed {size / 2**30:.1f} GiB of memory in {took:.1f} s", file=sys.stderr)
    return (
        f" Free memory warmed first ({size / 2**30:.1f} GiB touched once in {took:.1f} s: a fresh"
        " VM backs its pages on first touch)."
    )


if __name__ == "__main__":
    raise SystemExit(main())
