"""The mesh on emulated WAN links, called by scripts/bench.py (section
"wan"). Every link crosses the lab's userspace relay (``mesh_node.lab.netem``).

- Serving: gemma3-270m on a 3-node lab split (``mesh-node lab``'s nodes, one thread per stage),
  its links set in turn to 0, 5, 20 and 50 ms RTT (one lab, ``Netem.set_links``), beside the
  same runtime as one stage (``mesh-node serve --stages 1``, one thread) asked in the same
  minutes: decode and prefill tok/s, time to first token, and the model
  ``t_token = sum(stage compute) + hops x one-way latency`` (3 hops per token: stage 0 -> 1
  -> 2 -> back to stage 0), with the stages' compute per token read from their own counters
  around each decode request: each stage's mean decode step (``decode_busy_s`` /
  ``decode_steps``: the ggml graph, the embedding on stage 0, the head and the sampling on
  the last stage; not the frames' encoding, encryption and sends, which are the overhead the
  goal bounds).
- Transfer: a 201 MB artifact from the coordinator to a worker over a link shaped to
  100 Mbit/s and 1 Gbit/s at 20 ms RTT (and 1 Gbit/s at 50 ms RTT, where a fixed 4 MiB
  stream window would cap it at 80 MB/s), vs the link rate: the worker's own record of the
  verified transfer.
- Failover stall: the same 3-stage split at 20 ms RTT with two spares; a streamed greedy
  completion, the node of stage 1 (then, in the next completion, of stage 2) killed with
  SIGKILL after ``FAILOVER_AT`` tokens: the time from the kill to the next token, beside the
  decode gap between tokens before it (the lab's ``peer_loss_timeout_s`` bounds how soon a
  crash is known: a killed process cannot be told from a reset connection).
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path
from typing import Any

import trio
from bench_serve import _complete, _long_prompt  # type: ignore[import-not-found]
from bench_transfer_mesh import _package, _wait_record  # type: ignore[import-not-found]
from benchlib import BenchContext, Row, random_file, spread  # type: ignore[import-not-found]
from servetools import split_cluster, wait_ready  # type: ignore[import-not-found]

from mesh_node.lab.netem import LinkSpec, LinkTable, format_rate
from mesh_node.lab.run import LabOptions, open_lab

MODEL = "gemma3-270m"
RTTS_MS = (0, 5, 20, 50)
HOPS = 3
DECODE_TOKENS = 32
TRANSFER_BYTES = 3 * 64 << 20  # whole 64 MiB blocks (benchlib.random_file): 201 MB
TRANSFERS = ((100e6 / 8, 0.02), (1e9 / 8, 0.02), (1e9 / 8, 0.05))  # (bytes/s, RTT s)


def _package_dir(ctx: BenchContext) -> Path:
    from bench_stage import _package as stage_package  # type: ignore[import-not-found]

    return Path(stage_package(ctx))


async def _busy(lab: Any) -> float:
    total = 0.0
    for doc in await lab.cluster.statuses():
        stage = (doc or {}).get("stage") or {}
        total += float(stage.get("compute_busy_s") or 0.0)
    return total


async def _steps(lab: Any) -> list[tuple[int, float]]:
    """Each stage's decode steps so far and their compute seconds (``StageHost.steps``)."""
    out = []
    for doc in await lab.cluster.statuses():
        stage = (doc or {}).get("stage") or {}
        out.append((int(stage.get("decode_steps") or 0), float(stage.get("decode_busy_s") or 0)))
    return out


def step_compute_s(before: list[tuple[int, float]], after: list[tuple[int, float]]) -> float:
    """The model's compute per token: the sum over stages of each stage's mean decode step
    between two readings (every stage runs one step per decoded token). Decode steps alone:
    the request's prompt prefill is not averaged in (it was, through ``compute_busy_s``)."""
    total = 0.0
    for (n0, s0), (n1, s1) in zip(before, after, strict=True):
        if n1 > n0:
            total += (s1 - s0) / (n1 - n0)
    return total


async def _serving(ctx: BenchContext, pkg: Path, single_api: str) -> dict[int, dict[str, Any]]:
    root = ctx.work / "wan-serve-lab"
    shutil.rmtree(root, ignore_errors=True)
    options = LabOptions(
        nodes=3, package=str(pkg), transfer="open", root=root, links=LinkTable(), serve=True
    )
    out: dict[int, dict[str, Any]] = {}
    async with open_lab(options) as lab:
        api, _, _ = await lab.start_serving()
        assert lab.netem is not None
        await trio.to_thread.run_sync(wait_ready, api, 300)
        long = _long_prompt()
        for rtt_ms in RTTS_MS:
            lab.netem.set_links(LinkTable(LinkSpec(rtt_s=rtt_ms / 1000)))
            await trio.sleep(2 * rtt_ms / 1000 + 0.5)  # the new delay reaches every link
            got: dict[str, list[float]] = {
                k: []
                for k in ("dec", "dec1", "pre", "pre1", "ttft", "ttft1", "compute", "compute_all")
            }
            for _ in range(ctx.runs):
                for name, where in (("", api), ("1", single_api)):
                    before, steps = await _busy(lab), await _steps(lab)
                    d = await trio.to_thread.run_sync(
                        _complete, where, "Once upon a time", DECODE_TOKENS
                    )
                    n = d["usage"]["completion_tokens"]
                    got["dec" + name].append((n - 1) / d["timings"]["decode_s"])
                    if not name:
                        got["compute_all"].append((await _busy(lab) - before) / n)
                        got["compute"].append(step_compute_s(steps, await _steps(lab)))
                    p = await trio.to_thread.run_sync(_complete, where, long, 1)
                    got["pre" + name].append(len(long) / p["timings"]["prefill_s"])
                    got["ttft" + name].append(p["timings"]["ttft_s"])
            out[rtt_ms] = got
    return out


def _serve_rows(ctx: BenchContext, relay_excess_ms: dict[int, float]) -> list[Row]:
    """The serving rows; ``relay_excess_ms``: the emulator's own median latency per one-way
    pass over its configured delay at each RTT (``_relay_rows``, same run), so the overhead is
    also given net of what a real link of that RTT would not add."""
    pkg = _package_dir(ctx)
    root = ctx.work / "wan-single"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    kw = {"budget": "4GiB", "n_ctx": 1024, "chunk": 128, "threads": 1, "sessions": 4}
    with split_cluster(root, pkg, workers=0, stages=1, **kw) as single:
        wait_ready(single.api, 300)
        got = trio.run(_serving, ctx, pkg, single.api)
    out: list[Row] = []
    for rtt_ms, g in got.items():
        dec, dec1 = statistics.median(g["dec"]), statistics.median(g["dec1"])
        compute_ms = statistics.median(g["compute"]) * 1000
        all_ms = statistics.median(g["compute_all"]) * 1000  # the old reading, for comparison
        model_ms = compute_ms + HOPS * rtt_ms / 2
        measured_ms = 1000 / dec
        relay_ms = HOPS * relay_excess_ms.get(rtt_ms, 0.0)
        out += [
            (MODEL, f"wan {rtt_ms} ms RTT: decode tok/s, 3-stage lab split / 1 stage",
             f"{spread(g['dec'], fmt='{:.1f}')} / {spread(g['dec1'], fmt='{:.1f}')}",
             f"{dec / dec1:.2f}x one stage; {measured_ms:.1f} ms/token vs model "
             f"{model_ms:.1f} (stage compute {compute_ms:.1f} + {HOPS} x {rtt_ms / 2:g}): "
             f"overhead {measured_ms - model_ms:+.1f} ms/token (goal <= 3), of which the "
             f"emulator's own forwarding {relay_ms:.1f} ({HOPS} passes at its measured median "
             f"excess): {measured_ms - model_ms - relay_ms:+.1f} net of it; decode steps only "
             f"(every stage's compute per request / tokens would say {all_ms:.1f})"),
            (MODEL, f"wan {rtt_ms} ms RTT: prefill tok/s (512 tokens), split / 1 stage",
             f"{spread(g['pre'], fmt='{:.0f}')} / {spread(g['pre1'], fmt='{:.0f}')}",
             f"{statistics.median(g['pre']) / statistics.median(g['pre1']):.2f}x one stage"),
            (MODEL, f"wan {rtt_ms} ms RTT: time to first token (512 tokens), split / 1 stage",
             f"{spread(g['ttft'], 1000, '{:.0f}')} / {spread(g['ttft1'], 1000, '{:.0f}')}", "ms"),
        ]
    return out


async def _transfer_runs(package: Path, work: Path, spec: LinkSpec, runs: int) -> list[float]:
    root = work / "wan-xfer-lab"
    shutil.rmtree(root, ignore_errors=True)
    options = LabOptions(
        nodes=2,
        package=str(package),
        transfer="open",
        root=root,
        timeout_s=600,
        # (calibration off: the memory planner places by budget; the cost planner would not)
        node_overrides={
            0: {"memory_budget": "1GiB", "calibration": "off"},
            1: {"memory_budget": "16GiB", "calibration": "off"},
        },
        links=LinkTable(spec),
    )
    rates: list[float] = []
    async with open_lab(options) as lab:
        coordinator, worker = lab.cluster.nodes
        for i in range(runs + 1):
            await lab.cluster.stop(1)
            shutil.rmtree(worker.data_dir / "hub", ignore_errors=True)
            shutil.rmtree(worker.root / "cache", ignore_errors=True)
            await lab.cluster.start(1)
            await lab.cluster.wait_meshed(60)
            response = await coordinator.request(
                {"op": "topology", "package": lab.package.ref, "stages": 2, "include_self": True},
                timeout_s=120,
            )
            record = await _wait_record(worker, response["topology"]["topology_id"])
            if i:  # the first run warms up
                rates.append(record["mb_per_s"])
    return rates


def _transfer_rows(ctx: BenchContext) -> list[Row]:
    big, digest = random_file(ctx, TRANSFER_BYTES, name="wan-transfer.gguf", layer=1)
    package = _package(ctx.work, "wan", big, digest, link=True)
    out: list[Row] = []
    for rate, rtt in TRANSFERS:
        spec = LinkSpec(rtt_s=rtt, rate_bytes_per_s=rate)
        rates = trio.run(_transfer_runs, package, ctx.work, spec, max(2, ctx.runs // 2))
        link_mb = rate / 1e6
        out.append(
            ("wan transfer", f"{TRANSFER_BYTES / 1e6:.0f} MB verified peer transfer, "
             f"{format_rate(rate)} at {rtt * 1000:g} ms RTT", f"{spread(rates, fmt='{:.1f}')} MB/s",
             f"{statistics.median(rates) / link_mb:.2f}x the link rate ({link_mb:g} MB/s; "
             "target >= 0.9x)"),
        )
    return out


def rows(ctx: BenchContext) -> list[Row]:
    relay_rows, relay_excess = _relay_rows(ctx)
    return (
        relay_rows
        + _window_rows(ctx)
        + _transfer_rows(ctx)
        + _serve_rows(ctx, relay_excess)
        + _failover_rows(ctx)
    )


# --- the failover stall at 20 ms RTT -----------------------------------------------------------
FAILOVER_RTT_S = 0.02
FAILOVER_TOKENS = 64
FAILOVER_AT = 16


def _stream_with_kill(api: str, pid: int, at: int) -> tuple[float, list[float]]:
    """Stream a greedy completion; SIGKILL ``pid`` once ``at`` tokens arrived. Returns the
    seconds from the kill to the next token and the gaps between tokens before the kill."""
    import itertools
    import json
    import os
    import signal
    import time
    import urllib.request

    body = {"prompt": "Once upon a time", "max_tokens": FAILOVER_TOKENS, "temperature": 0,
            "stream": True}
    req = urllib.request.Request(
        f"{api}/completions", data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    arrivals: list[float] = []
    killed_at: float | None = None
    after: float | None = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            if killed_at is not None and after is None:
                after = now
            arrivals.append(now)
            if len(arrivals) == at:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
    if killed_at is None or after is None:
        raise SystemExit(f"bench wan: the stream ended after {len(arrivals)} tokens")
    gaps = [b - a for a, b in itertools.pairwise(arrivals[:at])]
    return after - killed_at, gaps[1:]  # the first gap holds the prefill


async def _failover(ctx: BenchContext, pkg: Path) -> tuple[list[float], list[float], float]:
    root = ctx.work / "wan-failover-lab"
    shutil.rmtree(root, ignore_errors=True)
    options = LabOptions(
        nodes=5, stages=3, package=str(pkg), transfer="open", root=root, serve=True,
        links=LinkTable(LinkSpec(rtt_s=FAILOVER_RTT_S)),
    )
    stalls: list[float] = []
    gaps: list[float] = []
    async with open_lab(options) as lab:
        api, _, _ = await lab.start_serving()
        await trio.to_thread.run_sync(wait_ready, api, 300)
        loss_s = float(lab.options.node_config.get("peer_loss_timeout_s", 0.0))
        by_id = {n.node_id: n for n in lab.cluster.nodes}
        for stage in (1, 2):
            topology = (await lab.cluster.coordinator.status())["topology"]
            victim = by_id[topology["stages"][stage]["node_id"]]
            assert victim.process is not None
            stall, before = await trio.to_thread.run_sync(
                _stream_with_kill, api, victim.process.pid, FAILOVER_AT
            )
            stalls.append(stall)
            gaps += before
            await trio.to_thread.run_sync(wait_ready, api, 300)
    return stalls, gaps, loss_s


def _failover_rows(ctx: BenchContext) -> list[Row]:
    stalls, gaps, loss_s = trio.run(_failover, ctx, _package_dir(ctx))
    return [
        (MODEL, f"wan {FAILOVER_RTT_S * 1000:g} ms RTT: failover stall (SIGKILL of stage 1, "
         "then stage 2; 2 spares)", f"{spread(stalls, fmt='{:.2f}')} s",
         f"kill to next token; decode gap before it {statistics.median(gaps) * 1000:.0f} ms; "
         f"the lab's peer_loss_timeout_s is {loss_s:g} s"),
    ]


# --- one stream's window at a long RTT (in one process: both nodes and the relay) -----------------
WINDOW_RTT_S = 0.1
WINDOW_BYTES = 200 << 20


async def _stream_rate(tmp: Path, window_max: int) -> float:
    """MB/s of one mesh stream through the relay at WINDOW_RTT_S (no rate limit), receiver
    side, with the receive window allowed to grow to ``window_max``."""
    from meshtools import identity, settings  # type: ignore[import-not-found]

    from mesh_node.lab.netem import open_netem
    from mesh_node.node import MeshNode
    from mesh_node.settings import PeerAddress
    from protocol import constants as pc

    limits = pc.Limits(
        stream_window_max_bytes=window_max, handshake_timeout_s=5, idle_timeout_s=10
    )
    chunk = b"\0" * (1 << 20)

    async def serve(stream: Any) -> None:
        for _ in range(WINDOW_BYTES // len(chunk)):
            await stream.stream.send_all(chunk)
        await stream.stream.send_eof()
        await stream.stream.receive_some()  # until the reader's end: a close would reset

    ia, ib = identity(), identity()
    timeouts = {"heartbeat_interval_s": 0.5, "peer_loss_timeout_s": 10.0}
    async with (
        open_netem(LinkTable(LinkSpec(rtt_s=WINDOW_RTT_S))) as netem,
        trio.open_nursery() as nursery,
    ):
        a = MeshNode(settings(tmp, "a", **timeouts), ia, limits=limits)
        a.register_subprotocol(0x7F, serve)
        await nursery.start(a.run)
        assert a.listen_url is not None
        host, port = a.listen_url.removeprefix("ws://").rsplit(":", 1)
        netem.set_target("a", lambda: (host, int(port)))
        url = (await netem.route("b", "a")).removeprefix("ws://")
        rh, rp = url.rsplit(":", 1)
        b = MeshNode(
            settings(tmp, "b", peers=(PeerAddress(host, int(port), ia.node_id),),
                     dial_via={ia.node_id: PeerAddress(rh, int(rp), ia.node_id)}, **timeouts),
            ib, limits=limits,
        )
        await nursery.start(b.run)
        while (peer := b.peer(ia.node_id)) is None or peer.rtt_s is None:
            await trio.sleep(0.05)
        stream = await b.open_stream(ia.node_id, 0x7F)
        got, t0 = 0, trio.current_time()
        while got < WINDOW_BYTES and (data := await stream.receive_some()):
            got += len(data)
        seconds = trio.current_time() - t0
        await stream.send_eof()
        nursery.cancel_scope.cancel()
    return got / seconds / 1e6


def _window_rows(ctx: BenchContext) -> list[Row]:
    fixed, grown = [], []
    for i in range(max(2, ctx.runs // 2)):
        root = ctx.work / f"wan-window-{i}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        fixed.append(trio.run(_stream_rate, root, 4 << 20))
        grown.append(trio.run(_stream_rate, root, 16 << 20))
    cap = (4 << 20) / WINDOW_RTT_S / 1e6
    return [
        ("wan stream", f"one mesh stream at {WINDOW_RTT_S * 1000:g} ms RTT (unshaped, one "
         "process): window fixed at 4 MiB / growing to 16 MiB",
         f"{spread(fixed, fmt='{:.1f}')} / {spread(grown, fmt='{:.1f}')} MB/s",
         f"{statistics.median(grown) / statistics.median(fixed):.2f}x; a fixed 4 MiB window "
         f"caps it at {cap:.0f} MB/s"),
    ]


# --- the emulator's own accuracy: what a relay adds over its configured delay ------------------
RELAY_RTTS_S = tuple(ms / 1000 for ms in RTTS_MS)  # the serving rows' RTTs
RELAY_PINGS = 300
_ECHO = """
import functools, trio
async def handler(s):
    try:
        while data := await s.receive_some(65536):
            await s.send_all(data)
    except trio.BrokenResourceError:
        pass
async def main():
    async with trio.open_nursery() as n:
        serve = functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1")
        (listener,) = await n.start(serve)
        print(listener.socket.getsockname()[1], flush=True)
trio.run(main)
"""
_PINGER = """
import json, socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
msg, out = b"x" * 2560, []  # one gemma3 decode frame's activations
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    s.sendall(msg)
    got = 0
    while got < len(msg):
        got += len(s.recv(65536))
    out.append(time.perf_counter() - t)
    time.sleep(0.005)
print(json.dumps(out))
"""


def _pings(port: int) -> list[float]:
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _PINGER, str(port), str(RELAY_PINGS)],
        capture_output=True, text=True, check=True,
    )
    return list(json.loads(out.stdout))


async def _relayed(port: int, rtt_s: float) -> tuple[list[float], list[float]]:
    from mesh_node.lab.netem import open_netem

    async with open_netem(LinkTable(LinkSpec(rtt_s=rtt_s))) as netem:
        netem.set_target("b", lambda: ("127.0.0.1", port))
        relay_port = int((await netem.route("a", "b")).rsplit(":", 1)[1])
        pings = await trio.to_thread.run_sync(_pings, relay_port)
        late = [e.sent_s - e.arrive_s for e in netem.events if e.kind == "chunk"]
    return pings, late


def _relay_rows(ctx: BenchContext) -> tuple[list[Row], dict[int, float]]:
    """Ping-pong of 2.5 KiB frames to an echo process, direct and through one relay (this
    process) at each configured RTT: the relay's excess over direct + configured, per one-way
    pass, and its own log's lateness (written minus due); and the median excess (ms) per RTT
    (ms) for the serving rows."""
    import subprocess
    import sys

    echo = subprocess.Popen([sys.executable, "-c", _ECHO], stdout=subprocess.PIPE, text=True)
    try:
        assert echo.stdout is not None
        port = int(echo.stdout.readline())
        direct = statistics.median(_pings(port))
        out: list[Row] = []
        medians: dict[int, float] = {}
        for rtt in RELAY_RTTS_S:
            pings, late = trio.run(_relayed, port, rtt)
            excess = sorted((p - direct - rtt) / 2 for p in pings)
            medians[round(rtt * 1000)] = 1000 * excess[len(excess) // 2]
            late.sort()
            out.append(
                ("wan relay", f"added latency per one-way pass over its configured "
                 f"{rtt * 500:g} ms ({RELAY_PINGS} ping-pongs of 2.5 KiB)",
                 f"{1000 * excess[len(excess) // 2]:.2f} ms median, "
                 f"{1000 * excess[len(excess) // 10]:.2f} p10, "
                 f"{1000 * excess[9 * len(excess) // 10]:.2f} p90",
                 f"written after due (its log): {1000 * late[len(late) // 2]:.2f} ms median, "
                 f"{1000 * late[9 * len(late) // 10]:.2f} p90; direct round trip "
                 f"{direct * 1000:.2f} ms"),
            )
        return out, medians
    finally:
        echo.kill()
        echo.wait()
