"""Split-serving rows, called by scripts/bench.py (section "serve").

On gemma3-270m, side by side in one run: a 3-node loopback split (`mesh-node serve` + two
`mesh-node run` workers, real processes) vs the same runtime as one stage (`mesh-node serve
--stages 1`: the same code path, HTTP included), both up at once and asked in turn, request
by request, so machine noise hits both:

- decode tok/s (32 greedy tokens) and prefill tok/s (a 512-token prompt), split / single;
- time to first token (the 512-token prompt);
- per-hop decode round trip: a one-token decode frame to its ack, which the receiving stage
  sends once the step's output is on its way (so it includes that stage's step), per hop
  (median of the single requests' frames, taken before the concurrent ones);
- prefill overlap: the stages' summed compute time during the 512-token prefills over their
  wall time (> 1: stage i+1 computed while stage i did, the chunked prefill's pipelining);
- 4 concurrent requests: aggregate decode tok/s vs one request, 1 stage and split (each stage
  batches the sessions' decode steps into one graph, target >= 2x); both
  rates are completion tokens over the wall time of the request(s), taken in turn per run;
  the split also as users run it by default (`threads = "auto"`: the cores shared among the
  stages on this host, so three stages computing at once do not oversubscribe 2 cores), in
  its own cluster after the others have stopped;
- peak RSS per stage process (VmHWM) vs its artifact bytes + KV of its sessions.

Every stage runs ggml with 2 threads (the machine's cores; the stages of a split mostly take
turns, so each may use both), except the "auto" split of the concurrency rows.
"""

from __future__ import annotations

import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from benchlib import BenchContext, Row, spread  # type: ignore[import-not-found]
from servetools import http, split_cluster, wait_ready  # type: ignore[import-not-found]

THREADS = 2
N_CTX = 1024
CHUNK = 128
DECODE_TOKENS = 32
PREFILL_TOKENS = 512
CONCURRENT = 4
MODEL = "gemma3-270m"


def _package(ctx: BenchContext) -> Path:
    from bench_stage import _package as stage_package  # type: ignore[import-not-found]

    return Path(stage_package(ctx))


def _complete(api: str, prompt: Any, max_tokens: int) -> dict[str, Any]:
    status, doc = http(
        "POST",
        f"{api}/completions",
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout_s=300,
    )
    if status != 200:
        raise SystemExit(f"bench serve: {status} {doc}")
    return dict(doc)


def _long_prompt() -> list[int]:
    # ordinary text tokens (ids of gemma's vocabulary well inside the range, no control ids)
    return [2] + [1000 + (i * 7919) % 200_000 for i in range(PREFILL_TOKENS - 1)]


def _vmhwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rows(ctx: BenchContext) -> list[Row]:
    pkg = _package(ctx)
    root = ctx.work / "serve"
    kw = {"budget": "4GiB", "n_ctx": N_CTX, "chunk": CHUNK, "threads": THREADS, "sessions": 4}
    shutil.rmtree(root, ignore_errors=True)  # fresh keys and node state every run
    for sub in ("single", "split", "split-auto"):
        (root / sub).mkdir(parents=True)
    with (
        split_cluster(root / "single", pkg, workers=0, stages=1, **kw) as single,
        split_cluster(root / "split", pkg, workers=2, stages=3, **kw) as split,
    ):
        wait_ready(single.api, 300)
        wait_ready(split.api, 300)
        prompt = "The capital of France is"
        long = _long_prompt()
        dec: dict[str, list[float]] = {"single": [], "split": []}
        pre: dict[str, list[float]] = {"single": [], "split": []}
        ttft: dict[str, list[float]] = {"single": [], "split": []}
        busy0 = _busy(split)
        wall = 0.0
        for _ in range(ctx.runs):
            for name, cluster in (("single", single), ("split", split)):
                d = _complete(cluster.api, prompt, DECODE_TOKENS)
                n = d["usage"]["completion_tokens"]
                dec[name].append((n - 1) / d["timings"]["decode_s"])
                before = _busy(cluster) if name == "split" else 0.0
                p = _complete(cluster.api, long, 1)
                pre[name].append(PREFILL_TOKENS / p["timings"]["prefill_s"])
                ttft[name].append(p["timings"]["ttft_s"])
                if name == "split":
                    wall += p["timings"]["prefill_s"]
                    busy0 += _busy(cluster) - before
        overlap = busy0 / wall if wall else float("nan")
        # before the concurrent requests: their frames wait for each other's steps
        hops = _hops(split)
        # concurrency: 4 requests at once vs one, whole and split, in turn per run
        clusters = (("single", single), ("split", split))
        ones: dict[str, list[float]] = {"split_auto": []}
        aggs: dict[str, list[float]] = {"split_auto": []}
        batched = _concurrency(clusters, prompt, ctx.runs, ones, aggs)
        rss = _rss(split)
    # The split as users run it by default, on its own (three more idle nodes beside the
    # clusters above would disturb their 2-thread barriers): its ratio is its own, in turn.
    auto_kw = {**kw, "threads": '"auto"'}
    with split_cluster(root / "split-auto", pkg, workers=2, stages=3, **auto_kw) as split_auto:
        wait_ready(split_auto.api, 300)
        batched |= _concurrency((("split_auto", split_auto),), prompt, ctx.runs, ones, aggs)
    ratio_dec = statistics.median(dec["split"]) / statistics.median(dec["single"])
    ratio_pre = statistics.median(pre["split"]) / statistics.median(pre["single"])
    out: list[Row] = [
        (MODEL, "serve: decode tok/s, 1 stage (mesh-node serve --stages 1)",
         spread(dec["single"], fmt="{:.1f}"), f"{DECODE_TOKENS} greedy tokens, {THREADS} threads"),
        (MODEL, "serve: decode tok/s, 3-node loopback split", spread(dec["split"], fmt="{:.1f}"),
         f"{ratio_dec:.2f}x single (target >= 0.85x)"),
        (MODEL, f"serve: prefill tok/s ({PREFILL_TOKENS} tokens), 1 stage",
         spread(pre["single"], fmt="{:.1f}"), ""),
        (MODEL, f"serve: prefill tok/s ({PREFILL_TOKENS} tokens), 3-node split",
         spread(pre["split"], fmt="{:.1f}"),
         f"{ratio_pre:.2f}x single (target >= 0.9x); chunks of {CHUNK}"),
        (MODEL, f"serve: time to first token ({PREFILL_TOKENS}-token prompt), 1 stage / split",
         f"{spread(ttft['single'], 1000, '{:.0f}')} / {spread(ttft['split'], 1000, '{:.0f}')}",
         "ms"),
        (MODEL, "serve: prefill overlap (stage compute / wall)", f"{overlap:.2f}",
         "> 1: stages computed chunks concurrently"),
        (MODEL, "serve: per-hop decode frame round trip (to its ack: after the next stage's step)",
         "; ".join(f"{k}: {v}" for k, v in hops.items()), "ms, median"),
    ]
    for name, label in (
        ("single", "1 stage"),
        ("split", "3-node split"),
        ("split_auto", '3-node split, threads = "auto"'),
    ):
        one_rate, agg = statistics.median(ones[name]), statistics.median(aggs[name])
        out.append(
            (MODEL, f"serve: {CONCURRENT} concurrent requests, aggregate decode tok/s, {label}",
             spread(aggs[name], fmt="{:.1f}"),
             f"{agg / one_rate:.2f}x one request ({spread(ones[name], fmt='{:.1f}')}; "
             f"target >= 2x); {batched[name]} over all stages")
        )
    for name, (peak, rise, budget) in rss.items():
        out.append(
            (MODEL, f"serve: peak RSS, {name}: process / rise over the node before loading",
             f"{peak:.0f} / {rise:.0f} MiB",
             f"rise {rise / budget:.2f}x artifact + KV of {CONCURRENT} sessions "
             f"({budget:.0f} MiB; target <= 1.5x)")
        )
    return out


def _busy(cluster: Any) -> float:
    total = 0.0
    for proc in cluster.procs:
        doc = _status_of(cluster, proc.name)
        stage = doc.get("stage") or {}
        total += float(stage.get("compute_busy_s") or 0.0)
    return total


def _status_of(cluster: Any, name: str) -> dict[str, Any]:
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "mesh_node", "status", "--json", "--config",
         str(cluster.root / f"{name}.toml")],
        capture_output=True, text=True, check=True,
    )
    return dict(json.loads(out.stdout))


def _hops(cluster: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for proc in cluster.procs:
        stage = _status_of(cluster, proc.name).get("stage") or {}
        for hop in (stage.get("hops") or {}).values():
            out[f"stage {stage['stage_index']}->{stage['stage_index'] + 1}"] = hop[
                "decode_ack_rtt_ms_median"
            ]
    return dict(sorted(out.items()))


def _rss(cluster: Any) -> dict[str, tuple[float, float, float]]:
    """Per stage: (peak RSS of the process, its rise over the process just before the stage
    loaded, artifact bytes + KV of CONCURRENT sessions), MiB."""
    out = {}
    for proc in cluster.procs:
        stage = _status_of(cluster, proc.name).get("stage") or {}
        held = stage["artifact_bytes"] + CONCURRENT * (stage["kv_bytes_per_session"] or 0)
        peak = _vmhwm_mib(proc.popen.pid)
        before = (stage.get("rss_before_load_kib") or 0) / 1024
        out[f"stage {stage['stage_index']} ({stage['layer_start']}..{stage['layer_end']})"] = (
            peak,
            peak - before,
            held / 2**20,
        )
    return dict(sorted(out.items()))


def _batched(cluster: Any) -> str:
    """Decode steps run in batches of two or more, and those batches, over every stage."""
    steps = batches = 0
    for proc in cluster.procs:
        stage = _status_of(cluster, proc.name).get("stage") or {}
        steps += int(stage.get("batched_decode_steps") or 0)
        batches += int(stage.get("decode_batches") or 0)
    return f"{steps} steps in {batches} batched graphs"


def _concurrency(
    clusters: tuple[tuple[str, Any], ...],
    prompt: str,
    runs: int,
    ones: dict[str, list[float]],
    aggs: dict[str, list[float]],
) -> dict[str, str]:
    """One request, then ``CONCURRENT`` at once, per cluster in turn, ``runs`` times (into
    ``ones`` and ``aggs``); each cluster's batched steps."""
    for name, _ in clusters:
        ones.setdefault(name, [])
        aggs.setdefault(name, [])
    for _ in range(runs):
        for name, cluster in clusters:
            ones[name].append(_concurrent(cluster.api, prompt, 1))
            aggs[name].append(_concurrent(cluster.api, prompt, CONCURRENT))
    return {name: _batched(c) for name, c in clusters}


def _concurrent(api: str, prompt: str, n: int) -> float:
    """Completion tokens per second of wall time for ``n`` requests at once."""
    results: list[dict[str, Any]] = []

    def one() -> None:
        results.append(_complete(api, prompt, DECODE_TOKENS))

    threads = [threading.Thread(target=one) for _ in range(n)]
    start = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - start
    return sum(r["usage"]["completion_tokens"] for r in results) / wall
