"""Swarm fetch: ``mesh-node run`` processes on loopback (``mesh_node.lab``).

Capped rows, the issue's setup: one coordinator and 6 workers, every node's serving rate capped
at 40 MiB/s (``artifact_serve_bytes_per_s``, standing for an uplink), 2 replicas of the gemma3
split served by the coordinator (``mesh-node lab --nodes 7 --replicas 2``: stage 0 on the
coordinator, shared by both replicas, and 3 worker stages per replica, so every worker stage's
files are needed by 2 workers and the tied embeddings by the 2 last stages). Time from the
first worker's stage fetch starting to the last one ready (every worker), the MB each node
served and the largest share against the average, coordinator-only (every node
``swarm_transfer = false``) against swarm. One fresh lab per run.

Chunk verification overhead: the embeddings (178 MB) needed by worker B of a 2-node lab, from
the coordinator alone, no rate cap (the same sender work in both modes; a second sender would
add its own CPU on these 2 cores). Its rate as B records it, one chunk checked against the
manifest's SHA-256 (the coordinator's ``swarm_transfer = false``: no signed list) against
8 MiB chunks each checked on arrival along the coordinator's signed SHA-256 chain (a swarm of
one), the two modes alternating per transfer in one lab (both nodes restarted, B with an empty
cache, each time), 2 x runs transfers per mode.
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path
from typing import Any

import trio
from benchlib import BenchContext, Row, gemma_package, spread  # type: ignore[import-not-found]

from mesh_node.lab.run import LabOptions, open_lab

MIB = 1 << 20
RATE = 40 * MIB  # every node's artifact_serve_bytes_per_s in the capped runs (the issue's)
NODES = 7
REPLICAS = 2
EMBEDDINGS = "shared/embeddings.gguf"


async def _wait_ready(node: Any, topology_id: str) -> dict[str, Any]:
    with trio.fail_after(600):
        while True:
            status = await node.status()
            stage = status["transfers"]["stage"] or {}
            if stage.get("topology_id") == topology_id and stage.get("state") == "failed":
                raise SystemExit(f"the worker's stage failed: {stage}")
            if stage.get("topology_id") == topology_id and stage.get("state") == "ready":
                return dict(status)
            await trio.sleep(0.05)


def _abba(pairs: int) -> list[str]:
    """The modes' order, ABBA then BAAB: a drift of the machine's speed within the run hits
    both modes alike, and neither always goes first."""
    out: list[str] = []
    for i in range(pairs):
        out += ["chunks", "whole"] if i % 2 == 0 else ["whole", "chunks"]
    return out


async def _interleaved(package: Path, work: Path, pairs: int) -> dict[str, list[float]]:
    """The chunk-overhead rows: one 2-node lab, no rate cap. Worker B fetches the embeddings
    from the coordinator alone, as one chunk (the coordinator's ``swarm_transfer`` off: no
    signed list) or in 8 MiB chunks each checked against the coordinator's signed list (on),
    the modes alternating per transfer: both nodes are restarted, B with an empty cache, the
    coordinator's ``swarm_transfer`` flipped each time. The first transfer (chunks: the
    coordinator's digests are computed then) is a warm-up."""
    root = work / "swarm-lab-overhead"
    shutil.rmtree(root, ignore_errors=True)
    config: dict[str, Any] = {"swarm_transfer": True, "artifact_serve_bytes_per_s": 0}
    options = LabOptions(nodes=2, package=str(package), transfer="open", root=root,
                         timeout_s=600, node_overrides={0: config, 1: config})
    out: dict[str, list[float]] = {"whole": [], "chunks": []}
    async with open_lab(options) as lab:
        cluster = lab.cluster
        coordinator, fresh = cluster.nodes
        for i, mode in enumerate(["chunks", *_abba(pairs)]):
            await cluster.stop(fresh.index)
            await cluster.stop(coordinator.index)
            shutil.rmtree(fresh.hub_cache_dir, ignore_errors=True)
            shutil.rmtree(fresh.root / "cache", ignore_errors=True)
            text = coordinator.config_path.read_text()
            on = "true" if mode == "chunks" else "false"
            for was in ("true", "false"):
                text = text.replace(f"swarm_transfer = {was}", f"swarm_transfer = {on}")
            coordinator.config_path.write_text(text)
            await cluster.start(coordinator.index)
            await cluster.start(fresh.index)
            await cluster.wait_meshed(60)
            response = await coordinator.request(
                {"op": "topology", "package": lab.package.ref, "stages": 1,
                 "include_self": False},
                timeout_s=120,
            )
            status = await _wait_ready(fresh, response["topology"]["topology_id"])
            for rec in status["transfers"]["recent"]:
                if rec["path"] == EMBEDDINGS and rec["direction"] == "fetch":
                    if i:
                        out[mode].append(rec["mb_per_s"])
                    break
    return out


async def _replica_run(package: Path, work: Path, label: str, *, swarm: bool) -> dict[str, Any]:
    """One fresh 7-node lab serving 2 replicas: every worker's fetch, the bytes served."""
    root = work / f"swarm-lab-{label}"
    shutil.rmtree(root, ignore_errors=True)
    config: dict[str, Any] = {"swarm_transfer": swarm, "artifact_serve_bytes_per_s": RATE}
    options = LabOptions(
        nodes=NODES, package=str(package), transfer="open", root=root, timeout_s=600,
        node_overrides={i: config for i in range(NODES)}, serve=True, replicas=REPLICAS,
    )
    async with open_lab(options) as lab:
        cluster = lab.cluster
        await cluster.wait_meshed(60)
        before = [(await n.status())["transfers"]["counters"]["served_bytes"]
                  for n in cluster.nodes]
        await lab.start_serving()
        statuses = [await n.status() for n in cluster.nodes]
    stages = [s["transfers"]["stage"] for s in statuses[1:]]
    if any(not st or st.get("state") != "ready" for st in stages):
        raise SystemExit(f"a worker's stage is not ready: {stages}")
    served = [s["transfers"]["counters"]["served_bytes"] - b
              for s, b in zip(statuses, before, strict=True)]
    sources = [len(r.get("served_by") or ()) for s in statuses[1:]
               for r in s["transfers"]["recent"]
               if r["path"] == EMBEDDINGS and r["direction"] == "fetch"]
    return {
        "ready_s": max(st["finished"] for st in stages) - min(st["started"] for st in stages),
        "served": served,
        "embedding_sources": max(sources, default=0),
    }


def rows(ctx: BenchContext) -> list[Row]:
    package = gemma_package(ctx)
    label = "gemma3 swarm"
    capped: dict[str, list[dict[str, Any]]] = {"coordinator": [], "swarm": []}
    for i in range(ctx.runs):  # alternating, so load changes hit both modes alike
        for mode in ("coordinator", "swarm"):
            capped[mode].append(trio.run(lambda m=mode, k=i: _replica_run(
                package, ctx.work, f"replicas-{m}-{k}", swarm=m == "swarm")))
    # The overhead rows: the modes alternate per transfer in one lab (alternating per lab,
    # the machine's drift of ~20% within an hour here swamped a 5% goal).
    free = trio.run(_interleaved, package, ctx.work, 2 * ctx.runs)
    coord_t = [r["ready_s"] for r in capped["coordinator"]]
    swarm_t = [r["ready_s"] for r in capped["swarm"]]
    ratio = [s / c for s, c in zip(swarm_t, coord_t, strict=True)]  # side by side, per pair

    def served(mode: str) -> tuple[str, str]:
        per_node = [statistics.median(r["served"][i] for r in capped[mode]) / 1e6
                    for i in range(NODES)]
        peak = [max(r["served"]) / (sum(r["served"]) / NODES) for r in capped[mode]]
        return " / ".join(f"{x:.0f}" for x in per_node), spread(peak)

    coord_served, coord_peak = served("coordinator")
    swarm_served, swarm_peak = served("swarm")
    whole, chunked = free["whole"], free["chunks"]
    overhead = 1 - statistics.median(chunked) / statistics.median(whole)
    paired = [c / w for c, w in zip(chunked, whole, strict=True)]  # neighbours in time
    setup = f"{NODES} nodes, {REPLICAS} replicas, every node capped at {RATE // MIB} MiB/s"
    return [
        (label, f"every worker ready, coordinator only ({setup})", f"{spread(coord_t)} s", ""),
        (label, "every worker ready, swarm", f"{spread(swarm_t)} s",
         f"{spread(ratio)}x coordinator-only (goal <= 0.5)"),
        (label, "MB served per node (coordinator, then workers), coordinator only",
         coord_served, f"largest / average {coord_peak}"),
        (label, "MB served per node (coordinator, then workers), swarm", swarm_served,
         f"largest / average {swarm_peak} (goal <= 1.5); embeddings from at most "
         f"{max(r['embedding_sources'] for r in capped['swarm'])} nodes"),
        (label, f"embeddings to B, uncapped, from the coordinator alone: one chunk, no list "
         f"({len(whole)} transfers, alternating with the chunked ones in one lab)",
         f"{spread(whole, fmt='{:.0f}')} MB/s", ""),
        (label, "embeddings to B, uncapped, from the coordinator alone: 8 MiB chunks, each "
         "checked on arrival (SHA-256 chain; a swarm of one)",
         f"{spread(chunked, fmt='{:.0f}')} MB/s",
         f"{overhead * 100:+.1f}% slower than whole-file (goal <= 5%); per pair chunked / "
         f"whole-file {spread(paired, fmt='{:.2f}')}"),
    ]
