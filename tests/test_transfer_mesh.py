"""Peer artifact transfer over real mesh links (issue #8 sections 3 and 4), nodes in this
process on loopback: workers fetch their stage's artifacts from the coordinator, verify and
install them, and report ready; the feature bit and the handler follow one decision; hostile
bytes are never installed; concurrency is bounded."""

from __future__ import annotations

import json

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import identity, settings, wait_for
from meshxfer import (
    Member,
    hub_package,  # noqa: F401 (fixture)
    import_into,
    propose,
    records,
    sha256_of,
    snapshot_files,
    start_member,
    wait_connected,
)

from mesh_node.errors import StreamRefused
from mesh_node.node import MeshNode
from mesh_node.transfer.records import TransferLog
from mesh_node.transfer.service import ArtifactService
from protocol import constants as pc
from skippy.atomic import find_partials
from skippy.constants import MANIFEST_NAME
from skippy.transfer.hubcache import RepoCache
from skippy.transfer.required import stage_refs

from meshxfer import environment


def required_of(member: Member, pkg, topology) -> dict[str, object]:  # type: ignore[no-untyped-def]
    stage = topology.stage_of(member.node.node_id)
    return {r.path: r for r in stage_refs(pkg.manifest, stage.layers)}


async def test_workers_fetch_their_stage_from_the_coordinator_and_report_ready(
    tmp_path, hub_package
):
    owner = Ed25519PrivateKey.generate()
    hp = hub_package
    async with trio.open_nursery() as n:
        coord = await start_member(n, tmp_path, "coord", owner, hub=hp.hub, artifact_transfer="trusted")
        pkg = import_into(coord, hp)
        hp.hub.reset()  # count only what the workers ask of the hub
        workers = [
            await start_member(n, tmp_path, f"w{i}", owner, hub=hp.hub, peers=(coord.node,))
            for i in range(2)
        ]
        await wait_connected([coord, *workers])
        active = await propose(coord, pkg)
        assert active.state == "active"
        await wait_for(lambda: coord.node.topology.active.all_ready, timeout_s=20)

        served = 0
        for w in workers:
            required = required_of(w, pkg, active.topology)
            files = snapshot_files(w, pkg.ref)
            assert set(files) == {*required, MANIFEST_NAME}  # exactly its required set
            for path, ref in required.items():
                assert sha256_of(files[path]) == ref.artifact.sha256
            recs = records(w)
            assert {p for p, r in recs.items()} == {*required, MANIFEST_NAME}
            assert all(r["source"] == "peer" and r["verified"] for r in recs.values())
            assert all(r["peer_id"] == coord.node.node_id for r in recs.values())
            stage = w.node.status()["transfers"]["stage"]
            assert stage["state"] == "ready" and stage["report"] == "accepted"
            assert stage["required"] == list(required)
            load = w.service.result.load
            assert load.sha256_verified and load.layers == active.topology.stage_of(w.node.node_id).layers
            assert all(p.is_file() for p in load.part_paths)
            served += w.node.transfers.counters.fetched_bytes["peer"]
            cache = RepoCache.for_ref(w.cache, pkg.ref)
            assert not any(find_partials(cache.blob_path(r.artifact.sha256)) for r in required.values())
        # the coordinator: its own stage from its cache, every byte sent counted once
        c = coord.node.transfers
        assert c.counters.served_bytes == served
        assert {r["source"] for r in records(coord).values()} == {"cache"}
        ready = coord.node.status()["topology"]["ready"]
        assert set(ready) == {s.node_id for s in active.topology.stages}
        assert all(v["state"] == "ready" for v in ready.values())
        assert hp.hub.downloaded_paths(hp.ref.split("@")[0].removeprefix("hf://")) == set()
        # the status document names repo-relative paths only, never a local folder
        for m in (coord, *workers):
            assert str(tmp_path) not in json.dumps(m.node.status())
        n.cancel_scope.cancel()
