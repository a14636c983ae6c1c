"""The soak, called by scripts/bench.py (section "soak"; ``--soak-s``,
default 1200): gemma3-270m over a 3-stage loopback split plus one spare (real processes, one
ggml thread per stage), two clients sending 64-token greedy completions back to back while a
random worker is SIGKILLed and started again with its own config every 30-90 s
(tests/support/soaktools.py). Kills and restarts only: link partitions come with the WAN relay
harness (issue "The mesh on real networks").

Rows: requests served exactly / with a clear error / wrong (must be 0), kills and failovers,
median and longest request, RSS and open file descriptors of every node at the start (after
warm-up) and at the end (flat within 10% expected for nodes never restarted), ghost peers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from benchlib import BenchContext, Row  # type: ignore[import-not-found]
from soaktools import soak  # type: ignore[import-not-found]

MODEL = "gemma3-270m"
PROMPT = "Once upon a time"
MAX_TOKENS = 64


def rows(ctx: BenchContext) -> list[Row]:
    from bench_stage import _package as stage_package  # type: ignore[import-not-found]

    duration = float(os.environ.get("SKIPPY_SOAK_S", "1200"))
    kill_every = (30.0, 90.0) if duration >= 300 else (duration / 8, duration / 4)
    root = ctx.work / "soak"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    result = soak(
        root,
        Path(stage_package(ctx)),
        duration_s=duration,
        kill_every_s=kill_every,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        warmup_s=10.0,
        budget="4GiB",
        n_ctx=512,
    )
    s = result.summary()

    def node_facts(which: dict[str, dict[str, int]]) -> str:
        return "; ".join(
            f"{name} {v['rss_kib'] // 1024} MiB {v['fds']} fds" for name, v in sorted(which.items())
        )

    errors = ", ".join(f"{k} {v}" for k, v in sorted(result.clear_errors.items())) or "none"
    return [
        (MODEL, f"soak: {s['seconds']:.0f} s, kills every {kill_every[0]:.0f}-"
         f"{kill_every[1]:.0f} s", f"{s['requests']} requests",
         f"exact {s['exact']}, clear errors ({errors}), wrong {s['wrong']} (target 0)"),
        (MODEL, "soak: kills / failovers", f"{s['kills']} / {s['failovers']}", ""),
        (MODEL, "soak: request time median / max", f"{s['median_request_s']} / "
         f"{s['max_request_s']} s", f"{MAX_TOKENS} greedy tokens, 2 clients"),
        (MODEL, "soak: RSS and fds at start (after warm-up)", node_facts(result.start), ""),
        (MODEL, "soak: RSS and fds at end", node_facts(result.end),
         "restarted nodes are new processes"),
        (MODEL, "soak: ghost peers at the end", str(s["ghosts"]), "target 0"),
    ]
