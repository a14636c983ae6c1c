"""A certificate-less stranger as a real process: a ``MeshNode`` of its own identity that
links to a victim and then misbehaves at one chosen step (tests start it with
``python tests/support/hostile_peer.py MODE ...``; it prints one ``result ...`` line and exits).

Modes:
- ``gossip KEY LISTEN VICTIM STAGES``: with the private key in file KEY, listen on LISTEN
  (``HOST:PORT``; the victim, node id VICTIM, dials it),
  once the victim is linked send ``Peers`` gossip listing ``FLOOD_IDS`` invented node ids,
  then offer the victim a topology of STAGES stages (the victim and invented nodes), signed
  by this stranger; prints ``result ACCEPTED CODE``.
- ``requests KEY VICTIM_ADDRESS N``: dial the victim (``ws://HOST:PORT#ID``) and ask it, for
  each artifact kind (0x03 artifact, 0x04 source list, 0x05 sibling topology), N requests
  as fast as ``CONCURRENCY`` streams at once carry them; prints ``linked`` as it starts,
  then one line per kind,
  ``result KIND answered=A limited=L other=O``: A streams answered (a refusal's header),
  L refused at the open as ``rate_limited``, O anything else.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import settings, topology_node

from mesh_node.coordination import EpochStore, sign_topology
from mesh_node.errors import MeshError, StreamRefused
from mesh_node.identity import LocalIdentity, load_private_key
from mesh_node.node import MeshNode
from mesh_node.settings import parse_host_port, parse_peer_address
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
from skippy.transfer.wire import ArtifactRequest, encode_request

FLOOD_IDS = 1020
CONCURRENCY = 16  # streams open at once (a link allows 32)
LINK_WAIT_S = 30.0


def invented_ids(n: int) -> list[str]:
    return [Ed25519PrivateKey.generate().public_key().public_bytes_raw().hex() for _ in range(n)]


async def linked(node: MeshNode, victim: str) -> None:
    with trio.fail_after(LINK_WAIT_S):
        while (info := node.peer(victim)) is None or not info.connected:
            await trio.sleep(0.02)


async def gossip(tmp: Path, key_path: str, listen: str, victim: str, stages: int) -> None:
    key = load_private_key(Path(key_path))
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


async def requests(tmp: Path, key_path: str, victim_address: str, per_kind: int) -> None:
    key = load_private_key(Path(key_path))
    victim = parse_peer_address(victim_address)
    node = topology_node(
        settings(tmp, "s", peers=(victim,)), LocalIdentity(key, None), stage_host=False
    )
    request = encode_request(
        ArtifactRequest(
            bytes.fromhex(node.node_id), "topo-x", "run-x", "s1",
            "hf://lab/tiny@" + "a" * 40, "b" * 64, "manifest.json",
        )
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        victim_id = victim.node_id or ""
        await linked(node, victim_id)
        print("linked", flush=True)  # the flood starts now (a bench times from here)
        for kind in (pc.KIND_ARTIFACT_TRANSFER, pc.KIND_SWARM_SOURCES, pc.KIND_SIBLING_TOPOLOGY):
            counts: Counter[str] = Counter()

            async def one(kind: int = kind, counts: Counter[str] = counts) -> None:
                try:
                    stream = await node.open_stream(victim_id, kind)
                except StreamRefused as exc:
                    counts["limited" if exc.actual == "rate_limited" else "other"] += 1
                    return
                try:
                    async with stream:
                        await stream.send_all(request)
                        await stream.send_eof()
                        answer = b""
                        with trio.fail_after(LINK_WAIT_S):
                            while data := await stream.receive_some():
                                answer += data
                    counts["answered" if answer else "other"] += 1
                except (MeshError, trio.TooSlowError):
                    counts["other"] += 1

            async def worker(n: int) -> None:
                for _ in range(n):
                    await one()

            async with trio.open_nursery() as flood:
                for i in range(CONCURRENCY):
                    flood.start_soon(worker, per_kind // CONCURRENCY + (i < per_kind % CONCURRENCY))
            print(
                f"result {kind:#04x} answered={counts['answered']} limited={counts['limited']} "
                f"other={counts['other']}",
                flush=True,
            )
        nursery.cancel_scope.cancel()


def main(argv: list[str]) -> None:
    mode = argv[0]
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:  # its data_dir, removed after
        if mode == "gossip":
            trio.run(gossip, Path(tmp), argv[1], argv[2], argv[3], int(argv[4]))
        elif mode == "requests":
            trio.run(requests, Path(tmp), argv[1], argv[2], int(argv[3]))
        else:
            raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
