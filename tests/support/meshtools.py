"""Helpers for mesh tests: identities, owner certificates and settings with short timeouts
(plain functions; the nodes they build are real, on loopback)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from mesh_node.identity import LocalIdentity, issue_certificate
from mesh_node.node import MeshNode
from mesh_node.serving.host import StageHost
from mesh_node.settings import HostPort, NodeSettings, PeerAddress, SecuritySettings
from mesh_node.topology import TopologyService

FAST = {
    "heartbeat_interval_s": 0.1,
    "peer_loss_timeout_s": 0.6,
    "idle_timeout_s": 1.0,
    "handshake_timeout_s": 1.0,
}
# Most mesh tests run nodes without owner certificates: they need the lab setting (the
# defaults, ``trusted``, are tested in tests/mesh_node/test_untrusted_peers.py with owners).
LAB_SECURITY = SecuritySettings(accept_topologies_from="any", place_stages_on="any")


def identity(owner: Ed25519PrivateKey | None = None, *, days: int = 1) -> LocalIdentity:
    key = Ed25519PrivateKey.generate()
    ident = LocalIdentity(key, None)
    if owner is None:
        return ident
    return LocalIdentity(key, issue_certificate(owner, ident.node_id, days=days))


def settings(tmp: Path, name: str, **kw: Any) -> NodeSettings:
    base: dict[str, Any] = {
        "config_path": tmp / f"{name}.toml",
        "listen": HostPort("127.0.0.1", 0),
        "identity_path": tmp / f"{name}.key",
        "certificate_path": None,
        "data_dir": tmp / name,
        "peers": (),
        "trusted_owners": (),
        "artifact_transfer": "disabled",
        "memory_budget_bytes": 1 << 30,
        "security": LAB_SECURITY,
        **FAST,
    }
    base.update(kw)
    return NodeSettings(**base)


def topology_node(
    s: NodeSettings, ident: LocalIdentity, *, stage_host: bool = True, **kw: Any
) -> MeshNode:
    """A node with the split topology service and a stage host (its skippy-stage bits make
    the node a capable peer), no artifact transfer or serving (``mesh_node.composition``
    wires every service; these tests need the core and topologies only)."""
    node = MeshNode(s, ident, **kw)
    node.add_service(TopologyService(node))
    if stage_host:
        node.add_service(StageHost(node, s.serving))
    return node


def topology_of(node: MeshNode) -> TopologyService:
    return node.service(TopologyService)


def address_of(node: MeshNode) -> PeerAddress:
    assert node.listen_url is not None
    host, port = node.listen_url.removeprefix("ws://").rsplit(":", 1)
    return PeerAddress(host, int(port), node.node_id)


@asynccontextmanager
async def running(nursery: trio.Nursery, node: MeshNode) -> AsyncIterator[MeshNode]:
    await nursery.start(node.run)
    yield node


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll a condition on trio's clock (tests assert behaviour, never elapsed time)."""
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.01)


def with_peers(s: NodeSettings, *nodes: MeshNode) -> NodeSettings:
    return replace(s, peers=tuple(address_of(n) for n in nodes))


def now() -> float:
    return time.time()
