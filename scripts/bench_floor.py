"""The machine's floor for split decode, called by scripts/bench.py (section
"floor").

What a 3-stage split on one host can reach at best, with no mesh at all: the real ggml stages
of gemma3-270m (0..6, 6..12, 12..18; the last holds the tied head and samples greedily) in
three processes that pass each token's activations over blocking loopback TCP with a 4-byte
length prefix (no trio, no WebSocket, no Noise, no multiplexer, no acks), against the whole
model in one process. Both sides run ggml with 2 threads, the serve rows' setting, with the
same OpenMP environment the runtime sets; the rounds alternate one process / three processes,
each side a fresh session of the same prompt and the same tokens.

Rows: decode ms/token each way and their ratio (the serve rows' "3-node split >= 0.85x one
stage" asks the mesh for at least this), and the three stages' summed compute per token in
their processes against the one process's (what separate processes cost the graphs
themselves: wake-ups, OpenMP pools that slept, caches the other stages evicted).

Every process here is started and stopped by PID by this script; sockets are loopback only,
each wait is bounded.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import ROOT, BenchContext, Row, spread  # type: ignore[import-not-found]

MODEL = "gemma3-270m"
RANGES = ("0..6", "6..12", "12..18")
THREADS = 2
N_CTX = 1024
TOKENS = 64
PROMPT = [2, 818, 5279, 529, 7001, 563]
WAIT_S = 120.0  # any socket wait; a stage process that does not answer in this fails the run


def rows(ctx: BenchContext) -> list[Row]:
    from bench_stage import _package  # type: ignore[import-not-found]

    pkg = Path(_package(ctx))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), "parent", str(pkg), str(max(ctx.runs, 3))],
        capture_output=True,
        text=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
        cwd=ROOT,
        timeout=900,
    )
    if proc.returncode != 0:
        raise SystemExit(f"bench_floor failed:\n{proc.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    one, three = res["one_ms"], res["three_ms"]
    ratios = [a / b for a, b in zip(one, three, strict=True)]
    return [
        (MODEL, f"floor: decode ms/token, whole model in one process ({THREADS} threads)",
         spread(one, fmt="{:.2f}"), f"{TOKENS} greedy tokens per round, rounds alternating"),
        (MODEL, "floor: decode ms/token, 3 processes over blocking loopback TCP (no mesh)",
         spread(three, fmt="{:.2f}"),
         f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})x one process "
         f"per round: the best a 3-stage split reaches here (the serve row's target: 0.85x)"),
        (MODEL, "floor: summed stage compute per token, 3 processes / one process",
         f"{res['three_compute_ms']:.2f} / {res['one_compute_ms']:.2f} ms",
         "the graphs alone: what separate processes cost them (stages "
         f"{'/'.join(RANGES)}, the head on the last)"),
    ]


# --- the processes -------------------------------------------------------------------------------
def _load(pkg: str, layers: str) -> Any:
    from bench_stage import _stage_loads  # type: ignore[import-not-found]

    from skippy.gguf.ggml import configure_openmp

    configure_openmp()  # as a node does, before libgomp loads
    from skippy.runtime.ggml_engine import GgmlStage
    from skippy.runtime.stage import StageConfig

    return GgmlStage(_stage_loads(pkg, (layers,))[0], StageConfig(n_ctx=N_CTX, n_threads=THREADS))


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("<I", len(payload)) + payload)


def _recv(sock: socket.socket) -> bytes:
    def exact(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    (n,) = struct.unpack("<I", exact(4))
    return exact(n)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _accept(listener: socket.socket) -> socket.socket:
    listener.settimeout(WAIT_S)
    sock, _ = listener.accept()
    sock.settimeout(WAIT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _activations(out: Any, position: int) -> bytes:
    import numpy as np

    rows = np.ascontiguousarray(out.activations, dtype=np.float32)
    return struct.pack("<ii", position, rows.shape[0]) + rows.tobytes()


def child_stage(pkg: str, index: int, listen_fd: int, next_port: int) -> None:
    """Stage ``index`` (1 or 2): activations in from the previous process, out to the next
    (the last stage sends the greedy token back to stage 0). Prints its decode compute per
    step when the previous process closes."""
    import numpy as np

    from skippy.runtime.sampling import Sampler

    stage = _load(pkg, RANGES[index])
    listener = socket.socket(fileno=listen_fd)
    print("ready", flush=True)
    nxt = _connect(next_port)
    prev = _accept(listener)
    final = index == len(RANGES) - 1
    busy, steps = 0.0, 0
    while True:
        try:
            msg = _recv(prev)
        except EOFError:
            break
        position, n = struct.unpack("<ii", msg[:8])
        x = np.frombuffer(msg[8:], dtype=np.float32).reshape(n, -1)
        sampler = Sampler() if final else None
        if position == 0:
            stage.free("s")
            out = stage.prefill("s", 0, x, sampler=sampler)
        else:
            t = time.perf_counter()
            out = stage.decode("s", position, x, sampler=sampler)
            busy += time.perf_counter() - t
            steps += 1
        _send(nxt, struct.pack("<i", int(out.token)) if final else _activations(out, position))
    nxt.close()
    stage.close()
    print(json.dumps({"compute_ms": 1000 * busy / max(steps, 1)}), flush=True)


def child_whole(pkg: str) -> None:
    """The whole model in one process: a round per "go" line, its decode seconds and compute
    per step printed."""
    import numpy as np

    from skippy.runtime.sampling import Sampler

    stage = _load(pkg, f"0..{RANGES[-1].split('..')[1]}")
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        stage.free("s")
        prompt = np.asarray(PROMPT, dtype=np.int64)
        tok = int(stage.prefill("s", 0, prompt, sampler=Sampler()).token)
        busy = 0.0
        start = time.perf_counter()
        for i in range(TOKENS):
            t = time.perf_counter()
            tok = int(stage.decode("s", len(PROMPT) + i, np.asarray([tok], dtype=np.int64),
                                   sampler=Sampler()).token)
            busy += time.perf_counter() - t
        print(json.dumps({"s": time.perf_counter() - start, "compute_s": busy}), flush=True)
    stage.close()


def parent(pkg: str, rounds: int) -> None:
    """Stage 0 here, stages 1 and 2 and the whole model in child processes."""
    import numpy as np

    listeners = [socket.socket() for _ in RANGES]
    for sock in listeners:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
    ports = [sock.getsockname()[1] for sock in listeners]
    me = [sys.executable, str(Path(__file__))]
    procs: list[subprocess.Popen[str]] = []
    try:
        for i in (1, 2):
            fd = listeners[i].fileno()
            procs.append(subprocess.Popen(
                [*me, "stage", pkg, str(i), str(fd), str(ports[(i + 1) % len(RANGES)])],
                stdout=subprocess.PIPE, text=True, pass_fds=(fd,),
            ))
        whole = subprocess.Popen([*me, "whole", pkg], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        procs.append(whole)
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise SystemExit(f"bench_floor: child {p.args} did not start")
        stage0 = _load(pkg, RANGES[0])
        nxt = _connect(ports[1])
        prev = _accept(listeners[0])
        one: list[float] = []
        three: list[float] = []
        one_busy = three_busy = 0.0
        assert whole.stdin is not None and whole.stdout is not None
        for _ in range(rounds):
            whole.stdin.write("go\n")
            whole.stdin.flush()
            doc = json.loads(whole.stdout.readline())
            one.append(1000 * doc["s"] / TOKENS)
            one_busy += doc["compute_s"]
            stage0.free("s")
            out = stage0.prefill("s", 0, np.asarray(PROMPT, dtype=np.int64))
            _send(nxt, _activations(out, 0))
            tok = struct.unpack("<i", _recv(prev))[0]
            start = time.perf_counter()
            for i in range(TOKENS):
                t = time.perf_counter()
                out = stage0.decode("s", len(PROMPT) + i, np.asarray([tok], dtype=np.int64))
                three_busy += time.perf_counter() - t
                _send(nxt, _activations(out, len(PROMPT) + i))
                tok = struct.unpack("<i", _recv(prev))[0]
            three.append(1000 * (time.perf_counter() - start) / TOKENS)
        whole.stdin.close()
        nxt.close()
        computes = [three_busy * 1000 / (rounds * TOKENS)]
        for p in procs[:2]:
            assert p.stdout is not None
            computes.append(json.loads(p.stdout.readline())["compute_ms"])
        for p in procs:
            p.wait(timeout=WAIT_S)
        stage0.close()
        print(json.dumps({
            "one_ms": one,
            "three_ms": three,
            "one_compute_ms": one_busy * 1000 / (rounds * TOKENS),
            "three_compute_ms": sum(computes),
        }))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "parent":
        parent(args[0], int(args[1]))
    elif cmd == "stage":
        child_stage(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif cmd == "whole":
        child_whole(args[0])
    else:
        raise SystemExit(f"bench_floor: unknown command {cmd!r}")
