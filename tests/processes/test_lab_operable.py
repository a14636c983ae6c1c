"""`mesh-node lab --nodes 4 --stages 3 --serve --json` is a lab to operate on, with
real processes and a synthetic model: once ready it prints one JSON document
with per node its id, role, stage, layers, pid and config; a worker killed with SIGKILL
mid-stream leaves the greedy completion exactly the undisturbed one (the spare takes its
stage); the killed node, started again with `mesh-node run --config <its config>`, links
back as the new spare; Ctrl-C ends the lab with exit 130 and every node stopped. Its /health
is ok only once a completion would be served."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")
pytest.importorskip("openai", reason="the openai client is a dev dependency")

import openai
import synth_gguf
from pkgtools import make_package

pytestmark = pytest.mark.llama
IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]


def _read_document(stream: object) -> dict[str, object]:
    """One indented JSON document from a text stream, read line by line."""
    lines: list[str] = []
    for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
        lines.append(line)
        if line.rstrip() == "}":
            return dict(json.loads("".join(lines)))
    raise AssertionError(f"the lab ended before its report: {''.join(lines)[-2000:]}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_serving_lab_can_be_operated_on(tmp_path: Path) -> None:
    src = synth_gguf.llama_like(tmp_path / "llama.gguf", n_layers=6)
    make_package(src, tmp_path / "pkg", model_id="acme/tiny-GGUF:Q8_0")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    lab = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mesh_node",
            "lab",
            "--nodes",
            "4",
            "--stages",
            "3",
            "--serve",
            "--json",
            "--package",
            str(tmp_path / "pkg"),
            "--timeout",
            "120",
            "--dir",
            str(tmp_path / "lab"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    restarted: subprocess.Popen[str] | None = None
    try:
        report = _read_document(lab.stdout)
        nodes = report["nodes"]
        assert isinstance(nodes, list) and len(nodes) == 4
        assert [n["role"] for n in nodes].count("spare") == 1
        assert nodes[0]["role"] == "coordinator" and nodes[0]["stage"] == 0
        for n in nodes:
            assert {"node_id", "role", "stage", "layers", "pid", "config"} <= set(n)
            assert _alive(n["pid"]) and Path(n["config"]).is_file()
        stages = sorted((n for n in nodes if n["stage"] is not None), key=lambda n: n["stage"])
        assert [n["layers"] for n in stages] == [
            f"{n['layer_start']}..{n['layer_end']}" for n in stages
        ]
        assert stages[0]["layers"].startswith("0..")
        client = openai.OpenAI(base_url=str(report["api"]), api_key="x", max_retries=0)
        want = (
            client.completions.create(
                model="acme/tiny-GGUF:Q8_0", prompt=IDS, max_tokens=40, temperature=0
            )
            .choices[0]
            .text
        )
        victim = stages[1]
        pieces = []
        for chunk in client.completions.create(
            model="acme/tiny-GGUF:Q8_0", prompt=IDS, max_tokens=40, temperature=0, stream=True
        ):
            pieces.append(chunk.choices[0].text)
            if len(pieces) == 5:
                os.kill(victim["pid"], signal.SIGKILL)
        assert "".join(pieces) == want
        # the killed node, started again from its config, links back (the new spare)
        restarted = subprocess.Popen(
            [sys.executable, "-m", "mesh_node", "run", "--config", victim["config"]],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**env, **victim["env"]},
        )
        assert restarted.stdout is not None
        assert restarted.stdout.readline().startswith("listening ")
        coord_cfg = nodes[0]["config"]
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run(
                [sys.executable, "-m", "mesh_node", "status", "--json", "--config", coord_cfg],
                capture_output=True,
                text=True,
                timeout=30,
                env=env,
            )
            peers = {p["node_id"]: p for p in json.loads(out.stdout)["peers"]}
            if peers.get(victim["node_id"], {}).get("connected"):
                break
            assert time.monotonic() < deadline, peers
            time.sleep(0.2)
    finally:
        if restarted is not None:
            restarted.send_signal(signal.SIGTERM)
            restarted.wait(timeout=30)
        lab.send_signal(signal.SIGINT)
        lab.wait(timeout=60)
    assert lab.returncode == 130
    assert not any(_alive(n["pid"]) for n in nodes)


def test_a_serving_labs_health_is_ok_only_once_a_completion_is_served(tmp_path: Path) -> None:
    """The coordinator's page (and /health) listens before the split is asked for: until the
    route is ready /health is 503 loading, so its first ok is followed by a served completion.
    (It said ok from the moment it listened, seconds before /v1 served.)"""
    src = synth_gguf.llama_like(tmp_path / "llama.gguf", n_layers=4)
    make_package(src, tmp_path / "pkg")
    with socket.socket() as s:  # a free port, so /health is watched from the moment it listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lab = subprocess.Popen(
        [sys.executable, "-m", "mesh_node", "lab", "--nodes", "2", "--serve", "--package",
         str(tmp_path / "pkg"), "--timeout", "120", "--http", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        seen: list[object] = []
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and lab.poll() is None, seen[-5:]
            try:
                status, doc = _http(base + "/health")
            except OSError:  # not listening yet
                time.sleep(0.02)
                continue
            seen.append(doc["status"])
            if status == 200:
                break
            assert status == 503 and doc["status"] == "loading", doc
            time.sleep(0.02)
        assert seen[0] == "loading", seen[:5]  # listening before the split was asked for
        status, doc = _http(base + "/v1/completions", {"prompt": [1, 5], "max_tokens": 1})
        assert status == 200, doc
    finally:
        lab.send_signal(signal.SIGINT)
        lab.wait(timeout=60)


def _http(url: str, body: object = None) -> tuple[int, dict[str, object]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        return e.code, dict(json.loads(e.read()))
