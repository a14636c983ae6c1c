"""Who gets which artifact: the trust modes, ``authorize()`` rule by rule, and the full matrix
of the authorization table ({open, trusted, disabled} x {same, trusted, untrusted, unverified
owner} x eight requests) served from a real hub cache filled by huggingface_hub."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from transfer_tools import (
    FRIEND,
    OWNER,
    PEERS,
    STRANGER,
    WORKER_A,
    WORKER_B,
    ServedPackage,
    policy,
    pump,
    serve_bytes,
    served_package,  # noqa: F401 - a fixture
)

from skippy.constants import MANIFEST_MAX_BYTES, MANIFEST_NAME
from skippy.consume.verify import VerifyCache
from skippy.package.select import select_stage
from skippy.transfer.authorize import (
    PEER_DISABLED,
    PEER_UNAVAILABLE,
    HeldManifest,
    ManifestProblem,
    authorize,
)
from skippy.transfer.chunk_sink import open_chunk_sink
from skippy.transfer.fetch_plan import FetchItem
from skippy.transfer.hubcache import RepoCache, load_held_manifest
from skippy.transfer.policy import NodePolicy, PeerFacts, peer_refusal, would_serve
from skippy.transfer.required import servable_refs
from skippy.transfer.serve import ArtifactServer
from skippy.transfer.wire import ArtifactRequest, encode_request

LAYER_OWN = "layers/layer-00003.gguf"  # worker B holds layers 3..4 (the final stage)
LAYER_OTHER = "layers/layer-00000.gguf"


# --- trust modes (pure) ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("node", "serves"),
    [
        (NodePolicy("disabled", OWNER, True), False),
        (NodePolicy("open"), True),
        (NodePolicy("open", OWNER, False), True),
        (NodePolicy("trusted", OWNER, True), True),
        (NodePolicy("trusted", OWNER, False), False),
        (NodePolicy("trusted", None, True), False),
    ],
)
def test_feature_bit_is_advertised_exactly_when_the_node_would_serve(
    node: NodePolicy, serves: bool
) -> None:
    assert would_serve(node) is serves
    verified_peer = PeerFacts(WORKER_B, node.own_owner_id, "verified")
    # A node that would serve admits its own verified owner's peers; one that would not,
    # admits nobody.
    assert (peer_refusal(node, verified_peer) is None) is serves


@pytest.mark.parametrize(
    ("peer", "trusted_reason", "open_reason"),
    [
        (PeerFacts(WORKER_B, OWNER, "verified"), None, None),
        (PeerFacts(WORKER_B, OWNER.upper(), "verified"), None, None),
        (PeerFacts(WORKER_B, FRIEND, "verified"), None, None),
        (PeerFacts(WORKER_B, STRANGER, "verified"), "peer_owner_untrusted", None),
        (PeerFacts(WORKER_B, OWNER, "unverified"), "peer_owner_unverified", None),
        (PeerFacts(WORKER_B, None, "unverified"), "peer_owner_unverified", None),
        (PeerFacts(WORKER_B, OWNER, "invalid"), "peer_owner_invalid", None),
    ],
)
def test_peer_admission(peer: PeerFacts, trusted_reason: str | None, open_reason: None) -> None:
    assert peer_refusal(policy("trusted"), peer) == trusted_reason
    assert peer_refusal(policy("open"), peer) == open_reason
    assert peer_refusal(policy("disabled"), peer) == "transfer_disabled"


def test_trusted_needs_this_nodes_owner_verified() -> None:
    node = NodePolicy("trusted", OWNER, own_owner_verified=False)
    assert peer_refusal(node, PeerFacts(WORKER_B, OWNER, "verified")) == "own_owner_unverified"


# --- authorize, rule by rule (pure, on the real manifest) -----------------------------------
@pytest.fixture(scope="module")
def held(served_package: ServedPackage) -> HeldManifest:  # noqa: F811
    cache = RepoCache.for_ref(served_package.hub_cache, served_package.ref)
    return load_held_manifest(cache, served_package.manifest_sha256).held


def req(sp: ServedPackage, path: str = LAYER_OWN, **changes: Any) -> ArtifactRequest:
    fields: dict[str, Any] = {
        "requester_id": WORKER_B,
        "topology_id": "topo-1",
        "run_id": "run-1",
        "stage_id": "stage-2",
        "package_ref": sp.ref,
        "manifest_sha256": sp.manifest_sha256,
        "relative_path": path,
    }
    fields.update(changes)
    return ArtifactRequest(**fields)


OPEN_PEER = PeerFacts(WORKER_B, OWNER, "verified")


def decide(sp: ServedPackage, held: HeldManifest | ManifestProblem | None, request: ArtifactRequest,
           *, peer: PeerFacts = OPEN_PEER, topology: Any = "default") -> str:
    topo = sp.topology() if topology == "default" else topology
    return authorize(policy("trusted"), peer, topo, held, request).reason


def test_authorize_rules(served_package: ServedPackage, held: HeldManifest) -> None:  # noqa: F811
    sp = served_package
    assert decide(sp, held, req(sp)) == "allowed"
    assert decide(sp, held, req(sp, MANIFEST_NAME)) == "allowed"
    assert decide(sp, held, req(sp), peer=PeerFacts(WORKER_A, OWNER, "verified")) == (
        "requester_mismatch"
    )
    assert decide(sp, held, req(sp), topology=None) == "no_active_topology"
    assert decide(sp, held, req(sp, topology_id="topo-2")) == "topology_mismatch"
    assert decide(sp, held, req(sp, run_id="run-2")) == "run_mismatch"
    other_ref = sp.ref.replace("tiny-layers", "other-layers")
    assert decide(sp, held, req(sp, package_ref=other_ref)) == "package_mismatch"
    assert decide(sp, held, req(sp, manifest_sha256="0" * 64)) == "manifest_mismatch"
    assert decide(sp, held, req(sp, stage_id="stage-1")) == "stage_mismatch"
    stranger = bytes(range(5, 37))
    peer = PeerFacts(stranger, OWNER, "verified")
    assert decide(sp, held, req(sp, requester_id=stranger), peer=peer) == (
        "requester_not_in_topology"
    )
    assert decide(sp, None, req(sp)) == "manifest_not_held"
    assert decide(sp, ManifestProblem("manifest_too_large", "big"), req(sp)) == (
        "manifest_too_large"
    )
    assert decide(sp, dataclasses.replace(held, sha256="1" * 64), req(sp)) == (
        "held_manifest_mismatch"
    )
    too_big = dataclasses.replace(held, size=MANIFEST_MAX_BYTES + 1)
    assert decide(sp, too_big, req(sp, MANIFEST_NAME)) == "manifest_too_large"
    assert decide(sp, held, req(sp, "README.md")) == "undeclared_path"
    assert decide(sp, held, req(sp, LAYER_OTHER)) == "not_in_stage"
    size = held.manifest.layer(3).artifact_bytes
    assert decide(sp, held, req(sp, expected_size=size + 1)) == "expectation_mismatch"
    assert decide(sp, held, req(sp, expected_sha256="2" * 64)) == "expectation_mismatch"
    assert decide(sp, held, req(sp, expected_size=size, offset=size)) == "allowed"
    assert decide(sp, held, req(sp, offset=size + 1)) == "offset_beyond_end"
    assert decide(sp, held, req(sp, MANIFEST_NAME, expected_size=held.size + 1)) == (
        "expectation_mismatch"
    )


def test_refusals_tell_the_peer_nothing_but_unavailable(
    served_package: ServedPackage, held: HeldManifest  # noqa: F811
) -> None:
    sp = served_package
    for request in (req(sp, LAYER_OTHER), req(sp, "README.md"), req(sp, run_id="run-9")):
        d = authorize(policy("trusted"), OPEN_PEER, sp.topology(), held, request)
        assert not d.allowed and d.peer_message == PEER_UNAVAILABLE
        assert d.reason in d.to_log()["reason"] and d.detail  # the precise reason is logged
    d = authorize(policy("disabled"), OPEN_PEER, sp.topology(), held, req(sp))
    assert d.peer_message == PEER_DISABLED and d.reason == "transfer_disabled"


@pytest.mark.parametrize(
    ("stage_id", "requester", "allowed"),
    [
        # stage 0 (layers 0..1): metadata, embeddings, its layer, every declared projector
        ("stage-0", bytes(range(32)), {"shared/metadata.gguf", "shared/embeddings.gguf",
                                       "layers/layer-00000.gguf", "projectors/a.gguf",
                                       "projectors/b.gguf"}),
        # a middle stage: metadata and its own layers only
        ("stage-1", WORKER_A, {"shared/metadata.gguf", "layers/layer-00001.gguf",
                               "layers/layer-00002.gguf"}),
        # the final stage of a tied-embedding package: embeddings and output too
        ("stage-2", WORKER_B, {"shared/metadata.gguf", "shared/embeddings.gguf",
                               "layers/layer-00003.gguf", "shared/output.gguf"}),
    ],
)
def test_each_stage_may_fetch_exactly_its_required_set(
    served_package: ServedPackage,  # noqa: F811
    held: HeldManifest,
    stage_id: str,
    requester: bytes,
    allowed: set[str],
) -> None:
    sp = served_package
    m = held.manifest
    assert m.tied_embeddings
    proj = m.projectors[0]
    two = dataclasses.replace(
        m,
        projectors=(
            dataclasses.replace(proj, path="projectors/a.gguf"),
            dataclasses.replace(proj, path="projectors/b.gguf"),
        ),
    )
    held2 = dataclasses.replace(held, manifest=two)
    peer = PeerFacts(requester, OWNER, "verified")
    every = {r.path for r in two.artifacts()}
    got = {
        path
        for path in every
        if authorize(
            policy("trusted"), peer, sp.topology(), held2,
            req(sp, path, requester_id=requester, stage_id=stage_id),
        ).allowed
    }
    assert got == allowed
    stage = sp.topology().stages[int(stage_id[-1])]
    # One selection rule: the default selection is always inside the servable set.
    assert {r.path for r in select_stage(two, stage.layers).all_refs} <= set(
        servable_refs(two, stage.layers)
    )


# --- the matrix, through the real server and files ------------------------------------------
@pytest.fixture(scope="module")
def matrix_cache(served_package: ServedPackage, tmp_path_factory) -> Iterator[Path]:  # noqa: F811
    """A copy of the coordinator's hub cache in which worker B's ``shared/output.gguf`` is a
    symlink to an identical file outside the repo folder (a symlink escape)."""
    root = tmp_path_factory.mktemp("matrix")
    cache = root / "hub"
    shutil.copytree(served_package.hub_cache, cache, symlinks=True)
    snap = RepoCache.for_ref(cache, served_package.ref).snapshot_dir
    outside = root / "outside-output.gguf"
    shutil.copyfile(snap / "shared/output.gguf", outside)
    (snap / "shared/output.gguf").unlink()
    os.symlink(outside, snap / "shared/output.gguf")
    yield cache


CASES = (
    "own stage's layer",
    "another stage's layer",
    "manifest",
    "undeclared path",
    "../ path",
    "symlink escape",
    "wrong topology/run id",
    "wrong manifest hash",
)
MODES = ("open", "trusted", "disabled")


def _frames(sp: ServedPackage, case: str) -> list[bytes]:
    def frame(path: str, **changes: Any) -> bytes:
        return encode_request(req(sp, path, **changes))

    if case == "own stage's layer":
        return [frame(LAYER_OWN)]
    if case == "another stage's layer":
        return [frame(LAYER_OTHER)]
    if case == "manifest":
        return [frame(MANIFEST_NAME)]
    if case == "undeclared path":
        return [frame("README.md")]  # present in the snapshot, absent from the manifest
    if case == "../ path":  # only a hostile peer can send it: build the bytes by hand
        wire = req(sp).to_wire() | {"relative_path": "../../blobs/x"}
        payload = msgpack.packb(wire, use_bin_type=True)
        return [len(payload).to_bytes(4, "big") + payload]
    if case == "symlink escape":
        return [frame("shared/output.gguf")]
    if case == "wrong topology/run id":
        return [frame(LAYER_OWN, topology_id="topo-old"), frame(LAYER_OWN, run_id="run-old")]
    assert case == "wrong manifest hash"
    return [frame(LAYER_OWN, manifest_sha256="f" * 64)]


def _expected(mode: str, owner: str, case: str) -> tuple[str | set[str], str]:
    """(internal reason(s), what the peer is told)."""
    if mode == "disabled":
        return "transfer_disabled", PEER_DISABLED
    if case == "../ path":  # refused while decoding, before any policy
        return "malformed_request", "malformed artifact request (unsafe_artifact_path)"
    if mode == "trusted" and owner == "untrusted owner":
        return "peer_owner_untrusted", PEER_UNAVAILABLE
    if mode == "trusted" and owner == "unverified owner":
        return "peer_owner_unverified", PEER_UNAVAILABLE
    return {
        "own stage's layer": "allowed",
        "another stage's layer": "not_in_stage",
        "manifest": "allowed",
        "undeclared path": "undeclared_path",
        "symlink escape": "resolved_outside_repo",
        "wrong topology/run id": {"topology_mismatch", "run_mismatch"},
        "wrong manifest hash": "manifest_mismatch",
    }[case], ""


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("owner", list(PEERS))
@pytest.mark.parametrize("mode", MODES)
def test_authorization_matrix(
    served_package: ServedPackage,  # noqa: F811
    matrix_cache: Path,
    tmp_path: Path,
    mode: str,
    owner: str,
    case: str,
) -> None:
    sp = served_package
    server = ArtifactServer(matrix_cache, verify_cache=VerifyCache(tmp_path / "verify-server"))
    reasons: set[str] = set()
    for frame in _frames(sp, case):
        outcome = serve_bytes(server, policy(mode), PEERS[owner], sp.topology(), frame)
        reasons.add(outcome.decision.reason)
        want_reason, want_message = _expected(mode, owner, case)
        if want_reason == "allowed":
            assert outcome.response.accepted and outcome.body is not None
            outcome.body.close()
            continue
        assert not outcome.response.accepted and outcome.body is None
        assert outcome.response.error == (want_message or PEER_UNAVAILABLE)
    want = want_reason if isinstance(want_reason, set) else {want_reason}
    assert reasons == want
    if want_reason == "allowed":  # the bytes really arrive, verified, in the worker's cache
        path = LAYER_OWN if case == "own stage's layer" else MANIFEST_NAME
        cache = RepoCache.for_ref(tmp_path / "worker-hub", sp.ref)
        held = load_held_manifest(RepoCache.for_ref(matrix_cache, sp.ref), sp.manifest_sha256)
        ref = {r.path: r for r in held.held.manifest.artifacts()}.get(path)
        item = FetchItem.of(ref) if ref else FetchItem(path, sp.manifest_sha256, None)
        sink = open_chunk_sink(cache, item, manifest_sha256=sp.manifest_sha256, verify_cache=None)
        ex = pump(server, policy(mode), PEERS[owner], sp.topology(), _frames(sp, case)[0],
                  sink=sink)
        assert ex.installed is not None
        assert ex.installed.read_bytes() == (sp.package_dir / path).read_bytes()
