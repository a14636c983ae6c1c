"""Helpers for the mesh transfer tests: a synthetic package on a lab hub, and real nodes (in
this process, on loopback) with their artifact services. Plain functions; nothing is faked
but the hub (``mesh_node.lab.hub_server``), and servers a test subclasses to misbehave."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from conftest import HubPackage
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import identity, settings, wait_for, with_peers

from mesh_node.lab.hub_server import FakeHub
from mesh_node.lab.package import LabPackage, import_package
from mesh_node.node import MeshNode
from mesh_node.node_service import FeatureBits, StreamKind
from mesh_node.serving.host import StageHost
from mesh_node.serving.split_service import Serving
from mesh_node.topology import ActiveTopology, TopologyService
from mesh_node.transfer.artifact_service import ArtifactService
from skippy.config import Environment
from skippy.consume.verify import VerifyCache
from skippy.produce.sizes import sizes_from_manifest
from skippy.transfer.serve import ArtifactServer


def environment(root: Path, hub: FakeHub | None, *, offline: bool = False) -> Environment:
    return Environment(
        hf_endpoint=None if hub is None else hub.url,
        hf_offline=offline,
        hf_cache_dir=root / "hf",
        skippy_cache_dir=root / "cache",
    )


@dataclass
class Member:
    node: MeshNode
    service: ArtifactService
    root: Path
    topology: TopologyService

    @property
    def cache(self) -> Path:
        return self.node.settings.hub_cache_dir


class NotFollowing:
    """An artifact service's streams, bits, status and metrics without its ``run``: it
    follows no topology (the test starts its fetches)."""

    def __init__(self, service: ArtifactService) -> None:
        self.service = service
        self.config_table = service.config_table

    def streams(self) -> Sequence[StreamKind]:
        return self.service.streams()

    def features(self, now_s: float) -> FeatureBits:
        return self.service.features(now_s)

    def status_sections(self) -> Mapping[str, Any]:
        return self.service.status_sections()

    def collectors(self) -> Sequence[Any]:
        return self.service.collectors()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()


async def start_member(
    nursery: trio.Nursery,
    tmp: Path,
    name: str,
    owner: Ed25519PrivateKey | None,
    *,
    hub: FakeHub | None,
    peers: tuple[MeshNode, ...] = (),
    offline: bool = False,
    server_class: type[ArtifactServer] = ArtifactServer,
    node_class: type[MeshNode] = MeshNode,
    run_service: bool = True,
    **settings_kw: Any,
) -> Member:
    s = with_peers(settings(tmp, name, **settings_kw), *peers)
    node = node_class(s, identity(owner))
    env = environment(tmp / name, hub, offline=offline)
    vc = VerifyCache.under(env.skippy_cache_dir)
    topology = TopologyService(node)
    service = ArtifactService(
        node,
        topology,
        env,
        server=server_class(s.hub_cache_dir, verify_cache=vc),
        verify_cache=vc,
    )
    host = StageHost(node, s.serving)  # its bits make the node a capable peer
    node.add_service(topology)
    node.add_service(host)
    node.add_service(service if run_service else NotFollowing(service))
    node.add_service(Serving(node, host, topology))
    await nursery.start(node.run)
    return Member(node, service, tmp / name, topology)


def import_into(member: Member, hp: HubPackage) -> LabPackage:
    return import_package(
        hp.ref,
        member.cache,
        endpoint=hp.hub.url,
        verify_cache=VerifyCache.under(member.root / "cache"),
    )


async def propose(coordinator: Member, pkg: LabPackage, **kw: Any) -> ActiveTopology:
    return await coordinator.topology.propose(
        package_ref=pkg.ref,
        manifest_sha256=pkg.manifest_sha256,
        sizes=sizes_from_manifest(pkg.manifest),
        **kw,
    )


async def wait_connected(members: list[Member]) -> None:
    n = len(members) - 1
    await wait_for(lambda: all(len(m.node.peers(connected_only=True)) == n for m in members))


def snapshot_files(member: Member, ref: str) -> dict[str, Path]:
    """Every file in ``member``'s snapshot of the package, by repo-relative path."""
    repo, commit = ref.removeprefix("hf://").split("@")
    snap = member.cache / ("models--" + repo.replace("/", "--")) / "snapshots" / commit
    if not snap.is_dir():
        return {}
    return {p.relative_to(snap).as_posix(): p for p in snap.rglob("*") if p.is_file()}


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def records(member: Member) -> dict[str, dict[str, Any]]:
    """The finished fetch records by path (the latest one per path)."""
    out: dict[str, dict[str, Any]] = {}
    for rec in member.node.status()["transfers"]["recent"][::-1]:
        if rec["direction"] == "fetch":
            out[rec["path"]] = rec
    return out
