"""Nodes gossip only listen addresses, feature bits, memory budgets and their devices' names,
types and memory. Every advertisement and gossip message that three real nodes exchange is
captured and inspected."""

from __future__ import annotations

from pathlib import Path

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import identity, settings, wait_for, with_peers
from meshxfer import import_into, propose, start_member, wait_connected

from mesh_node.composition import add_services
from mesh_node.device_adverts import advertise
from mesh_node.hostid import host_fingerprint
from mesh_node.link import Link
from mesh_node.node import MeshNode
from protocol import constants as pc
from protocol.frames import unpack_bounded
from protocol.messages import Hello, Peers, decode_link_message
from skippy.config import read_environment
from skippy.gguf import ggml
from skippy.runtime.devices import list_devices

SECRET_TOKEN = "hf_secrettoken0123456789"


class RecordingNode(MeshNode):
    """A real node that keeps a copy of every link message it receives (test-only subclass)."""

    captured: list[bytes]

    def _on_message(self, link: Link, payload: bytes) -> None:
        self.captured.append(payload)
        super()._on_message(link, payload)


async def test_every_advertisement_and_gossip_message_carries_only_allowed_fields(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_TOKEN", SECRET_TOKEN)
    owner = Ed25519PrivateKey.generate()
    infos = list_devices(ggml.load())  # this machine's real devices
    devices = advertise(infos, "CPU", experts_in_ram=False, speeds={})
    assert devices is not None
    async with trio.open_nursery() as n:
        nodes: list[RecordingNode] = []
        for i in range(3):
            s = settings(tmp_path, f"secret-cache-{i}", artifact_transfer="open")
            if nodes:
                s = with_peers(s, nodes[0])
            node = RecordingNode(s, identity(owner))
            add_services(node, read_environment())  # as `mesh-node run` wires it
            node.devices = devices  # as `mesh-node run` reads them (mesh_node.calibration)
            node.captured = []
            await n.start(node.run)
            nodes.append(node)
        await wait_for(lambda: all(len(x.peers(connected_only=True)) == 2 for x in nodes))
        await trio.sleep(0.2)
        n.cancel_scope.cancel()
    messages = [p for node in nodes for p in node.captured]
    kinds = {type(decode_link_message(p)) for p in messages}
    assert kinds == {Hello, Peers}
    addresses = {x.listen_url for x in nodes}
    try:
        machine_id: bytes | None = Path("/etc/machine-id").read_bytes().strip() or None
    except OSError:
        machine_id = None
    for payload in messages:
        raw = unpack_bounded(payload)
        assert isinstance(raw, dict)
        if raw["t"] == "hello":
            assert set(raw) - {"observed", "direct"} == {
                "t", "gen", "listen", "features", "memory_budget_bytes", "host", "boot", "devices"
            }
            # each device's name, type and memory, never its description (the CPU's model)
            assert raw["devices"] == devices.to_wire()
            for d in raw["devices"]["list"]:
                assert set(d) == {"name", "type", "free_bytes", "total_bytes"}
            for info in infos:
                assert info.description == info.name or info.description.encode() not in payload
            # where the receiver appears (its own address, over TCP), and the sender's listen
            # port at the address its peers saw it at: nothing a direct peer does not see
            assert raw["observed"].startswith("127.0.0.1:")
            port = raw["listen"].rsplit(":", 1)[1]
            assert set(raw.get("direct", [])) <= {f"127.0.0.1:{port}"}
            # the process's random id (a restart is told from a reconnect): nothing of the machine
            assert isinstance(raw["boot"], str) and len(raw["boot"]) == 16
            assert machine_id is None or raw["boot"].encode() not in machine_id
            assert raw["listen"] in addresses
            # the salted host fingerprint, never the machine id itself
            assert raw["host"] == host_fingerprint() and len(raw["host"]) == 32
            assert machine_id is None or machine_id not in payload
            assert raw["features"] == {
                pc.FEATURE_MESH_RELAY: [pc.BIT_RELAYED],  # reads relayed addresses in gossip
                pc.FEATURE_SKIPPY_STAGE: sorted(
                    [
                        *pc.STAGE_BUNDLE,
                        pc.BIT_ARTIFACT_TRANSFER,
                        pc.BIT_SWARM_TRANSFER,
                        pc.BIT_SIBLING_SERVE,
                        pc.BIT_CHUNK_RUNS,
                        pc.BIT_PARTIAL_SERVE,
                        pc.BIT_VERIFY_WINDOW,
                        pc.BIT_NEXTN_DRAFTS,
                        pc.BIT_SAMPLING_CONTROLS,
                        pc.BIT_CHUNK_CHAIN,
                    ]
                )
            }
        else:
            assert set(raw) == {"t", "gen", "peers"}
            for entry in raw["peers"]:
                assert set(entry) == {"node_id", "address"} and entry["address"] in addresses
        for secret in (
            SECRET_TOKEN.encode(),
            b"secret-cache",
            str(tmp_path).encode(),
            b".gguf",
            b"model-package.json",
        ):
            assert secret not in payload


async def test_advertisements_carry_only_the_feature_bit_while_artifacts_move(
    tmp_path, hub_package
):
    """Spec "Peer Cache Transfer": nodes advertise only skippy-stage/2 feature support,
    including artifact-transfer, never package inventory, artifact paths or cache roots, also
    while a coordinator holds a package and serves it to its workers."""
    owner = Ed25519PrivateKey.generate()
    async with trio.open_nursery() as n:
        coord = await start_member(
            n, tmp_path, "inventory-coord", owner, hub=hub_package.hub,
            node_class=RecordingNode, artifact_transfer="trusted",
        )
        coord.node.captured = []
        pkg = import_into(coord, hub_package)
        worker = await start_member(
            n, tmp_path, "inventory-worker", owner, hub=hub_package.hub,
            node_class=RecordingNode, peers=(coord.node,),
        )
        worker.node.captured = []
        await wait_connected([coord, worker])
        await propose(coord, pkg)
        await wait_for(lambda: coord.topology.active.all_ready, 20)
        assert worker.service.records.counters.fetched_bytes["peer"] > 0
        n.cancel_scope.cancel()
    for node, other in ((coord.node, worker.node), (worker.node, coord.node)):
        for payload in node.captured:
            message = decode_link_message(payload)
            if isinstance(message, Hello):
                bits = set(message.features[pc.FEATURE_SKIPPY_STAGE])
                assert set(message.features) == {pc.FEATURE_SKIPPY_STAGE}
                always = {
                    pc.BIT_VERIFY_WINDOW,
                    pc.BIT_NEXTN_DRAFTS,
                    pc.BIT_SAMPLING_CONTROLS,
                    pc.BIT_CHUNK_CHAIN,
                }
                assert bits == set(pc.STAGE_BUNDLE) | always | (
                    {
                        pc.BIT_ARTIFACT_TRANSFER,
                        pc.BIT_SWARM_TRANSFER,
                        pc.BIT_SIBLING_SERVE,
                        pc.BIT_CHUNK_RUNS,
                        pc.BIT_PARTIAL_SERVE,
                    }
                    if other is coord.node
                    else set()
                )
            for secret in (b"inventory", b"tiny-layers", b".gguf", b"model-package", b"hub"):
                assert secret not in payload
