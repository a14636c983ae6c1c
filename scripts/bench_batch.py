"""Batched decode at the stage, called by scripts/bench.py (section "batch").

On gemma3-270m and SmolLM2-135M-Instruct, the whole model as one ggml stage, 2 threads, in one
child process per model: 4 sessions' one-position steps in one graph (``decode_batch``) against
one session's ``decode`` step, interleaved step by step so machine noise hits all three alike:

- one session's step;
- 4 sessions' step with every weight broadcast over the batch (the layout before: each column
  through the one-session GEMV, sharing only the weight reads);
- 4 sessions' step as built now: weights whose type this ggml multiplies exactly as a
  ``[k, B]`` matrix take the batch as one (``skippy.runtime.batch_layout``).

Each 4-session figure is also given as throughput: 4 x one step / the batched step (the
serve section's "4 concurrent requests" row is this plus the HTTP path; its target is 2x).
Outputs are checked equal between the two batched forms and each session alone.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import ROOT, BenchContext, Row, gemma_package, spread  # type: ignore[import-not-found]

SESSIONS = 4
STEPS = 24  # per round, each measured for the three forms in turn
MODELS = {"gemma3-270m": "0..18", "SmolLM2-135M": "0..30"}


def rows(ctx: BenchContext) -> list[Row]:
    from bench_speculative import smollm_package  # type: ignore[import-not-found]

    pkgs = {"gemma3-270m": gemma_package(ctx), "SmolLM2-135M": smollm_package(ctx)}
    out: list[Row] = []
    for model, layers in MODELS.items():
        r = _child(str(pkgs[model]), layers, str(ctx.runs))
        one, old, new = r["one"], r["broadcast"], r["gemm"]
        out.append((model, "batch: one session's decode step (ms)", spread(one, fmt="{:.1f}"),
                    "2 threads, whole model as one stage"))
        for label, series, key in (
            ("every weight broadcast (before)", old, "broadcast_ratio"),
            ("exact [k, B] GEMM where checked", new, "gemm_ratio"),
        ):
            ratio = r[key]
            out.append((
                model, f"batch: {SESSIONS} sessions' step, {label} (ms)",
                spread(series, fmt="{:.1f}"),
                f"{spread(ratio, fmt='{:.2f}')} x one step = "
                f"{SESSIONS / statistics.median(ratio):.2f}x throughput (target >= 2x)",
            ))
        out.append((model, "batch: layouts of the 4-session graph's weight matmuls",
                    f"{r['gemm_matmuls']} [k, B] / {r['broadcast_matmuls']} broadcast",
                    f"exact widths per type: {r['exact']}; outputs equal alone: {r['equal']}"))
    return out


def _child(pkg: str, layers: str, runs: str) -> dict[str, Any]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), "child", pkg, layers, runs],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )
    if proc.returncode != 0:
        raise SystemExit(f"bench_batch child failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def child(pkg: str, layers: str, runs: int) -> dict[str, Any]:
    from skippy.gguf.ggml import configure_openmp

    configure_openmp()
    import numpy as np
    from bench_stage import _stage_loads  # type: ignore[import-not-found]

    from skippy.runtime.ggml_engine import GgmlStage
    from skippy.runtime.stage import DecodeStep, StageConfig

    load = _stage_loads(pkg, (layers,))[0]
    cfg = StageConfig(n_ctx=1024, n_threads=2, max_sessions=2 * SESSIONS)
    stages = {"one": GgmlStage(load, cfg), "broadcast": GgmlStage(load, cfg),
              "gemm": GgmlStage(load, cfg)}
    stages["broadcast"]._gemm_exact = {}  # no width of any type: every weight broadcast
    names = [f"s{i}" for i in range(SESSIONS)]
    prompt = np.array([2, 651, 6037, 576, 6081, 603], dtype=np.int32)
    for st in stages.values():
        for i, n in enumerate(names):
            st.prefill(n, 0, prompt + i)
    pos = {k: {n: len(prompt) for n in names} for k in stages}
    series: dict[str, list[float]] = {k: [] for k in stages}
    equal = True
    for _ in range(runs):
        times: dict[str, list[float]] = {k: [] for k in stages}
        for step in range(STEPS):
            feed = {n: np.array([1000 + 17 * step + i], dtype=np.int32)
                    for i, n in enumerate(names)}
            outs = {}
            for key, st in stages.items():
                if key == "one":
                    t0 = time.perf_counter()
                    alone = [st.decode(n, pos[key][n], feed[n]) for n in names[:1]]
                    times[key].append(time.perf_counter() - t0)
                    for n in names[1:]:  # untimed: the others' logits alone, for the check
                        alone.append(st.decode(n, pos[key][n], feed[n]))
                    outs[key] = [o.logits for o in alone]
                else:
                    steps = [DecodeStep(n, pos[key][n], feed[n]) for n in names]
                    t0 = time.perf_counter()
                    res = st.decode_batch(steps)
                    times[key].append(time.perf_counter() - t0)
                    outs[key] = [o.logits for o in res]
                for n in names:
                    pos[key][n] += 1
            equal &= all(
                np.array_equal(a, b) and np.array_equal(a, c)
                for a, b, c in zip(outs["one"], outs["broadcast"], outs["gemm"], strict=True)
            )
        for k, v in times.items():
            series[k].append(1000 * statistics.median(v))
        for st in stages.values():  # the next round starts at the prompt again
            for n in names:
                st.truncate(n, len(prompt))
        pos = {k: {n: len(prompt) for n in names} for k in stages}
    g = stages["gemm"].g
    bg = next(iter(stages["gemm"]._batch_graphs.values()))
    exact = {g.ggml_type_name(t).decode(): sorted(w) for t, w in stages["gemm"]._gemm_exact.items()}
    return {
        "one": series["one"],
        "broadcast": series["broadcast"],
        "gemm": series["gemm"],
        "broadcast_ratio": [b / a for a, b in zip(series["one"], series["broadcast"], strict=True)],
        "gemm_ratio": [b / a for a, b in zip(series["one"], series["gemm"], strict=True)],
        "gemm_matmuls": bg.gemm_matmuls,
        "broadcast_matmuls": bg.broadcast_matmuls,
        "exact": ", ".join(f"{k} {v[0]}..{v[-1]}" if v else f"{k} none" for k, v in exact.items()),
        "equal": equal,
    }


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
    else:
        raise SystemExit("usage: bench_batch.py child PKG LAYERS RUNS (run through scripts/bench)")
