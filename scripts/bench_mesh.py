"""Mesh link benchmark rows (issue #7), called by scripts/bench.py; also runnable alone.

Each figure is measured against a server in a child process (so both ends get a core), with
the same workload over three transports in one run:
- raw trio TCP (``trio.serve_tcp``), 1 MiB writes;
- raw trio-websocket, 1 MiB binary messages, 1 MiB receive buffer (GOTCHAS);
- the mesh: two ``MeshNode``s, one Noise-encrypted multiplexed stream under flow control.
Bulk throughput in both directions ("upload" = dialer to listener, the masked WebSocket
direction), and control round-trip latency (a 64-byte message echoed on an open stream; raw
WebSocket beside it). Target: mesh >= 0.6x raw trio-websocket in each direction.
"""

from __future__ import annotations

import argparse
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio
from benchlib import BenchContext, Row, spread  # type: ignore[import-not-found]

BULK_BYTES = 256 * 1024 * 1024
CHUNK = 1024 * 1024
RTT_ROUNDS = 500
BENCH_PROTOCOL = "bench"
_HDR = struct.Struct(">BQ")  # direction (0 upload, 1 download), byte count
UP, DOWN, ECHO = 0, 1, 2


# --- servers (child process) ------------------------------------------------------------------
async def _serve_tcp() -> None:
    async def handle(stream: trio.SocketStream) -> None:
        hdr = await _read_exact(stream, _HDR.size)
        direction, n = _HDR.unpack(hdr)
        if direction == UP:
            got = 0
            while got < n:
                got += len(await stream.receive_some(CHUNK))
            await stream.send_all(b"k")
        elif direction == DOWN:
            block = b"d" * CHUNK
            for _ in range(n // CHUNK):
                await stream.send_all(block)
        else:
            while data := await stream.receive_some(CHUNK):
                await stream.send_all(data)
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(handle, listeners)


async def _read_exact(stream: Any, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _ws_opts() -> dict[str, Any]:
    return {"max_message_size": 4 * CHUNK, "receive_buffer_size": CHUNK}


async def _serve_ws() -> None:
    from trio_websocket import ConnectionClosed, serve_websocket

    async def handle(request: Any) -> None:
        ws = await request.accept()
        try:
            direction, n = _HDR.unpack(await ws.get_message())
            if direction == UP:
                got = 0
                while got < n:
                    got += len(await ws.get_message())
                await ws.send_message(b"k")
            elif direction == DOWN:
                block = b"d" * CHUNK
                for _ in range(n // CHUNK):
                    await ws.send_message(block)
                await ws.get_message()
            else:
                while True:
                    await ws.send_message(await ws.get_message())
        except ConnectionClosed:
            pass

    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: serve_websocket(handle, "127.0.0.1", 0, None,
                                                task_status=task_status, **_ws_opts())
        )
        print(server.port, flush=True)


def _settings(tmp: Path, name: str, peers: tuple[Any, ...] = ()) -> Any:
    from skippy.config import HostPort, NodeSettings

    return NodeSettings(
        config_path=tmp / f"{name}.toml", listen=HostPort("127.0.0.1", 0),
        identity_path=tmp / "unused.key", certificate_path=None, data_dir=tmp / name,
        peers=peers, trusted_owners=(), artifact_transfer="disabled",
        memory_budget_bytes=1 << 30, heartbeat_interval_s=5, peer_loss_timeout_s=30,
    )


def _new_node(settings: Any) -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from mesh_node.identity import LocalIdentity
    from mesh_node.node import MeshNode

    return MeshNode(settings, LocalIdentity(Ed25519PrivateKey.generate(), None))


async def _serve_mesh() -> None:
    from mesh_node.peers import InboundStream

    node = _new_node(_settings(Path("/nonexistent"), "server"))

    async def handle(inbound: InboundStream) -> None:
        stream = inbound.stream
        direction, n = _HDR.unpack(await _read_exact(stream, _HDR.size))
        if direction == UP:
            got = 0
            while got < n:
                got += len(await stream.receive_some())
            await stream.send_all(b"k")
        elif direction == DOWN:
            block = b"d" * CHUNK
            for _ in range(n // CHUNK):
                await stream.send_all(block)
        else:
            while (message := await stream.receive_message()) is not None:
                await stream.send_message(message)
        await stream.send_eof()
        await stream.receive_some()

    node.register_subprotocol(1, handle, name=BENCH_PROTOCOL, major=1)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(node.run)
        print(address, flush=True)


# --- clients (bench process) ---------------------------------------------------------------
async def _tcp_client(port: int, direction: int, n: int) -> float:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        t = time.perf_counter()
        await stream.send_all(_HDR.pack(direction, n))
        if direction == UP:
            block = b"u" * CHUNK
            for _ in range(n // CHUNK):
                await stream.send_all(block)
            await _read_exact(stream, 1)
        else:
            got = 0
            while got < n:
                got += len(await stream.receive_some(CHUNK))
        return time.perf_counter() - t


async def _ws_client(port: int, direction: int, n: int) -> float | list[float]:
    from trio_websocket import open_websocket_url

    async with open_websocket_url(f"ws://127.0.0.1:{port}", **_ws_opts()) as ws:
        t = time.perf_counter()
        await ws.send_message(_HDR.pack(direction, n))
        if direction == UP:
            block = b"u" * CHUNK
            for _ in range(n // CHUNK):
                await ws.send_message(block)
            await ws.get_message()
        elif direction == DOWN:
            got = 0
            while got < n:
                got += len(await ws.get_message())
            await ws.send_message(b"k")
        else:
            rtts = []
            for _ in range(n):
                t0 = time.perf_counter()
                await ws.send_message(b"p" * 64)
                await ws.get_message()
                rtts.append(time.perf_counter() - t0)
            return rtts
        return time.perf_counter() - t


async def _mesh_client(address: str, direction: int, n: int) -> float | list[float]:
    import tempfile

    from skippy.config import parse_peer_address

    with tempfile.TemporaryDirectory() as tmp:
        node = _new_node(_settings(Path(tmp), "client", (parse_peer_address(address),)))
        server_id = address.rsplit("#", 1)[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            while node.peer(server_id) is None:
                await trio.sleep(0.01)
            stream = await node.open_stream(server_id, 1, name=BENCH_PROTOCOL, major=1)
            result: float | list[float]
            t = time.perf_counter()
            await stream.send_all(_HDR.pack(direction, n))
            if direction == UP:
                block = b"u" * CHUNK
                for _ in range(n // CHUNK):
                    await stream.send_all(block)
                await _read_exact(stream, 1)
                result = time.perf_counter() - t
            elif direction == DOWN:
                got = 0
                while got < n:
                    got += len(await stream.receive_some())
                result = time.perf_counter() - t
            else:
                rtts = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    await stream.send_message(b"p" * 64)
                    await stream.receive_message()
                    rtts.append(time.perf_counter() - t0)
                result = rtts
            await stream.aclose()
            nursery.cancel_scope.cancel()
        return result


def _server(kind: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, __file__, "serve", kind], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def download_rates(kind: str, nbytes: int, runs: int) -> list[float]:
    """MB/s receiving ``nbytes`` (whole MiB) from a server in a child process, listener to
    dialer (the direction a coordinator serves its workers): ``kind`` is ``ws`` (raw
    trio-websocket) or ``mesh`` (one stream between two MeshNodes, no files)."""
    proc, where = _server(kind)
    client = _ws_client if kind == "ws" else _mesh_client
    target: Any = int(where) if kind == "ws" else where
    try:
        times = [trio.run(client, target, DOWN, nbytes) for _ in range(runs)]
    finally:
        proc.kill()
        proc.wait()
    return [nbytes / t / 1e6 for t in times]  # type: ignore[operator]


def measure(runs: int, bulk_bytes: int = BULK_BYTES) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("tcp", "ws", "mesh"):
        proc, where = _server(kind)
        try:
            for direction, label in ((UP, "upload"), (DOWN, "download")):
                times = []
                for _ in range(runs):
                    if kind == "tcp":
                        times.append(trio.run(_tcp_client, int(where), direction, bulk_bytes))
                    elif kind == "ws":
                        times.append(trio.run(_ws_client, int(where), direction, bulk_bytes))
                    else:
                        times.append(trio.run(_mesh_client, where, direction, bulk_bytes))
                out[(kind, label)] = times
            if kind != "tcp":
                rtts: list[float] = []
                for _ in range(runs):
                    client = _ws_client if kind == "ws" else _mesh_client
                    target: Any = int(where) if kind == "ws" else where
                    got = trio.run(client, target, ECHO, RTT_ROUNDS)
                    assert isinstance(got, list)
                    rtts.append(statistics.median(got))
                out[(kind, "rtt")] = rtts
        finally:
            proc.kill()
            proc.wait()
    return out


def rows(ctx: BenchContext) -> list[Row]:
    m = measure(ctx.runs)
    mb = BULK_BYTES / 1e6
    result: list[Row] = []
    for label in ("upload", "download"):
        speeds = {k: [mb / t for t in m[(k, label)]] for k in ("tcp", "ws", "mesh")}
        for kind, name in (("tcp", "raw trio TCP"), ("ws", "raw trio-websocket"),
                           ("mesh", "mesh stream (Noise + mux)")):
            note = ""
            if kind == "mesh":
                ratios = [a / b for a, b in zip(speeds["mesh"], speeds["ws"], strict=True)]
                note = f"{spread(ratios, fmt='{:.2f}')}x raw websocket (target >= 0.6)"
            result.append(("mesh", f"{label} 256 MiB, {name}",
                           f"{spread(speeds[kind], fmt='{:.0f}')} MB/s", note))
    for kind, name in (("ws", "raw trio-websocket echo"), ("mesh", "mesh control stream echo")):
        result.append(("mesh", f"64 B round trip, {name}",
                       f"{spread(m[(kind, 'rtt')], unit=1e6, fmt='{:.0f}')} µs",
                       f"median of {RTT_ROUNDS} per run"))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("mode", choices=["serve", "measure"])
    ap.add_argument("kind", nargs="?", choices=["tcp", "ws", "mesh"])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if args.mode == "serve":
        trio.run({"tcp": _serve_tcp, "ws": _serve_ws, "mesh": _serve_mesh}[args.kind])
    else:
        from benchlib import render  # type: ignore[import-not-found]

        ctx = BenchContext(Path(), Path(), args.runs, 0, True)
        print(render(rows(ctx)))


if __name__ == "__main__":
    main()
