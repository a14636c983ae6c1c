"""The link near the machine: the mesh stream alone and verified peer
transfer, each way, as ratios of raw trio-websocket with the same allocator tuning, measured
side by side in one run. Self-contained and bounded (~1-2 min with 3 runs): a 256 MiB random
file, no model.

- raw trio-websocket and the mesh stream (two ``MeshNode`` processes, Noise + mux, no files):
  ``bench_mesh``'s child processes, both tuned as ``mesh-node run``; "download" is listener to
  dialer, "upload" dialer to listener (the direction whose WebSocket frames are masked). Each
  run measures raw then mesh, so every mesh figure has a raw figure taken seconds apart, and
  the ratio is taken per run.
- verified transfer: two ``mesh-node run`` processes (``mesh_node.lab``) where the worker
  fetches the file (as one layer of a synthetic package) from the coordinator: request,
  serve, stream, SHA-256 while writing, digest check, rename. "download": the worker dialed
  the coordinator (the lab's usual shape); "upload": the coordinator dialed the worker, so the
  bytes go from the dialer to the listener. The first transfer of each only warms up; the
  ratio is against the median raw WebSocket of the same direction in this run.
- the link cipher both ends agreed on (AES-256-GCM where the CPU has AES instructions), and
  the mesh stream once more with ChaCha20-Poly1305 (what a link to an older node uses).
- the floor of a verified transfer on trio-websocket's own receive path (``bench_mesh``'s
  ``wsfloor``): raw trio-websocket carrying the same file with only the work no verified
  transfer can skip, in the same two processes' shape: the sender reads it and seals 64 KiB
  records with AES-256-GCM, the receiver opens them, hashes and writes a new file and checks
  its SHA-256. No Noise framing, multiplexer, flow control or request, against the same raw
  baseline, run by run. The node's links parse their WebSocket frames themselves
  (``protocol.ws_frames``, ``mesh_node.websocket``), so their verified transfer can pass it.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
from pathlib import Path
from typing import Any

import bench_mesh as bm  # type: ignore[import-not-found]
import trio
from bench_transfer_mesh import BIG_LAYER, _package, _wait_record  # type: ignore[import-not-found]
from benchlib import BenchContext, Row, random_file, spread  # type: ignore[import-not-found]

from mesh_node.cipher_support import local_ciphers
from mesh_node.lab.run import LabOptions, open_lab

MIB = 1 << 20
FILE_BYTES = 256 * MIB
MAX_RUNS = 5  # bounds the section's time whatever --runs says
DIRECTIONS = (("download", bm.DOWN), ("upload", bm.UP))


def _stream_rates(
    runs: int, floor_file: Path, floor_sha256: str
) -> dict[tuple[str, str], list[float]]:
    """MB/s per run: (kind, direction) -> rates, raw and mesh interleaved run by run."""
    out: dict[tuple[str, str], list[float]] = {}
    servers = {kind: bm._server(kind, True) for kind in ("ws", "mesh")}
    os.environ[bm.FLOOR_FILE_ENV] = f"{floor_file} {floor_sha256}"  # its server and clients
    servers["wsfloor"] = bm._server("wsfloor", True)
    os.environ[bm.CIPHER_ENV] = "chacha"  # inherited by this server and its clients only
    try:
        servers["mesh-chacha"] = bm._server("mesh", True)
    finally:
        del os.environ[bm.CIPHER_ENV]
    try:
        for _ in range(runs):
            for label, direction in DIRECTIONS:
                for kind, (_, where) in servers.items():
                    seconds = _client(kind, where, direction)
                    out.setdefault((kind, label), []).append(FILE_BYTES / seconds / 1e6)
    finally:
        del os.environ[bm.FLOOR_FILE_ENV]
        for proc, _ in servers.values():
            proc.kill()
            proc.wait()
    return out


def _client(kind: str, where: str, direction: int) -> float:
    if kind != "mesh-chacha":
        return float(bm._client(kind, where, direction, FILE_BYTES, True))
    os.environ[bm.CIPHER_ENV] = "chacha"
    try:
        return float(bm._client("mesh", where, direction, FILE_BYTES, True))
    finally:
        del os.environ[bm.CIPHER_ENV]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _transfers(package: Path, work: Path, label: str, runs: int) -> list[float]:
    """MB/s of ``runs`` verified fetches of ``BIG_LAYER`` (after one warm-up)."""
    root = work / f"link-lab-{label}"
    shutil.rmtree(root, ignore_errors=True)
    # Calibration off: the memory planner places by budget, and the worker states the larger
    # one, so it gets the big layer (the cost planner would place it by compute speed).
    coordinator: dict[str, Any] = {"memory_budget": "1GiB", "calibration": "off"}
    worker: dict[str, Any] = {"memory_budget": "16GiB", "calibration": "off"}
    if label == "upload":  # the coordinator dials the worker: bytes go dialer -> listener
        port = _free_port()
        worker.update(listen=f"127.0.0.1:{port}", peers=[])
        coordinator.update(peers=[f"ws://127.0.0.1:{port}"])
    options = LabOptions(
        nodes=2,
        package=str(package),
        transfer="open",
        root=root,
        timeout_s=300,
        node_overrides={0: coordinator, 1: worker},
    )
    rates: list[float] = []
    async with open_lab(options) as lab:
        coord, work_node = lab.cluster.nodes
        for i in range(runs + 1):
            await lab.cluster.stop(1)
            shutil.rmtree(work_node.data_dir / "hub", ignore_errors=True)
            shutil.rmtree(work_node.root / "cache", ignore_errors=True)
            await lab.cluster.start(1)
            await lab.cluster.wait_meshed(60)
            response = await coord.request(
                {"op": "topology", "package": lab.package.ref, "stages": 2, "include_self": True},
                timeout_s=120,
            )
            record = await _wait_record(work_node, response["topology"]["topology_id"])
            if i:  # the first run warms up
                rates.append(record["mb_per_s"])
        await lab.cluster.stop(1)
    return rates


def rows(ctx: BenchContext) -> list[Row]:
    runs = max(1, min(ctx.runs, MAX_RUNS))
    big, digest = random_file(ctx, FILE_BYTES, name="link-256MiB.gguf", layer=1)
    package = _package(ctx.work, "link", big, digest, link=True)
    assert (package / BIG_LAYER).exists()
    stream = _stream_rates(runs, big, digest)
    verified = {
        label: trio.run(_transfers, package, ctx.work, label, runs) for label, _ in DIRECTIONS
    }
    cipher = local_ciphers()[0].label
    out: list[Row] = [
        ("link", "cipher both ends agree on (this machine)", cipher, "target >= 0.6x each way"),
    ]
    for label, _ in DIRECTIONS:
        raw, mesh = stream[("ws", label)], stream[("mesh", label)]
        ratios = [m / r for m, r in zip(mesh, raw, strict=True)]
        chacha = stream[("mesh-chacha", label)]
        chacha_ratios = [m / r for m, r in zip(chacha, raw, strict=True)]
        moved = [v / statistics.median(raw) for v in verified[label]]
        floor = stream[("wsfloor", label)]
        floor_ratios = [f / r for f, r in zip(floor, raw, strict=True)]
        out += [
            ("link", f"{label} 256 MiB, raw trio-websocket, malloc tuned",
             f"{spread(raw, fmt='{:.0f}')} MB/s", "the like-for-like baseline"),
            ("link", f"{label} 256 MiB, mesh stream alone (Noise + mux, no files)",
             f"{spread(mesh, fmt='{:.0f}')} MB/s",
             f"{spread(ratios, fmt='{:.2f}')}x raw websocket (per-run pairs)"),
            ("link", f"{label} 256 MiB, mesh stream alone, ChaCha20-Poly1305 (older peers)",
             f"{spread(chacha, fmt='{:.0f}')} MB/s",
             f"{spread(chacha_ratios, fmt='{:.2f}')}x raw websocket (per-run pairs)"),
            ("link", f"{label} 256 MiB, verified peer transfer (two mesh-node processes)",
             f"{spread(verified[label], fmt='{:.0f}')} MB/s",
             f"{spread(moved, fmt='{:.2f}')}x raw websocket (its median this run)"),
            ("link", f"{label} 256 MiB, floor: raw trio-websocket + a verified transfer's "
             "own work (read, AES-256-GCM both ends, SHA-256, write)",
             f"{spread(floor, fmt='{:.0f}')} MB/s",
             f"{spread(floor_ratios, fmt='{:.2f}')}x raw websocket (per-run pairs): the most a "
             "verified transfer reaches here through wsproto's receive path"),
        ]
    return out
