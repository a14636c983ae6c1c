"""Hostile peers against one real `mesh-node run` (the figures), called by
scripts/bench.py (section "adversary"); also runnable alone (``python scripts/bench_adversary.py
--work DIR``).

The victim is one `mesh-node run` process on loopback with the default `[security]` budgets.
The attack clients are built on our own ``protocol/`` (a real Noise handshake, then chosen
frames, as tests/mesh_node/test_untrusted_peers.py does) and run in a child process of this
script, so
the honest measurements here (pings, connect times) do not share an event loop with them:
- memory: 32 links from fresh keys (no certificate), each opening 32 control streams and
  sending a 1 MiB length prefix plus 1 MiB - 1 bytes on each; the victim's RSS at the start,
  its peak (VmHWM, reset before the attack) and 3 s after the attackers left, against
  ``peer_memory_budget`` + 100 MB and start + 50 MB; an honest link's ping RTT meanwhile;
- burst: 200 WebSocket upgrades from one address that then stay silent; a legitimate peer's
  connect time (dial to the victim's Hello) meanwhile, against 2 s;
- membership: links from fresh keys fill the victim's membership (cap lowered to
  ``MEMBERS`` through `[security] max_members`: 1024 handshakes take minutes on this machine),
  then a peer of the victim's own owner joins: dial to Hello, against 2 s;
- refusals: one certificate-less link (tests/support/hostile_peer.py ``requests``) asks the victim,
  which serves artifacts to trusted peers only, ``FLOOD_PER_KIND`` requests on each artifact
  kind (0x03, 0x04, 0x05), 16 streams at once; the victim's CPU share and log bytes a second
  meanwhile, and how many requests it answered (read, decided: work) vs refused at the open.
Bounded: every wait has a deadline, only this script's child PIDs are stopped.
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from benchlib import BenchContext, Row  # type: ignore[import-not-found]

MIB = 1024 * 1024
LINKS, STREAMS = 32, 32
HOLD_S = 3.0  # the attack holds its streams this long before leaving
SEND_S = 10.0  # each attacking link sends for at most this long
AFTER_S = 3.0  # RSS "after" is read this long after the attackers left
BURST = 200
MEMBERS = 128  # the membership cap the membership figure runs with (default 1024)
BUDGET_BYTES = 256 * MIB  # the default peer_memory_budget
PING_EVERY_S = 0.05
FLOOD_PER_KIND = 3000  # refused requests asked per artifact kind
HOSTILE = Path(__file__).resolve().parent.parent / "tests" / "hostile_peer.py"


# --- protocol-level clients (shared by this process and the attack child) ----------------------
@asynccontextmanager
async def raw_link(
    url: str, source: str = "127.0.0.1", certificate: Any = None, key: Any = None
) -> AsyncIterator[tuple[Any, Any, Any]]:
    """A real Noise handshake from ``source`` (a loopback address), then hand-driven frames."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from trio_websocket import wrap_client_stream

    from protocol.handshake import Handshake
    from protocol.streams import Multiplexer

    host, port = url.removeprefix("ws://").split("#")[0].rsplit(":", 1)
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect((host, int(port)))
    async with trio.open_nursery() as nursery:
        ws = await wrap_client_stream(nursery, trio.SocketStream(sock), host, "/",
                                      max_message_size=4 * MIB)
        try:
            hs = Handshake(initiator=True, identity=key or Ed25519PrivateKey.generate(),
                           certificate=certificate)
            await ws.send_message(hs.start())
            reply = hs.receive(await ws.get_message())
            assert reply is not None and hs.channel is not None
            await ws.send_message(reply)
            yield ws, hs.channel, Multiplexer(initiator=True)
        finally:
            with trio.move_on_after(1):
                await ws.aclose()
            nursery.cancel_scope.cancel()


async def flush(ws: Any, channel: Any, mux: Any) -> None:
    records: list[bytes] = []
    while (record := mux.next_record()) is not None:
        records.append(record)
        if len(records) == 16:
            await ws.send_message(channel.seal(records))
            records = []
    if records:
        await ws.send_message(channel.seal(records))


async def events_in(ws: Any, channel: Any, mux: Any) -> list[Any]:
    events: list[Any] = []
    for plaintext in channel.open(await ws.get_message()):
        events += mux.receive(plaintext)
    return events


async def until_hello(ws: Any, channel: Any, mux: Any, timeout_s: float) -> bool:
    """True once the victim's Hello arrived (it sends one only to a member it admitted)."""
    with trio.move_on_after(timeout_s):
        while True:
            try:
                events = await events_in(ws, channel, mux)
            except Exception:  # closed: refused
                return False
            await flush(ws, channel, mux)  # pongs for its pings
            if any(type(e).__name__ == "LinkMessageReceived" for e in events):
                return True
    return False


# --- the attack child --------------------------------------------------------------------------
async def _memory_attack(url: str, links: int, streams: int) -> None:
    from trio_websocket import ConnectionClosed

    from protocol import constants as pc
    from protocol import frames as f

    payload = struct.pack(">I", MIB) + b"x" * (MIB - 1)
    sent = closed = 0
    leave = trio.Event()

    async def attacker(i: int) -> None:
        nonlocal closed
        try:
            await attack_link(i)
        except* (ConnectionClosed, trio.BrokenResourceError):
            closed += 1  # the victim dropped this link

    async def attack_link(i: int) -> None:
        nonlocal sent
        async with raw_link(url, source=f"127.0.1.{1 + i // 8}") as (ws, channel, mux):
            sids = [mux.open_stream(f.SubprotocolOpen(pc.SKIPPY_STAGE, pc.SKIPPY_STAGE_MAJOR,
                                                      pc.KIND_CONTROL)) for _ in range(streams)]
            await flush(ws, channel, mux)
            accepted: set[int] = set()
            with trio.move_on_after(10):
                while len(accepted) < len(sids):
                    for e in await events_in(ws, channel, mux):
                        if type(e).__name__ == "StreamAccepted":
                            accepted.add(e.stream_id)
            # The victim may stop reading (TCP pushes back): stop queueing at the deadline,
            # but never cancel a sealed message mid-write (a nonce gap kills the link).
            deadline = trio.current_time() + SEND_S
            for sid in sorted(accepted):
                if trio.current_time() > deadline:
                    break
                if mux.send_capacity(sid) >= len(payload):
                    mux.send_data(sid, payload)
                    await flush(ws, channel, mux)
            sent += 1
            # Keep the link alive (answer pings) until told to leave.
            with trio.move_on_after(60):
                while not leave.is_set():
                    with trio.move_on_after(0.2):
                        await events_in(ws, channel, mux)
                    await flush(ws, channel, mux)

    async with trio.open_nursery() as nursery:
        for i in range(links):
            nursery.start_soon(attacker, i)
        with trio.move_on_after(60):
            while sent + closed < links:
                await trio.sleep(0.05)
        print(f"sent {sent} {closed}", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        leave.set()
    print(f"left {closed}", flush=True)


async def _fill(url: str, links: int) -> None:
    """Fresh-key links that stay connected (membership entries); per address 8 at a time."""
    from trio_websocket import ConnectionClosed

    admitted = 0
    leave = trio.Event()

    async def member(i: int) -> None:
        nonlocal admitted
        async with raw_link(url, source=f"127.0.2.{1 + i // 8}") as (ws, channel, mux):
            if await until_hello(ws, channel, mux, 20):
                admitted += 1
            while not leave.is_set():
                with trio.move_on_after(0.2):
                    await events_in(ws, channel, mux)
                await flush(ws, channel, mux)

    async def member_or_evicted(i: int) -> None:
        try:
            await member(i)
        except* (ConnectionClosed, trio.BrokenResourceError):
            pass  # evicted for a trusted peer

    async with trio.open_nursery() as nursery:
        for i in range(links):
            nursery.start_soon(member_or_evicted, i)
        with trio.move_on_after(60):
            while admitted < links:
                await trio.sleep(0.05)
        print(f"admitted {admitted}", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        leave.set()
    print("left", flush=True)


# --- measurements (this process) ---------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    """The process's user + system CPU time so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_kib(pid: int, field: str = "VmRSS:") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


class _Sampler:
    """The victim's VmRSS every 20 ms in a thread (the peak is also read from VmHWM)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_kib, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak_kib = max(self.peak_kib, _rss_kib(self.pid))
            except OSError:
                return

    def __enter__(self) -> _Sampler:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # reset VmHWM
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, _rss_kib(self.pid, "VmHWM:"))


async def _pinger(url: str, rtts: list[float], stop: trio.Event, owner: Any = None) -> None:
    """An honest link to the victim (of its own owner when ``owner`` is given: trusted):
    one PING at a time, its PONG's round trip."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from mesh_node.identity import issue_certificate, node_id_of

    key = Ed25519PrivateKey.generate()
    cert = issue_certificate(owner, node_id_of(key), days=1) if owner is not None else None
    async with raw_link(url, source="127.0.5.1", certificate=cert, key=key) as (
        ws, channel, mux,
    ):
        await until_hello(ws, channel, mux, 5)
        seq = 0
        while not stop.is_set():
            seq += 1
            mux.ping(struct.pack(">Q", seq))
            t0 = time.perf_counter()
            await flush(ws, channel, mux)
            with trio.move_on_after(5):
                done = False
                while not done:
                    for e in await events_in(ws, channel, mux):
                        done = done or type(e).__name__ == "PongReceived"
                    await flush(ws, channel, mux)
            rtts.append(time.perf_counter() - t0)
            if rtts[-1] > 0.05 and os.environ.get("BENCH_ADVERSARY_DEBUG"):
                print(f"slow ping {rtts[-1] * 1000:.0f} ms at {time.time() % 1000:.2f}",
                      file=sys.stderr)
            await trio.sleep(PING_EVERY_S)


def _child(mode: str, url: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, mode, url, *args], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )


def _expect(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(prefix):
        raise SystemExit(f"bench adversary: the attack child said {line!r}, not {prefix!r}")
    return line


def _leave(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("leave\n")
    proc.stdin.flush()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def memory_attack(url: str, pid: int, owner: Any) -> dict[str, Any]:
    rtts_before: list[float] = []
    rtts: list[float] = []
    rtts_untrusted: list[float] = []

    async def main() -> dict[str, Any]:
        stop = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(_pinger, url, rtts_before, stop, owner)
            await trio.sleep(1.0)
            stop.set()
        await trio.sleep(0.5)
        start = _rss_kib(pid)
        stop = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(_pinger, url, rtts, stop, owner)
            n.start_soon(_pinger, url, rtts_untrusted, stop)
            await trio.sleep(0.3)
            rtts.clear()
            rtts_untrusted.clear()
            cpu0, wall0 = _cpu_s(pid), time.perf_counter()
            with _Sampler(pid) as sampler:
                debug = os.environ.get("BENCH_ADVERSARY_DEBUG")
                if debug:
                    print(f"attack starts at {time.time() % 1000:.2f}", file=sys.stderr)
                child = _child("attack-memory", url, str(LINKS), str(STREAMS))
                sent = await trio.to_thread.run_sync(_expect, child, "sent")
                if debug:
                    print(f"attack sent at {time.time() % 1000:.2f}", file=sys.stderr)
                await trio.sleep(HOLD_S)
                child_cpu = _cpu_s(child.pid)
                await trio.to_thread.run_sync(_leave, child)
                if debug:
                    print(f"attackers left at {time.time() % 1000:.2f}", file=sys.stderr)
            stop.set()
        wall = time.perf_counter() - wall0
        cpu, child_cpu = (_cpu_s(pid) - cpu0) / wall, child_cpu / wall
        await trio.sleep(AFTER_S)
        return {"start_kib": start, "peak_kib": sampler.peak_kib, "after_kib": _rss_kib(pid),
                "sent": sent.split()[1], "dropped": sent.split()[2], "cpu": cpu,
                "child_cpu": child_cpu}

    out = trio.run(main)
    out["rtt_before"], out["rtt"], out["rtt_untrusted"] = rtts_before, rtts, rtts_untrusted
    return out


def burst_connect(url: str, runs: int) -> list[float]:
    """The issue's lockout: 200 silent upgrades from one address; then a peer connects."""
    host, port = url.removeprefix("ws://").split("#")[0].rsplit(":", 1)
    times: list[float] = []

    async def upgrade(held: list[trio.SocketStream]) -> None:
        with trio.move_on_after(5):
            sock = trio.socket.socket()
            await sock.bind(("127.0.3.1", 0))
            await sock.connect((host, int(port)))
            stream = trio.SocketStream(sock)
            held.append(stream)
            await stream.send_all(
                f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n".encode()
            )
            await stream.receive_some(4096)

    async def one() -> None:
        held: list[trio.SocketStream] = []
        async with trio.open_nursery() as n:
            for _ in range(BURST):
                n.start_soon(upgrade, held)
            await trio.sleep(0.05)  # the burst is under way
            t0 = time.perf_counter()
            async with raw_link(url, source="127.0.3.200") as (ws, channel, mux):
                ok = await until_hello(ws, channel, mux, 10)
            times.append(time.perf_counter() - t0 if ok else float("inf"))
        for s in held:
            await s.aclose()
        await trio.sleep(2.5)  # the address's token bucket refills before the next round

    for _ in range(runs):
        trio.run(one)
    return times


def trusted_join(url: str, owner_key: Any, runs: int) -> tuple[list[float], str]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from mesh_node.identity import issue_certificate, node_id_of

    child = _child("fill", url, str(MEMBERS))
    admitted = _expect(child, "admitted").split()[1]
    times: list[float] = []

    async def one() -> None:
        key = Ed25519PrivateKey.generate()
        cert = issue_certificate(owner_key, node_id_of(key), days=1)
        t0 = time.perf_counter()
        async with raw_link(url, source="127.0.4.1", certificate=cert, key=key) as (
            ws, channel, mux,
        ):
            ok = await until_hello(ws, channel, mux, 10)
        times.append(time.perf_counter() - t0 if ok else float("inf"))

    try:
        for _ in range(runs):
            trio.run(one)
    finally:
        _leave(child)
    return times, admitted


def refusal_flood(victim: Any, root: Path) -> dict[str, Any]:
    """The victim's CPU and log while one stranger floods it with refused requests."""
    from mesh_node.identity import write_private_key

    key = root / "hostile.key"
    write_private_key(key)
    pid = victim.popen.pid
    child = subprocess.Popen(
        [sys.executable, str(HOSTILE), "requests", str(key), victim.address,
         str(FLOOD_PER_KIND)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        _expect(child, "linked")  # timed from the link, not the child's start-up
        lines0, bytes0 = victim.log_written
        cpu0, t0 = _cpu_s(pid), time.monotonic()
        stdout, stderr = child.communicate(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    wall = time.monotonic() - t0
    cpu = _cpu_s(pid) - cpu0
    if child.returncode != 0:
        raise SystemExit(f"bench adversary: the flood child failed: {stderr[-2000:]}")
    kinds = {}
    for line in stdout.splitlines():
        if line.startswith("result "):
            _, kind, *counts = line.split()
            kinds[kind] = dict(c.split("=") for c in counts)
    time.sleep(0.5)  # the victim's last lines through the pump
    return {
        "wall_s": wall, "cpu": cpu / wall, "kinds": kinds,
        "log_lines": victim.log_written[0] - lines0,
        "log_bytes_per_s": (victim.log_written[1] - bytes0) / wall,
    }


def _fmt_ms(times: list[float]) -> str:
    ms = [t * 1000 for t in times]
    return f"{statistics.median(ms):.0f} ms ({min(ms):.0f}..{max(ms):.0f})"


def _fmt_rtt(times: list[float]) -> str:
    ms = sorted(t * 1000 for t in times)
    p90 = ms[int(0.9 * (len(ms) - 1))]
    over = sum(1 for t in ms if t >= 50)
    return (f"median {statistics.median(ms):.0f} ms, p90 {p90:.0f}, max {ms[-1]:.0f} "
            f"({over} of {len(ms)} >= 50 ms)")


def rows(ctx: BenchContext) -> list[Row]:
    from servetools import Cluster, node_toml  # type: ignore[import-not-found]

    from mesh_node.identity import issue_certificate, write_certificate

    root = ctx.work / "adversary"
    if root.exists():
        import shutil

        shutil.rmtree(root)
    root.mkdir(parents=True)
    cluster = Cluster(root)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    owner = Ed25519PrivateKey.generate()
    toml = node_toml(root, "victim")
    node_id = subprocess.run([sys.executable, "-m", "mesh_node", "id", str(root / "victim.key")],
                             capture_output=True, text=True, check=True).stdout.strip()
    write_certificate(root / "victim.cert", issue_certificate(owner, node_id, days=1))
    # The defaults (timeouts; [security]: trusted / trusted, a 256 MiB peer budget) but a
    # lowered membership cap.
    head = toml.split("heartbeat_interval_s")[0]
    toml = head + (
        'certificate = "victim.cert"\nartifact_transfer = "trusted"\n'
        f"[security]\nmax_members = {MEMBERS}\n"
    )

    out: list[Row] = []
    try:
        victim = cluster.start("victim", ["run"], toml)
        victim.address = victim.wait_line("listening ")
        pid = victim.popen.pid
        mem = memory_attack(victim.address, pid, owner)
        if os.environ.get("BENCH_ADVERSARY_DEBUG"):
            doc = cluster.status("victim")
            linked = sum(1 for p in doc.get("peers", []) if p.get("connected"))
            print("after:", doc.get("security"), linked, file=sys.stderr)
            for line in victim.log:
                if "closing" in line:
                    print("victim:", line[:200], file=sys.stderr)
        budget_mb = BUDGET_BYTES / 1e6
        start, peak, after = (mem[k] * 1024 / 1e6 for k in ("start_kib", "peak_kib", "after_kib"))
        out.append(("adversary", f"{LINKS} hostile links x {STREAMS} streams x 2 MiB: victim RSS "
                    "start / peak / 3 s after", f"{start:.0f} / {peak:.0f} / {after:.0f} MB",
                    f"peak {peak:.0f} vs budget + 100 = {budget_mb + 100:.0f} MB "
                    f"({peak / (budget_mb + 100):.2f}x); after - start {after - start:+.0f} MB "
                    f"(target <= +50); {mem['sent']} links sent, {mem['dropped']} dropped by "
                    "the victim before"))
        rtt, rtt_u = mem["rtt"], mem["rtt_untrusted"]
        out.append(("adversary", "honest trusted link (same owner) ping RTT during the memory "
                    "attack", _fmt_rtt(rtt),
                    f"target < 50 ms (max {max(rtt) / 0.05:.1f}x); before "
                    f"the attack {_fmt_ms(mem['rtt_before'])}; the victim used "
                    f"{mem['cpu']:.0%} of a core meanwhile, the attack child "
                    f"{mem['child_cpu']:.0%}; load average "
                    f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"))
        out.append(("adversary", "honest untrusted link (no certificate) ping RTT, same run",
                    _fmt_rtt(rtt_u), "shares the untrusted half of the budget with the "
                    "attackers"))
        burst = burst_connect(victim.address, ctx.runs)
        out.append(("adversary", f"legitimate peer connect (dial to Hello) during a {BURST}-"
                    "upgrade silent burst from one address", _fmt_ms(burst),
                    f"target < 2 s ({max(burst) / 2:.2f}x of it at worst); {len(burst)} runs"))
        join, admitted = trusted_join(victim.address, owner, ctx.runs)
        out.append(("adversary", f"trusted peer joins a full membership (cap lowered to "
                    f"{MEMBERS} via [security] max_members)", _fmt_ms(join),
                    f"target < 2 s ({max(join) / 2:.2f}x at worst); {admitted} untrusted members"
                    f" held it full; {len(join)} runs (each evicts one)"))
        flood = refusal_flood(victim, root)
        total = 3 * FLOOD_PER_KIND
        answered = sum(int(k.get("answered", 0)) for k in flood["kinds"].values())
        limited = sum(int(k.get("limited", 0)) for k in flood["kinds"].values())
        per_kind = ", ".join(f"{kind} {k.get('answered')}" for kind, k in flood["kinds"].items())
        out.append(("adversary", f"one untrusted link floods refused requests on kinds 0x03/"
                    f"0x04/0x05 ({FLOOD_PER_KIND} each, 16 at once): victim CPU and log",
                    f"{flood['cpu']:.0%} of a core, {flood['log_bytes_per_s'] / 1e6:.3f} MB/s "
                    "of log", f"{total / flood['wall_s']:.0f} requests/s for "
                    f"{flood['wall_s']:.1f} s; answered {answered} ({per_kind}), refused at "
                    f"the open {limited}; {flood['log_lines']} log lines (before the refusal "
                    "budget: 0.7-0.9 of a core, 0.18-0.37 MB/s, every request answered)"))
    finally:
        cluster.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="bench")
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-adversary"))
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if args.mode == "attack-memory":
        url, links, streams = args.rest
        trio.run(_memory_attack, url, int(links), int(streams))
    elif args.mode == "fill":
        url, links = args.rest
        trio.run(_fill, url, int(links))
    else:
        from benchlib import render  # type: ignore[import-not-found]

        ctx = BenchContext(Path(os.devnull), args.work, args.runs, 0, True)
        print(render(rows(ctx)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
