"""The soak: a 3-stage split plus one spare (real processes) under steady
client load while a random worker is SIGKILLed and started again with its own config, every
``kill_every_s`` seconds. Used by tests/processes/test_soak.py (short) and scripts/bench_soak.py
(long).

Every request must end with exactly the undisturbed output or a clear error (an OpenAI error
body with a code); the result counts requests, failovers and kills, the longest request, the
RSS and open file descriptors of every node at the start (after warm-up) and the end, and
ghost peers (a peer shown connected that is not a running node, or a link seen from one side
only).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servetools import Cluster, http, split_cluster, wait_ready


@dataclass
class SoakResult:
    seconds: float
    requests: int = 0
    exact: int = 0
    clear_errors: dict[str, int] = field(default_factory=dict)
    wrong: list[str] = field(default_factory=list)  # a differing text, or an unclear failure
    kills: int = 0
    failovers: int = 0
    latencies_s: list[float] = field(default_factory=list)
    start: dict[str, dict[str, int]] = field(default_factory=dict)  # node -> rss_kib, fds
    end: dict[str, dict[str, int]] = field(default_factory=dict)
    ghosts: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_s)
        return {
            "seconds": round(self.seconds, 1),
            "requests": self.requests,
            "exact": self.exact,
            "clear_errors": dict(self.clear_errors),
            "wrong": len(self.wrong),
            "kills": self.kills,
            "failovers": self.failovers,
            "median_request_s": round(statistics.median(lat), 3) if lat else None,
            "max_request_s": round(lat[-1], 3) if lat else None,
            "start": self.start,
            "end": self.end,
            "ghosts": len(self.ghosts),
        }


def _proc_facts(pid: int) -> dict[str, int]:
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _facts(cluster: Cluster) -> dict[str, dict[str, int]]:
    out = {}
    for proc in cluster.procs:
        if proc.popen.poll() is None:
            with contextlib.suppress(OSError):  # it just exited
                out[proc.name] = _proc_facts(proc.popen.pid)
    return out


def _ghosts(cluster: Cluster) -> list[str]:
    """Peers shown connected that are not running nodes, and links seen from one side only."""
    live = {p.name: p for p in cluster.procs if p.popen.poll() is None}
    ids = {p.address.rsplit("#", 1)[1]: name for name, p in live.items() if "#" in p.address}
    seen: dict[str, set[str]] = {}
    for name in live:
        try:
            doc = cluster.status(name)
        except Exception as exc:  # a node that cannot answer is reported, not ignored
            return [f"{name}: no status ({exc})"]
        seen[doc["node_id"]] = {p["node_id"] for p in doc["peers"] if p["connected"]}
    found = []
    for node, peers in seen.items():
        for peer in peers:
            if peer not in ids:
                found.append(f"{ids.get(node, node[:12])} shows {peer[:12]} connected: not running")
            elif node not in seen.get(peer, set()):
                found.append(f"{ids.get(node)} -> {ids[peer]} is seen from one side only")
    return found


def _settled_ghosts(cluster: Cluster, *, settle_s: float) -> list[str]:
    """The ghosts still there once links had ``settle_s`` to settle: none as soon as a look
    finds none (a link that a kill left half-open takes up to a heartbeat or two to go)."""
    deadline = time.monotonic() + settle_s
    while True:
        ghosts = _ghosts(cluster)
        if not ghosts or time.monotonic() >= deadline:
            return ghosts
        time.sleep(0.2)


def soak(
    root: Path,
    package: Path,
    *,
    duration_s: float,
    kill_every_s: tuple[float, float],
    prompt: Any,
    max_tokens: int,
    warmup_s: float = 5.0,
    seed: int = 18,
    min_kills: int = 0,
    **node_kw: object,
) -> SoakResult:
    """Kill and restart for ``duration_s``, and on (up to 3x as long) until ``min_kills``
    kills were made: a loaded machine restarts nodes slowly, and a soak of fewer kills than
    its test asks for would fail for the machine, not for the mesh."""
    rng = random.Random(seed)
    with split_cluster(root, package, workers=2, stages=3, spares=1, **node_kw) as cluster:
        wait_ready(cluster.api, 300)
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        status, doc = http("POST", f"{cluster.api}/completions", body, timeout_s=300)
        assert status == 200, doc
        want = doc["choices"][0]["text"]
        configs = {p.name: (root / f"{p.name}.toml").read_text() for p in cluster.procs}
        result = SoakResult(seconds=0.0)
        stop = threading.Event()
        lock = threading.Lock()

        def client() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                status, doc = http("POST", f"{cluster.api}/completions", body, timeout_s=300)
                took = time.monotonic() - t0
                with lock:
                    result.requests += 1
                    result.latencies_s.append(took)
                    if status == 200 and doc["choices"][0]["text"] == want:
                        result.exact += 1
                    elif (
                        status >= 400 and isinstance(doc, dict) and doc.get("error", {}).get("code")
                    ):
                        code = str(doc["error"]["code"])
                        result.clear_errors[code] = result.clear_errors.get(code, 0) + 1
                        time.sleep(0.2)  # the split is healing: do not spin
                    else:
                        result.wrong.append(f"{status}: {str(doc)[:200]}")

        threads = [threading.Thread(target=client, daemon=True) for _ in range(2)]
        for th in threads:
            th.start()
        time.sleep(warmup_s)
        result.start = _facts(cluster)
        t_start = time.monotonic()
        deadline = t_start + duration_s
        last_deadline = t_start + 3 * duration_s
        next_kill = t_start + rng.uniform(*kill_every_s)
        while time.monotonic() < deadline or (
            result.kills < min_kills and time.monotonic() < last_deadline
        ):
            time.sleep(0.1)
            if time.monotonic() < next_kill:
                continue
            workers = [p for p in cluster.procs if p.name != "coord" and p.popen.poll() is None]
            victim = rng.choice(workers)
            os.kill(victim.popen.pid, signal.SIGKILL)
            victim.popen.wait()
            result.kills += 1
            time.sleep(rng.uniform(0.5, 2.0))
            cluster.procs.remove(victim)
            again = cluster.start(victim.name, ["run"], configs[victim.name])
            again.address = again.wait_line("listening ")
            next_kill = time.monotonic() + rng.uniform(*kill_every_s)
        stop.set()
        for th in threads:
            th.join(timeout=320)
        result.seconds = time.monotonic() - t_start
        wait_ready(cluster.api, 120)  # it heals after the last kill too
        result.ghosts = _settled_ghosts(cluster, settle_s=2.0)
        result.end = _facts(cluster)
        result.failovers = int(cluster.status()["serving"]["failovers_total"])
        return result
