"""Peer transfer over the mesh: coordinator and worker as separate
``mesh-node run`` processes on loopback (``mesh_node.lab``), in one run beside raw
trio-websocket bulk throughput in the same direction (listener to dialer, child processes;
with glibc's malloc defaults and with the allocator tuning ``mesh-node run`` applies, see
``bench_mesh``) and ``hashlib.file_digest(sha256)`` of the same file.

The figure is the worker's own record of the artifact: from asking the coordinator to the
verified install (request, serve, Noise + multiplexed stream, hidden partial, SHA-256 while
writing, size and digest check, rename, snapshot link), in MB/s. Each run starts the worker
afresh with an empty cache and plans the split again; the first run only warms up (page cache,
the coordinator's verification record). The package is a small synthetic one whose layer 1
is the measured file (gemma3's largest artifact, then 1 GiB of random bytes), planned so the
worker's stage holds that layer; its other artifacts are a few KB. Peak RSS of each process
(``VmHWM``) is read after the 1 GiB runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

import trio
from bench_mesh import download_rates  # type: ignore[import-not-found]
from benchlib import (  # type: ignore[import-not-found]
    BenchContext,
    Row,
    gemma_package,
    hash_file,
    random_file,
    spread,
    times_of,
)

from mesh_node.lab.cluster import peak_rss_bytes
from mesh_node.lab.run import LabOptions, open_lab
from skippy.constants import MANIFEST_NAME
from skippy.package.manifest import dump_manifest, parse_manifest, read_manifest_bytes

MIB = 1 << 20
SYNTH_BYTES = 1 << 30
BIG_LAYER = "layers/layer-00001.gguf"


def _template(work: Path) -> Path:
    """A 3-layer synthetic gemma-like package (tied embeddings; a few KB per artifact)."""
    import synth_gguf  # type: ignore[import-not-found]
    from pkgtools import make_package  # type: ignore[import-not-found]

    out = work / "meshxfer-template"
    if not (out / MANIFEST_NAME).exists():
        shutil.rmtree(out, ignore_errors=True)
        source = synth_gguf.gemma_like(work / "meshxfer-template.gguf", n_layers=3)
        make_package(source, out)
    return out


def _package(work: Path, label: str, big: Path, sha256: str, *, link: bool) -> Path:
    """The template with ``big`` as layer 1: hard-linked when this section owns the file (a
    link changes the file's ctime, which would void other sections' verification records),
    else copied."""
    template = _template(work)
    out = work / f"meshxfer-{label}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(template, out)
    (out / BIG_LAYER).unlink()
    if link:
        os.link(big, out / BIG_LAYER)
    else:
        shutil.copyfile(big, out / BIG_LAYER)
    m = parse_manifest(read_manifest_bytes(template))
    size = big.stat().st_size
    layer = dataclasses.replace(m.layer(1), artifact_bytes=size, tensor_bytes=size, sha256=sha256)
    layers = tuple(layer if x.layer_index == 1 else x for x in m.layers)
    (out / MANIFEST_NAME).write_bytes(dump_manifest(dataclasses.replace(m, layers=layers)))
    return out


async def _runs(package: Path, work: Path, label: str, runs: int) -> dict[str, Any]:
    root = work / f"meshxfer-lab-{label}"
    shutil.rmtree(root, ignore_errors=True)
    options = LabOptions(
        nodes=2,
        package=str(package),
        transfer="open",
        root=root,
        timeout_s=600,
        # The worker states the larger budget: the planner gives it the stage with the big layer.
        # (calibration off: the memory planner places by budget; the cost planner would not)
        node_overrides={
            0: {"memory_budget": "1GiB", "calibration": "off"},
            1: {"memory_budget": "16GiB", "calibration": "off"},
        },
    )
    rates: list[float] = []
    worker_rss: list[int] = []
    async with open_lab(options) as lab:
        coordinator, worker = lab.cluster.nodes
        for i in range(runs + 1):
            await lab.cluster.stop(1)
            if i:
                worker_rss.append(worker.peak_rss_bytes or 0)
            shutil.rmtree(worker.data_dir / "hub", ignore_errors=True)
            shutil.rmtree(worker.root / "cache", ignore_errors=True)
            await lab.cluster.start(1)
            await lab.cluster.wait_meshed(60)
            response = await coordinator.request(
                {"op": "topology", "package": lab.package.ref, "stages": 2, "include_self": True},
                timeout_s=120,
            )
            tid = response["topology"]["topology_id"]
            record = await _wait_record(worker, tid)
            if i:  # the first run warms up
                rates.append(record["mb_per_s"])
        coordinator_rss = peak_rss_bytes(coordinator.process.pid) if coordinator.process else None
        await lab.cluster.stop(1)
        worker_rss.append(worker.peak_rss_bytes or 0)
    return {"rates": rates, "worker_rss": max(worker_rss), "coordinator_rss": coordinator_rss}


async def _wait_record(worker: Any, topology_id: str) -> dict[str, Any]:
    with trio.fail_after(600):
        while True:
            status = await worker.status()
            stage = status["transfers"]["stage"] or {}
            if stage.get("topology_id") == topology_id and stage.get("state") == "failed":
                raise SystemExit(f"the worker's stage failed: {json.dumps(stage)}")
            if stage.get("topology_id") == topology_id and stage.get("state") == "ready":
                for rec in status["transfers"]["recent"]:
                    if rec["path"] == BIG_LAYER and rec["direction"] == "fetch":
                        if rec["source"] != "peer" or not rec["verified"]:
                            raise SystemExit(f"{BIG_LAYER} did not come from the peer: {rec}")
                        return dict(rec)
                raise SystemExit(f"the worker's stage has no {BIG_LAYER}: {stage}")
            await trio.sleep(0.05)


def _rows(label: str, big: Path, sha256: str, ctx: BenchContext, *, own: bool) -> list[Row]:
    size = big.stat().st_size
    package = _package(ctx.work, label.split()[0], big, sha256, link=own)
    t_hash = times_of(lambda: hash_file(big), ctx.runs)
    whole = size // MIB * MIB
    raw = download_rates("ws", whole, ctx.runs, tuned=False)
    raw_tuned = download_rates("ws", whole, ctx.runs, tuned=True)
    stream = download_rates("mesh", whole, ctx.runs)
    got = trio.run(_runs, package, ctx.work, label.split()[0], ctx.runs)
    mesh = got["rates"]
    ratios = [m / statistics.median(raw_tuned) for m in mesh]
    ratios_default = [m / statistics.median(raw) for m in mesh]
    out: list[Row] = [
        (label, f"sha256 (hashlib.file_digest) of {size / MIB:.0f} MiB", f"{spread(t_hash)} s",
         f"{size / statistics.median(t_hash) / 1e9:.2f} GB/s"),
        (label, "raw trio-websocket, listener to dialer, glibc malloc defaults",
         f"{spread(raw, fmt='{:.0f}')} MB/s", ""),
        (label, "raw trio-websocket, same, malloc tuned as mesh-node run",
         f"{spread(raw_tuned, fmt='{:.0f}')} MB/s", ""),
        (label, "mesh stream alone (Noise + mux, no files), same direction",
         f"{spread(stream, fmt='{:.0f}')} MB/s",
         f"{statistics.median(stream) / statistics.median(raw):.2f}x raw websocket as shipped; "
         f"{statistics.median(stream) / statistics.median(raw_tuned):.2f}x with the same "
         "malloc tuning"),
        (label, "verified peer transfer over the mesh (coordinator and worker processes)",
         f"{spread(mesh, fmt='{:.0f}')} MB/s",
         f"{spread(ratios_default, fmt='{:.2f}')}x raw websocket as shipped, malloc defaults "
         f"(target >= 0.6); {spread(ratios, fmt='{:.2f}')}x with the same malloc tuning; "
         f"{statistics.median(mesh) / statistics.median(stream):.2f}x the mesh stream"),
    ]
    if own:  # the 1 GiB rows: peak RSS of each process
        out.append(
            (label, "peak RSS during the transfer: coordinator / worker",
             f"{(got['coordinator_rss'] or 0) / MIB:.0f} / {got['worker_rss'] / MIB:.0f} MiB",
             "target <= 150 MiB each")
        )
    return out


def rows(ctx: BenchContext) -> list[Row]:
    from skippy.consume.preflight import load_package

    pkg_dir = gemma_package(ctx)
    manifest = load_package(pkg_dir).manifest
    largest = max(manifest.artifacts(), key=lambda r: r.artifact.artifact_bytes)
    out = _rows(
        f"gemma3 {largest.path}", pkg_dir / largest.path, largest.artifact.sha256.lower(), ctx,
        own=False,
    )
    if ctx.skip_big:
        return out
    big, digest = random_file(ctx, SYNTH_BYTES, name="transfer-mesh-synthetic.gguf", layer=1)
    return out + _rows("synthetic 1 GiB", big, digest, ctx, own=True)
