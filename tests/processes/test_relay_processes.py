"""Relays with real ``mesh-node run`` processes: on loopback, and in the NAT lab
(mesh_node/lab/netns.py) with the relay on the public segment and two nodes in two homes behind
two kernel masquerade routers, which nothing outside can dial. The homes link through the
relay (``mesh-node status`` says relayed, through which relay, with its RTT), lose that link
when the relay is killed, and link again when it comes back. The NAT lab needs root, ip and
nft: in CI they are required (as tests/mesh_node/lab/test_nat_lab.py), elsewhere the test is
skipped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from natmarks import needs_lab
from test_mesh_processes import MESH, make_keys, start, stop, wait_status

from mesh_node.lab.netns import NatLab

RELAY_PORT = 7400


def write_config(
    path: Path, name: str, listen: str, *, relays: list[str], relay: bool, direct: bool = False
) -> None:
    # direct: the direct upgrade of relayed links (off here: these tests keep links relayed,
    # test_direct_processes.py upgrades them)
    lines = [
        f'listen = "{listen}"',
        f'identity = "keys/{name}.key"',
        f'certificate = "keys/{name}.cert"',
        f'data_dir = "d-{name}"',
        f"relays = {json.dumps(relays)}",
        'memory_budget = "1GiB"',
        'calibration = "off"',
        "heartbeat_interval_s = 0.2",
        "peer_loss_timeout_s = 2",
        "handshake_timeout_s = 2",
        f"direct_upgrade = {'true' if direct else 'false'}",
    ]
    if relay:
        lines += ["[relay]", "enable = true"]
    path.write_text("\n".join(lines) + "\n")


def link_to(doc: dict[str, Any], node_id: str) -> dict[str, Any] | None:
    return next((p for p in doc["peers"] if p["node_id"] == node_id and p["connected"]), None)


def relayed(doc: dict[str, Any], node_id: str, relay_id: str) -> bool:
    link = link_to(doc, node_id)
    return link is not None and link["link"] == "relayed" and link["relay"] == relay_id


def test_two_processes_link_through_a_relay_process_on_loopback(tmp_path: Path) -> None:
    ids, _ = make_keys(tmp_path, ("relay", "a", "b"))
    write_config(tmp_path / "relay.toml", "relay", "127.0.0.1:0", relays=[], relay=True)
    relay, relay_url = start(tmp_path, "relay.toml")
    try:
        for name in ("a", "b"):
            write_config(
                tmp_path / f"{name}.toml", name, "127.0.0.1:0", relays=[relay_url], relay=False
            )
        a, _ = start(tmp_path, "a.toml")
        b, _ = start(tmp_path, "b.toml")
        try:
            doc = wait_status(tmp_path, "a.toml", lambda d: relayed(d, ids["b"], ids["relay"]))
            assert relayed(doc, ids["b"], ids["relay"]), doc["peers"]
            link = link_to(doc, ids["b"])
            assert link is not None and link["rtt_ms"] is not None  # measured end to end
            assert link_to(doc, ids["relay"])["link"] == "direct"  # type: ignore[index]
            section = wait_status(
                tmp_path, "relay.toml", lambda d: d["relay"]["circuits_open"] >= 1
            )["relay"]
            assert section["enabled"] and section["circuits_open"] >= 1
            assert section["bytes_forwarded"] > 0
            text = subprocess.run(
                [*MESH, "status", "--config", "a.toml"],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
            assert f"relayed via {ids['relay'][:12]}" in text, text
        finally:
            for proc in (a, b):
                stop(proc)
    finally:
        stop(relay)


def _start_in(lab: NatLab, host: str, cwd: Path, config: str) -> subprocess.Popen[bytes]:
    proc = lab.run(
        host,
        [*MESH, "run", "--config", config],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("listening "), line
    return proc


@needs_lab
def test_two_nodes_behind_two_nats_link_through_a_relay_and_survive_its_restart(
    tmp_path: Path,
) -> None:
    ids, _ = make_keys(tmp_path, ("relay", "h1", "h2"))
    with NatLab(f"rl{os.getpid() % 10000}") as lab:
        relay_host = lab.hosts["relay"].address
        relay_url = f"ws://{relay_host}:{RELAY_PORT}#{ids['relay']}"
        write_config(
            tmp_path / "relay.toml", "relay", f"0.0.0.0:{RELAY_PORT}", relays=[], relay=True
        )
        for name, home in (("h1", "home1"), ("h2", "home2")):
            listen = f"{lab.hosts[home].address}:7401"
            write_config(tmp_path / f"{name}.toml", name, listen, relays=[relay_url], relay=False)
        relay = _start_in(lab, "relay", tmp_path, "relay.toml")
        _start_in(lab, "home1", tmp_path, "h1.toml")
        _start_in(lab, "home2", tmp_path, "h2.toml")
        doc = wait_status(tmp_path, "h1.toml", lambda d: relayed(d, ids["h2"], ids["relay"]), 30)
        assert relayed(doc, ids["h2"], ids["relay"]), doc["peers"]
        # The relay saw the homes' routers, not the homes: they are behind NAT.
        section = wait_status(tmp_path, "relay.toml", lambda d: d["relay"]["circuits_open"] >= 1)
        assert section["relay"]["circuits_open"] >= 1
        relay.send_signal(signal.SIGKILL)  # no goodbye: the circuits' links just break
        relay.wait(20)
        doc = wait_status(tmp_path, "h1.toml", lambda d: link_to(d, ids["h2"]) is None, 30)
        assert link_to(doc, ids["h2"]) is None
        _start_in(lab, "relay", tmp_path, "relay.toml")
        doc = wait_status(tmp_path, "h2.toml", lambda d: relayed(d, ids["h1"], ids["relay"]), 30)
        assert relayed(doc, ids["h1"], ids["relay"]), doc["peers"]
