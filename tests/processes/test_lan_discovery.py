"""LAN discovery by multicast DNS in the NAT lab's LAN: two real ``mesh-node run`` processes
of one owner in ``lan1``/``lan2`` (``lan_discovery = true``, no peers configured) find and
link to each other; a node of another owner on the same LAN is announced to but not dialed,
and a node of the same owner in another segment (``home1``, behind its router) finds nobody.
Needs root, ip and nft (required in CI, as tests/mesh_node/lab/test_nat_lab.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from natmarks import needs_lab
from test_mesh_processes import make_keys, mesh

from mesh_node.lab.netns import NatLab
from protocol.invite import owner_fingerprint

PORT = 7000


def _config(cwd: Path, name: str, host: str, port: int = PORT) -> str:
    (cwd / f"{name}.toml").write_text(
        "\n".join(
            [
                f'listen = "{host}:{port}"',
                f'identity = "keys/{name}.key"',
                f'certificate = "keys/{name}.cert"',
                f'data_dir = "d-{name}"',
                "lan_discovery = true",
                'memory_budget = "1GiB"',
                "heartbeat_interval_s = 0.2",
                "peer_loss_timeout_s = 2",
            ]
        )
        + "\n"
    )
    return f"{name}.toml"


def _status(cwd: Path, config: str) -> dict[str, Any]:
    out = mesh(cwd, "status", "--config", config, "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def _wait(cwd: Path, config: str, predicate: Any, timeout_s: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            doc = _status(cwd, config)
        except AssertionError:  # not listening on its control socket yet
            doc = {}
        if (doc and predicate(doc)) or time.monotonic() > deadline:
            return doc
        time.sleep(0.2)


def _linked(doc: dict[str, Any]) -> set[str]:
    return {p["node_id"] for p in doc["peers"] if p["connected"]}


@needs_lab
def test_nodes_of_one_owner_find_each_other_on_the_lan_and_nowhere_else(tmp_path: Path) -> None:
    ids, owner = make_keys(tmp_path, ("a", "b", "h"))
    # a node of another owner on the same LAN
    x_id = mesh(tmp_path, "keygen", "keys/x.key").stdout.strip()
    assert mesh(tmp_path, "owner", "init", "keys/other.key").returncode == 0
    assert mesh(tmp_path, "owner", "sign", "--owner", "keys/other.key", x_id,
                "--out", "keys/x.cert").returncode == 0  # fmt: skip
    with NatLab(f"ld{os.getpid()}") as lab:
        a_host, b_host = lab.hosts["lan1"].address, lab.hosts["lan2"].address
        configs = {
            "a": ("lan1", _config(tmp_path, "a", a_host)),
            "b": ("lan2", _config(tmp_path, "b", b_host)),
            "x": ("lan2", _config(tmp_path, "x", b_host, PORT + 1)),
            "h": ("home1", _config(tmp_path, "h", lab.hosts["home1"].address)),
        }
        logs = {}
        for name, (host, config) in configs.items():
            logs[name] = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 (closed below)
            lab.run(host, [sys.executable, "-m", "mesh_node", "run", "--config", config],
                    cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=logs[name])  # fmt: skip
        try:
            doc_a = _wait(tmp_path, "a.toml", lambda d: ids["b"] in _linked(d))
            doc_b = _wait(tmp_path, "b.toml", lambda d: ids["a"] in _linked(d))
            assert ids["b"] in _linked(doc_a), (tmp_path / "a.log").read_text()
            assert ids["a"] in _linked(doc_b), (tmp_path / "b.log").read_text()
            for doc, other in ((doc_a, "b"), (doc_b, "a")):
                (peer,) = [p for p in doc["peers"] if p["node_id"] == ids[other]]
                assert peer["trusted"] is True and peer["owner_id"] == owner
            # the other node announced its discovery too: give home1 its 1 + 2 + 4 s of
            # announcements, then nobody has linked to it or to the other owner's node
            time.sleep(4)
            doc_a, doc_x, doc_h = (_status(tmp_path, f"{n}.toml") for n in ("a", "x", "h"))
            assert _linked(doc_a) == {ids["b"]} and _linked(doc_x) == set()
            assert _linked(doc_h) == set() and doc_h["lan_discovery"]["found"] == []
            assert doc_h["lan_discovery"]["state"] == "on"
            assert doc_a["lan_discovery"]["found"] == [f"ws://{b_host}:{PORT}"]
            assert doc_x["lan_discovery"]["found"] == []  # it heard a and b: not its owner's
            assert owner_fingerprint(bytes.fromhex(owner)) != owner_fingerprint(
                bytes.fromhex(mesh(tmp_path, "id", "keys/other.key").stdout.strip())
            )
        finally:
            lab.close()
            for f in logs.values():
                f.close()
        for name in configs:
            assert b"Traceback" not in (tmp_path / f"{name}.log").read_bytes()


def test_lan_discovery_is_off_by_default_and_takes_only_true_or_false(tmp_path: Path) -> None:
    import pytest

    from mesh_node.settings import load_node_settings
    from skippy.errors import UsageError

    (tmp_path / "n.toml").write_text('identity = "n.key"\n')
    assert load_node_settings(tmp_path / "n.toml").lan_discovery is False
    (tmp_path / "n.toml").write_text('identity = "n.key"\nlan_discovery = true\n')
    assert load_node_settings(tmp_path / "n.toml").lan_discovery is True
    (tmp_path / "n.toml").write_text('identity = "n.key"\nlan_discovery = "yes"\n')
    with pytest.raises(UsageError, match="lan_discovery"):
        load_node_settings(tmp_path / "n.toml")


async def test_a_learned_address_of_a_linked_node_or_of_itself_is_dialed_once(
    tmp_path: Path, caplog: Any
) -> None:
    """LAN discovery knows an address, not the node id behind it: a dial that reaches a node
    already linked (or this node) ends its dial loop instead of redialing every 50 ms."""
    import logging
    from dataclasses import replace

    import trio
    from meshtools import address_of, identity, running, settings, wait_for, with_peers

    from mesh_node.node import MeshNode

    caplog.set_level(logging.INFO, logger="mesh_node.node")
    async with trio.open_nursery() as nursery:
        a = MeshNode(settings(tmp_path, "a"), identity())
        async with running(nursery, a):
            b = MeshNode(with_peers(settings(tmp_path, "b"), a), identity())
            async with running(nursery, b):
                await wait_for(lambda: len(a.peers(connected_only=True)) == 1)
                a.dial_learned(replace(address_of(b), node_id=None))
                a.dial_learned(replace(address_of(a), node_id=None))
                await trio.sleep(1.5)
                text = caplog.text
                assert text.count("duplicate link to") <= 2, text
                assert text.count("refusing a link to myself") <= 2, text
                assert [p.node_id for p in a.peers(connected_only=True)] == [b.node_id]
                nursery.cancel_scope.cancel()
