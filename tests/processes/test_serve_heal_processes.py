"""Serving that heals itself, with real `mesh-node` processes on loopback (synthetic model):

- `serve` waits like a service: past `ready_timeout_s` it logs a WARNING naming what is
  missing, and forms the split when the workers arrive later; `mesh-node topology` (and
  `--replan`) against the serving node is refused with `node_is_serving`;
- no spare: a worker killed with SIGKILL and started again with the same config is planned
  back in with no command (503 `no_capable_peer` naming the node in between);
- a coordinator killed with SIGKILL and started again with the same identity and config
  re-forms the same split (same nodes, same run), with nothing fetched again;
- a worker restarted within `peer_loss_timeout_s` (no peer loss for the mesh) is planned in
  again and must report ready anew before the route is published.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

import synth_gguf
from pkgtools import make_package
from servetools import Cluster, Proc, http, node_toml, wait_ready

pytestmark = pytest.mark.llama
IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve_heal")
    src = synth_gguf.llama_like(root / "llama.gguf", n_layers=6)
    make_package(src, root / "pkg", model_id="acme/tiny-GGUF:Q8_0")
    return root / "pkg"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_log(proc: Proc, needle: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [line for line in proc.log if needle in line]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"{proc.name}: no log line with {needle!r}: {proc.log[-10:]}")


def _complete(api: str, n: int = 16) -> str:
    status, doc = http(
        "POST", f"{api}/completions", {"prompt": IDS, "max_tokens": n, "temperature": 0}
    )
    assert status == 200, doc
    return str(doc["choices"][0]["text"])


def _serve_args(pkg: Path, http_port: int) -> list[str]:
    return [
        "serve",
        "--package",
        str(pkg),
        "--stages",
        "3",
        "--http",
        f"127.0.0.1:{http_port}",
        "--model-name",
        "tiny",
    ]


def test_serve_waits_heals_and_restarts(tiny_pkg: Path, tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    port, http_port = _free_port(), _free_port()
    coord_toml = (
        node_toml(tmp_path, "coord")
        .replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"')
        .replace("ready_timeout_s = 60", "ready_timeout_s = 1")
    )
    try:
        coord = cluster.start("coord", _serve_args(tiny_pkg, http_port), coord_toml)
        cluster.coordinator_address = coord.address = coord.wait_line("listening ")
        cluster.api = coord.wait_line("api ")
        # 1. no workers yet: past ready_timeout_s a WARNING names what is missing; 503 says it
        warning = _wait_log(coord, "not ready after 1 s")
        assert "level=WARNING" in warning and "2 more capable peer(s)" in warning, warning
        status, doc = http("POST", f"{cluster.api}/completions", {"prompt": IDS})
        assert status == 503 and "2 more capable peer(s)" in doc["error"]["message"], doc
        workers = {}
        for name in ("w0", "w1"):
            toml = node_toml(tmp_path, name, peers=(cluster.coordinator_address,))
            workers[name] = toml
            worker = cluster.start(name, ["run"], toml)
            worker.address = worker.wait_line("listening ")
        wait_ready(cluster.api)  # ... and it formed the split when they came
        want = _complete(cluster.api)
        # `mesh-node topology` against the serving node: refused, the split undisturbed
        cfg = str(tmp_path / "coord.toml")
        for args in (["--package", str(tiny_pkg)], ["--replan"]):
            out = subprocess.run(
                [sys.executable, "-m", "mesh_node", "topology", "--config", cfg, *args],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 2 and "error [node_is_serving]" in out.stderr, out.stderr
        assert _complete(cluster.api) == want
        before = cluster.status()
        topo = before["topology"]

        # 2. no spare: SIGKILL the final stage's node, start it again: serving comes back
        victim = cluster.proc_of(topo["stages"][2]["node_id"])
        os.kill(victim.popen.pid, signal.SIGKILL)
        victim.popen.wait()
        deadline = time.monotonic() + 30
        while True:
            status, doc = http("POST", f"{cluster.api}/completions", {"prompt": IDS})
            if status == 503 and doc["error"]["code"] == "no_capable_peer":
                break
            assert time.monotonic() < deadline, doc
            time.sleep(0.1)
        assert f"node {topo['stages'][2]['node_id'][:12]} to come back" in doc["error"]["message"]
        back = cluster.start(victim.name, ["run"], workers[victim.name])
        back.address = back.wait_line("listening ")
        wait_ready(cluster.api)
        assert _complete(cluster.api) == want
        healed = cluster.status()["topology"]
        assert [s["node_id"] for s in healed["stages"]] == [s["node_id"] for s in topo["stages"]]
        assert healed["run_id"] == topo["run_id"]

        # 3. the coordinator dies and is started again with the same identity and config
        fetched = {w: cluster.status(w)["transfers"]["counters"]["fetched_bytes"] for w in workers}
        os.kill(coord.popen.pid, signal.SIGKILL)
        coord.popen.wait()
        t0 = time.monotonic()
        again = cluster.start("coord", _serve_args(tiny_pkg, http_port), coord_toml)
        again.wait_line("listening ")
        wait_ready(cluster.api)
        took = time.monotonic() - t0
        assert _complete(cluster.api) == want
        after = cluster.status()
        assert [s["node_id"] for s in after["topology"]["stages"]] == [
            s["node_id"] for s in healed["stages"]
        ]
        assert after["topology"]["run_id"] == topo["run_id"]
        assert after["serving"]["restored_run"] == topo["run_id"]
        assert after["topology"]["topology_id"] != healed["topology_id"]
        # nothing was transferred again: the workers found their verified parts in place
        for w in workers:
            now = cluster.status(w)["transfers"]["counters"]["fetched_bytes"]
            assert (now["peer"], now["hub"]) == (fetched[w]["peer"], fetched[w]["hub"])
            assert now["cache"] > fetched[w]["cache"]
        print(f"coordinator restart: serving again {took:.2f} s after its start")
    finally:
        cluster.stop()


def test_a_worker_restarted_within_peer_loss_timeout_must_report_ready_again(
    tiny_pkg: Path, tmp_path: Path
) -> None:
    # peer_loss_timeout_s far longer than the restart takes: the mesh sees no peer loss (the
    # link "came back in time"), yet the node is a new process holding no stage. The route
    # must not come back on its old ready report (every request failed with
    # transport_width_mismatch): the node is planned in again and reports ready anew.
    def toml(name: str, peers: tuple[str, ...] = ()) -> str:
        text = node_toml(tmp_path, name, peers=peers)
        return text.replace("peer_loss_timeout_s = 2.0", "peer_loss_timeout_s = 30.0")

    cluster = Cluster(tmp_path)
    try:
        coord = cluster.start("coord", _serve_args(tiny_pkg, _free_port()), toml("coord"))
        cluster.coordinator_address = coord.address = coord.wait_line("listening ")
        cluster.api = coord.wait_line("api ")
        workers = {name: toml(name, (cluster.coordinator_address,)) for name in ("w0", "w1")}
        for name, text in workers.items():
            worker = cluster.start(name, ["run"], text)
            worker.address = worker.wait_line("listening ")
        wait_ready(cluster.api)
        want = _complete(cluster.api)
        topo = cluster.status()["topology"]
        victim = cluster.proc_of(topo["stages"][2]["node_id"])
        os.kill(victim.popen.pid, signal.SIGKILL)
        victim.popen.wait()
        back = cluster.start(victim.name, ["run"], workers[victim.name])
        back.address = back.wait_line("listening ")
        wait_ready(cluster.api, timeout_s=25)  # well inside peer_loss_timeout_s
        assert _complete(cluster.api) == want
        after = cluster.status()["topology"]
        assert after["lost_nodes"] == []  # the mesh saw no peer loss ...
        assert after["topology_id"] != topo["topology_id"]  # ... the node was planned in again
        assert [s["node_id"] for s in after["stages"]] == [s["node_id"] for s in topo["stages"]]
        assert after["run_id"] == topo["run_id"]
    finally:
        cluster.stop()
