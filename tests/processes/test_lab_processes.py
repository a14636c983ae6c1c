"""``mesh-node lab`` and peer transfer faults with real ``mesh-node run`` processes:
the gemma3 split entirely from the peer ("Done when"), refusals and hub
fallback (``--transfer disabled``, ``--foreign-owner 1``), a coordinator killed mid-transfer and
restarted (the worker resumes its partial), a stalled coordinator (the hub takes over), a worker
restarted after completion (nothing fetched again), and Ctrl-C stopping every node."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import synth_gguf
import trio
from pkgtools import make_package

from mesh_node.lab.cluster import LabError
from mesh_node.lab.run import Lab, LabOptions, open_lab

MESH = [sys.executable, "-m", "mesh_node"]
# Short timeouts: loopback nodes on a loaded machine still answer within these.
FAST = {
    "heartbeat_interval_s": 0.2,
    "peer_loss_timeout_s": 2.0,
    "idle_timeout_s": 2.0,
    "handshake_timeout_s": 2.0,
}


def lab_cli(*args: str, timeout: float = 300) -> tuple[int, dict[str, Any]]:
    out = subprocess.run(
        [*MESH, "lab", *args, "--json"], capture_output=True, text=True, timeout=timeout
    )
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, json.loads(out.stdout)


def worker_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [n for n in report["nodes"] if n["role"] == "worker"]


@pytest.fixture(scope="module")
def tiny_package(synth_dir, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    pkg = tmp_path_factory.mktemp("lab") / "tiny-layers"
    make_package(synth_dir.gemma, pkg, projectors=(synth_dir.projector,))
    return pkg


@pytest.fixture(scope="module")
def big_package(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """~32 MiB: layers of ~3 MiB, several 1 MiB serving chunks each (a transfer can be cut).
    Transfer test data the stage runtime refuses (``synth_gguf.big``): its stage fetches and
    verifies, then fails its load (``transferred``)."""
    root = tmp_path_factory.mktemp("lab-big")
    source = synth_gguf.big(root / "big.gguf", 32 << 20)
    make_package(source, root / "big-layers", model_id="acme/big-GGUF:Q8_0")
    return root / "big-layers"


@pytest.mark.slow
def test_done_when_gemma3_on_three_nodes_every_worker_part_from_the_peer(gemma_package):
    pkg = gemma_package  # tests/conftest.py: "gemma-3-270m-layers", written once per session
    code, report = lab_cli("--nodes", "3", "--package", str(pkg))
    assert code == 0 and report["ok"], report["problems"]
    workers = worker_rows(report)
    assert len(workers) == 2
    for w in workers:
        assert w["state"] == "ready" and w["report"] == "accepted" and w["exact"]
        assert w["artifacts"] and all(
            a["source"] == "peer" and a["verified"] for a in w["artifacts"]
        )
    assert report["totals"]["hub_bytes"] == 0 and report["totals"]["peer_bytes"] > 100e6
    assert report["coordinator"]["refusals"] == {}


def test_transfer_disabled_workers_use_the_hub_and_end_verified(tiny_package):
    code, report = lab_cli("--nodes", "3", "--package", str(tiny_package), "--transfer", "disabled")
    assert code == 0 and report["ok"], report["problems"]
    for w in worker_rows(report):
        assert w["exact"] and all(
            a["source"] == "hub" and a["verified"] and a["fallback"] == "not_advertised"
            for a in w["artifacts"]
        )
    assert report["totals"]["peer_bytes"] == 0 and report["coordinator"]["served_bytes"] == 0


def test_a_foreign_owner_is_refused_and_falls_back_to_the_hub(tiny_package):
    code, report = lab_cli("--nodes", "3", "--package", str(tiny_package), "--foreign-owner", "1")
    assert code == 0 and report["ok"], report["problems"]
    own, foreign = worker_rows(report)
    assert own["owner"] == "primary" and foreign["owner"] == "foreign"
    assert foreign["owner_id"] != own["owner_id"]
    assert all(a["source"] == "peer" and a["verified"] for a in own["artifacts"])
    assert all(
        a["source"] == "hub" and a["verified"] and a["fallback"] == "refused: artifact unavailable"
        for a in foreign["artifacts"]
    )
    # refused generically to the peer, precisely in the coordinator's counters
    assert report["coordinator"]["refusals"] == {"peer_owner_untrusted": len(foreign["artifacts"])}


# --- faults with processes ----------------------------------------------------------------------
def options(package: Path, root: Path, **kw: Any) -> LabOptions:
    config = {**FAST, **kw.pop("node_config", {})}
    return LabOptions(
        nodes=2, package=str(package), transfer="open", root=root / "lab",
        node_config=config, timeout_s=60, **kw,
    )


def transferred(stage: dict[str, Any]) -> bool:
    """The stage's transfer succeeded: ready, or failed only at the load of ``big_package``'s
    model, which the stage runtime refuses (its K/V shapes), after every part was verified."""
    return stage["state"] == "ready" or stage["error"] == "fragment_tensor_shape"


async def propose(lab: Lab) -> dict[str, Any]:
    response = await lab.cluster.coordinator.request(
        {"op": "topology", "package": lab.package.ref, "stages": None, "include_self": True},
        timeout_s=30,
    )
    topology: dict[str, Any] = response["topology"]
    return topology


async def worker_stage(lab: Lab, topology_id: str, states: tuple[str, ...]) -> dict[str, Any]:
    """The worker's status once its stage for ``topology_id`` is in one of ``states``."""
    worker = lab.cluster.nodes[1]
    status: dict[str, Any] = {}
    with trio.move_on_after(60):
        while True:
            status = await worker.status()
            stage = status["transfers"]["stage"] or {}
            if stage.get("topology_id") == topology_id and stage.get("state") in states:
                return status
            await trio.sleep(0.05)
    raise AssertionError(f"the worker's stage not {states} within 60 s: {status.get('transfers')}")


def fetches(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in status["transfers"]["recent"] if r["direction"] == "fetch"]


def partial_artifacts(lab: Lab, node: Any) -> list[tuple[str, int]]:
    """The hidden partials on ``node``'s disk holding some but not all of their artifact's
    bytes (a status row's bytes_done counts bytes received, which are written in batches of
    up to 2 MiB: a cut before the first write leaves nothing to resume from)."""
    sizes = {
        r.artifact.sha256.lower(): r.artifact.artifact_bytes
        for r in lab.package.manifest.artifacts()
    }
    found = []
    for p in node.hub_cache_dir.rglob("blobs/.*.part"):
        with contextlib.suppress(FileNotFoundError):
            size = p.stat().st_size
            if 0 < size < sizes.get(p.name.split(".")[1], 0):
                found.append((p.name, size))
    return found


async def test_a_coordinator_killed_mid_transfer_is_resumed_after_its_restart(
    big_package, tmp_path
):
    opts = options(
        big_package,
        tmp_path,
        node_config={"artifact_serve_bytes_per_s": 8_000_000},
        node_env={1: {"HF_HUB_OFFLINE": "1"}},  # no hub: only the coordinator can finish it
    )
    async with open_lab(opts) as lab:
        coordinator, worker = lab.cluster.nodes
        first = await propose(lab)
        with trio.fail_after(60):  # until the worker holds part of an artifact on its disk
            while not partial_artifacts(lab, worker):
                await trio.sleep(0.005)
        assert await lab.cluster.stop(0, signal.SIGKILL) == -signal.SIGKILL
        failed = await worker_stage(lab, first["topology_id"], ("failed",))
        assert failed["transfers"]["stage"]["error"] is not None  # clear error, nothing installed
        await lab.cluster.start(0)  # same identity, port and cache
        await lab.cluster.wait_meshed(30)
        second = await propose(lab)
        done = await worker_stage(lab, second["topology_id"], ("ready", "failed"))
        assert transferred(done["transfers"]["stage"]), done["transfers"]["stage"]
        latest = {}
        for rec in reversed(fetches(done)):
            latest[rec["path"]] = rec
        resumed = [r for r in latest.values() if r["source"] == "peer" and r["resumed_from"] > 0]
        assert resumed, latest  # at least the cut artifact continued from its partial
        served = (await coordinator.status())["transfers"]["counters"]["served_bytes"]
        stage_bytes = done["transfers"]["stage"]["bytes_required"]
        assert served < stage_bytes  # the restarted coordinator did not send it all again
        stage = next(s for s in second["stages"] if s["node_id"] == lab.cluster.nodes[1].node_id)
        check = lab.check_cache(lab.cluster.nodes[1], stage)
        assert check.exact, check


async def test_a_stalled_coordinator_is_left_for_the_hub(big_package, tmp_path):
    opts = options(big_package, tmp_path, node_config={"artifact_serve_bytes_per_s": 8_000_000})
    async with open_lab(opts) as lab:
        coordinator = lab.cluster.coordinator
        topology = await propose(lab)
        with trio.fail_after(60):
            while not any(
                r["direction"] == "serve" and 0 < r["bytes_done"] < r["total"]
                for r in (await coordinator.status())["transfers"]["active"]
            ):
                await trio.sleep(0.02)
        lab.cluster.send_signal(0, signal.SIGSTOP)
        try:
            done = await worker_stage(lab, topology["topology_id"], ("ready", "failed"))
        finally:
            lab.cluster.send_signal(0, signal.SIGCONT)
        assert transferred(done["transfers"]["stage"]), done["transfers"]["stage"]
        recs = fetches(done)
        from_hub = [r for r in recs if r["source"] == "hub" and r["verified"]]
        assert from_hub and all(r["fallback"] for r in from_hub)
        stage = next(s for s in topology["stages"] if s["node_id"] == lab.cluster.nodes[1].node_id)
        assert lab.check_cache(lab.cluster.nodes[1], stage).exact


async def test_a_worker_restarted_after_completion_fetches_nothing(tiny_package, tmp_path):
    async with open_lab(options(tiny_package, tmp_path)) as lab:
        first = await propose(lab)
        await worker_stage(lab, first["topology_id"], ("ready",))
        coordinator = lab.cluster.coordinator
        served = (await coordinator.status())["transfers"]["counters"]["served_bytes"]
        assert served > 0
        assert await lab.cluster.stop(1) == 0
        await lab.cluster.start(1)
        await lab.cluster.wait_meshed(30)
        second = await propose(lab)
        done = await worker_stage(lab, second["topology_id"], ("ready",))
        counters = done["transfers"]["counters"]
        assert counters["fetched_bytes"]["peer"] == 0 and counters["fetched_bytes"]["hub"] == 0
        assert {r["source"] for r in fetches(done)} == {"cache"}
        after = (await coordinator.status())["transfers"]["counters"]["served_bytes"]
        assert after == served
        worker = lab.cluster.nodes[1]
        text = await trio.to_thread.run_sync(
            lambda: subprocess.run(
                [*MESH, "status", "--config", str(worker.config_path)],
                capture_output=True, text=True, timeout=60,
            )
        )
        assert text.returncode == 0 and "ready, report accepted" in text.stdout
        assert "fetched peer 0 hub 0" in text.stdout


async def test_workers_take_the_coordinators_calibration_and_measure_nothing(
    tiny_package, tmp_path
):
    """The lab's nodes share one machine: the workers start with the coordinator's
    calibration (measured while it started alone), read it from their cache and advertise
    the same figure."""
    on = {"MESH_NODE_CALIBRATION": "auto"}  # the suite turns it off (tests/conftest.py)
    async with open_lab(options(tiny_package, tmp_path, node_env={0: on, 1: on})) as lab:
        cluster = lab.cluster
        coordinator_log = cluster.coordinator.log_path.read_text()
        assert "calibration (measured)" in coordinator_log
        docs = await cluster.statuses()
        for node in cluster.nodes[1:]:
            log_text = node.log_path.read_text()
            assert "calibration (cached)" in log_text and "calibration (measured)" not in log_text
        computes = [d["compute"] for d in docs if d is not None]
        assert len(computes) == len(cluster.nodes) and all(c == computes[0] for c in computes)


async def test_serving_gives_up_at_the_deadline_with_the_cores_waiting_reason(
    tiny_package, tmp_path
):
    # The serving core waits like a service; only the lab gives up, at its
    # deadline, saying what the core waits for (here: the worker it needs is gone).
    opts = dataclasses.replace(options(tiny_package, tmp_path), stages=2, timeout_s=8)
    async with open_lab(opts) as lab:
        assert await lab.cluster.stop(1) == 0
        with pytest.raises(LabError) as failed:
            await lab.start_serving()
        assert failed.value.code == "split_not_ready"
        message = str(failed.value)
        assert "within 8 s" in message and "capable peer" in message, message


def _processes_under(root: Path) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if str(root).encode() in cmdline:
                pids.append(int(entry))
    return pids


def test_ctrl_c_stops_every_node(big_package, tmp_path):
    root = tmp_path / "lab"
    proc = subprocess.Popen(
        # 1 MB/s: the 32 MiB split is still moving when the signal lands (unthrottled, the lab
        # could finish first on a quiet machine and exit 0)
        [*MESH, "lab", "--nodes", "3", "--package", str(big_package), "--dir", str(root),
         "--serve-rate", "1MB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (root / "n1" / "stdout").exists() or not (
            (root / "n1" / "stdout").read_text().startswith("listening")
        ):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
            time.sleep(0.02)
        assert len(_processes_under(root)) >= 2  # nodes are running
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert _processes_under(root) == []


def test_a_ctrl_c_inside_a_nursery_leaves_trio_as_itself_before_any_other_error() -> None:
    """The lab's Ctrl-C can land in any nursery (a start, the meshing wait's status calls):
    the CLI's trio runner raises it unwrapped, ahead of an error of ours beside it, so
    ``main`` exits 130 without a traceback (the process test above hit this in a nursery)."""
    from mesh_node.cli import _run_trio

    async def fail() -> None:  # fails as it is cancelled: both errors are in the group
        try:
            await trio.sleep_forever()
        finally:
            raise LabError("a node did not stop", code="lab_node_failed")

    async def interrupted() -> None:
        await trio.sleep(0.01)
        raise KeyboardInterrupt

    async def lab() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(interrupted)
            async with trio.open_nursery() as inner:  # nested, as the lab's are
                inner.start_soon(fail)

    with pytest.raises(KeyboardInterrupt):
        _run_trio(lab)


@pytest.fixture(autouse=True)
def _no_leftover_nodes(tmp_path: Path) -> Iterator[None]:
    yield
    assert _processes_under(tmp_path) == []
