"""A certificate-less stranger as a real process: a ``MeshNode`` of its own identity that
links to a victim and then misbehaves at one chosen step (tests start it with
``python tests/hostile_peer.py MODE ...``; it prints one ``result ...`` line and exits).

Modes:
- ``gossip KEY LISTEN VICTIM STAGES``: with the private key in file KEY, listen on LISTEN
  (``HOST:PORT``; the victim, node id VICTIM, dials it),
  once the victim is linked send ``Peers`` gossip listing ``FLOOD_IDS`` invented node ids,
  then offer the victim a topology of STAGES stages (the victim and invented nodes), signed
  by this stranger; prints ``result ACCEPTED CODE``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import settings, topology_node

from mesh_node.coordination import EpochStore, sign_topology
from mesh_node.identity import LocalIdentity, load_private_key
from mesh_node.node import MeshNode
from mesh_node.settings import parse_host_port
from protocol import constants as pc
from protocol.messages import (
    PeerRecord,
    Peers,
    TopologyAck,
    TopologyOffer,
    decode_control_message,
)
from skippy.package.ranges import LayerRange
from skippy.package.topology import SplitTopology, StageAssignment

FLOOD_IDS = 1020
LINK_WAIT_S = 30.0


def invented_ids(n: int) -> list[str]:
    return [Ed25519PrivateKey.generate().public_key().public_bytes_raw().hex() for _ in range(n)]


async def linked(node: MeshNode, victim: str) -> None:
    with trio.fail_after(LINK_WAIT_S):
        while node.peer(victim) is None or not node.peer(victim).connected:  # type: ignore[union-attr]
            await trio.sleep(0.02)


async def gossip(key_path: str, listen: str, victim: str, stages: int) -> None:
    key = load_private_key(Path(key_path))
    tmp = Path(tempfile.mkdtemp(prefix="hostile-"))
    node = topology_node(
        settings(tmp, "s", listen=parse_host_port(listen, "listen")), LocalIdentity(key, None)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        await linked(node, victim)
        member = node._members[victim]  # the stranger's own end: it may send anything
        ids = invented_ids(FLOOD_IDS)
        for i in range(0, len(ids), pc.DEFAULT_LIMITS.max_gossip_peers):
            records = tuple(
                PeerRecord(bytes.fromhex(nid), "ws://127.0.0.1:1")
                for nid in ids[i : i + pc.DEFAULT_LIMITS.max_gossip_peers]
            )
            node._send_message(member, Peers(records).encode())
        nodes = [node.node_id, victim, *ids][:stages]
        topology = SplitTopology(
            "topo-hostile",
            "run-hostile",
            "hf://lab/tiny@" + "a" * 40,
            "b" * 64,
            stages,
            tuple(
                StageAssignment(nid, f"s{i}", i, LayerRange(i, i + 1, stages))
                for i, nid in enumerate(nodes)
            ),
        )
        signed, sig = sign_topology(key, topology, EpochStore(tmp / "epochs"), time.time())
        stream = await node.open_stream(victim, pc.KIND_CONTROL)
        async with stream:
            await stream.send_message(TopologyOffer(signed.to_dict(), sig).encode())
            await stream.send_eof()
            reply = await stream.receive_message()
        ack = decode_control_message(reply or b"", node.limits)
        assert isinstance(ack, TopologyAck)
        print(f"result {ack.accepted} {ack.code}", flush=True)
        nursery.cancel_scope.cancel()


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "gossip":
        trio.run(gossip, argv[1], argv[2], argv[3], int(argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    main(sys.argv[1:])
