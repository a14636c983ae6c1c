"""``mesh-node run --http``: the page address on stdout, loopback unless told otherwise, clear
errors (exit 2, a code, no traceback) for a refused bind, a taken port or a busy data_dir."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from httptools import get_json
from test_mesh_processes import MESH, mesh, start, stop


def node_config(tmp_path: Path, name: str, extra: str = "") -> str:
    assert mesh(tmp_path, "keygen", f"{name}.key").returncode == 0
    (tmp_path / f"{name}.toml").write_text(
        f'identity = "{name}.key"\ndata_dir = "d-{name}"\nlisten = "127.0.0.1:0"\n{extra}'
    )
    return f"{name}.toml"


def run_briefly(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MESH, "run", *args], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def test_a_non_loopback_page_needs_the_public_flag_and_a_taken_port_is_a_clear_error(tmp_path):
    config = node_config(tmp_path, "a")
    out = run_briefly(tmp_path, "--config", config, "--http", "0.0.0.0:0")
    assert out.returncode == 2 and "error [http_not_loopback]" in out.stderr
    assert "--http-public" in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""  # refused before the node started
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = run_briefly(tmp_path, "--config", config, "--http", str(port))  # bare port
    assert out.returncode == 2 and "error [http_bind_failed]" in out.stderr, out.stderr
    assert f"127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr


def test_public_page_from_the_config_warns_and_a_busy_data_dir_is_a_clear_error(tmp_path):
    config = node_config(tmp_path, "a", 'http = "0.0.0.0:0"\nhttp_public = true\n')
    proc, _ = start(tmp_path, config)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("status-page http://0.0.0.0:"), line
        port = int(line.rsplit(":", 1)[1].strip().rstrip("/"))
        doc = get_json(f"http://127.0.0.1:{port}/api/status")
        assert doc["node_id"] == mesh(tmp_path, "id", "a.key").stdout.strip()
        # A second node on the same data_dir: refused with its code, not a traceback.
        again = run_briefly(tmp_path, "--config", config)
        assert again.returncode == 2 and "error [data_dir_in_use]" in again.stderr
        assert "Traceback" not in again.stderr
    finally:
        assert stop(proc) == 0
    err = proc.stderr.read() if proc.stderr else ""
    # the node's own start (the one gate) warns, on its log: loudly, as no key is set
    warning = next(line for line in err.splitlines() if "reachable from other machines" in line)
    assert "level=WARNING" in warning and "listen on 0.0.0.0:0" in warning
    assert "NO API KEY is configured" in warning and "Traceback" not in err
