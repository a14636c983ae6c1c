"""Replicas of a split in real processes: `mesh-node serve --replicas 2
--stages 2` with two `mesh-node run` workers on loopback, the small synthetic model. Both
replicas take concurrent requests with the same greedy output; SIGKILL of one replica's
worker moves its request in flight to the other replica (same output) and leaves that one
serving while the lost replica waits for a capable peer; a peer that joins heals it."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")
pytest.importorskip("openai", reason="the openai client is a dev dependency")

import openai
import synth_gguf
from pkgtools import make_package
from servetools import Cluster, http, split_cluster

pytestmark = pytest.mark.llama

IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]
N = 200  # tokens per request: long enough that a kill lands mid-generation


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve_replicas")
    src = synth_gguf.llama_like(root / "llama.gguf", n_layers=6)
    make_package(src, root / "pkg", model_id="acme/tiny-GGUF:Q8_0")
    return root / "pkg"


def _replicas(cluster: Cluster) -> list[dict[str, Any]]:
    """The coordinator's replicas from its status document (over HTTP: fast enough to act
    on mid-generation)."""
    status, doc = http("GET", cluster.api.removesuffix("/v1") + "/api/status")
    assert status == 200, doc
    return list(doc["serving"]["replicas"])


def _wait_replicas_ready(cluster: Cluster, timeout_s: float = 90.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    reps: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        reps = _replicas(cluster)
        if len(reps) == 2 and all(r["state"] == "ready" for r in reps):
            return reps
        time.sleep(0.3)
    raise AssertionError(f"the replicas did not become ready: {reps}")


def test_two_replicas_share_requests_and_one_survives_the_others_loss(
    tiny_pkg: Path, tmp_path: Path
) -> None:
    with split_cluster(
        tmp_path, tiny_pkg, workers=2, stages=2, serve_args=("--replicas", "2")
    ) as cluster:
        reps = _wait_replicas_ready(cluster)
        workers = [r["nodes"][1] for r in reps]
        assert workers[0] != workers[1] and reps[0]["nodes"][0] == reps[1]["nodes"][0]
        client = openai.OpenAI(base_url=cluster.api, api_key="unused", max_retries=0, timeout=60)

        # concurrent requests: both replicas take some, every greedy output is the same
        texts: list[str] = []

        def one() -> None:
            done = client.completions.create(model="tiny", prompt=IDS, max_tokens=N, temperature=0)
            texts.append(done.choices[0].text)

        threads = [threading.Thread(target=one) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert len(texts) == 4 and len(set(texts)) == 1
        reference = texts[0]
        reps = _replicas(cluster)
        totals = [r["requests_total"] for r in reps]
        assert sum(totals) == 4 and min(totals) >= 1, totals
        # every request's tokens and slot were given back when it ended
        assert [(r["outstanding_tokens"], r["requests_in_flight"]) for r in reps] == [(0, 0)] * 2

        # SIGKILL the worker of the replica a stream runs on: the stream continues on the
        # other replica (the coordinator moves it), with the same output
        before = [r["requests_total"] for r in _replicas(cluster)]
        moved = client.completions.create(
            model="tiny", prompt=IDS, max_tokens=N, temperature=0, stream=True
        )
        pieces = []
        lost = -1
        for chunk in moved:
            pieces.append(chunk.choices[0].text)
            if len(pieces) == 2:
                now = [r["requests_total"] for r in _replicas(cluster)]
                lost = next(k for k in range(2) if now[k] > before[k])
                os.kill(cluster.proc_of(workers[lost]).popen.pid, signal.SIGKILL)
        assert "".join(pieces) == reference
        kept = 1 - lost
        coord = cluster.proc("coord")
        assert any(f"moves from replica {lost} to replica {kept}" in line for line in coord.log), [
            line for line in coord.log if "replica" in line or "lost" in line or "WARN" in line
        ]

        # the lost replica waits for a capable peer; the other keeps serving, /health is ok
        deadline = time.monotonic() + 30
        while _replicas(cluster)[lost]["state"] == "ready" and time.monotonic() < deadline:
            time.sleep(0.2)
        reps = _replicas(cluster)
        assert reps[kept]["state"] == "ready" and reps[lost]["state"] != "ready", reps
        assert reps[lost]["code"] == "no_capable_peer", reps
        before_kept = reps[kept]["requests_total"]
        for _ in range(2):
            status, doc = http(
                "POST", f"{cluster.api}/completions",
                {"prompt": IDS, "max_tokens": N, "temperature": 0},
            )
            assert status == 200 and doc["choices"][0]["text"] == reference
        assert _replicas(cluster)[kept]["requests_total"] == before_kept + 2
        base = cluster.api.removesuffix("/v1")
        status, health = http("GET", base + "/health")
        assert status == 200
        assert [r["state"] == "ready" for r in health["replicas"]] == [
            k == kept for k in range(2)
        ]
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert f'mesh_node_replica_ready{{replica="{kept}"}} 1.0' in metrics
        assert f'mesh_node_replica_ready{{replica="{lost}"}} 0.0' in metrics

        # a capable peer that joins heals the lost replica, never the other's nodes
        late = cluster.add_worker("late")
        reps = _wait_replicas_ready(cluster)
        assert reps[lost]["nodes"][1] == late.address.rsplit("#", 1)[1]
        assert reps[kept]["nodes"] == [reps[kept]["nodes"][0], workers[kept]]


def test_serve_refuses_replicas_without_a_stage_count(tiny_pkg: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from servetools import node_toml

    cfg = tmp_path / "coord.toml"
    cfg.write_text(node_toml(tmp_path, "coord"))
    # One invocation (the other bad counts are pure: tests/skippy/serving/test_replicas_pure.py).
    out = subprocess.run(
        [sys.executable, "-m", "mesh_node", "serve", "--config", str(cfg), "--json",
         "--package", str(tiny_pkg), "--replicas", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert '"code": "usage"' in out.stdout and "Traceback" not in out.stderr
    assert "--stages" in out.stdout


async def test_replicas_asking_at_once_load_the_tokenizer_once(
    tiny_pkg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every replica's route manager reaches its tokenizer at bring-up, most of them while
    the first load still runs: one real load (llama.cpp, on a thread), shared by all."""
    import trio

    from mesh_node.serving import split

    loads: list[Path] = []
    real = split.load_tokenizer

    async def counted(path: Path):  # type: ignore[no-untyped-def]
        loads.append(path)
        return await real(path)

    monkeypatch.setattr(split, "load_tokenizer", counted)
    shared = split.SharedTokenizer()
    metadata = tiny_pkg / "shared" / "metadata.gguf"
    got: list[Any] = []

    async def ask() -> None:
        got.append(await shared.load(metadata))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(ask)
    assert loads == [metadata] and len(got) == 3 and all(t is got[0] for t in got)
    assert got[0].n_vocab > 0
    got[0].close()
