"""Swarm fetch: signed source lists and chunk-verified, multi-source
transfer of one artifact.

Coordinator (``SourcesHandler``, kind 0x04, registered with the serving handler): a worker
asks with an ``ArtifactRequest`` for the manifest (the same fields bind it to the topology,
run, package, manifest and its stage), ``authorize`` decides exactly as for the manifest
itself, then ``plan_sources`` lists, for each artifact of the requester's stage, the
coordinator and the stage nodes that reported ready with a stage needing that file (and that
advertise ``swarm-transfer``), with the chunk digests of the coordinator's verified copy
(``ChunkDigestStore``). The list is signed with the node key under
``SIG_DOMAIN_SWARM_SOURCES``. Nodes never gossip holdings (spec "Peer Cache Transfer").

Worker (``SwarmFetch``): the one download engine (a single holder is a swarm of one). The
list's signature is checked against the topology's coordinator, the list against the verified
manifest and topology (``check_source_list``), then one task per source takes chunks from a
shared ``ChunkScheduler`` and asks that source for them as a range request on a kind 0x03
stream (the source's own ``authorize`` applies in full: a node outside the topology, or on
another revision, refuses), a run of chunks in a row per request (``_RunReceiver``; one chunk
a request from a source without ``chunk-runs``). Bytes are written as they arrive and every
chunk is checked when its last byte is in (``ChunkSink.stream``); a source that serves a wrong
chunk is dropped (logged, ``chunk_failures`` / ``dropped_sources`` counted, named in the
record) and the chunk goes to another source. The list is asked again every ``refresh_s``
while chunks remain, so holders that become ready meanwhile join. A file no list names is
fetched the same way from the coordinator alone (``alone``), as one chunk checked against the
manifest's SHA-256. When no source is left, ``SwarmFailed``: the caller
(``mesh_node.transfer.fetch``) tries the coordinator again after a cut, else the hub.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NoReturn

import trio

from mesh_node.errors import MeshError, StreamStalled
from mesh_node.identity import short_id
from mesh_node.link import MeshStream
from mesh_node.peers import InboundStream
from mesh_node.request_gate import RequestGate, RequestSlots
from mesh_node.topology import TopologyService
from mesh_node.transfer.pace import RateDeadline
from mesh_node.transfer.partials import speaks_partials
from mesh_node.transfer.policy import node_policy, peer_facts
from mesh_node.transfer.records import TransferLog, TransferRecord
from mesh_node.transfer.requests import read_request
from mesh_node.transfer.serve import PEER_BUSY
from mesh_node.transfer.siblings import coordinated, sibling_topologies, speaks_siblings
from protocol import constants as pc
from protocol.certificates import sign_domain, verify_domain
from protocol.errors import ProtocolError
from skippy.constants import MANIFEST_MAX_BYTES, MANIFEST_NAME
from skippy.consume.verify import FileStamp, VerifyCache
from skippy.errors import IntegrityError, SkippyError
from skippy.package.manifest import ArtifactRef, PackageManifest
from skippy.package.topology import SplitTopology, StageAssignment
from skippy.transfer.authorize import PEER_DISABLED, PEER_UNAVAILABLE, authorize, refuse
from skippy.transfer.chunk_sink import ChunkSink, ChunkStream
from skippy.transfer.chunks import (
    CHUNK_BYTES,
    ChunkDigestStore,
    ChunkScheduler,
    chain_fits,
    digest_chunks,
    run_length,
)
from skippy.transfer.errors import ArtifactWireError, TransferRefused
from skippy.transfer.fetch_plan import FetchItem, manifest_item, request_for
from skippy.transfer.hubcache import LoadedManifest, RepoCache
from skippy.transfer.partials import (
    MAX_HAVE_BYTES,
    check_have,
    decode_have,
    encode_have,
    fetch_order,
)
from skippy.transfer.policy import peer_refusal
from skippy.transfer.required import stage_refs
from skippy.transfer.serve import ArtifactServer
from skippy.transfer.sources import (
    MAX_SOURCE_LIST_BYTES,
    ArtifactSources,
    SourceList,
    check_source_list,
    decode_source_list,
    encode_source_list,
    plan_sources,
    required_set,
)
from skippy.transfer.wire import (
    ArtifactRequest,
    ArtifactResponse,
    BodyData,
    RequestReader,
    ResponseHeader,
    ResponseReader,
    encode_request,
    encode_response,
)

if TYPE_CHECKING:
    from mesh_node.node import MeshNode

log = logging.getLogger("mesh_node.transfer.swarm")

REFRESH_S: Final = 1.0  # how often a running swarm fetch asks for new holders
MAX_SOURCES: Final = 4  # sources used at once for one artifact
# Chunk requests in flight per source: while one chunk is checked and written the others keep
# the link busy (each is its own stream with its own 4 MiB window; one at a time left the link
# idle for both: ~50% slower than a whole file, two at a time still ~30%).
PER_SOURCE: Final = 4
MAX_IN_FLIGHT: Final = 8  # chunks of one artifact requested at once, over all its sources
# A holder that advertises ``chunk-runs`` gets runs of chunks in a row, one range request per
# run (one request, authorization and stream, whose window grows, per run instead of per
# chunk), each chunk checked as its bytes arrive. Two streams per such holder: while one run's
# request is answered the other keeps the link busy.
RUN_CHUNKS: Final = 8  # chunks in one run at most (64 MiB at the default 8 MiB)
RUN_STREAMS: Final = 2  # runs in flight per holder
# Received chunks wait in memory until they are checked and written: that memory is taken from
# the node's peer-memory budget (``mesh_node.budget.PeerMemory``) under one trusted
# account for every swarm fetch of the node, and all of them together hold at most this part
# of the budget (the links need the rest to keep receiving).
CHUNK_BUDGET_FRACTION: Final = 0.5
CHUNK_ACCOUNT: Final = -23  # the budget account (links use positive ``id()`` keys)
_RESERVE_POLL_S: Final = 0.02
# End-game: a chunk in flight this long is a straggler another idle source may fetch too.
ENDGAME_AFTER_S: Final = 1.0
# While a task of a counterpart's fetch (partial-serve) waits for chunks in flight elsewhere,
# the list is asked for this often: it carries this node's report and brings the
# counterpart's, so a chunk changes hands ~0.05 s after it is verified instead of up to two
# refreshes (0.5 s) later. Measured (one 7-node bring-up): the coordinator's CPU over the
# fetch 2.15 -> 2.7 s, at most 20 asks a second per waiting fetch; 0.1 s gained half as much.
WAITING_REFRESH_S: Final = 0.05
# ``partial-serve``: streams to the coordinator per file while counterparts
# exchange chunks (one chunk a request), so what it still has in flight when a counterpart
# verifies the same chunk is small.
PARTIAL_COORDINATOR_STREAMS: Final = 2
BUSY_WAIT_S: Final = 5.0  # a chunk another holder fetches is waited for this long at most
# Integrity failures of received bytes (the verification failures counter).
VERIFICATION_CODES: Final = frozenset(
    {
        "chunk_digest_mismatch",
        "artifact_sha256_mismatch",
        "artifact_size_mismatch",
        "peer_artifact_mismatch",
    }
)
_KNOWN_ANSWERS: Final = frozenset({PEER_UNAVAILABLE, PEER_DISABLED, PEER_BUSY})
# A response's bytes go to the disk in batches of this size (one thread call each), at most
# ``WRITE_QUEUE`` waiting: the stream keeps granting credit while the disk works, and memory
# stays bounded. The chunk budget is charged this much per response (a one-chunk file of any
# size streams through it).
WRITE_BATCH_BYTES: Final = 2 * 1024 * 1024
WRITE_QUEUE: Final = 2
STREAM_HOLD_BYTES: Final = (WRITE_QUEUE + 2) * WRITE_BATCH_BYTES
SWARM_BITS: Final = frozenset({pc.BIT_ARTIFACT_TRANSFER, pc.BIT_SWARM_TRANSFER})
RUN_BITS: Final = SWARM_BITS | {pc.BIT_CHUNK_RUNS}
CHAIN_BITS: Final = frozenset({pc.BIT_CHUNK_CHAIN})


def allowed_from_coordinator(
    others: list[frozenset[int] | None], busy: list[frozenset[int]] | None = None
) -> Callable[[int], bool]:
    """The chunks a fetch asks the coordinator for while counterparts exchange partials
    (pure): none that another holder in use has (``others``: each one's listed chunks, None
    for a whole copy, which leaves the coordinator only the end-game's stragglers) or was
    fetching at its last report (``busy``: it will have them soon, from the coordinator)."""
    if any(h is None for h in others):
        return lambda _index: False
    held = frozenset().union(*[h for h in others if h is not None], *(busy or []))
    return lambda index: index not in held


def counterpart_next(
    count: int, rank: int, claimed: frozenset[int], k: int = PARTIAL_COORDINATOR_STREAMS
) -> frozenset[int]:
    """(pure) Of two counterparts fetching one file in opposite orders (``fetch_order``),
    the chunks the other one (rank ``1 - rank``) asks the coordinator for next, within the
    other one's half of the file: the first ``k`` in the other's order that are not
    ``claimed`` (held or in flight at either, as this fetch knows). This fetch (rank
    ``rank``) leaves those to it: at the meeting point both took the middle chunk from the
    coordinator, each unaware of the other's request (its report ~0.25 s old), which cost
    the coordinator's uplink a chunk (0.2 s at 40 MiB/s). The halves settle a tie: no chunk
    is left by both, and a chunk of this fetch's own half is never left."""
    other = 1 - rank
    out: list[int] = []
    for index in fetch_order(count, other, 2):
        if len(out) >= k:
            break
        if index in claimed:
            continue
        if (2 * index < count) == (other == 0):  # the other one's half
            out.append(index)
    return frozenset(out)


def honoured_busy(
    busy: frozenset[int], first_seen: Mapping[int, float], now: float, wait_s: float = BUSY_WAIT_S
) -> frozenset[int]:
    """The chunks a holder says it is fetching that a fetch still waits for rather than ask
    the coordinator (pure): those first listed as such less than ``wait_s`` ago. A holder
    that keeps claiming chunks it never verifies (slow, stuck or lying: it is only a peer's
    word) holds nobody back for longer."""
    return frozenset(i for i in busy if now - first_seen.get(i, now) < wait_s)


def may_ask(node: MeshNode, holder_id: str, coordinator_id: str) -> bool:
    """This node's own trust mode for a holder that is not the coordinator (the coordinator
    is asked as for a whole-file fetch): ``trusted`` asks only holders whose owner it trusts
    (``skippy.transfer.policy.peer_refusal``); ``open`` and ``disabled`` (which is about
    serving) ask any member the signed list names: every chunk is checked against the
    coordinator's signed digests, the file against the signed topology's manifest."""
    if holder_id == coordinator_id:
        return True
    policy = node_policy(node.settings, node.identity, node.wall_clock())
    if policy.mode != "trusted":
        return True
    peer = node.authenticated(holder_id)
    return peer is not None and peer_refusal(policy, peer_facts(peer)) is None


def speaks_swarm(node: MeshNode, node_id: str) -> bool:
    """``node_id`` (not this node) is linked and advertises serving with chunk ranges."""
    return node_id != node.node_id and node.speaks(node_id, SWARM_BITS)


def speaks_chain(node: MeshNode, node_id: str) -> bool:
    """``node_id`` checks chunks along a SHA-256 chain (``chunk-chain``): its source lists
    carry chains, and it hashes each byte once."""
    return node.speaks(node_id, CHAIN_BITS)


def speaks_runs(node: MeshNode, node_id: str) -> bool:
    """``node_id`` serves a run of chunks on one range request (``chunk-runs``); else one
    chunk a request, as before."""
    return node.speaks(node_id, RUN_BITS)


# --- the coordinator: source lists --------------------------------------------------------
# A holder's "being fetched" chunks count (others wait for them) only from a report this
# recent: a holder that stopped reporting (gone, stuck) holds nobody back for longer.
BUSY_FRESH_S: Final = 2.0


@dataclass(frozen=True)
class Holding:
    """One node's last have-report (``partial-serve``): path -> chunks verified,
    path -> chunks being fetched, and when it came (trio clock)."""

    have: dict[str, frozenset[int]]
    busy: dict[str, frozenset[int]]
    at: float


class SourcesHandler:
    """``node.register_subprotocol(KIND_SWARM_SOURCES, handler)``: one list per stream."""

    def __init__(
        self,
        node: MeshNode,
        server: ArtifactServer,
        records: TransferLog,
        digests: ChunkDigestStore,
        *,
        gate: RequestGate | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.node = node
        self.server = server
        self.records = records
        self.digests = digests
        self.gate = gate if gate is not None else RequestGate()
        # As many lists computed at once as artifact requests served (kind 0x03's bounds).
        self.slots = RequestSlots()
        self.chunk_bytes = chunk_bytes  # the coordinator chooses; tests use small chunks
        # ``partial-serve``: (topology id, node) -> path -> the chunks that node
        # reported verified (its have-reports, after its source requests); only the
        # coordinator's current topologies are kept.
        self.holdings: dict[tuple[str, str], Holding] = {}
        self._digest_locks: dict[tuple[str, bool], threading.Lock] = {}  # (SHA-256, chain)
        self._locks_lock = threading.Lock()
        self._prepared: dict[str, trio.Event] = {}  # by topology id: ``prepare`` has run
        self._preparing: set[str] = set()  # topology ids whose ``prepare`` started

    async def prepare(self, topology: SplitTopology) -> None:
        """Compute the chunk digests of every file the other stages need, as the topology
        becomes active (single flight; a problem is logged, the requests then say it).

        Every worker asks for its source list at once, ~0.1 s later; until each has one it
        fetches nothing, and the coordinator's uplink idles. Started here, the hashing gets
        the cores before the coordinator's own bring-up work (``prepared``)."""
        tid = topology.topology_id
        if tid in self._preparing:
            return
        self._preparing.add(tid)
        done = self.expect(topology)
        began = trio.current_time()
        try:
            held = await trio.to_thread.run_sync(self.server.held, topology)
            if isinstance(held, LoadedManifest):
                kinds = {s.node_id: self._chain_for(s.node_id) for s in topology.stages}
                n = await trio.to_thread.run_sync(
                    self._digest_all, topology, held.held.manifest, kinds
                )
                log.info(
                    "topology %s: chunk digests of %d files ready in %.2f s",
                    tid, n, trio.current_time() - began,
                )
        except (SkippyError, OSError) as exc:
            log.info("topology %s: chunk digests not prepared: %s", tid, exc)
        finally:
            done.set()

    def expect(self, topology: SplitTopology) -> trio.Event:
        """From now on ``prepared`` waits for this topology's ``prepare`` (registered before
        the tasks that wait for it start; forgets the topologies this node no longer runs)."""
        tid = topology.topology_id
        done = self._prepared.get(tid)
        if done is None:
            done = self._prepared[tid] = trio.Event()
        current = {a.topology.topology_id for a in coordinated(self.node)}
        for old in [k for k in self._prepared if k != tid and k not in current]:
            self._prepared.pop(old).set()
            self._preparing.discard(old)
        return done

    async def prepared(self, topology_id: str) -> None:
        """Until ``prepare`` of that topology has finished (at once if it never started)."""
        done = self._prepared.get(topology_id)
        if done is not None:
            await done.wait()

    def _chain_for(self, node_id: str) -> bool:
        """Send ``node_id`` SHA-256 chains (it advertises ``chunk-chain`` and this node can
        compute them for its chunk size), else plain per-chunk digests."""
        return speaks_chain(self.node, node_id) and chain_fits(self.chunk_bytes)

    def _digest_all(
        self, topology: SplitTopology, manifest: PackageManifest, chains: dict[str, bool]
    ) -> int:
        """Thread: the other stages' files, each once per kind their nodes take (``chains``:
        node -> a chain, or plain digests for a node without ``chunk-chain``), the largest
        first; how many."""
        refs: dict[str, tuple[ArtifactRef, set[bool]]] = {}
        for stage in topology.stages:
            if stage.node_id != self.node.node_id:
                kind = chains.get(stage.node_id, False)
                for ref in stage_refs(manifest, stage.layers):
                    refs.setdefault(ref.artifact.sha256.lower(), (ref, set()))[1].add(kind)
        for ref, kinds in sorted(refs.values(), key=lambda r: -r[0].artifact.artifact_bytes):
            for chain in sorted(kinds, reverse=True):
                try:
                    self._digests_of(topology, ref, chain=chain)
                except (SkippyError, OSError) as exc:  # not held, or not verified: unlisted
                    log.info("no chunk digests for %s: %s", ref.path, exc)
        return len(refs)

    async def __call__(self, inbound: InboundStream) -> None:
        stream = inbound.stream
        timeout = self.node.timeouts.handshake_s
        reports = speaks_partials(self.node, inbound.peer.node_id)
        reader = RequestReader(MAX_HAVE_BYTES if reports else 0)
        try:
            request = await read_request(stream, reader, timeout)
        except (ArtifactWireError, trio.TooSlowError) as exc:
            self.gate.refused(inbound.peer, pc.KIND_SWARM_SOURCES, "malformed")
            stream.reset("malformed", f"no valid source request: {type(exc).__name__}")
            return
        async with self.slots.slot(inbound.peer.node_id, self.node.timeouts.idle_s) as held:
            if not held:
                self.gate.refused(inbound.peer, pc.KIND_SWARM_SOURCES, "server_busy")
                body = None
            else:
                body = await self._answer_or_none(inbound, request, reader.trailer)
        with trio.move_on_after(self.node.timeouts.idle_s):
            if body is None:
                await stream.send_all(encode_response(ArtifactResponse.refusal("unavailable")))
            else:
                digest = hashlib.sha256(body).hexdigest()
                await stream.send_all(
                    encode_response(ArtifactResponse.accept(len(body), digest)) + body
                )
            await stream.send_eof()

    async def _answer_or_none(
        self, inbound: InboundStream, request: ArtifactRequest, report: bytes | None
    ) -> bytes | None:
        try:
            return await self._answer(inbound, request, report)
        except (SkippyError, OSError) as exc:  # a clear log line, a refusal, no crash
            log.warning("source list for %s failed: %s", short_id(inbound.peer.node_id), exc)
            return None

    async def _answer(
        self, inbound: InboundStream, request: ArtifactRequest, report: bytes | None = None
    ) -> bytes | None:
        node = self.node
        # The requester's replica's topology, as the artifact server does:
        # with ``active`` alone a second replica's workers got no list and fetched every
        # file whole from this node (seen in ``mesh-node lab --nodes 7 --replicas 2``).
        active = node.service(TopologyService).active_for(inbound.peer.node_id)
        policy = node_policy(node.settings, node.identity, node.wall_clock())
        if active is None or active.role != "coordinator":
            decision = refuse("no_active_topology", "this node coordinates no topology")
        elif request.relative_path != MANIFEST_NAME:
            decision = refuse("undeclared_path", "a source request names the manifest")
        else:
            topology = active.topology
            held = await trio.to_thread.run_sync(self.server.held, topology)
            facts = held.held if isinstance(held, LoadedManifest) else held
            decision = authorize(policy, peer_facts(inbound.peer), topology, facts, request)
        if not decision.allowed or active is None:
            # Logged (summed per interval), not counted in ``refusals`` (those count artifact
            # requests): the requester then asks for its files one by one and is refused (or
            # served) there.
            self.gate.refused(inbound.peer, pc.KIND_SWARM_SOURCES, decision.reason)
            return None
        topology = active.topology
        manifest = held.held.manifest if isinstance(held, LoadedManifest) else None
        if manifest is None:
            return None
        ready = [nid for nid, r in active.reports.items() if r.state == "ready"]
        servers = {s.node_id for s in topology.stages if speaks_swarm(node, s.node_id)}
        servers.add(node.node_id)  # this node serves (the handler is registered only then)
        # The sibling replicas' ready nodes, when the requester takes them and
        # they serve siblings (each asks this node for the requester's topology).
        siblings: list[tuple[SplitTopology, list[str]]] = []
        if speaks_siblings(node, inbound.peer.node_id):
            for other in sibling_topologies(node, topology):
                siblings.append(
                    (other.topology, [n for n, r in other.reports.items() if r.state == "ready"])
                )
                servers |= {
                    s.node_id for s in other.topology.stages if speaks_siblings(node, s.node_id)
                }
        partial_holders: dict[str, dict[str, frozenset[int]]] | None = None
        busy_holders: dict[str, dict[str, frozenset[int]]] | None = None
        rank: tuple[int, int] | None = None
        if speaks_partials(node, inbound.peer.node_id):
            self._record_have(topology, manifest, request.requester_hex, report)
            family = [topology, *(s for s, _ in siblings)]
            partial_holders, busy_holders = self._partial_holders(family, servers)
            rank = _rank(topology, family)
        chain = self._chain_for(inbound.peer.node_id)
        digests = await trio.to_thread.run_sync(
            self._digests, topology, manifest, request.requester_hex, chain
        )
        sources = plan_sources(
            topology,
            manifest,
            request.requester_hex,
            coordinator_id=node.node_id,
            ready=ready,
            servers=servers,
            digests=digests,
            chunk_bytes=self.chunk_bytes,
            siblings=siblings,
            partial_holders=partial_holders,
            busy_holders=busy_holders,
            rank=rank,
            chain=chain,
        )
        signature = sign_domain(
            node.identity.key, pc.SIG_DOMAIN_SWARM_SOURCES, sources.signed_bytes()
        )
        return encode_source_list(sources, signature)

    def _record_have(
        self,
        topology: SplitTopology,
        manifest: PackageManifest,
        requester: str,
        report: bytes | None,
    ) -> None:
        """Keep the requester's have-report (its own words on its own stage's files; a
        report that names anything else is ignored whole, with a log line)."""
        current = {a.topology.topology_id for a in coordinated(self.node)}
        for key in [k for k in self.holdings if k[0] not in current]:
            del self.holdings[key]  # a topology this node no longer runs
        if report is None:
            return
        required = required_set(manifest, topology, requester)
        try:
            have, busy = decode_have(report)
            held = Holding(
                check_have(have, required, self.chunk_bytes),
                check_have(busy, required, self.chunk_bytes),
                trio.current_time(),
            )
        except (ArtifactWireError, SkippyError) as exc:
            log.info("ignored a have-report from %s: %s", short_id(requester), exc)
            return
        self.holdings[(topology.topology_id, requester)] = held

    def _partial_holders(
        self, family: list[SplitTopology], servers: set[str]
    ) -> tuple[dict[str, dict[str, frozenset[int]]], dict[str, dict[str, frozenset[int]]]]:
        """Node -> its reported chunks (verified; being fetched, from a fresh report only),
        for the members of ``family`` (the requester's topology and its siblings) that
        serve partials."""
        members = {t.topology_id: {s.node_id for s in t.stages} for t in family}
        have: dict[str, dict[str, frozenset[int]]] = {}
        busy: dict[str, dict[str, frozenset[int]]] = {}
        now = trio.current_time()
        for (tid, nid), held in self.holdings.items():
            if nid in members.get(tid, ()) and nid in servers and speaks_partials(self.node, nid):
                have[nid] = held.have
                if now - held.at <= BUSY_FRESH_S:
                    busy[nid] = held.busy
        return have, busy

    def _digests(
        self, topology: SplitTopology, manifest: PackageManifest, requester: str, chain: bool
    ) -> dict[str, tuple[bytes, ...]]:
        """The requester's stage's chunk digests from this node's verified copies (thread); a
        file this node does not hold verified is left out (the worker fetches it whole)."""
        stage = topology.stage_of(requester)
        if stage is None:
            return {}
        out: dict[str, tuple[bytes, ...]] = {}
        for ref in stage_refs(manifest, stage.layers):
            sha = ref.artifact.sha256.lower()
            try:
                out[sha] = self._digests_of(topology, ref, chain=chain)
            except (SkippyError, OSError) as exc:  # not held here, or not verified: unlisted
                log.info("no chunk digests for %s: %s", ref.path, exc)
        return out

    def _digests_of(
        self, topology: SplitTopology, ref: ArtifactRef, *, chain: bool
    ) -> tuple[bytes, ...]:
        """One file's digests of one kind, computed once however many ask at once (thread:
        the stage nodes of every replica ask together at bring-up, and each computation
        reads the whole file, 178 MB for gemma3's embeddings), from the file the serving
        warm-up verified (hashed once, not a second time for the whole-file proof; a chain
        proves it anyway), kept only when the file did not change while it was read."""
        sha = ref.artifact.sha256.lower()
        with self._locks_lock:
            lock = self._digest_locks.setdefault((sha, chain), threading.Lock())
        with lock:
            size = ref.artifact.artifact_bytes
            known = self.digests.get(sha, size, self.chunk_bytes, chain=chain)
            if known is not None:
                return known
            path, stamp = self.server.verified_path(topology, ref)
            digests = digest_chunks(
                path,
                size=size,
                sha256=sha,
                chunk_bytes=self.chunk_bytes,
                proven=True,
                chain=chain,
            )
            if FileStamp.of(path.stat()) != stamp:
                raise IntegrityError(f"{ref.path} changed while its chunks were hashed")
            with contextlib.suppress(OSError):  # storing only saves work next time
                self.digests.put(sha, self.chunk_bytes, digests, chain=chain)
            return digests


def _rank(topology: SplitTopology, family: list[SplitTopology]) -> tuple[int, int]:
    """``topology``'s place among the sibling replicas (by topology id, the same for every
    counterpart) and their number: the fetch order its nodes get."""
    ids = sorted({t.topology_id for t in family})
    return ids.index(topology.topology_id), len(ids)


# --- the worker: asking for the list ------------------------------------------------------
async def ask_sources(
    node: MeshNode,
    coordinator_id: str,
    topology: SplitTopology,
    stage: StageAssignment,
    manifest: PackageManifest,
    have: Callable[[], tuple[Mapping[str, bytes], Mapping[str, bytes]]] | None = None,
) -> SourceList:
    """The coordinator's signed list for this node's stage, checked; a ``SkippyError`` or
    ``MeshError`` when there is none to trust. ``have`` (``partial-serve``, both
    ends advertising it): this node's verified chunks per file, in the coordinator's chunk
    size (the last list's), sent after the request."""
    request = request_for(
        manifest_item(topology), topology, stage, bytes.fromhex(node.node_id), offset=0
    )
    timeouts = node.timeouts
    body = bytearray()
    report = b""
    if have is not None and speaks_partials(node, coordinator_id):
        report = encode_have(*have())
    with trio.fail_after(timeouts.handshake_s + timeouts.idle_s):
        stream = await node.open_stream(coordinator_id, pc.KIND_SWARM_SOURCES)
        async with stream:
            await stream.send_all(encode_request(request) + report)
            await stream.send_eof()
            reader = ResponseReader(0)
            header: ArtifactResponse | None = None
            while not reader.done:
                data = await stream.receive_some()
                if not data:
                    reader.eof()
                for event in reader.feed(data):
                    if isinstance(event, ResponseHeader):
                        header = event.response
                        if header.accepted and header.total_size > MAX_SOURCE_LIST_BYTES:
                            raise ArtifactWireError(
                                "the source list is too large", code="source_list_malformed"
                            )
                    elif isinstance(event, BodyData):
                        body += event.data
    if header is None or not header.accepted:
        raise IntegrityError("the coordinator gave no source list", code="source_list_refused")
    required = required_set(manifest, topology, node.node_id)
    return checked_source_list(
        bytes(body),
        topology,
        required,
        node.node_id,
        coordinator_id,
        siblings_ok=speaks_siblings(node, coordinator_id),
    )


def checked_source_list(
    body: bytes,
    topology: SplitTopology,
    required: Mapping[str, tuple[str, int]],
    requester_id: str,
    coordinator_id: str,
    *,
    siblings_ok: bool = False,
) -> SourceList:
    """A source list's bytes -> the list, only when the topology's coordinator signed it and
    it is for this requester's stage (``check_source_list``); pure."""
    sources, signed, signature = decode_source_list(body)
    if not verify_domain(
        bytes.fromhex(coordinator_id), signature, pc.SIG_DOMAIN_SWARM_SOURCES, signed
    ):
        raise IntegrityError(
            "the source list's signature does not verify against the coordinator",
            code="source_list_signature",
        )
    return check_source_list(
        sources, topology, required, requester_id, coordinator_id, siblings_ok=siblings_ok
    )


@dataclass
class SourceBook:
    """The latest checked list of one stage fetch, asked again at most every ``refresh_s``."""

    ask: Callable[[], Awaitable[SourceList]] | None
    latest: SourceList
    refresh_s: float = REFRESH_S
    _asked_at: float = 0.0

    async def refreshed(self, every_s: float | None = None) -> SourceList:
        """The latest list, asked again when the last ask is ``refresh_s`` old (or
        ``every_s``, when shorter)."""
        now = trio.current_time()
        interval = self.refresh_s if every_s is None else min(every_s, self.refresh_s)
        if self.ask is not None and now - self._asked_at >= interval:
            self._asked_at = now
            try:
                self.latest = await self.ask()
            except (SkippyError, MeshError, ProtocolError, trio.TooSlowError) as exc:
                log.info("asking for new sources failed: %s", exc)
        return self.latest


class SwarmFailed(MeshError):
    """No source is left for some chunk (every one refused, failed or served a bad chunk)."""

    code = "swarm_sources_exhausted"


class ChunkMemory:
    """Chunk buffers of this node's swarm fetches, taken from its peer-memory budget."""

    def __init__(self, node: MeshNode) -> None:
        self.budget = node.peer_memory
        self.budget.open(CHUNK_ACCOUNT, trusted=True)  # once per node (open is idempotent)
        self.cap = int(self.budget.budget_bytes * CHUNK_BUDGET_FRACTION)

    async def reserve(self, nbytes: int) -> None:
        """Wait until ``nbytes`` fit (a chunk is requested only then); ``SwarmFailed`` when
        a chunk could never fit (a budget smaller than two chunks: fetch files whole)."""
        if nbytes > self.cap:
            raise SwarmFailed(f"a {nbytes}-byte chunk exceeds the chunk budget ({self.cap})")
        budget = self.budget
        while True:
            held = budget.held(CHUNK_ACCOUNT)
            if held + nbytes <= self.cap and nbytes <= budget.room(CHUNK_ACCOUNT):
                budget.take(CHUNK_ACCOUNT, nbytes)
                return
            await trio.sleep(_RESERVE_POLL_S)  # bytes are given back as chunks are written

    def release(self, nbytes: int) -> None:
        self.budget.give(CHUNK_ACCOUNT, nbytes)


# --- the worker: one artifact from many sources -------------------------------------------
class SwarmFetch:
    """One artifact, chunk by chunk, from every usable holder at once."""

    def __init__(
        self,
        node: MeshNode,
        records: TransferLog,
        cache: RepoCache,
        topology: SplitTopology,
        stage: StageAssignment,
        item: FetchItem,
        rec: TransferRecord,
        book: SourceBook,
        *,
        verify_cache: VerifyCache | None,
    ) -> None:
        self.node = node
        self.records = records
        self.cache = cache
        self.topology = topology
        self.stage = stage
        self.item = item
        self.rec = rec
        self.book = book
        self.verify_cache = verify_cache
        self.dropped: set[str] = set()
        self.errors: dict[str, SkippyError | MeshError | ProtocolError] = {}  # why each was
        self.coordinator_id = ""  # set by ``run``
        self._busy: Counter[str] = Counter()  # holder -> its tasks (streams_for each)
        self._runs: dict[str, bool] = {}  # holder -> it takes runs (fixed once asked)
        self._changed = trio.Event()  # the source tasks wait on it
        self._loop_wake = trio.Event()  # ``run``'s loop waits on it
        self._memory = ChunkMemory(node)
        # chunk -> source -> the cancel scope of that source's copy (two in the end-game);
        # None for a chunk of a run (its stream carries other chunks: never cancelled for one)
        self._fetching: dict[int, dict[str, trio.CancelScope | None]] = {}
        # ``partial-serve``: counterparts exchange what each verified; this fetch's
        # order among them, and per holder the chunks it was listed with (None: all).
        latest = book.latest
        self.partial = latest.partial and latest.ranks > 1
        self.rank = (latest.rank, latest.ranks)
        self._have: dict[str, frozenset[int] | None] = {}
        self._peer_busy: dict[str, frozenset[int]] = {}  # holder -> chunks it was fetching
        # (holder, chunk) -> when it was first listed as fetching it (``honoured_busy``)
        self._busy_seen: dict[tuple[str, int], float] = {}
        self._sched: ChunkScheduler | None = None
        self._waiting = 0  # source tasks with nothing to take (the rest is in flight elsewhere)

    def busy_chunks(self) -> frozenset[int]:
        """The chunks asked for and not verified yet (this node's have-report)."""
        sched = self._sched
        return frozenset(sched.in_flight) if sched is not None else frozenset()

    def _some_waiting(self) -> bool:
        """A source task of this counterpart's fetch waits for chunks in flight elsewhere."""
        return self.partial and self._waiting > 0

    def _entry(self, sources: SourceList) -> ArtifactSources | None:
        return sources.by_path().get(self.item.path)

    async def run(self, sink: ChunkSink, coordinator_id: str) -> None:
        """Until every chunk is verified in ``sink``; ``SwarmFailed`` when no source is left."""
        # A file whose size only the response tells (the manifest) is one chunk.
        count = len(sink.spans) if sink.spans or sink.complete else 1
        sched = ChunkScheduler(count, sink.verified, order=fetch_order(count, *self.rank))
        self._sched = sched
        self.coordinator_id = coordinator_id
        async with trio.open_nursery() as nursery:
            self._start_sources(nursery, sink, sched, self.book.latest)
            # No usable source: the SwarmFailed below (raised here it would leave the
            # nursery wrapped in an exception group, which the caller does not catch).
            while not sched.complete and self._busy:
                if self._some_waiting():  # a fixed pace: the tasks' wake-ups do not count
                    await trio.sleep(WAITING_REFRESH_S)
                else:
                    with trio.move_on_after(self.book.refresh_s):
                        await self._loop_wake.wait()
                if sched.complete or not self._busy:
                    break
                every = WAITING_REFRESH_S if self._some_waiting() else None
                latest = await self.book.refreshed(every)
                self._start_sources(nursery, sink, sched, latest)
                self._loop_wake = trio.Event()  # set by that call's own wake-up
            nursery.cancel_scope.cancel()
        if not sched.complete:
            raise SwarmFailed(
                f"{self.item.path}: every source failed or was dropped "
                f"({len(self.dropped)} dropped)"
            )

    def _start_sources(
        self, nursery: trio.Nursery, sink: ChunkSink, sched: ChunkScheduler, sources: SourceList
    ) -> None:
        entry = self._entry(sources)
        if entry is None:
            return
        for holder in entry.holders:
            self._have[holder] = entry.chunks_of(holder)
            self._peer_busy[holder] = entry.busy_of(holder)
            now = trio.current_time()
            for index in self._peer_busy[holder]:
                self._busy_seen.setdefault((holder, index), now)
        self._wake()  # tasks waiting for chunks a holder did not have look again
        usable = [
            h
            for h in entry.holders
            if h not in self.dropped
            and self._serves(sink, h)
            and may_ask(self.node, h, self.coordinator_id)
        ][:MAX_SOURCES]
        # The coordinator last: it is every worker's source, the other holders serve only
        # their counterparts, so a file of one chunk (most layer files) goes to a peer and the
        # coordinator's uplink is left for what only it holds (docs/performance.md).
        usable.sort(key=lambda h: h == self.coordinator_id)
        for holder in usable:
            self._runs.setdefault(holder, speaks_runs(self.node, holder))
        streams = sum(self._streams_for(h) for h in usable)
        # Round robin: every holder gets its first task before any gets a second, and at
        # most MAX_IN_FLIGHT chunks of this file are in memory at once (a run's stream holds
        # one chunk at a time: ``_one_run``).
        for _ in range(PER_SOURCE):
            for holder in usable:
                most = self._streams_for(holder)
                if sum(self._busy.values()) >= MAX_IN_FLIGHT or self._busy[holder] >= most:
                    continue
                self._busy[holder] += 1
                # Its first chunks are taken here, in round-robin order (trio starts tasks in
                # no set order: a holder's tasks could otherwise take every chunk of a
                # small file before another holder's first task runs).
                first = self._take(sched, holder, streams)
                nursery.start_soon(self._source, holder, sink, sched, first)
        for holder in [h for h, n in self._busy.items() if n <= 0]:
            del self._busy[holder]

    def _serves(self, sink: ChunkSink, holder: str) -> bool:
        """``holder`` answers this fetch's requests: chunk ranges, or, for a one-chunk sink
        (asked from a byte to the end, no range), plain ``artifact-transfer``."""
        if sink.whole and holder != self.node.node_id:
            return self.node.speaks(holder, frozenset({pc.BIT_ARTIFACT_TRANSFER}))
        return speaks_swarm(self.node, holder)

    def _streams_for(self, holder: str) -> int:
        if self.partial and holder == self.coordinator_id:
            return PARTIAL_COORDINATOR_STREAMS
        return RUN_STREAMS if self._runs.get(holder) else PER_SOURCE

    def _take(self, sched: ChunkScheduler, holder: str, streams: int) -> list[int]:
        """The next chunks for ``holder``: a run when it takes runs (``run_length``)."""
        most = run_length(sched.waiting, streams, RUN_CHUNKS) if self._runs.get(holder) else 1
        if self.partial and holder == self.coordinator_id:
            most = 1  # little in flight from it: a counterpart may verify the next ones first
        return sched.take_run(most, trio.current_time(), self._allow(holder))

    def _allow(self, holder: str) -> Callable[[int], bool] | None:
        """Which chunks ``holder`` is asked for (``partial-serve``): a partial
        holder only those it was listed with; the coordinator, while counterparts exchange,
        only those no other holder in use has (its uplink then carries each distinct chunk
        about once; ``allowed_from_coordinator``)."""
        if holder != self.coordinator_id:
            have = self._have.get(holder)
            return None if have is None else have.__contains__
        if not self.partial:
            return None
        others = [h for h in self._busy if h != holder and h not in self.dropped]
        busy = [
            honoured_busy(
                self._peer_busy.get(h, frozenset()),
                {i: t for (n, i), t in self._busy_seen.items() if n == h},
                trio.current_time(),
            )
            for h in others
        ]
        allowed = allowed_from_coordinator([self._have.get(h) for h in others], busy)
        sched = self._sched
        rank, ranks = self.rank
        if ranks != 2 or len(others) != 1 or sched is None or self._have.get(others[0]) is None:
            return allowed
        have = self._have[others[0]] or frozenset()
        flying = frozenset(i for i, copies in sched.in_flight.items() if copies)
        claimed = have | busy[0] | frozenset(sched.done) | flying
        leave = counterpart_next(sched.count, rank, claimed)
        return lambda index: allowed(index) and index not in leave

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
        self._loop_wake.set()

    def _drop(
        self, source: str, why: str, exc: SkippyError | MeshError | ProtocolError | None = None
    ) -> None:
        if source in self.dropped:  # its other task already did
            return
        self.dropped.add(source)
        if exc is not None:
            self.errors[source] = exc
        self.records.counters.dropped_sources += 1
        self.rec.dropped[source] = why

    async def _source(
        self, source: str, sink: ChunkSink, sched: ChunkScheduler, first: list[int] | None = None
    ) -> None:
        try:
            while not sched.complete and source not in self.dropped:
                now = trio.current_time()
                if first:
                    run, first = first, None
                else:
                    streams = max(1, sum(self._busy.values()))
                    run = self._take(sched, source, streams)
                if run:  # written as it arrives (a cut keeps what came)
                    if not await self._one_run(source, sink, sched, run):
                        return
                    self._wake()
                    continue
                # End-game: help with a chunk another source is slow with (a copy held in
                # memory until it is checked: the first copy may be writing the same bytes).
                mine = [i for i, by in self._fetching.items() if source in by]
                # Only what a partial holder has; the coordinator helps any straggler.
                allow = self._allow(source) if source != self.coordinator_id else None
                index = sched.take_duplicate(mine, now, ENDGAME_AFTER_S, allow)
                if index is not None:
                    self.rec.endgame_chunks += 1
                if index is None:  # the rest is in flight elsewhere: wait for a change
                    self._waiting += 1
                    if self._waiting == 1 and self.partial:
                        self._loop_wake.set()  # the loop (its pace), not the waiting tasks
                    try:
                        with trio.move_on_after(ENDGAME_AFTER_S):
                            await self._changed.wait()
                    finally:
                        self._waiting -= 1
                    continue
                if not await self._one_chunk(source, sink, sched, index):
                    return
                self._wake()
        finally:
            for index in first or ():  # never asked for (dropped or done first): back in line
                sched.failed(index)
            self._busy[source] -= 1
            if self._busy[source] <= 0:
                del self._busy[source]
            self._wake()

    def _forget_partial(self, source: str, chunks: list[int]) -> bool:
        """A partial holder refused chunks it was listed with: not dropped (it may be
        installing the file: between its partial and the installed file a range is refused
        for a moment), the chunks are taken off its list here until the next list says
        otherwise. False for a whole-file holder (dropped, as before)."""
        have = self._have.get(source)
        if have is None:
            return False
        log.info("%s: partial holder %s refused; asking others", self.item.path, short_id(source))
        self._have[source] = have - set(chunks)
        return True

    def _bad_bytes(self, source: str, exc: IntegrityError) -> None:
        """``source`` served bytes that failed their check: counted, logged, dropped."""
        if exc.code == "chunk_digest_mismatch":
            self.records.counters.chunk_failures += 1
        if exc.code in VERIFICATION_CODES:
            self.records.counters.verification_failures += 1
        log.warning("%s from %s: %s; dropping that source", self.item.path, short_id(source), exc)
        self._drop(source, exc.code, exc)

    def _refused(self, source: str, exc: TransferRefused) -> str:
        """A source's refusal, counted by its answer (one of a server's sentences, else
        ``other``: the text is the peer's); returns that answer."""
        answer = refusal_answer(exc.actual)
        self.records.counters.refusals_received[answer] += 1
        return answer

    def _gave_up(self, source: str, exc: SkippyError | MeshError | ProtocolError) -> None:
        """``source`` failed otherwise (a refusal, a cut, a stall): not asked again here."""
        code = exc.code
        if isinstance(exc, TransferRefused):
            code = f"refused: {refusal_answer(exc.actual)}"
        log.info("%s from %s: %s; not asking it again", self.item.path, short_id(source), exc)
        self._drop(source, code, exc)

    async def _one_chunk(
        self, source: str, sink: ChunkSink, sched: ChunkScheduler, index: int
    ) -> bool:
        """Chunk ``index`` from ``source``, checked and written; False: stop using it."""
        n = sink.spans[index].length
        await self._memory.reserve(n)
        try:
            with trio.CancelScope() as scope:
                self._fetching.setdefault(index, {})[source] = scope
                data = await self._get_chunk(source, sink, index)
                wrote = await trio.to_thread.run_sync(sink.write_chunk_parts, index, data)
        except IntegrityError as exc:
            sched.failed(index)
            self._bad_bytes(source, exc)
            return False
        except TransferRefused as exc:
            sched.failed(index)
            if self._refused(source, exc) == PEER_BUSY:  # no slot now: it may have one later
                await trio.sleep(min(1.0, self.node.timeouts.idle_s))
                return True
            if self._forget_partial(source, [index]):
                return True
            self._gave_up(source, exc)
            return False
        except (SkippyError, MeshError, ProtocolError) as exc:
            sched.failed(index)
            if index in sched.done:  # the other copy won meanwhile: this source is not at fault
                return True
            self._gave_up(source, exc)
            return False
        finally:
            self._memory.release(n)
            by = self._fetching.get(index, {})
            by.pop(source, None)
            if not by:
                self._fetching.pop(index, None)
        if scope.cancelled_caught:  # the other copy of this chunk was verified first
            sched.failed(index)  # releases this copy (the chunk is done)
            return True
        self._verified(source, sink, sched, index, wrote)
        return True

    def _verified(
        self, source: str, sink: ChunkSink, sched: ChunkScheduler, index: int, wrote: bool
    ) -> None:
        sched.finished(index)
        for other in self._fetching.get(index, {}).values():
            if other is not None:
                other.cancel()  # first verified copy wins: stop receiving the slower one
        if wrote:  # a copy checked in memory (a stream counts its bytes as they arrive)
            self._received(source, sink, sink.spans[index].length)

    def _received(self, source: str, sink: ChunkSink, n: int) -> None:
        """``n`` bytes from ``source`` are in place (progress, per-source and node totals)."""
        if n:
            self.rec.served_by[source] = self.rec.served_by.get(source, 0) + n
            self.records.counters.fetched_bytes["peer"] += n
        self.rec.bytes_done = sink.offset

    async def _one_run(
        self, source: str, sink: ChunkSink, sched: ChunkScheduler, run: list[int]
    ) -> bool:
        """Chunks ``run`` (in a row) from ``source`` on one range request, each checked and
        written as its bytes arrive (``_RunReceiver``); False: stop using the source. A bad
        chunk drops the source there (the chunks before it stay verified, it and the rest go
        back in line); so does a stream that stops."""
        for index in run:
            self._fetching.setdefault(index, {})[source] = None
        receiver = _RunReceiver(self, source, sink, sched, run)
        try:
            await receiver.receive()
        except IntegrityError as exc:
            self._bad_bytes(source, exc)
            return False
        except TransferRefused as exc:
            if self._refused(source, exc) == PEER_BUSY:  # no slot now: it may have one later
                receiver.give_back()
                await trio.sleep(min(1.0, self.node.timeouts.idle_s))
                return True
            if self._forget_partial(source, run):
                return True
            self._gave_up(source, exc)
            return False
        except SwarmFailed:  # a chunk larger than the chunk budget
            raise
        except (SkippyError, MeshError, ProtocolError) as exc:
            if all(i in sched.done for i in receiver.left):  # others finished them meanwhile
                return True
            self._gave_up(source, exc)
            return False
        finally:
            receiver.give_back()
            for index in run:
                by = self._fetching.get(index, {})
                by.pop(source, None)
                if not by:
                    self._fetching.pop(index, None)
        return True

    async def _run_request(self, source: str, start: int, length: int | None) -> MeshStream:
        """A request for ``length`` bytes from ``start`` (None: to the end of the file)."""
        request = request_for(
            self.item, self.topology, self.stage, bytes.fromhex(self.node.node_id), offset=start
        )
        stream = await self.node.open_stream(source, pc.KIND_ARTIFACT_TRANSFER)
        try:
            await stream.send_all(encode_request(dataclasses.replace(request, length=length)))
            await stream.send_eof()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def _get_chunk(self, source: str, sink: ChunkSink, index: int) -> list[memoryview]:
        span = sink.spans[index]
        request = request_for(
            self.item,
            self.topology,
            self.stage,
            bytes.fromhex(self.node.node_id),
            offset=span.start,
        )
        request = dataclasses.replace(request, length=span.length)
        out: list[memoryview] = []
        stream = await self.node.open_stream(source, pc.KIND_ARTIFACT_TRANSFER)
        async with stream:
            await stream.send_all(encode_request(request))
            await stream.send_eof()
            reader = ResponseReader(span.start, span.length)
            await self._read_chunk(stream, reader, sink, out, source)
        return out  # views of the received records, handed to the sink as they are

    async def _read_chunk(
        self,
        stream: MeshStream,
        reader: ResponseReader,
        sink: ChunkSink,
        out: list[memoryview],
        source: str,
    ) -> None:
        """The response into ``out``. As in ``StageFetcher._receive_into``: one deadline,
        pushed on only while the source keeps ``min_transfer_bytes_per_s``, so a
        trickle is dropped like a stall."""
        idle = self.node.timeouts.idle_s
        min_rate = self.node.settings.security.min_transfer_bytes_per_s
        guard = RateDeadline(idle, min_rate)
        with guard.scope:
            while not reader.done:
                views = await stream.receive_views()
                guard.received(views)
                if not views:
                    reader.eof()
                for view in views:
                    for event in reader.feed(view):
                        if isinstance(event, ResponseHeader):
                            sink.accept(event.response)  # a refusal, another size or digest
                        elif isinstance(event, BodyData):
                            out.append(event.data)  # a view of immutable bytes: no copy
            return
        _deadline_passed(stream, guard, source)


def _deadline_passed(stream: MeshStream, guard: RateDeadline, source: str) -> NoReturn:
    """A response read whose deadline passed: reset the stream and say why (a trickle under
    the minimum rate, or a stall)."""
    if guard.since_mark:
        stream.reset("too_slow", "under the minimum transfer rate")
        raise TransferTooSlow(f"{short_id(source)} sent under {guard.min_bytes_per_s} bytes/s")
    stream.reset("stalled", "no bytes within the idle timeout")
    raise StreamStalled(f"{short_id(source)} sent nothing for {guard.idle_s:g} s")


class _RunReceiver:
    """One response: chunks ``run`` (in a row) from one source, written as the bytes arrive
    (``ChunkSink.stream``) and each checked when its last byte is in, by a second task on a
    thread, so the stream keeps being read (and granting credit) while the disk and the
    digests work. A cut keeps what was written: the verified chunks, and the unchecked bytes
    of the chunk in progress as its head (a resume continues from that byte). Memory: the
    batches between the reader and the writer (``WRITE_BATCH_BYTES``, at most
    ``WRITE_QUEUE`` waiting), taken from the chunk budget."""

    def __init__(
        self, fetch: SwarmFetch, source: str, sink: ChunkSink, sched: ChunkScheduler, run: list[int]
    ) -> None:
        self.fetch, self.source, self.sink, self.sched = fetch, source, sink, sched
        self.run = list(run)
        self.left = list(run)  # chunks not yet verified from this run
        self._held = 0  # chunk-budget bytes taken for this response
        self._stream: ChunkStream | None = None

    async def receive(self) -> None:
        sink = self.sink
        if sink.spans:
            start = sink.start_of(self.run[0])
            stop = sink.spans[self.run[-1]].stop
        else:  # the manifest: its size is what the response says
            start, stop = 0, MANIFEST_MAX_BYTES
        # A one-chunk sink asks from its byte to the end (no range: any server answers it).
        length = None if sink.whole else stop - start
        self._held = min(stop - start, STREAM_HOLD_BYTES, self.fetch._memory.cap)
        await self.fetch._memory.reserve(self._held)
        stream = await self.fetch._run_request(self.source, start, length)
        send, recv = trio.open_memory_channel[list[memoryview]](WRITE_QUEUE)
        wrote_failure: list[SkippyError | OSError] = []
        read_failure: SkippyError | ProtocolError | MeshError | None = None
        batch = _Batch()
        try:
            async with stream, trio.open_nursery() as nursery:
                nursery.start_soon(self._write, recv, wrote_failure)
                async with send:
                    try:
                        await self._read(stream, ResponseReader(start, length), send, batch, start)
                    except trio.BrokenResourceError:  # the writer stopped: its error says why
                        pass
                    except (SkippyError, ProtocolError, MeshError) as exc:
                        read_failure = exc
            # Every batch handed to the writer is written (or its failure kept).
            if wrote_failure:
                raise wrote_failure[0]
            if read_failure is not None:
                # What came before the failure is kept for the resume (if it is wrong, its
                # chunk's check says so when the rest arrives).
                if batch.size and self._stream is not None and sink.state == "receiving":
                    with contextlib.suppress(SkippyError, OSError):
                        await self._write_batch(batch.take())
                raise read_failure
        finally:
            if self._stream is not None:
                self._stream.close()

    async def _read(
        self,
        stream: MeshStream,
        reader: ResponseReader,
        send: trio.MemorySendChannel[list[memoryview]],
        batch: _Batch,
        start: int,
    ) -> None:
        """As ``SwarmFetch._read_chunk``: one deadline, pushed on only while the source keeps
        ``min_transfer_bytes_per_s``; time spent waiting for the writer is ours, not the
        source's, and is added back."""
        idle = self.fetch.node.timeouts.idle_s
        guard = RateDeadline(idle, self.fetch.node.settings.security.min_transfer_bytes_per_s)
        with guard.scope:
            ended = False
            while not ended:
                views = await stream.receive_views()
                guard.received(views)
                if not views:
                    reader.eof()
                for view in views:
                    for event in reader.feed(view):
                        if isinstance(event, ResponseHeader):
                            self.sink.accept(event.response)  # a refusal, another size or digest
                            self.fetch.rec.total = event.response.total_size
                            self._stream = await trio.to_thread.run_sync(self.sink.stream, start)
                        elif isinstance(event, BodyData):
                            batch.add(event.data)  # a view of immutable bytes: no copy
                ended = reader.done
                if batch.size >= WRITE_BATCH_BYTES or (ended and batch.size):
                    began = trio.current_time()
                    await send.send(batch.take())
                    guard.scope.deadline += trio.current_time() - began
                if all(i in self.sched.done for i in self.left):
                    return  # end-game copies verified the rest: stop this stream
            return
        _deadline_passed(stream, guard, self.source)

    async def _write(
        self,
        batches: trio.MemoryReceiveChannel[list[memoryview]],
        failure: list[SkippyError | OSError],
    ) -> None:
        async with batches:
            async for parts in batches:
                try:
                    await self._write_batch(parts)
                except (SkippyError, OSError) as exc:
                    failure.append(exc)  # closing ``batches`` tells the reader to stop
                    return

    async def _write_batch(self, parts: list[memoryview]) -> None:
        fetch, stream, sink = self.fetch, self._stream, self.sink
        if stream is None:
            raise ArtifactWireError("body bytes before the header", code="artifact_wire_malformed")
        try:
            await trio.to_thread.run_sync(stream.write, parts)
        finally:  # also the chunks verified before one that failed
            done, stream.verified = stream.verified, []
            fetch._received(self.source, sink, stream.credit)
            stream.credit = 0
            # A chunk another copy verified meanwhile is done for this run too.
            done += [i for i in self.left if i in sink.verified and i not in done]
            now = trio.current_time()
            for index in done:
                if index in self.left:
                    self.left.remove(index)
                fetch._verified(self.source, sink, self.sched, index, False)
                for nxt in self.left[:1]:
                    self.sched.touch(nxt, now)
            if done:
                fetch._wake()

    def give_back(self) -> None:
        """The chunks this run did not verify back in line, its memory back to the budget
        (idempotent)."""
        for index in self.left:
            self.sched.failed(index)
        self.left = []
        if self._held:
            self.fetch._memory.release(self._held)
            self._held = 0


class _Batch:
    """Received body pieces (views of the stream's bytes) waiting to be written."""

    def __init__(self) -> None:
        self.parts: list[memoryview] = []
        self.size = 0

    def add(self, view: memoryview) -> None:
        self.parts.append(view)
        self.size += len(view)

    def take(self) -> list[memoryview]:
        parts, self.parts, self.size = self.parts, [], 0
        return parts


class TransferTooSlow(MeshError):
    """A peer sent bytes, but slower than ``min_transfer_bytes_per_s``: take the hub."""

    code = "transfer_too_slow"


def refusal_answer(text: object) -> str:
    """A peer's refusal as this node records it: one of the sentences a server says, else
    ``other`` (the text is the peer's: it must not grow the counters or reach the page)."""
    return text if text in _KNOWN_ANSWERS and isinstance(text, str) else "other"


def alone(
    topology: SplitTopology, stage: StageAssignment, node_id: str, item: FetchItem, holder: str
) -> SourceBook:
    """A list of one holder for a file no signed list names (the manifest, or a file the
    coordinator lists no digests for): the file is one chunk, checked against the manifest's
    SHA-256 (``ChunkSink`` without digests), asked of ``holder`` alone."""
    entry = ArtifactSources(
        item.path, item.sha256, item.size or 0, (bytes.fromhex(item.sha256),), (holder,)
    )
    latest = SourceList(
        topology.topology_id,
        topology.run_id,
        topology.manifest_sha256,
        stage.stage_id,
        node_id,
        CHUNK_BYTES,
        (entry,),
    )
    return SourceBook(None, latest)
