"""Mesh link benchmark rows, called by scripts/bench.py; also runnable alone.

Each figure is measured between two child processes (so both ends get a core and their own
allocator settings), with the same workload over three transports in one run:
- raw trio TCP (``trio.serve_tcp``), 1 MiB writes;
- raw trio-websocket, 1 MiB binary messages, 1 MiB receive buffer (docs/runtime-facts.md);
- the mesh: two ``MeshNode``s, one Noise-encrypted multiplexed stream under flow control.
Bulk throughput in both directions ("upload" = dialer to listener, the masked WebSocket
direction), and control round-trip latency (a 64-byte message echoed on an open stream; raw
WebSocket beside it). Target: mesh >= 0.6x raw trio-websocket in each direction.

Both mesh ends tune glibc's allocator as ``mesh-node run`` does (``mesh_node.allocator``: freed
buffers stay in the heap). That alone speeds raw trio-websocket too, so raw WebSocket is
measured both ways, with glibc's defaults (what a plain trio-websocket program gets) and with
the same tuning (the like-for-like baseline), and the mesh ratio is given against each.
"""

from __future__ import annotations

import argparse
import json
import os
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
CIPHER_ENV = "SKIPPY_BENCH_MESH_CIPHER"  # "chacha": both mesh ends offer ChaCha20-Poly1305 only
# ``wsfloor`` (bench_link): raw trio-websocket carrying this file with only the
# work a verified transfer cannot skip: the sender ``pread``s it and seals each 64 KiB record
# with AES-256-GCM, the receiver opens each record, SHA-256s and writes it to a new file and
# checks the digest at the end. No Noise framing, no multiplexer, no flow control: the most a
# verified transfer built on trio-websocket can reach on this machine.
FLOOR_FILE_ENV = "SKIPPY_BENCH_FLOOR_FILE"  # the file's path, then a space, then its SHA-256
FLOOR_RECORD = 64 * 1024
FLOOR_KEY = bytes(range(32))


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


class _Floor:
    """Either end of a ``wsfloor`` transfer (see ``FLOOR_FILE_ENV``)."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        path, self.sha256 = os.environ[FLOOR_FILE_ENV].rsplit(" ", 1)
        self.path = Path(path)
        self.size = self.path.stat().st_size
        self.aes = AESGCM(FLOOR_KEY)
        self.count = 0

    def _nonce(self) -> bytes:
        self.count += 1
        return self.count.to_bytes(12, "big")

    def messages(self) -> Any:
        """The file as 1 MiB messages of sealed 64 KiB records."""
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        with open(self.path, "rb", buffering=0) as f:
            for offset in range(0, self.size, CHUNK):
                n = os.preadv(f.fileno(), [view], offset)
                yield b"".join(
                    self.aes.encrypt(self._nonce(), view[r : min(r + FLOOR_RECORD, n)], None)
                    for r in range(0, n, FLOOR_RECORD)
                )

    def sink(self) -> tuple[Any, Any]:
        """(take one message, finish(complete): remove the copy, then, if ``complete``, check
        the digest). ``finish`` runs whatever happened, so no copy is left behind."""
        import hashlib
        import tempfile

        h = hashlib.sha256()
        fd, out = tempfile.mkstemp(prefix=".wsfloor-", dir=self.path.parent)
        sealed = FLOOR_RECORD + 16

        def take(message: bytes) -> int:
            view, got = memoryview(message), 0
            for r in range(0, len(view), sealed):
                plain = self.aes.decrypt(self._nonce(), view[r : r + sealed], None)
                h.update(plain)
                os.write(fd, plain)
                got += len(plain)
            return got

        def finish(complete: bool) -> None:
            os.close(fd)
            os.unlink(out)
            if complete and h.hexdigest() != self.sha256:
                raise SystemExit("wsfloor: the received file does not hash to its SHA-256")

        return take, finish


async def _floor_send(ws: Any) -> None:
    """The floor file to the other end, as sealed messages."""
    for message in _Floor().messages():
        await ws.send_message(message)


async def _floor_receive(ws: Any, n: int) -> None:
    """The floor file from the other end: opened, hashed, written and checked."""
    take, finish = _Floor().sink()
    got = 0
    try:
        while got < n:
            got += take(await ws.get_message())
    finally:
        finish(got >= n)


async def _serve_ws(floor: bool = False) -> None:
    from trio_websocket import ConnectionClosed, serve_websocket

    async def handle(request: Any) -> None:
        ws = await request.accept()
        try:
            direction, n = _HDR.unpack(await ws.get_message())
            if floor and direction == UP:
                await _floor_receive(ws, n)
                await ws.send_message(b"k")
            elif floor:
                await _floor_send(ws)
                await ws.get_message()
            elif direction == UP:
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
    from mesh_node.settings import HostPort, NodeSettings

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

    ciphers = None
    if os.environ.get(CIPHER_ENV) == "chacha":  # bench_link: the cipher older peers speak
        from protocol.link_cipher import LinkCipher

        ciphers = (LinkCipher.CHACHAPOLY,)
    return MeshNode(
        settings, LocalIdentity(Ed25519PrivateKey.generate(), None), link_ciphers=ciphers
    )


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


async def _ws_client(port: int, direction: int, n: int, floor: bool = False) -> float | list[float]:
    from trio_websocket import open_websocket_url

    async with open_websocket_url(f"ws://127.0.0.1:{port}", **_ws_opts()) as ws:
        t = time.perf_counter()
        await ws.send_message(_HDR.pack(direction, n))
        if floor and direction == UP:
            await _floor_send(ws)
            await ws.get_message()
        elif floor:
            await _floor_receive(ws, n)
            await ws.send_message(b"k")
        elif direction == UP:
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

    from mesh_node.settings import parse_peer_address

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


def _server(kind: str, tuned: bool) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "serve", kind, *(["--tuned"] if tuned else [])],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _client(kind: str, where: str, direction: int, n: int, tuned: bool) -> Any:
    """One client run in a child process: seconds, or the round trips for ECHO."""
    out = subprocess.run(
        [sys.executable, __file__, "client", kind, "--where", where, "--direction",
         str(direction), "--n", str(n), *(["--tuned"] if tuned else [])],
        check=True, stdout=subprocess.PIPE, text=True,
    ).stdout
    return json.loads(out)


def _run_client(kind: str, where: str, direction: int, n: int) -> float | list[float]:
    if kind == "tcp":
        return trio.run(_tcp_client, int(where), direction, n)
    if kind in ("ws", "wsfloor"):
        return trio.run(_ws_client, int(where), direction, n, kind == "wsfloor")
    return trio.run(_mesh_client, where, direction, n)


def _tuned(kind: str, variant: str) -> bool:
    """The mesh always runs as ``mesh-node run`` does; raw WebSocket both ways."""
    return kind == "mesh" or variant == "tuned"


def download_rates(kind: str, nbytes: int, runs: int, *, tuned: bool | None = None) -> list[float]:
    """MB/s receiving ``nbytes`` (whole MiB) from a server in a child process, listener to
    dialer (the direction a coordinator serves its workers): ``kind`` is ``ws`` (raw
    trio-websocket) or ``mesh`` (one stream between two MeshNodes, no files). ``tuned``: the
    allocator settings of ``mesh-node run`` in both processes (default: only for the mesh)."""
    tuned = kind == "mesh" if tuned is None else tuned
    proc, where = _server(kind, tuned)
    try:
        times = [_client(kind, where, DOWN, nbytes, tuned) for _ in range(runs)]
    finally:
        proc.kill()
        proc.wait()
    return [nbytes / t / 1e6 for t in times]


# (kind, allocator variant) measured in one run; the mesh is always tuned.
KINDS = (("tcp", "default"), ("ws", "default"), ("ws", "tuned"), ("mesh", "tuned"))


def measure(runs: int, bulk_bytes: int = BULK_BYTES) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for kind, variant in KINDS:
        tuned = _tuned(kind, variant)
        proc, where = _server(kind, tuned)
        try:
            for direction, label in ((UP, "upload"), (DOWN, "download")):
                out[(kind, variant, label)] = [
                    _client(kind, where, direction, bulk_bytes, tuned) for _ in range(runs)
                ]
            if kind != "tcp" and variant == "tuned":
                rtts: list[float] = []
                for _ in range(runs):
                    got = _client(kind, where, ECHO, RTT_ROUNDS, tuned)
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
    names = {
        ("tcp", "default"): "raw trio TCP",
        ("ws", "default"): "raw trio-websocket, glibc malloc defaults",
        ("ws", "tuned"): "raw trio-websocket, malloc tuned as mesh-node run",
        ("mesh", "tuned"): "mesh stream (Noise + mux), malloc tuned",
    }
    result: list[Row] = []
    for label in ("upload", "download"):
        speeds = {kv: [mb / t for t in m[(*kv, label)]] for kv in KINDS}
        for kv in KINDS:
            note = ""
            if kv[0] == "mesh":
                notes = []
                for base, what in (
                    (("ws", "default"), "raw websocket as shipped (target >= 0.6)"),
                    (("ws", "tuned"), "raw websocket with the same malloc tuning"),
                ):
                    ratios = [a / b for a, b in zip(speeds[kv], speeds[base], strict=True)]
                    notes.append(f"{spread(ratios, fmt='{:.2f}')}x {what}")
                note = "; ".join(notes)
            result.append(("mesh", f"{label} 256 MiB, {names[kv]}",
                           f"{spread(speeds[kv], fmt='{:.0f}')} MB/s", note))
    for kind, name in (("ws", "raw trio-websocket echo"), ("mesh", "mesh control stream echo")):
        result.append(("mesh", f"64 B round trip, {name}",
                       f"{spread(m[(kind, 'rtt')], unit=1e6, fmt='{:.0f}')} µs",
                       f"median of {RTT_ROUNDS} per run"))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("mode", choices=["serve", "client", "measure"])
    ap.add_argument("kind", nargs="?", choices=["tcp", "ws", "wsfloor", "mesh"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tuned", action="store_true", help="mesh-node run's allocator settings")
    ap.add_argument("--where", default="")
    ap.add_argument("--direction", type=int, default=DOWN)
    ap.add_argument("--n", type=int, default=BULK_BYTES)
    args = ap.parse_args()
    if args.tuned:
        from mesh_node.allocator import tune_for_streaming

        tune_for_streaming()
    if args.mode == "serve":
        if args.kind == "wsfloor":
            trio.run(_serve_ws, True)
        else:
            trio.run({"tcp": _serve_tcp, "ws": _serve_ws, "mesh": _serve_mesh}[args.kind])
    elif args.mode == "client":
        print(json.dumps(_run_client(args.kind, args.where, args.direction, args.n)))
    else:
        from benchlib import render  # type: ignore[import-not-found]

        ctx = BenchContext(Path(), Path(), args.runs, 0, True)
        print(render(rows(ctx)))


if __name__ == "__main__":
    main()
