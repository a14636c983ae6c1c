"""Peer-transfer rows (the part measurable before the mesh exists).

Both halves of a verified peer transfer run in one process with the network left out: the
coordinator's ``ArtifactServer`` (authorize, file checks from the verification cache, pread
in 256 KiB chunks) feeds the worker's ``ResponseReader`` and a one-chunk ``ChunkSink`` (hidden
partial, SHA-256 while writing, size and digest check, rename into ``blobs/``, snapshot
symlink, verification record). Beside it, ``hashlib.file_digest(sha256)`` of the same file:
hashing is the floor of any verified transfer. On gemma3's largest artifact and on a ~1 GiB
synthetic one; peak RSS of a child doing the 1 GiB transfer. The over-the-mesh figure (vs raw
trio-websocket) comes with the mesh node.

Also runnable alone: ``python scripts/bench_transfer.py child JSON`` does one transfer (what
the RSS row measures).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from benchlib import (  # type: ignore[import-not-found]
    BenchContext,
    Row,
    child_peak_rss_mib,
    gemma_package,
    hash_file,
    random_file,
    spread,
    times_of,
)

from skippy.constants import MANIFEST_NAME
from skippy.consume.verify import VerifyCache
from skippy.package.manifest import ArtifactRef, Manifest, dump_manifest
from skippy.package.ranges import LayerRange
from skippy.package.topology import SplitTopology, StageAssignment
from skippy.transfer.chunk_sink import open_chunk_sink
from skippy.transfer.fetch_plan import FetchItem, request_for
from skippy.transfer.hubcache import RepoCache, load_held_manifest
from skippy.transfer.policy import NodePolicy, PeerFacts
from skippy.transfer.serve import DEFAULT_CHUNK_BYTES, ArtifactServer
from skippy.transfer.wire import BodyData, BodyEnd, ResponseHeader, ResponseReader

COMMIT = "0" * 39 + "1"
WORKER = bytes(range(32))
SYNTH_BYTES = 1 << 30


def _publish(hub: Path, repo: str, files: dict[str, Path], manifest: bytes) -> RepoCache:
    """A coordinator hub cache holding ``files`` (hard links, no copy) and ``manifest``, in
    huggingface_hub's layout."""
    cache = RepoCache.for_ref(hub, f"hf://{repo}@{COMMIT}")
    shutil.rmtree(cache.repo_root, ignore_errors=True)
    blobs = cache.repo_root / "blobs"
    blobs.mkdir(parents=True)
    entries = {MANIFEST_NAME: blobs / hashlib.sha256(manifest).hexdigest()}
    entries[MANIFEST_NAME].write_bytes(manifest)
    for rel, src in files.items():
        blob = blobs / f"file-{len(entries)}"
        try:
            os.link(src, blob)  # no copy: the bench measures the transfer, not the setup
        except OSError:
            shutil.copyfile(src, blob)
        entries[rel] = blob
    for rel, blob in entries.items():
        link = cache.snapshot_path(rel)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return cache


def _setup(label: str, manifest: Manifest, ref: ArtifactRef, source: Path, work: Path) -> dict[
    str, Any
]:
    """Publish ``source`` as ``ref`` of ``manifest`` on a coordinator; return the job spec."""
    raw = dump_manifest(manifest)
    cache = _publish(work / f"xfer-{label}-coordinator", f"bench/{label}", {ref.path: source}, raw)
    layer = ref.layer_index or 0
    return {
        "coordinator": str(cache.cache_dir),
        "worker": str(work / f"xfer-{label}-worker"),
        "ref": str(cache.ref),
        "path": ref.path,
        "sha": hashlib.sha256(raw).hexdigest(),
        "layer": layer,
        "layer_count": manifest.layer_count,
        "server_verify": str(work / f"xfer-{label}-verify"),
    }


def transfer_once(job: dict[str, Any]) -> int:
    """One verified transfer, as the mesh shell will drive it, minus the network."""
    n, layer = job["layer_count"], job["layer"]
    stages = [StageAssignment(WORKER.hex(), "s", 0, LayerRange(0, n, n))]
    topology = SplitTopology("t", "r", job["ref"], job["sha"], n, tuple(stages))
    server = ArtifactServer(
        Path(job["coordinator"]), verify_cache=VerifyCache(Path(job["server_verify"]))
    )
    coordinator = RepoCache.for_ref(Path(job["coordinator"]), job["ref"])
    held = load_held_manifest(coordinator, job["sha"]).held
    ref = {r.path: r for r in held.manifest.artifacts()}[job["path"]]
    item = FetchItem.of(ref)
    worker = RepoCache.for_ref(Path(job["worker"]), job["ref"])
    sink = open_chunk_sink(worker, item, manifest_sha256=job["sha"], verify_cache=None)
    request = request_for(item, topology, stages[0], WORKER, offset=sink.offset)
    policy = NodePolicy("open")
    outcome = server.serve(policy, PeerFacts(WORKER), topology, request)
    if outcome.body is None:
        raise SystemExit(f"refused: {outcome.decision.to_log()} (layer {layer})")
    reader = ResponseReader(sink.offset)
    body = outcome.body
    try:
        with sink:
            for event in reader.feed(outcome.header):
                if isinstance(event, ResponseHeader):
                    sink.accept(event.response)
            while chunk := body.read(DEFAULT_CHUNK_BYTES):
                for event in reader.feed(chunk):
                    if isinstance(event, BodyData):
                        sink.write(event.data)
                    elif isinstance(event, BodyEnd):
                        sink.finish()
            reader.eof()
    finally:
        body.close()
    if sink.state != "installed":
        raise SystemExit(f"transfer of {item.path} ended {sink.state}")
    return item.size or 0


def _measure(label: str, job: dict[str, Any], source: Path, runs: int) -> list[Row]:
    size = source.stat().st_size

    def clean() -> None:
        shutil.rmtree(job["worker"], ignore_errors=True)

    clean()
    transfer_once(job)  # warms the page cache and the server's verification record
    t_hash = times_of(lambda: hash_file(source), runs)
    t_xfer = times_of(lambda: transfer_once(job), runs, setup=clean)
    clean()
    gbps = [size / t / 1e9 for t in t_xfer]
    ratio = statistics.median(t_hash) / statistics.median(t_xfer)
    return [
        (
            label,
            f"sha256 (hashlib.file_digest) of {size / 2**20:.0f} MiB",
            f"{spread(t_hash)} s",
            f"{size / statistics.median(t_hash) / 1e9:.2f} GB/s",
        ),
        (
            label,
            "serve + receive + verify + install, in process",
            f"{spread(t_xfer)} s",
            f"{spread(gbps, fmt='{:.2f}')} GB/s; {ratio:.2f}x the sha256 rate (target >= 0.6x)",
        ),
    ]


def rows(ctx: BenchContext) -> list[Row]:
    from skippy.consume.preflight import load_package

    pkg_dir = gemma_package(ctx)
    manifest = load_package(pkg_dir).manifest
    largest = max(manifest.artifacts(), key=lambda r: r.artifact.artifact_bytes)
    gemma_job = _setup("gemma3", manifest, largest, pkg_dir / largest.path, ctx.work)
    out = _measure(f"gemma3 {largest.path}", gemma_job, pkg_dir / largest.path, ctx.runs)
    if ctx.skip_big:
        return out

    big, digest = random_file(ctx, SYNTH_BYTES)
    layer0 = manifest.layer(0)
    synthetic = dataclasses.replace(
        layer0, artifact_bytes=SYNTH_BYTES, tensor_bytes=SYNTH_BYTES, sha256=digest
    )
    synth_manifest = dataclasses.replace(
        manifest, layers=(synthetic, *manifest.layers[1:])
    )
    ref = ArtifactRef("layer", synthetic, 0)
    big_job = _setup("synthetic", synth_manifest, ref, big, ctx.work)
    out += _measure("synthetic 1 GiB", big_job, big, ctx.runs)
    shutil.rmtree(big_job["worker"], ignore_errors=True)
    rss = child_peak_rss_mib(
        [sys.executable, str(Path(__file__).resolve()), "child", json.dumps(big_job)]
    )
    shutil.rmtree(big_job["worker"], ignore_errors=True)
    out.append(
        (
            "synthetic 1 GiB",
            "peak RSS of one process serving and receiving it",
            f"{rss:.0f} MiB",
            "target <= 150 MiB",
        )
    )
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "child":
        transfer_once(json.loads(sys.argv[2]))
        raise SystemExit(0)
    raise SystemExit("usage: bench_transfer.py child JSON (run the section via scripts/bench)")
