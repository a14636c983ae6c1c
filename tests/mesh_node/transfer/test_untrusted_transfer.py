"""With real nodes and a lab hub: a rogue coordinator (a real
``MeshNode`` of another owner, serving a manifest it forged for the real pinned commit) cannot
poison the cache; a trickling peer falls back to the hub; declared sizes meet the budgets
before a byte is written."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import wait_for
from meshxfer import import_into, propose, records, start_member, wait_connected
from test_transfer_mesh import TARGET

from mesh_node.settings import SecuritySettings
from skippy.constants import MANIFEST_NAME
from skippy.package.manifest import parse_manifest
from skippy.produce.sizes import sizes_from_manifest
from skippy.transfer.hubcache import PEER_SNAPSHOTS, RepoCache
from skippy.transfer.serve import ArtifactServer

LAB = SecuritySettings(accept_topologies_from="any", place_stages_on="any")


def _forge(cache: RepoCache, path: str) -> tuple[str, bytes]:
    """Replace ``path`` in the rogue's own snapshot of the commit by bytes it chose, and the
    manifest by one declaring them. Returns the forged manifest's SHA-256 and bytes."""
    snap = cache.snapshot_dir
    raw = (snap / MANIFEST_NAME).read_bytes()
    data = bytearray((snap / path).read_bytes())
    data[-1] ^= 0xFF  # the attacker's bytes: same size, another digest
    sha = hashlib.sha256(data).hexdigest()
    doc = json.loads(raw)

    def patch(node: object) -> None:
        if isinstance(node, dict):
            if node.get("path") == path and "sha256" in node:
                node["sha256"] = sha
            for v in node.values():
                patch(v)
        elif isinstance(node, list):
            for v in node:
                patch(v)

    patch(doc)
    forged = json.dumps(doc, indent=2).encode()
    for rel, content in ((path, bytes(data)), (MANIFEST_NAME, forged)):
        digest = hashlib.sha256(content).hexdigest()
        blob = cache.blob_path(digest)
        blob.write_bytes(content)
        link = snap / rel
        link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    return hashlib.sha256(forged).hexdigest(), forged


async def test_a_rogue_coordinator_cannot_poison_the_commit_in_the_cache(tmp_path, hub_package):
    async with trio.open_nursery() as n:
        rogue = await start_member(
            n, tmp_path, "rogue", Ed25519PrivateKey.generate(), hub=hub_package.hub,
            artifact_transfer="open", security=LAB,
        )
        pkg = import_into(rogue, hub_package)
        cache = RepoCache.for_ref(rogue.cache, pkg.ref)
        forged_sha, forged = _forge(cache, TARGET)
        worker = await start_member(  # lab mode: it accepts the stranger's topology
            n, tmp_path, "w", Ed25519PrivateKey.generate(), hub=hub_package.hub,
            peers=(rogue.node,), security=LAB,
        )
        await wait_connected([rogue, worker])
        active = await rogue.topology.propose(
            package_ref=pkg.ref,
            manifest_sha256=forged_sha,
            sizes=sizes_from_manifest(parse_manifest(forged)),
        )
        assert active.acks[worker.node.node_id] == "accepted"
        await wait_for(lambda: TARGET in records(worker), timeout_s=30)
        assert records(worker)[TARGET]["source"] == "peer"  # the rogue's bytes did arrive...
        mine = RepoCache.for_ref(worker.cache, pkg.ref)
        commit_dir = mine.snapshot_dir
        # ... but never under the commit: neither our cache nor huggingface_hub returns them.
        assert not (commit_dir / MANIFEST_NAME).exists()
        assert not (commit_dir / TARGET).exists()
        area = mine.repo_root / PEER_SNAPSHOTS / forged_sha
        assert (area / MANIFEST_NAME).read_bytes() == forged
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        repo = pkg.ref.removeprefix("hf://").split("@")[0]
        for rel in (MANIFEST_NAME, TARGET):
            try:
                got = hf_hub_download(
                    repo, rel, revision=mine.commit, cache_dir=worker.cache,
                    local_files_only=True,
                )
            except LocalEntryNotFoundError:
                continue
            raise AssertionError(f"huggingface_hub returned {got} for the commit")
        n.cancel_scope.cancel()


async def test_a_default_node_refuses_the_rogue_coordinator_outright(tmp_path, hub_package):
    async with trio.open_nursery() as n:
        rogue = await start_member(
            n, tmp_path, "rogue", Ed25519PrivateKey.generate(), hub=hub_package.hub,
            artifact_transfer="open", security=LAB,
        )
        pkg = import_into(rogue, hub_package)
        worker = await start_member(
            n, tmp_path, "w", Ed25519PrivateKey.generate(), hub=hub_package.hub,
            peers=(rogue.node,), security=SecuritySettings(),
        )
        await wait_connected([rogue, worker])
        active = await propose(rogue, pkg)
        assert active.acks[worker.node.node_id].startswith("refused: untrusted_coordinator")
        assert worker.topology.active is None and records(worker) == {}
        n.cancel_scope.cancel()


class _Trickle:
    """A real body that sends one byte at a time, slowly (under the idle timeout)."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner

    @property
    def remaining(self) -> int:
        return self.inner.remaining

    def read(self, max_bytes: int = 1) -> bytes:
        time.sleep(0.2)
        return self.inner.read(1)

    def close(self) -> None:
        self.inner.close()


class TrickleServer(ArtifactServer):
    def serve(self, policy, peer, topology, request):  # type: ignore[no-untyped-def]
        out = super().serve(policy, peer, topology, request)
        if out.body is None or request.relative_path != TARGET:
            return out
        return dataclasses.replace(out, body=_Trickle(out.body))


async def test_a_trickling_peer_falls_back_to_the_hub(tmp_path, hub_package):
    owner = Ed25519PrivateKey.generate()
    async with trio.open_nursery() as n:
        coord = await start_member(
            n, tmp_path, "coord", owner, hub=hub_package.hub, server_class=TrickleServer,
            artifact_transfer="open",
        )
        pkg = import_into(coord, hub_package)
        worker = await start_member(
            n, tmp_path, "w", owner, hub=hub_package.hub, peers=(coord.node,)
        )
        await wait_connected([coord, worker])
        await propose(coord, pkg)
        await wait_for(lambda: coord.topology.active.all_ready, timeout_s=30)
        rec = records(worker)[TARGET]
        assert rec["source"] == "hub" and rec["verified"]
        assert rec["fallback"] == "transfer_too_slow"
        n.cancel_scope.cancel()


async def test_a_stage_over_the_cache_budget_writes_no_artifact(tmp_path, hub_package):
    owner = Ed25519PrivateKey.generate()
    async with trio.open_nursery() as n:
        coord = await start_member(
            n, tmp_path, "coord", owner, hub=hub_package.hub, artifact_transfer="open"
        )
        pkg = import_into(coord, hub_package)
        worker = await start_member(
            n, tmp_path, "w", owner, hub=hub_package.hub, peers=(coord.node,),
            security=dataclasses.replace(LAB, cache_budget_bytes=1),
        )
        await wait_connected([coord, worker])
        await propose(coord, pkg)
        await wait_for(
            lambda: (worker.service.records.stage is not None
                     and worker.service.records.stage.state == "failed"),
            timeout_s=30,
        )
        assert worker.service.records.stage.error == "cache_budget"
        fetched = {p for p in records(worker) if p != MANIFEST_NAME}
        assert fetched == set()
        blobs = RepoCache.for_ref(worker.cache, pkg.ref).repo_root / "blobs"
        assert len(list(blobs.iterdir())) == 1  # the manifest only
        n.cancel_scope.cancel()
