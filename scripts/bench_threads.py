"""Threads that fit the host, called by scripts/bench.py (section
"threads"): the documented manual setup, three `mesh-node` processes on this one host
(`serve` + two `run` workers, gemma3-270m), decoding 32 greedy tokens with the default
`[serving] threads` ("auto": cores / co-located stages), beside the old fixed default of 2
threads per stage and beside `mesh-node lab`'s choice (cores / nodes, written explicitly).
The three splits are up one after the other (six stage processes at once would measure
contention, not the setting); each is asked ``ctx.runs`` times."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

from benchlib import BenchContext, Row, spread  # type: ignore[import-not-found]
from servetools import http, split_cluster, wait_ready  # type: ignore[import-not-found]

MODEL = "gemma3-270m"
TOKENS = 32


def _decode_rate(api: str) -> float:
    t0 = time.perf_counter()
    status, doc = http("POST", f"{api}/completions",
                       {"prompt": "Once upon a time", "max_tokens": TOKENS, "temperature": 0},
                       timeout_s=300)
    if status != 200:
        raise SystemExit(f"bench threads: {status} {doc}")
    return float(doc["usage"]["completion_tokens"]) / (time.perf_counter() - t0)


def rows(ctx: BenchContext) -> list[Row]:
    from bench_stage import _package as stage_package  # type: ignore[import-not-found]

    pkg = Path(stage_package(ctx))
    lab_threads = max(1, (os.cpu_count() or 1) // 3)
    setups = {"auto (default)": '"auto"', "fixed 2 (old default)": "2",
              f"lab's choice ({lab_threads})": str(lab_threads)}
    rates: dict[str, list[float]] = {}
    for name, threads in setups.items():
        root = ctx.work / "threads" / name.split()[0]
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        with split_cluster(root, pkg, workers=2, stages=3, threads=threads, budget="4GiB",
                           n_ctx=512) as cluster:
            wait_ready(cluster.api, 300)
            _decode_rate(cluster.api)  # warm
            rates[name] = [_decode_rate(cluster.api) for _ in range(ctx.runs)]
    lab = statistics.median(rates[f"lab's choice ({lab_threads})"])
    return [
        (MODEL, f"threads: 3 nodes on one host, decode tok/s, {name}",
         spread(r, fmt="{:.1f}"), f"{statistics.median(r) / lab:.2f}x the lab's choice"
         + (" (target >= 0.9x)" if name.startswith("auto") else ""))
        for name, r in rates.items()
    ]
