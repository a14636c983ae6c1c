"""Serving across sibling replicas of one coordinator: the pure decisions.

Which topology counts as a sibling (same package and revision), what the coordinator vouches
for when a holder asks (kind 0x05), which sibling nodes its source list names, what a
requester takes from the list, and that the holder's ``authorize`` under a sibling topology
allows exactly the requester's stage there."""

from __future__ import annotations

from dataclasses import replace

import pytest

from skippy.errors import IntegrityError
from skippy.package.ranges import LayerRange
from skippy.package.topology import SplitTopology, StageAssignment
from skippy.transfer.authorize import HeldManifest, authorize
from skippy.transfer.policy import NodePolicy, PeerFacts
from skippy.transfer.siblings import sibling_refusal, vouch
from skippy.transfer.sources import ArtifactSources, SourceList, check_source_list, plan_sources
from skippy.transfer.wire import ArtifactRequest

REF = "hf://acme/tiny@" + "a" * 40
COORD = (bytes([9]) * 32).hex()


def _id(i: int) -> str:
    return (bytes([i]) * 32).hex()


def _split(tid: str, nodes: tuple[int, int], n: int, **kw) -> SplitTopology:  # type: ignore[no-untyped-def]
    """A two-stage replica: stage 0 on the coordinator, stage 1 on ``nodes[1]``; the run and
    package as ``kw`` say."""
    fields = dict(
        topology_id=tid,
        run_id="r-" + tid,
        package_ref=REF,
        manifest_sha256="b" * 64,
        layer_count=n,
        stages=(
            StageAssignment(_id(nodes[0]), "s0", 0, LayerRange(0, n // 2, n)),
            StageAssignment(_id(nodes[1]), "s1", 1, LayerRange(n // 2, n, n)),
        ),
    )
    fields.update(kw)
    return SplitTopology(**fields)  # type: ignore[arg-type]


def test_a_sibling_has_the_same_package_and_revision():
    own = _split("t0", (9, 1), 4)
    assert sibling_refusal(own, _split("t1", (9, 2), 4)) is None
    assert sibling_refusal(own, own) is not None  # not its own sibling
    other_rev = _split("t1", (9, 2), 4, manifest_sha256="e" * 64)
    assert sibling_refusal(own, other_rev) == (
        "manifest_mismatch",
        f"the sibling names revision {'e' * 12}, this node's topology {'b' * 12}",
    )
    other_pkg = _split("t1", (9, 2), 4, package_ref="hf://acme/other@" + "a" * 40)
    assert sibling_refusal(own, other_pkg)[0] == "package_mismatch"  # type: ignore[index]
    pinned_other = _split("t1", (9, 2), 4, package_ref="hf://acme/tiny@" + "c" * 40)
    assert sibling_refusal(own, pinned_other)[0] == "package_mismatch"  # type: ignore[index]


def test_the_coordinator_vouches_only_for_a_current_sibling_to_one_of_its_stage_nodes():
    r0, r1 = _split("t0", (9, 1), 4), _split("t1", (9, 2), 4)
    stale_rev = _split("t2", (9, 3), 4, manifest_sha256="e" * 64)
    current = [r0, r1, stale_rev]
    # the holder (replica 0's worker) asks for the requester's (replica 1's) topology
    assert vouch(current, _id(1), "t1", _id(2), "s1") == (r1, "")
    # a node holding no stage in any of its topologies learns nothing
    assert vouch(current, _id(7), "t1", _id(2), "s1")[0] is None
    # a topology that is not current (replaced, or never signed) is not vouched for
    assert vouch([r0], _id(1), "t1", _id(2), "s1")[0] is None
    # another revision of the package is no sibling
    assert vouch(current, _id(1), "t2", _id(3), "s1")[0] is None
    # the requester must hold the named stage there
    assert vouch(current, _id(1), "t1", _id(2), "s0")[0] is None
    assert vouch(current, _id(1), "t1", _id(7), "s1")[0] is None


def test_a_sibling_replicas_ready_node_is_a_source_and_another_revisions_is_not(hub_package):
    from skippy.consume.preflight import load_package
    from skippy.transfer.required import stage_refs

    manifest = load_package(hub_package.directory).manifest
    n = manifest.layer_count
    mine, sibling = _split("t1", (9, 2), n), _split("t0", (9, 1), n)
    other_rev = _split("t3", (9, 3), n, manifest_sha256="e" * 64)
    refs = stage_refs(manifest, mine.stages[1].layers)
    digests = {r.artifact.sha256.lower(): (b"\0" * 32,) for r in refs}
    kw = dict(coordinator_id=COORD, digests=digests, chunk_bytes=1 << 26)
    everyone = [COORD, _id(1), _id(2), _id(3)]
    sl = plan_sources(
        mine, manifest, _id(2), ready=[], servers=everyone,
        siblings=[(sibling, [_id(1)]), (other_rev, [_id(3)])], **kw,  # type: ignore[arg-type]
    )
    # replica 0's stage-1 node needs every file replica 1's stage 1 needs: it is listed,
    # after the coordinator; the node of the other revision never is
    assert [a.path for a in sl.artifacts] == [r.path for r in refs]
    assert all(a.holders == (COORD, _id(1)) for a in sl.artifacts)
    not_ready = plan_sources(
        mine, manifest, _id(2), ready=[], servers=everyone,
        siblings=[(sibling, [])], **kw,  # type: ignore[arg-type]
    )
    assert all(a.holders == (COORD,) for a in not_ready.artifacts)
    not_serving = plan_sources(
        mine, manifest, _id(2), ready=[], servers=[COORD, _id(2)],
        siblings=[(sibling, [_id(1)])], **kw,  # type: ignore[arg-type]
    )
    assert all(a.holders == (COORD,) for a in not_serving.artifacts)


def _list(holders: tuple[str, ...]) -> SourceList:
    t = _split("t1", (9, 2), 4)
    entry = ArtifactSources("a.gguf", "c" * 64, 10, (b"\x01" * 32,), holders)
    return SourceList("t1", t.run_id, "b" * 64, "s1", _id(2), 1 << 22, (entry,))


def test_a_requester_takes_sibling_holders_only_when_both_ends_serve_siblings():
    t = _split("t1", (9, 2), 4)
    required = {"a.gguf": ("c" * 64, 10)}
    with_sibling = _list((COORD, _id(1)))
    with pytest.raises(IntegrityError) as e:  # without sibling-serve: members only
        check_source_list(with_sibling, t, required, _id(2), COORD)
    assert e.value.code == "source_list_mismatch"
    assert check_source_list(with_sibling, t, required, _id(2), COORD, siblings_ok=True) is (
        with_sibling
    )
    with pytest.raises(IntegrityError):  # never itself
        check_source_list(_list((_id(2),)), t, required, _id(2), COORD, siblings_ok=True)


def test_a_holder_authorizes_under_the_sibling_topology_exactly_the_requesters_stage(
    hub_package,
):
    from skippy.consume.preflight import load_package
    from skippy.transfer.required import servable_refs

    loaded = load_package(hub_package.directory)
    manifest = loaded.manifest
    n = manifest.layer_count
    sibling = _split("t1", (9, 2), n, manifest_sha256="f" * 64)
    held = HeldManifest(manifest, "f" * 64, 1000)
    policy = NodePolicy("open", own_owner_id=None, own_owner_verified=False)
    peer = PeerFacts(bytes.fromhex(_id(2)), None, "unverified")
    theirs = sorted(servable_refs(manifest, sibling.stages[1].layers))
    not_theirs = sorted({r.path for r in manifest.artifacts()} - set(theirs))

    def ask(path: str, topology: SplitTopology = sibling, **kw) -> str:  # type: ignore[no-untyped-def]
        fields = dict(
            topology_id=topology.topology_id, run_id=topology.run_id, package_ref=REF,
            manifest_sha256=topology.manifest_sha256, stage_id="s1",
            requester_id=bytes.fromhex(_id(2)), relative_path=path, offset=0,
        )
        fields.update(kw)
        return authorize(policy, peer, topology, held, ArtifactRequest(**fields)).reason  # type: ignore[arg-type]

    assert ask(theirs[0]) == "allowed"
    assert ask(not_theirs[0]) == "not_in_stage"  # a file its stage does not need
    assert ask(theirs[0], stage_id="s0") == "stage_mismatch"
    # the holder's own revision differs from a topology on another revision
    other = replace(sibling, manifest_sha256="e" * 64)
    assert ask(theirs[0], topology=other) == "held_manifest_mismatch"


def test_another_replica_waits_for_replica_0_only_while_its_nodes_would_serve_the_others():
    from skippy.serving.replicas import STAGGER_MAX_S, waits_for_first

    assert waits_for_first(first_ready=False, waited_s=1.0, siblings_serve=True)
    assert not waits_for_first(first_ready=True, waited_s=1.0, siblings_serve=True)
    # without sibling serving on every capable peer, waiting would only delay
    assert not waits_for_first(first_ready=False, waited_s=1.0, siblings_serve=False)
    # a replica 0 that does not come up holds nobody back for long
    assert not waits_for_first(first_ready=False, waited_s=STAGGER_MAX_S, siblings_serve=True)


def test_a_holder_asks_about_a_sibling_only_for_its_own_package_and_revision():
    from skippy.transfer.siblings import names_own_revision

    own = _split("t0", (9, 1), 4)
    assert names_own_revision(own, REF, "b" * 64)
    assert not names_own_revision(own, REF, "e" * 64)  # another revision
    assert not names_own_revision(own, "hf://acme/other@" + "a" * 40, "b" * 64)
    assert not names_own_revision(own, "not a ref", "b" * 64)
