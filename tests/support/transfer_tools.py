"""Helpers for the peer-transfer tests (plain functions and fixtures, imported by the tests).

``pump`` moves one request and its response between the real serving pieces and the real
receiving pieces, in memory, the way the mesh shell will over a stream: the request's bytes
go through ``RequestReader``, ``ArtifactServer.serve`` decides and opens, the header and the
body chunks go through ``ResponseReader`` into a one-chunk ``ChunkSink``. Only the network is
missing (it is the mesh's, not built yet); ``mutate`` edits the bytes in flight to simulate
a corrupting or truncating peer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hubfaults import FaultyHub, running_hub
from huggingface_hub import hf_hub_download
from pkgtools import make_package

from skippy.constants import MANIFEST_NAME
from skippy.consume.verify import VerifyCache
from skippy.package.ranges import LayerRange
from skippy.package.topology import SplitTopology, StageAssignment
from skippy.transfer.chunk_sink import ChunkSink, open_chunk_sink
from skippy.transfer.errors import ArtifactWireError
from skippy.transfer.fetch_plan import FetchItem, request_for
from skippy.transfer.hubcache import RepoCache, load_held_manifest
from skippy.transfer.policy import NodePolicy, PeerFacts
from skippy.transfer.serve import ArtifactServer, ServeOutcome, refuse_malformed
from skippy.transfer.wire import (
    BodyData,
    BodyEnd,
    RequestReader,
    ResponseHeader,
    ResponseReader,
    encode_request,
)

REPO = "lab/tiny-layers"
OWNER = "a1" * 32
FRIEND = "b2" * 32
STRANGER = "c3" * 32
COORDINATOR = bytes(range(32))
WORKER_A = bytes(range(1, 33))
WORKER_B = bytes(range(2, 34))


def node_hex(node: bytes) -> str:
    return node.hex()


@dataclass(frozen=True)
class ServedPackage:
    """A real synthetic package (gemma-like: tied embeddings, 4 layers, a projector) published
    on the local hub and downloaded whole into the coordinator's hub cache by huggingface_hub."""

    package_dir: Path
    hub_cache: Path
    ref: str  # hf://lab/tiny-layers@<commit>
    commit: str
    manifest_sha256: str
    hub: FaultyHub  # still running: the hub workers fall back to

    def topology(self, **changes: object) -> SplitTopology:
        n = 4
        stages = (
            StageAssignment(node_hex(COORDINATOR), "stage-0", 0, LayerRange(0, 1, n)),
            StageAssignment(node_hex(WORKER_A), "stage-1", 1, LayerRange(1, 3, n)),
            StageAssignment(node_hex(WORKER_B), "stage-2", 2, LayerRange(3, 4, n)),
        )
        fields: dict[str, object] = {
            "topology_id": "topo-1",
            "run_id": "run-1",
            "package_ref": self.ref,
            "manifest_sha256": self.manifest_sha256,
            "layer_count": n,
            "stages": stages,
        }
        fields.update(changes)
        return SplitTopology(**fields)  # type: ignore[arg-type]


def publish_package(gemma: Path, projector: Path, root: Path) -> Iterator[ServedPackage]:
    pkg = root / "pkg"
    make_package(gemma, pkg, projectors=(projector,))
    with running_hub({REPO: pkg}) as hub:
        commit = hub.commit_of(REPO)
        cache = root / "coordinator-hub"
        files = [p.relative_to(pkg).as_posix() for p in pkg.rglob("*") if p.is_file()]
        for rel in files:
            hf_hub_download(REPO, rel, revision=commit, cache_dir=cache, endpoint=hub.url)
        sha = hashlib.sha256((pkg / MANIFEST_NAME).read_bytes()).hexdigest()
        hub.reset()  # count only what the tests ask of it
        yield ServedPackage(pkg, cache, f"hf://{REPO}@{commit}", commit, sha, hub)


@pytest.fixture(scope="session")
def served_package(synth_dir, tmp_path_factory) -> Iterator[ServedPackage]:  # type: ignore[no-untyped-def]
    yield from publish_package(
        synth_dir.gemma, synth_dir.projector, tmp_path_factory.mktemp("served")
    )


def policy(mode: str, *, trusted: tuple[str, ...] = (FRIEND,)) -> NodePolicy:
    return NodePolicy(
        mode=mode,  # type: ignore[arg-type]
        own_owner_id=OWNER,
        own_owner_verified=True,
        trusted_owners=frozenset(trusted),
    )


PEERS: dict[str, PeerFacts] = {
    "same owner": PeerFacts(WORKER_B, OWNER, "verified"),
    "trusted owner": PeerFacts(WORKER_B, FRIEND, "verified"),
    "untrusted owner": PeerFacts(WORKER_B, STRANGER, "verified"),
    "unverified owner": PeerFacts(WORKER_B, None, "unverified"),
}


@dataclass
class Exchange:
    """What one request produced on both sides."""

    outcome: ServeOutcome
    events: list[object] = field(default_factory=list)
    body: bytes = b""
    installed: Path | None = None


Mutate = Callable[[list[bytes]], list[bytes]]


def serve_bytes(
    server: ArtifactServer,
    node_policy: NodePolicy,
    peer: PeerFacts,
    topology: SplitTopology | None,
    request_frame: bytes,
) -> ServeOutcome:
    """The serving shell's decision step: request bytes in (fed in small pieces), outcome out."""
    reader = RequestReader()
    try:
        request = None
        for i in range(0, len(request_frame), 7):
            request = reader.feed(request_frame[i : i + 7])
        reader.eof()
    except ArtifactWireError as exc:
        return refuse_malformed(node_policy, exc)
    assert request is not None
    return server.serve(node_policy, peer, topology, request)


def stream_of(outcome: ServeOutcome, chunk: int = 64 * 1024) -> list[bytes]:
    """Everything the server puts on the stream: the header, then body chunks."""
    out = [outcome.header]
    if outcome.body is not None:
        try:
            while piece := outcome.body.read(chunk):
                out.append(piece)
        finally:
            outcome.body.close()
    return out


def pump(
    server: ArtifactServer,
    node_policy: NodePolicy,
    peer: PeerFacts,
    topology: SplitTopology | None,
    request_frame: bytes,
    *,
    offset: int = 0,
    sink: ChunkSink | None = None,
    mutate: Mutate | None = None,
    chunk: int = 64 * 1024,
) -> Exchange:
    """One request end to end. With a ``sink`` the body goes into it (``finish`` at the end;
    any exception propagates after ``abort``, as the shell would do)."""
    outcome = serve_bytes(server, node_policy, peer, topology, request_frame)
    pieces = stream_of(outcome, chunk)
    if mutate is not None:
        pieces = mutate(pieces)
    ex = Exchange(outcome)
    reader = ResponseReader(offset)
    body = bytearray()
    try:
        for piece in pieces:
            for event in reader.feed(piece):
                ex.events.append(event)
                if isinstance(event, ResponseHeader) and sink is not None:
                    sink.accept(event.response)
                elif isinstance(event, BodyData):
                    body += event.data
                    if sink is not None:
                        sink.write(event.data)
                elif isinstance(event, BodyEnd) and sink is not None:
                    ex.installed = sink.finish()
        reader.eof()
    except BaseException:
        if sink is not None:
            sink.abort()
        raise
    ex.body = bytes(body)
    return ex


def fetch_item(
    sp: ServedPackage,
    server: ArtifactServer,
    worker_hub: Path,
    item: FetchItem,
    *,
    verify_cache: VerifyCache | None = None,
    requester: bytes = WORKER_B,
    mode: str = "open",
    mutate: Mutate | None = None,
    chunk: int = 16 * 1024,
    lock_timeout_s: float = 0.0,
) -> tuple[ChunkSink, Exchange | None]:
    """The worker's whole fetch of one item: open the sink, ask from its offset, pump."""
    topology = sp.topology()
    stage = topology.stage_of(requester.hex())
    assert stage is not None
    sink = open_chunk_sink(
        RepoCache.for_ref(worker_hub, sp.ref),
        item,
        manifest_sha256=sp.manifest_sha256,
        verify_cache=verify_cache,
        lock_timeout_s=lock_timeout_s,
    )
    if sink.present:
        return sink, None
    frame = encode_request(request_for(item, topology, stage, requester, offset=sink.offset))
    peer = PeerFacts(requester, OWNER, "verified")
    ex = pump(
        server, policy(mode), peer, topology, frame,
        offset=sink.offset, sink=sink, mutate=mutate, chunk=chunk,
    )
    return sink, ex


def item_for(sp: ServedPackage, path: str) -> FetchItem:
    """The fetch item for ``path`` as the package's manifest declares it."""
    if path == MANIFEST_NAME:
        return FetchItem(MANIFEST_NAME, sp.manifest_sha256, None)
    held = load_held_manifest(RepoCache.for_ref(sp.hub_cache, sp.ref), sp.manifest_sha256)
    ref = {r.path: r for r in held.held.manifest.artifacts()}[path]
    return FetchItem.of(ref)
