"""Every way out of ``mesh-node lab`` stops what it started, with real processes and signals:
SIGTERM and SIGINT at two points of bring-up (SIGINT as a shell's background job receives it,
inherited ignored), in the plain and the ``--http`` form; the lab's own SIGKILL (its nodes
notice through their lifeline); a node restarted by hand, which stops with its lab; a
``--serve`` lab whose coordinator dies; a plain node whose data_dir is removed. Afterwards the
process table holds none of the lab's processes and its temporary directory is empty."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import synth_gguf
from pkgtools import make_package
from servetools import Cluster, node_toml

MESH = [sys.executable, "-m", "mesh_node"]
WAIT_S = 90.0  # bounds for a loaded 2-core machine; none of them is a speed assertion


@pytest.fixture(scope="module")
def slow_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~30 MiB: at the lab's --serve-rate 1MB its split takes ~30 s, so a signal lands in it.
    A model the stage runtime loads: a lab fails a stage it cannot load at once."""
    root = tmp_path_factory.mktemp("lab-signals")
    source = synth_gguf.llama_like(root / "slow.gguf", n_layers=10, width=512, ff=2048)
    make_package(source, root / "big-layers", model_id="acme/big-GGUF:Q8_0")
    return root / "big-layers"


def _processes_under(root: Path) -> list[int]:
    """Processes whose command line names ``root`` (a lab node names its config in it)."""
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


def _wait_until(predicate, what: str, timeout_s: float = WAIT_S) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.05)


def _listening(node_dir: Path) -> bool:
    stdout = node_dir / "stdout"
    return stdout.is_file() and stdout.read_text(errors="replace").startswith("listening ")


def _lab_dir(tmpdir: Path) -> Path:
    """The lab's folder in its temporary directory, once it made one."""
    found: list[Path] = []

    def made() -> bool:
        found[:] = sorted(tmpdir.glob("mesh-lab-*"))
        return bool(found)

    _wait_until(made, "the lab made its folder")
    return found[0]


def _start_lab(tmp_path: Path, *args: str, ignore_sigint: bool = False) -> subprocess.Popen[str]:
    """``mesh-node lab`` with its own temporary directory (``tmp_path / "tmp"``); with
    ``ignore_sigint`` it starts as a shell's background job does: SIGINT inherited ignored."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmpdir), "OPENBLAS_NUM_THREADS": "1"}

    def background() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(
        [*MESH, "lab", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=background if ignore_sigint else None,
    )


@pytest.fixture(autouse=True)
def _nothing_left(tmp_path: Path) -> Iterator[None]:
    yield
    leftover = _processes_under(tmp_path)
    for pid in leftover:  # a failed test must not leave nodes to the next one
        os.kill(pid, signal.SIGKILL)
    assert leftover == []


@pytest.mark.parametrize(
    ("point", "signum", "mode"),
    [
        pytest.param("nodes starting", signal.SIGTERM, "plain", id="sigterm-starting"),
        pytest.param("ready wait", signal.SIGINT, "plain", id="sigint-background-ready-wait"),
        pytest.param("ready wait", signal.SIGTERM, "http", id="sigterm-http-ready-wait"),
    ],
)
def test_a_signal_during_bring_up_stops_every_node_and_removes_the_folder(
    slow_package: Path, tmp_path: Path, point: str, signum: int, mode: str
) -> None:
    extra = ("--http", "0") if mode == "http" else ()
    lab = _start_lab(
        tmp_path,
        *("--nodes", "3", "--package", str(slow_package), "--serve-rate", "1MB", *extra),
        ignore_sigint=signum == signal.SIGINT,
    )
    try:
        root = _lab_dir(tmp_path / "tmp")
        if point == "nodes starting":  # the coordinator runs, the workers are not up yet
            _wait_until(lambda: _listening(root / "n0"), "the coordinator listens")
            assert not _listening(root / "n2")
        else:  # every node up, the workers fetching at 1 MB/s
            _wait_until(lambda: _listening(root / "n2"), "the last worker listens")
            time.sleep(1.0)
        assert len(_processes_under(root)) >= 1
        lab.send_signal(signum)
        _, err = lab.communicate(timeout=WAIT_S)
    finally:
        if lab.poll() is None:
            lab.kill()
            lab.wait()
    assert lab.returncode == 128 + signum, err
    assert f"error [interrupted]: interrupted by {signal.Signals(signum).name}" in err, err
    assert "Traceback" not in err
    assert _processes_under(root) == []
    assert os.listdir(tmp_path / "tmp") == []


def test_a_lab_killed_with_sigkill_takes_its_nodes_with_it(
    slow_package: Path, tmp_path: Path
) -> None:
    lab = _start_lab(
        tmp_path, "--nodes", "3", "--package", str(slow_package), "--serve-rate", "1MB"
    )
    try:
        root = _lab_dir(tmp_path / "tmp")
        _wait_until(lambda: _listening(root / "n2"), "the last worker listens")
        nodes = _processes_under(root)
        assert len(nodes) == 3
        lab.kill()
        lab.wait()
        # Nothing could handle that signal: the nodes stop by themselves, each saying why.
        _wait_until(lambda: _processes_under(root) == [], "the nodes stop after their lab")
        for name in ("n0", "n1", "n2"):
            log = (root / name / "node.log").read_text()
            assert "the lab that started this node is gone" in log, log[-2000:]
    finally:
        if lab.poll() is None:
            lab.kill()
            lab.wait()


def test_a_node_restarted_by_hand_stops_with_its_lab(slow_package: Path, tmp_path: Path) -> None:
    # --keep: the folder (and the node's data_dir) stays, so only the lab's lifeline tells it
    root = tmp_path / "lab"
    lab = _start_lab(
        tmp_path, "--nodes", "2", "--package", str(slow_package), "--dir", str(root),
        "--keep", "--http", "0",
    )
    restarted: subprocess.Popen[str] | None = None
    try:
        _wait_until(lambda: _listening(root / "n1"), "the worker listens")
        config = root / "n1" / "node.toml"
        (worker,) = [p for p in _processes_under(root) if str(config) in _cmdline(p)]
        os.kill(worker, signal.SIGKILL)
        _wait_until(lambda: worker not in _processes_under(root), "the worker is gone")
        restarted = subprocess.Popen(
            [*MESH, "run", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "XDG_CACHE_HOME": str(root / "n1" / "cache")},
        )
        assert restarted.stdout is not None
        assert restarted.stdout.readline().startswith("listening ")
        lab.send_signal(signal.SIGINT)
        lab.communicate(timeout=WAIT_S)
        _, err = restarted.communicate(timeout=WAIT_S)
    finally:
        for proc in (lab, restarted):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert restarted.returncode == 0, err
    assert "the lab that started this node is gone" in err and "Traceback" not in err, err
    assert (root / "n1" / "d").is_dir()  # kept: the node stopped because the lab was gone


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _read_document(stream: object) -> dict[str, object]:
    """One indented JSON document from a text stream, read line by line."""
    lines: list[str] = []
    for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
        lines.append(line)
        if line.rstrip() == "}":
            return dict(json.loads("".join(lines)))
    raise AssertionError(f"the lab ended before its report: {''.join(lines)[-2000:]}")


def test_a_serving_lab_ends_when_its_coordinator_dies(tmp_path: Path) -> None:
    src = synth_gguf.llama_like(tmp_path / "llama.gguf", n_layers=4)
    make_package(src, tmp_path / "pkg", model_id="acme/tiny-GGUF:Q8_0")
    lab = _start_lab(
        tmp_path, "--nodes", "2", "--serve", "--json", "--package", str(tmp_path / "pkg"),
        "--timeout", "120",
    )
    try:
        report = _read_document(lab.stdout)
        nodes = report["nodes"]
        assert isinstance(nodes, list) and nodes[0]["role"] == "coordinator"
        os.kill(nodes[0]["pid"], signal.SIGKILL)
        out, err = lab.communicate(timeout=WAIT_S)
    finally:
        if lab.poll() is None:
            lab.kill()
            lab.wait()
    assert lab.returncode == 1, err
    assert "error [lab_coordinator_exited]" in err and "SIGKILL" in err, err
    assert "Traceback" not in err and out.strip() == ""  # stdout: the one report, already read
    assert not any(_alive(n["pid"]) for n in nodes)
    assert os.listdir(tmp_path / "tmp") == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_node_whose_data_dir_is_removed_stops_and_says_why(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    node = cluster.start("solo", ["run"], node_toml(tmp_path, "solo"))
    try:
        node.wait_line("listening ")
        shutil.rmtree(tmp_path / "solo-data")
        code = node.popen.wait(timeout=WAIT_S)
    finally:
        cluster.stop()
    assert code == 0
    _wait_until(lambda: any("was removed" in line for line in node.log), "the log line")
    assert any(f"data_dir {tmp_path / 'solo-data'} was removed" in line for line in node.log)
