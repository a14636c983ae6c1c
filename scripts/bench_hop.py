"""The per-hop cost of one small decode frame (section 4), called by
scripts/bench.py (``--only hop``); also runnable alone (``python scripts/bench_hop.py measure``).

In a pipeline split every generated token crosses each stage boundary once as a one-position
activation frame: ~2.5 KiB for gemma3-270m's 640-float hidden state. This section ping-pongs a
frame of that size between two child processes on loopback and reports the one-way latency
(half of each round trip: median, p10, p90) over:
- raw trio-websocket (one binary message each way, the same options as the mesh's links);
- the mesh: two ``MeshNode``s, one Noise-encrypted multiplexed stream, ``send_all`` of the
  frame and ``receive_some`` until it is whole, as the serving route does; both nodes hold
  certificates of one owner, so each trusts the other (a lab's or a user's own split), and
  once more without certificates (strangers: every read, message and stream step waits its
  turn, ``mesh_node.turns``).
Each run measures raw then mesh, so every mesh figure has a raw figure taken seconds apart.
Both ends run ``mesh-node run``'s allocator tuning.

``SKIPPY_BENCH_HOP_BASE=/path/to/an/older/tree`` adds a third kind, the mesh as that tree's
code has it (its ``mesh_node`` and ``protocol`` first on ``PYTHONPATH`` in both children), so a
change to the link stack is measured before and after, alternating, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio
from benchlib import BenchContext, Row, spread  # type: ignore[import-not-found]

FRAME_BYTES = 2560  # gemma3-270m: 640 f32 activations (the frame header is a few bytes more)
ROUNDS = 2000  # round trips per run (after WARMUP)
WARMUP = 200
MAX_RUNS = 5
HOP_PROTOCOL = "bench-hop"
BASE_ENV = "SKIPPY_BENCH_HOP_BASE"
OWNER_ENV = "SKIPPY_BENCH_HOP_OWNER"  # the owner's raw Ed25519 private key, hex (trusted kinds)


def _new_node(settings: Any) -> Any:
    """A node with a fresh key; certified by the owner in ``OWNER_ENV`` when it is set."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from mesh_node.identity import LocalIdentity, issue_certificate, node_id_of
    from mesh_node.node import MeshNode

    key = Ed25519PrivateKey.generate()
    cert = None
    if owner := os.environ.get(OWNER_ENV):
        owner_key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(owner))
        cert = issue_certificate(owner_key, node_id_of(key), days=1)
    return MeshNode(settings, LocalIdentity(key, cert))


# --- servers (child process) ------------------------------------------------------------------
async def _serve_ws() -> None:
    from trio_websocket import ConnectionClosed, serve_websocket

    async def handle(request: Any) -> None:
        ws = await request.accept()
        try:
            while True:
                await ws.send_message(await ws.get_message())
        except ConnectionClosed:
            pass

    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: serve_websocket(
                handle, "127.0.0.1", 0, None, task_status=task_status, **_ws_opts()
            )
        )
        print(server.port, flush=True)


def _ws_opts() -> dict[str, Any]:
    """trio-websocket options as close to a link's WebSocket as it has (one queued message, the
    link's message bound, 1 MiB reads: ``mesh_node.link.websocket_settings``)."""
    return {"message_queue_size": 1, "max_message_size": 4 << 20, "receive_buffer_size": 1 << 20}


async def _read_frame(stream: Any, n: int) -> bytes:
    """One frame of ``n`` bytes from a mesh stream (``b""`` at its end)."""
    buf = b""
    while len(buf) < n:
        chunk = await stream.receive_some()
        if not chunk:
            return b""
        buf += chunk
    return buf


async def _serve_mesh() -> None:
    from bench_mesh import _settings  # type: ignore[import-not-found]

    from mesh_node.peers import InboundStream

    node = _new_node(_settings(Path("/nonexistent"), "server"))

    async def handle(inbound: InboundStream) -> None:
        stream = inbound.stream
        while frame := await _read_frame(stream, FRAME_BYTES):
            await stream.send_all(frame)
        await stream.send_eof()

    node.register_subprotocol(1, handle, name=HOP_PROTOCOL, major=1)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(node.run)
        print(address, flush=True)


# --- clients (child process) ------------------------------------------------------------------
async def _ws_client(port: int, rounds: int) -> dict[str, Any]:
    from trio_websocket import open_websocket_url

    frame = os.urandom(FRAME_BYTES)
    out: list[float] = []
    async with open_websocket_url(f"ws://127.0.0.1:{port}", **_ws_opts()) as ws:
        cpu = time.process_time()
        for i in range(WARMUP + rounds):
            t0 = time.perf_counter()
            await ws.send_message(frame)
            await ws.get_message()
            if i == WARMUP - 1:
                cpu = time.process_time()
            if i >= WARMUP:
                out.append(time.perf_counter() - t0)
    return {"rtts": out, "cpu_s": time.process_time() - cpu}


async def _mesh_client(address: str, rounds: int) -> dict[str, Any]:
    import tempfile

    from bench_mesh import _settings

    from mesh_node.settings import parse_peer_address

    frame = os.urandom(FRAME_BYTES)
    out: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        node = _new_node(_settings(Path(tmp), "client", (parse_peer_address(address),)))
        server_id = address.rsplit("#", 1)[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            while node.peer(server_id) is None:
                await trio.sleep(0.01)
            stream = await node.open_stream(server_id, 1, name=HOP_PROTOCOL, major=1)
            cpu = time.process_time()
            for i in range(WARMUP + rounds):
                t0 = time.perf_counter()
                await stream.send_all(frame)
                if len(await _read_frame(stream, FRAME_BYTES)) != FRAME_BYTES:
                    raise RuntimeError("the echo ended early")
                if i == WARMUP - 1:
                    cpu = time.process_time()
                if i >= WARMUP:
                    out.append(time.perf_counter() - t0)
            cpu = time.process_time() - cpu
            await stream.aclose()
            nursery.cancel_scope.cancel()
    return {"rtts": out, "cpu_s": cpu}


def _child_env(kind: str, base: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(BASE_ENV, None)
    env.pop(OWNER_ENV, None)
    if kind.startswith("mesh") and "stranger" not in kind:
        env[OWNER_ENV] = _OWNER_HEX
    if base:
        env["PYTHONPATH"] = os.pathsep.join([base, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _server(kind: str, base: str | None) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "serve", "ws" if kind == "ws" else "mesh"],
        stdout=subprocess.PIPE,
        text=True,
        env=_child_env(kind, base),
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _client(kind: str, where: str, rounds: int, base: str | None) -> dict[str, Any]:
    """One client run in a child: {"rtts": round trips (s), "cpu_s": its CPU over them}."""
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "client",
            "ws" if kind == "ws" else "mesh",
            "--where",
            where,
            "--rounds",
            str(rounds),
        ],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
        env=_child_env(kind, base),
    ).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def _owner_hex() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    raw = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return raw.hex()


_OWNER_HEX = _owner_hex()  # one owner per bench process: its children trust each other


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(runs: int, rounds: int = ROUNDS) -> dict[str, list[dict[str, float]]]:
    """kind -> per run {p10, median, p90} of the one-way latency and the client's CPU per
    frame (s), kinds interleaved."""
    base = os.environ.get(BASE_ENV) or None
    kinds: dict[str, str | None] = {"ws": None, "mesh": None, "mesh-stranger": None}
    if base:
        kinds["mesh-base"] = base
        kinds["mesh-stranger-base"] = base
    servers = {kind: _server(kind, where) for kind, where in kinds.items()}
    out: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    try:
        for _ in range(runs):
            for kind, tree in kinds.items():
                got = _client(kind, servers[kind][1], rounds, tree)
                one_way = [rtt / 2 for rtt in got["rtts"]]
                out[kind].append(
                    {
                        "p10": _pct(one_way, 0.10),
                        "median": statistics.median(one_way),
                        "p90": _pct(one_way, 0.90),
                        # one send and one receive per round trip in the client
                        "cpu_per_frame": got["cpu_s"] / rounds / 2,
                    }
                )
    finally:
        for proc, _ in servers.values():
            proc.kill()
            proc.wait()
    return out


def rows(ctx: BenchContext) -> list[Row]:
    m = measure(max(1, min(ctx.runs, MAX_RUNS)))
    names = {
        "ws": "raw trio-websocket (one message each way)",
        "mesh": "mesh stream, trusted peers (one owner)",
        "mesh-stranger": "mesh stream, strangers (no certificates)",
        "mesh-base": f"mesh stream, trusted peers, the code in {os.environ.get(BASE_ENV)}",
        "mesh-stranger-base": f"mesh stream, strangers, the code in {os.environ.get(BASE_ENV)}",
    }
    ws_median = [r["median"] for r in m["ws"]]
    out: list[Row] = []
    for kind, per_run in m.items():
        median = [r["median"] for r in per_run]
        p10 = [r["p10"] for r in per_run]
        p90 = [r["p90"] for r in per_run]
        us = {"unit": 1e6, "fmt": "{:.0f}"}
        cpu = [r["cpu_per_frame"] for r in per_run]
        note = (
            f"p10 {spread(p10, **us)} µs, p90 {spread(p90, **us)} µs; "
            f"client CPU per frame (one send + one receive, halved) {spread(cpu, **us)} µs"
        )
        if kind != "ws":
            excess = [a - b for a, b in zip(median, ws_median, strict=True)]
            note += f"; +{spread(excess, unit=1e6, fmt='{:.0f}')} µs over raw (per-run pairs)"
        out.append(
            (
                "hop",
                f"{FRAME_BYTES} B frame one way (half a ping-pong), {names[kind]}",
                f"{spread(median, unit=1e6, fmt='{:.0f}')} µs",
                note,
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("mode", choices=["serve", "client", "measure"])
    ap.add_argument("kind", nargs="?", choices=["ws", "mesh"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--where", default="")
    args = ap.parse_args()
    from mesh_node.allocator import tune_for_streaming

    tune_for_streaming()
    if args.mode == "serve":
        trio.run(_serve_ws if args.kind == "ws" else _serve_mesh)
    elif args.mode == "client":
        if args.kind == "ws":
            result = trio.run(_ws_client, int(args.where), args.rounds)
        else:
            result = trio.run(_mesh_client, args.where, args.rounds)
        print(json.dumps(result))
    else:
        from benchlib import render

        ctx = BenchContext(Path(), Path(), args.runs, 0, True)
        print(render(rows(ctx)))


if __name__ == "__main__":
    main()
