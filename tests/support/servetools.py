"""Real `mesh-node` processes on loopback for the serving tests: a `serve` coordinator and
plain `run` workers, with fresh keys, short timeouts and ggml on one thread (see
tests/support/stagetools.py). Plain functions and a context manager; nothing is faked."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from mesh_node import control
from mesh_node.cli import STATUS_TIMEOUT_S
from mesh_node.identity import node_id_of, write_private_key
from mesh_node.settings import load_node_settings

FAST_TOML = """
heartbeat_interval_s = 0.2
peer_loss_timeout_s = 2.0
idle_timeout_s = 5.0
handshake_timeout_s = 5.0
memory_budget = "{budget}"
[security]
accept_topologies_from = "any"
place_stages_on = "any"
[serving]
threads = {threads}
n_ctx = {n_ctx}
prefill_chunk = {chunk}
token_timeout_s = 20
failover_timeout_s = 60
ready_timeout_s = 60
max_sessions = {sessions}
max_queue = {queue}
"""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    address: str = ""  # ws://host:port#<node id>, once listening
    log: list[str] = field(default_factory=list)  # the last 400 lines of stderr
    log_written: list[int] = field(default_factory=lambda: [0, 0])  # stderr lines, bytes

    def wait_line(self, prefix: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.popen.poll() is not None:
                    break
                continue
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise AssertionError(f"{self.name}: no line {prefix!r}; stderr tail: {self.log[-15:]}")


def _pump(
    stream: object, sink: queue.Queue[str] | list[str], written: list[int] | None = None
) -> None:
    for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
        if written is not None:
            written[0] += 1
            written[1] += len(line.encode())
        if isinstance(sink, list):
            sink.append(line.rstrip())
            del sink[:-400]
        else:
            sink.put(line)


def _keygen(path: Path) -> str:
    # What `mesh-node keygen` does, in this process: a `python -m mesh_node` start-up costs
    # ~0.3-1 s per node (the CLI itself is tested in tests/processes/test_mesh_processes.py).
    return node_id_of(write_private_key(path))


@dataclass
class Cluster:
    root: Path
    procs: list[Proc] = field(default_factory=list)
    api: str = ""
    coordinator_address: str = ""

    def start(
        self, name: str, args: list[str], toml: str, env: dict[str, str] | None = None
    ) -> Proc:
        """Start one node; ``env`` adds to (or overrides) this process's environment."""
        cfg = self.root / f"{name}.toml"
        cfg.write_text(toml)
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        popen = subprocess.Popen(
            [sys.executable, "-m", "mesh_node", *args, "--config", str(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        proc = Proc(name, popen)
        threading.Thread(target=_pump, args=(popen.stdout, proc.lines), daemon=True).start()
        threading.Thread(
            target=_pump, args=(popen.stderr, proc.log, proc.log_written), daemon=True
        ).start()
        self.procs.append(proc)
        return proc

    def add_worker(self, name: str, **kw: object) -> Proc:
        """Start one more `mesh-node run` node that dials the coordinator."""
        toml = node_toml(self.root, name, peers=(self.coordinator_address,), **kw)
        worker = self.start(name, ["run"], toml)
        worker.address = worker.wait_line("listening ")
        return worker

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def proc_of(self, node_id: str) -> Proc:
        return next(p for p in self.procs if p.address.endswith("#" + node_id))

    def status(self, name: str = "coord") -> dict[str, Any]:
        """A node's status document (what `mesh-node status --json` prints), the coordinator's
        default: the same control request, sent from this process (a CLI start-up per read
        cost ~0.3-1 s; the command itself is tested in tests/processes/test_mesh_processes.py)."""
        settings = load_node_settings(self.root / f"{name}.toml")
        response = trio.run(
            control.request, settings.control_socket, {"op": "status"}, STATUS_TIMEOUT_S
        )
        return dict(response["status"])

    def stop(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()


def node_toml(root: Path, name: str, *, peers: tuple[str, ...] = (), **kw: object) -> str:
    _keygen(root / f"{name}.key")
    opts = {
        "budget": "1GiB",
        "n_ctx": 256,
        "chunk": 16,
        "sessions": 4,
        "queue": 8,
        "threads": 1,
        **kw,
    }
    text = (
        f'listen = "127.0.0.1:0"\nidentity = "{name}.key"\ndata_dir = "{name}-data"\n'
        f"peers = {list(peers)!r}\n".replace("'", '"')
    )
    return text + FAST_TOML.format(**opts)


@contextlib.contextmanager
def split_cluster(
    root: Path,
    package: Path,
    *,
    workers: int,
    stages: int,
    spares: int = 0,
    serve_args: tuple[str, ...] = (),
    **kw: object,
) -> Iterator[Cluster]:
    """`mesh-node serve` (stage 0, the API) plus ``workers`` + ``spares`` `mesh-node run`
    nodes; yields once the API answers (the split is then being brought up)."""
    cluster = Cluster(root)
    try:
        coord = cluster.start(
            "coord",
            [
                "serve",
                "--package",
                str(package),
                "--stages",
                str(stages),
                "--http",
                "127.0.0.1:0",
                "--model-name",
                "tiny",
                *serve_args,
            ],
            node_toml(root, "coord", **kw),
        )
        cluster.coordinator_address = coord.address = coord.wait_line("listening ")
        cluster.api = coord.wait_line("api ")
        for i in range(workers + spares):
            if i == workers:
                # spares join after the plan, so the plan uses the first workers
                wait_ready(cluster.api)
            toml = node_toml(root, f"w{i}", peers=(cluster.coordinator_address,), **kw)
            worker = cluster.start(f"w{i}", ["run"], toml)
            worker.address = worker.wait_line("listening ")
        yield cluster
    finally:
        cluster.stop()


def http(method: str, url: str, body: object = None, timeout_s: float = 30.0) -> tuple[int, Any]:
    """(status, decoded JSON) of one request (stdlib only)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def wait_ready(api: str, timeout_s: float = 90.0) -> dict[str, Any]:
    """Send a one-token completion until the split serves it (503 until then)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        status, doc = http("POST", f"{api}/completions", {"prompt": [1], "max_tokens": 1})
        if status == 200:
            return dict(doc)
        last = doc
        time.sleep(0.2)
    raise AssertionError(f"the split did not become ready: {last}")


def served_completions(
    root: Path,
    pkg: Path,
    *,
    prompt: str,
    max_tokens: int,
    workers: int,
    stages: int,
    serve_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A greedy and a seeded completion (the official ``openai`` client) from a split of
    ``pkg`` served with ``serve_args``, and the coordinator's serving status after them."""
    import openai

    root.mkdir()
    with split_cluster(root, pkg, workers=workers, stages=stages, serve_args=serve_args) as cluster:
        wait_ready(cluster.api)
        client = openai.OpenAI(base_url=cluster.api, api_key="unused", max_retries=0, timeout=60)
        done = client.completions.create
        greedy = done(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
        seeded = done(
            model="tiny",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.9,
            seed=7,
            extra_body={"top_k": 20},
        )
        return {
            "greedy": greedy.choices[0].text,
            "seeded": seeded.choices[0].text,
            "serving": cluster.status()["serving"],
        }
