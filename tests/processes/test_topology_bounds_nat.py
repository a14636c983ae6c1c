"""A worker's topology sanity bound counts what it can verify, with real ``mesh-node run``
processes in the NAT lab (mesh_node/lab/netns.py): a coordinator on the public segment, two
workers behind two different NATs (so they can never link to each other), all certified by
one owner, and a certificate-less stranger on the public segment that worker B links to.

The honest coordinator's 3-stage topology names worker A, which B has never authenticated
(no link can form between the homes); B accepts it on the trusted coordinator's signed word.
The stranger then gossips ~1,020 invented node ids to B and offers it a topology over them:
hearsay lifts nothing, and B refuses it as ``topology_bounds``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import synth_gguf
from natmarks import needs_lab
from pkgtools import make_package
from test_mesh_processes import make_keys, mesh, status, wait_status

from mesh_node.lab.netns import NatLab

PORT = 7000
HOSTILE = str(Path(__file__).resolve().parents[1] / "support" / "hostile_peer.py")
STRANGER_STAGES = 64  # far more than B verified, far fewer than the invented ids


def _config(root: Path, name: str, listen: str, peers: list[str], extra: str = "") -> str:
    cert = (
        f'certificate = "keys/{name}.cert"\n' if (root / "keys" / f"{name}.cert").exists() else ""
    )
    (root / f"{name}.toml").write_text(
        f'listen = "{listen}:{PORT}"\n'
        f'identity = "keys/{name}.key"\n{cert}'
        f'data_dir = "d-{name}"\n'
        f"peers = {json.dumps(peers)}\n"
        'memory_budget = "4GiB"\n'
        "heartbeat_interval_s = 0.2\npeer_loss_timeout_s = 5\nhandshake_timeout_s = 5\n" + extra
    )
    return f"{name}.toml"


def _start(lab: NatLab, host: str, root: Path, config: str) -> subprocess.Popen[bytes]:
    proc = lab.run(
        host,
        [sys.executable, "-m", "mesh_node", "run", "--config", config],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=open(root / f"{config}.log", "wb"),  # noqa: SIM115 (the process owns it)
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("listening "), (line, (root / f"{config}.log").read_text())
    return proc


def _connected(doc: dict[str, object], node_id: str) -> bool:
    peers = doc["peers"]
    assert isinstance(peers, list)
    return any(p["node_id"] == node_id and p["connected"] for p in peers)


@needs_lab
def test_a_nated_stage_node_counts_by_the_coordinators_word_and_gossip_counts_for_nothing(
    tmp_path: Path,
) -> None:
    src = synth_gguf.llama_like(tmp_path / "llama.gguf", n_layers=6)
    make_package(src, tmp_path / "pkg")
    ids, _owner = make_keys(tmp_path, ("c", "a", "b"))
    out = mesh(tmp_path, "keygen", "keys/s.key")  # the stranger: a key, no certificate
    assert out.returncode == 0, out.stderr
    stranger_id = out.stdout.strip()
    with NatLab(f"tb{os.getpid()}") as lab:
        hosts = lab.hosts
        coord = f"ws://{hosts['coord'].address}:{PORT}#{ids['c']}"
        stranger = f"ws://{hosts['relay'].address}:{PORT}#{stranger_id}"
        _start(lab, "coord", tmp_path, _config(tmp_path, "c", hosts["coord"].address, []))
        hostile = lab.run(
            "relay",
            [sys.executable, HOSTILE, "gossip", "keys/s.key", f"{hosts['relay'].address}:{PORT}",
             ids["b"], str(STRANGER_STAGES)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        # B takes topologies from any coordinator: only the sanity bound stands between a
        # stranger's nonsense and B (the trusted default refuses the stranger outright).
        b_cfg = _config(
            tmp_path, "b", hosts["home2"].address, [coord, stranger],
            '[security]\naccept_topologies_from = "any"\n',
        )  # fmt: skip
        _start(lab, "home1", tmp_path, _config(tmp_path, "a", hosts["home1"].address, [coord]))
        _start(lab, "home2", tmp_path, b_cfg)
        doc = wait_status(
            tmp_path, "c.toml", lambda d: _connected(d, ids["a"]) and _connected(d, ids["b"])
        )
        assert _connected(doc, ids["a"]) and _connected(doc, ids["b"])

        # The stranger floods B with invented ids, then offers its nonsense topology.
        stdout, stderr = hostile.communicate(timeout=60)
        result = stdout.decode().strip().splitlines()
        assert result and result[-1] == "result False topology_bounds", (result, stderr[-2000:])
        assert status(tmp_path, "b.toml")["topology"] is None or (
            status(tmp_path, "b.toml")["topology"]["topology_id"] != "topo-hostile"
        )

        # The honest split: B never authenticated A (two homes, two NATs), yet accepts.
        doc_b = status(tmp_path, "b.toml")
        assert not _connected(doc_b, ids["a"])
        out = mesh(tmp_path, "topology", "--config", "c.toml", "--package",
                   str(tmp_path / "pkg"), "--stages", "3", "--json")  # fmt: skip
        assert out.returncode == 0, out.stderr + out.stdout
        topo = json.loads(out.stdout)
        assert topo["acks"] == {ids["a"]: "accepted", ids["b"]: "accepted"}, topo["acks"]
        assert {s["node_id"] for s in topo["stages"]} == set(ids.values())
        assert status(tmp_path, "b.toml")["topology"]["coordinator_id"] == ids["c"]
