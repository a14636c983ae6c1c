"""The traps of an operator's first hour, each with real `mesh-node`
processes: a busy or unresolvable `listen` address is `error [code]` with a hint and exit 2,
never a traceback; `listening` is printed only when every check passed; SIGHUP shuts down as
cleanly as SIGTERM; a `data_dir` that is a file is its own error; a failed dial says why;
`mesh-node --version`; the serving section of `mesh-node status` as text."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from servetools import Cluster, Proc, node_toml

import skippy
from mesh_node.peers import render_status


def _mesh(args: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mesh_node", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )


def _config(tmp: Path, listen: str = "127.0.0.1:0") -> Path:
    cfg = tmp / "n.toml"
    cfg.write_text(node_toml(tmp, "n").replace('"127.0.0.1:0"', f'"{listen}"', 1))
    return cfg


def _wait_log(proc: Proc, needle: str, timeout_s: float = 15.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [line for line in proc.log if needle in line]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no log line with {needle!r}: {proc.log[-10:]}")


def _assert_user_error(out: subprocess.CompletedProcess[str], code: str) -> None:
    assert out.returncode == 2, out.stderr
    assert f"error [{code}]" in out.stderr and "hint: " in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "ExceptionGroup" not in out.stderr, out.stderr
    assert "listening" not in out.stdout


def test_a_busy_listen_address_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        cfg = _config(tmp_path, f"127.0.0.1:{port}")
        _assert_user_error(_mesh(["run", "--config", str(cfg)]), "listen_in_use")


def test_an_unresolvable_listen_host_is_a_clear_error(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "no-such-host.invalid:7000")
    _assert_user_error(_mesh(["run", "--config", str(cfg)]), "listen_unresolvable")


def test_listening_is_printed_only_after_every_check(tmp_path: Path) -> None:
    """`serve` with a package that is not there: no `listening` line, exit 2."""
    cfg = _config(tmp_path)
    out = _mesh(
        [
            "serve",
            "--config",
            str(cfg),
            "--package",
            str(tmp_path / "missing"),
            "--http",
            "127.0.0.1:0",
        ]
    )
    assert out.returncode == 2 and "error [" in out.stderr, out.stderr
    assert "listening" not in out.stdout and "Traceback" not in out.stderr


def test_a_data_dir_that_is_a_file_is_its_own_error(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    (tmp_path / "n-data").write_text("not a folder")
    _assert_user_error(_mesh(["run", "--config", str(cfg)]), "data_dir_not_a_directory")


def test_sighup_shuts_down_cleanly_and_a_failed_dial_says_why(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        cluster = Cluster(tmp_path)
        toml = node_toml(tmp_path, "n", peers=(f"ws://127.0.0.1:{port}#{'ab' * 32}",))
        proc = cluster.start("n", ["run"], toml)
        try:
            proc.wait_line("listening ")
            failed = _wait_log(proc, f"dial ws://127.0.0.1:{port}")
            assert "failed: " in failed and "Connection refused" in failed, failed
            proc.popen.send_signal(signal.SIGHUP)
            assert proc.popen.wait(timeout=20) == 0
        finally:
            cluster.stop()
    assert any("SIGHUP: shutting down" in line for line in proc.log), proc.log[-10:]
    assert any('msg="stopped"' in line for line in proc.log), proc.log[-10:]
    assert not (tmp_path / "n-data" / "mesh-node.sock").exists()


def test_version() -> None:
    out = _mesh(["--version"])
    assert out.returncode == 0 and out.stdout.strip() == f"mesh-node {skippy.__version__}"


def test_status_text_has_the_serving_section() -> None:
    doc = {
        "node_id": "a" * 64,
        "listen": "ws://127.0.0.1:7000",
        "owner_id": None,
        "owner_status": "unverified",
        "features": {},
        "memory_budget": 1,
        "artifact_transfer": "disabled",
        "peers": [],
        "topology": None,
        "transfers": None,
    }
    waiting = {
        "model": "tiny",
        "state": "waiting",
        "code": "no_capable_peer",
        "reason": "no capable peer can take stage 2; waiting for node abc to come back",
        "requests": {"ok": 3, "error": 1},
        "requests_in_flight": 1,
        "requests_queued": 0,
        "failovers_total": 2,
        "decode_tokens_per_s": 17.5,
    }
    text = render_status({**doc, "serving": waiting})
    assert "serving  tiny waiting [no_capable_peer]: no capable peer" in text
    assert "failovers 2" in text and "17.5 tok/s" in text and "ok 3" in text
    ready = {**waiting, "state": "ready", "stages": 3, "topology_id": "topo-1"}
    assert "serving  tiny ready (3 stage(s), topology topo-1)" in render_status(
        {**doc, "serving": ready}
    )
    assert "serving" not in render_status(doc)
    # memory in human units (the raw bytes stay in --json); a failed stage's reason, a
    # peer's words, cannot forge a line
    text = render_status({**doc, "memory_budget": 8 * 2**30})
    assert "memory   8.0 GiB budget;" in text and str(8 * 2**30) not in text
    failed = {**waiting, "state": "failed", "code": "unsupported_architecture"}
    text = render_status({**doc, "serving": {**failed, "reason": "stage 1: no\nforged line"}})
    assert "serving  tiny failed [unsupported_architecture]: stage 1: no\\x0aforged line" in text
