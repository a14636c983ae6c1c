"""Real ``mesh-node`` processes on loopback ("Done when"): keys from ``keygen``,
certificates from one owner, two ``run`` processes that find and trust each other, and a
coordinator's signed topology acknowledged by its worker; plus the CLI's conventions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from pkgtools import make_package

MESH = [sys.executable, "-m", "mesh_node"]


def mesh(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MESH, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def write_config(path: Path, name: str, peers: list[str]) -> None:
    path.write_text(
        "\n".join(
            [
                'listen = "127.0.0.1:0"',
                f'identity = "keys/{name}.key"',
                f'certificate = "keys/{name}.cert"',
                f'data_dir = "d-{name}"',
                f"peers = {json.dumps(peers)}",
                'memory_budget = "4GiB"',
                "heartbeat_interval_s = 0.2",
                "peer_loss_timeout_s = 2",
                "handshake_timeout_s = 2",
            ]
        )
        + "\n"
    )


def start(cwd: Path, config: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [*MESH, "run", "--config", config, *extra],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the node prints exactly one line when ready
    if not line.startswith("listening "):
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"no listening line: {line!r} {err}")
    return proc, line.split(" ", 1)[1].strip()


def make_keys(cwd: Path, names: tuple[str, ...]) -> tuple[dict[str, str], str]:
    """``keys/<name>.key`` (``keygen``) and ``keys/<name>.cert`` from one owner (``owner init``,
    ``owner sign``), as an operator makes them; returns (node ids by name, owner id)."""
    ids = {}
    for name in names:
        out = mesh(cwd, "keygen", f"keys/{name}.key")
        assert out.returncode == 0, out.stderr
        ids[name] = out.stdout.strip()
    owner = mesh(cwd, "owner", "init", "keys/owner.key").stdout.strip()
    for name in names:
        cert = f"keys/{name}.cert"
        out = mesh(cwd, "owner", "sign", "--owner", "keys/owner.key", ids[name], "--out", cert)
        assert out.returncode == 0, out.stderr
    return ids, owner


def status(cwd: Path, config: str) -> dict[str, Any]:
    out = mesh(cwd, "status", "--config", config, "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def wait_status(cwd: Path, config: str, predicate: Any, timeout_s: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        doc = status(cwd, config)
        if predicate(doc) or time.monotonic() > deadline:
            return doc
        time.sleep(0.1)


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_two_real_processes_trust_each_other_and_a_signed_topology_is_acknowledged(
    tmp_path, synth_dir
):
    pkg = tmp_path / "pkg"
    make_package(synth_dir.llama, pkg)
    ids, owner = make_keys(tmp_path, ("a", "b"))
    for name in ("a", "b"):
        assert os.stat(tmp_path / "keys" / f"{name}.key").st_mode & 0o777 == 0o600
    write_config(tmp_path / "a.toml", "a", [])
    a, a_url = start(tmp_path, "a.toml")
    procs = [a]
    try:
        assert a_url.endswith("#" + ids["a"])
        sock = tmp_path / "d-a" / "mesh-node.sock"
        assert sock.stat().st_mode & 0o777 == 0o600  # the local control socket
        assert (tmp_path / "d-a").stat().st_mode & 0o777 == 0o700
        write_config(tmp_path / "b.toml", "b", [a_url])
        b, _ = start(tmp_path, "b.toml")
        procs.append(b)

        def trusts(other: str):
            return lambda doc: any(
                p["node_id"] == ids[other] and p["connected"] and p["trusted"] for p in doc["peers"]
            )

        doc_a = wait_status(tmp_path, "a.toml", trusts("b"))
        doc_b = wait_status(tmp_path, "b.toml", trusts("a"))
        for doc, other in ((doc_a, "b"), (doc_b, "a")):
            (peer,) = doc["peers"]
            assert peer["node_id"] == ids[other] and peer["trusted"] is True
            assert peer["owner_id"] == owner and peer["owner_status"] == "verified"
            assert doc["owner_status"] == "verified"
            assert "control" in peer["features"]["skippy-stage/2"]

        out = mesh(tmp_path, "topology", "--config", "a.toml", "--package", str(pkg), "--json")
        assert out.returncode == 0, out.stderr + out.stdout
        topo = json.loads(out.stdout)
        assert topo["state"] == "active" and topo["acks"] == {ids["b"]: "accepted"}
        assert {s["node_id"] for s in topo["stages"]} == {ids["a"], ids["b"]}
        worker = status(tmp_path, "b.toml")["topology"]
        assert worker["role"] == "worker" and worker["coordinator_id"] == ids["a"]
        assert worker["topology_id"] == topo["topology_id"]
        assert worker["stages"] == topo["stages"]

        assert stop(b) == 0
        procs.remove(b)
        assert b"Traceback" not in (b.stderr.read().encode() if b.stderr else b"")
        degraded = wait_status(tmp_path, "a.toml", lambda d: d["topology"]["state"] == "degraded")
        assert degraded["topology"]["lost_nodes"] == [ids["b"]]
        out = mesh(tmp_path, "topology", "--config", "a.toml", "--replan", "--json")
        replanned = json.loads(out.stdout)
        assert out.returncode == 0 and replanned["run_id"] == topo["run_id"]
        assert [s["node_id"] for s in replanned["stages"]] == [ids["a"]]  # the remaining peer
        assert stop(a, signal.SIGINT) == 0  # clean shutdown on SIGINT (b: SIGTERM), exit 0
        procs.remove(a)
        assert not (tmp_path / "d-a" / "mesh-node.sock").exists()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_cli_errors_have_codes_and_exit_codes(tmp_path):
    out = mesh(tmp_path, "keygen", "k.key", "--json")
    assert out.returncode == 0
    again = mesh(tmp_path, "keygen", "k.key", "--json")
    assert again.returncode == 2 and json.loads(again.stdout)["error"]["code"] == "output_exists"
    os.chmod(tmp_path / "k.key", 0o640)
    bad = mesh(tmp_path, "id", "k.key")
    assert bad.returncode == 2 and "error [key_file_permissions]" in bad.stderr
    assert "Traceback" not in bad.stderr
    os.chmod(tmp_path / "k.key", 0o600)
    (tmp_path / "n.toml").write_text('identity = "k.key"\nlisten_on = "x"\n')
    out = mesh(tmp_path, "status", "--config", "n.toml", "--json")
    assert out.returncode == 2
    err = json.loads(out.stdout)["error"]
    assert err["code"] == "unknown_config_key" and "listen_on" in err["message"]
    (tmp_path / "n.toml").write_text('identity = "k.key"\n')
    out = mesh(tmp_path, "status", "--config", "n.toml")
    assert out.returncode == 2 and "error [node_not_running]" in out.stderr
    out = mesh(tmp_path, "owner", "sign", "--owner", "k.key", "nothex", "--out", "c.cert")
    assert out.returncode == 2 and "invalid_node_id" in out.stderr
    out = mesh(tmp_path, "run", "--config", "missing.toml")
    assert out.returncode == 2 and "unreadable_input" in out.stderr


@pytest.mark.parametrize("mode", [0o644, 0o604])
def test_a_node_refuses_a_readable_private_key(tmp_path, mode):
    assert mesh(tmp_path, "keygen", "k.key").returncode == 0
    os.chmod(tmp_path / "k.key", mode)
    (tmp_path / "n.toml").write_text('identity = "k.key"\n')
    out = mesh(tmp_path, "run", "--config", "n.toml")
    assert out.returncode == 2 and "key_file_permissions" in out.stderr
