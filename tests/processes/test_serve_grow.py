"""A served model grows into a split when a peer joins: real processes, the real `openai` client.

`mesh-node serve --package PKG` with no config and no `--stages` serves on its own node at
once; a `mesh-node run` node of the same owner (certified with the owner key the first run
made) joins later, and the coordinator grows the split to two stages with no command: the
status says so, the worker holds the second stage, and the greedy text is the single stage's.
Streamed requests sent back to back through the whole switch all finish with that text; the
same when a configured split of two stages grows to three. Prompts are token ids (the
synthetic vocabulary cannot encode most text).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")
pytest.importorskip("openai", reason="the openai client is a dev dependency")

import openai
import synth_gguf
import trio
from pkgtools import make_package
from servetools import Cluster, Proc, _pump, node_toml, wait_ready
from stagetools import chain

from mesh_node import control
from mesh_node.cli import STATUS_TIMEOUT_S
from mesh_node.identity import (
    issue_certificate,
    load_private_key,
    node_id_of,
    write_certificate,
    write_private_key,
)
from mesh_node.settings import load_node_settings

pytestmark = pytest.mark.llama

IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]
N = 12


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grow_tiny")
    src = synth_gguf.llama_like(root / "llama.gguf", n_layers=6)
    make_package(src, root / "pkg", model_id="acme/t-GGUF:Q8_0")
    return root / "pkg"


def _start(name: str, args: list[str]) -> Proc:
    popen = subprocess.Popen(
        [sys.executable, "-m", "mesh_node", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )
    proc = Proc(name, popen)
    threading.Thread(target=_pump, args=(popen.stdout, proc.lines), daemon=True).start()
    threading.Thread(target=_pump, args=(popen.stderr, proc.log), daemon=True).start()
    return proc


def _stop(proc: Proc) -> None:
    if proc.popen.poll() is None:
        proc.popen.send_signal(signal.SIGTERM)
    try:
        proc.popen.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.popen.kill()
        proc.popen.wait()


def _client(api: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=60)


def _complete(api: str) -> str:
    client = _client(api)
    done = client.completions.create(
        model=client.models.list().data[0].id, prompt=IDS, max_tokens=N, temperature=0
    )
    assert done.usage is not None and done.usage.completion_tokens == N
    return done.choices[0].text


def _status(config: Path) -> dict[str, Any]:
    settings = load_node_settings(config)
    response = trio.run(
        control.request, settings.control_socket, {"op": "status"}, STATUS_TIMEOUT_S
    )
    return dict(response["status"])


def _detok(pkg: Path, ids: list[int]) -> str:
    from skippy.runtime.tokenizer import LlamaTokenizer

    with LlamaTokenizer(pkg / "shared" / "metadata.gguf") as tok:
        return tok.detokenize(ids)


class _Streams:
    """Streamed greedy completions sent one after the other until stopped: each one's text,
    or the error it ended with."""

    def __init__(self, api: str) -> None:
        self.client = _client(api)
        self.model = self.client.models.list().data[0].id
        self.done: list[tuple[float, str | BaseException]] = []  # (when it ended, outcome)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            outcome: str | BaseException
            try:
                parts = self.client.completions.create(
                    model=self.model, prompt=IDS, max_tokens=N, temperature=0, stream=True
                )
                outcome = "".join(c.choices[0].text for c in parts if c.choices)
            except Exception as exc:  # recorded: the test asserts there is none
                outcome = exc
            self.done.append((time.monotonic(), outcome))

    def __enter__(self) -> _Streams:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=90)


def test_a_single_node_serve_grows_into_a_split_when_a_peer_of_its_owner_joins(
    tiny_pkg: Path, tmp_path: Path
) -> None:
    with chain("ggml", tiny_pkg, ["0..6"]) as ch:
        expected = _detok(tiny_pkg, list(ch.generate(IDS, max_tokens=N).tokens))
    data = tmp_path / "node"
    coord = _start(
        "serve",
        ["serve", "--package", str(tiny_pkg), "--data-dir", str(data), "--http", "127.0.0.1:0",
         "--listen", "127.0.0.1:0"],
    )
    worker: Proc | None = None
    try:
        address = coord.wait_line("listening ")
        api = coord.wait_line("api ")
        wait_ready(api)
        one = _complete(api)
        assert one == expected
        before = _status(data / "node.toml")
        assert before["serving"]["stages"] == 1 and before["serving"].get("growth") is None

        # A node of the same owner joins while streamed requests keep coming.
        key = write_private_key(tmp_path / "w.key")
        wid = node_id_of(key)
        cert = issue_certificate(load_private_key(data / "owner.key"), wid, days=1)
        write_certificate(tmp_path / "w.cert", cert)
        (tmp_path / "w.toml").write_text(
            'identity = "w.key"\ncertificate = "w.cert"\ndata_dir = "w-data"\n'
            f'listen = "127.0.0.1:0"\npeers = ["{address}"]\n'
        )
        with _Streams(api) as streams:
            deadline = time.monotonic() + 60
            while not streams.done:  # the first stream ended on the single stage
                assert time.monotonic() < deadline, coord.log[-15:]
                time.sleep(0.05)
            worker = _start("w", ["run", "--config", str(tmp_path / "w.toml")])
            worker.wait_line("listening ")
            joined = time.monotonic()
            deadline = joined + 90
            while True:  # the route switched to two stages, and the status says it grew
                serving = _status(data / "node.toml")["serving"]
                growth = serving.get("growth") or {}
                if serving["stages"] == 2 and growth.get("state") == "serving":
                    break
                assert time.monotonic() < deadline, (serving, coord.log[-15:])
                time.sleep(0.2)
            grown_at = time.monotonic()
            while not any(t > grown_at for t, _ in streams.done):  # one more on the split
                assert time.monotonic() < grown_at + 60, streams.done[-3:]
                time.sleep(0.05)
        after = _status(data / "node.toml")
        assert after["serving"]["stages"] == 2
        stages = after["topology"]["stages"]
        assert [s["node_id"] for s in stages] == [before["node_id"], wid]
        held = _status(tmp_path / "w.toml")["stage"]
        assert held is not None and held["stage_index"] == 1
        assert (held["layer_start"], held["layer_end"]) == (stages[1]["layer_start"], 6)
        assert growth["summary"] == (
            f"1 -> 2 stages, node {wid[:12]} took layers {held['layer_start']}..6"
        )
        assert any(f"split grown: {growth['summary']}" in line for line in coord.log)
        # the same greedy text on two stages; every stream across the switch finished with it
        assert _complete(api) == one
        outcomes = [o for _, o in streams.done]
        assert outcomes == [one] * len(outcomes), outcomes
        assert after["topology"]["run_id"] == before["topology"]["run_id"]
        switch = sum(joined <= t <= grown_at for t, _ in streams.done)
        print(f"grown {grown_at - joined:.2f} s after the worker listened; {switch} streams then")
    finally:
        if worker is not None:
            _stop(worker)
        _stop(coord)


def _wait_grown(cluster: Cluster, stages: int, timeout_s: float = 90.0) -> dict[str, Any]:
    """The coordinator's serving status once its route has ``stages`` stages after a grow."""
    deadline = time.monotonic() + timeout_s
    while True:
        serving = cluster.status()["serving"]
        growth = serving.get("growth") or {}
        if serving["stages"] == stages and growth.get("state") == "serving":
            return dict(serving)
        assert time.monotonic() < deadline, (serving, cluster.proc("coord").log[-15:])
        time.sleep(0.2)


def test_a_two_stage_split_grows_to_three_under_streamed_requests(
    tiny_pkg: Path, tmp_path: Path
) -> None:
    # The worker whose layers change keeps its replaced stage for the old route's sessions
    # until the route moves on: the streams sent while the third node loads finish with the
    # same text (tests/mesh_node/serving/test_serve_grow_links.py holds that load back to check
    # it exactly).
    cluster = Cluster(tmp_path)
    try:
        coord = cluster.start(
            "coord",
            ["serve", "--package", str(tiny_pkg), "--http", "127.0.0.1:0", "--model-name", "t"],
            node_toml(tmp_path, "coord"),
        )
        cluster.coordinator_address = coord.address = coord.wait_line("listening ")
        cluster.api = coord.wait_line("api ")
        wait_ready(cluster.api)
        one = _complete(cluster.api)
        w0 = cluster.add_worker("w0")
        _wait_grown(cluster, 2)
        assert _complete(cluster.api) == one
        with _Streams(cluster.api) as streams:
            deadline = time.monotonic() + 60
            while not streams.done:
                assert time.monotonic() < deadline, coord.log[-15:]
                time.sleep(0.05)
            w1 = cluster.add_worker("w1")
            serving = _wait_grown(cluster, 3)
            grown_at = time.monotonic()
            while not any(t > grown_at for t, _ in streams.done):
                assert time.monotonic() < grown_at + 60, streams.done[-3:]
                time.sleep(0.05)
        assert serving["growth"]["summary"].startswith("2 -> 3 stages, node ")
        nodes = [s["node_id"] for s in cluster.status()["topology"]["stages"]]
        assert sorted(nodes[1:]) == sorted(p.address.rsplit("#", 1)[1] for p in (w0, w1))
        outcomes = [o for _, o in streams.done]
        assert outcomes == [one] * len(outcomes), outcomes
        assert _complete(cluster.api) == one
        lost = [line for line in coord.log if "lost its route" in line]
        print(f"2 -> 3 stages: {len(outcomes)} streams, {len(lost)} failovers", lost[:3])
    finally:
        cluster.stop()
