"""The serving side: the ``skippy-stage/2`` kind 0x03 stream handler.

The shell of ``skippy.transfer.serve``, its core.

Per stream: read one request frame (``RequestReader``, bounded, within the handshake
timeout), take a serving slot (per link and per node, ``RequestSlots``), let
``ArtifactServer.serve`` decide and open the file on a worker thread, send the response
header, then the body in bounded chunks (``pread`` on a thread), each send bounded by the
write-idle timeout and, when configured, paced by the node's upload rate. The peer hears one
generic sentence for every refusal; the counters get the precise reason, and so does the log,
summed per interval (``RequestGate``: refusals beyond a per-peer budget are refused at the
open, before this handler runs).

Memory per request is bounded by what is in flight: one chunk read, and what the stream's flow
control lets queue (the peer's credit, <= its 4 MiB window). ``PER_LINK`` and ``PER_NODE`` bound
how many requests are served at once; a request that cannot get a slot within the idle timeout
is refused as busy (the requester may retry), so waiting requests hold nothing but a task, and
a link holds at most ``Limits.max_streams_per_link`` of those.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

import trio

from mesh_node.errors import MeshError, StreamReset, StreamStalled
from mesh_node.link import CLOSED_EARLY, MeshStream
from mesh_node.peers import AuthenticatedPeer, InboundStream
from mesh_node.request_gate import PER_LINK, PER_NODE, RequestGate, RequestSlots
from mesh_node.topology import TopologyService
from mesh_node.transfer.policy import node_policy, peer_facts
from mesh_node.transfer.records import TransferLog
from mesh_node.transfer.requests import read_request
from mesh_node.transfer.siblings import SiblingBook, coordinated
from protocol import constants as pc
from skippy.errors import SkippyError
from skippy.package.topology import SplitTopology
from skippy.transfer.authorize import PEER_UNAVAILABLE
from skippy.transfer.errors import ArtifactWireError
from skippy.transfer.policy import NodePolicy, peer_refusal
from skippy.transfer.serve import ArtifactServer, ServeOutcome, refuse_malformed
from skippy.transfer.wire import ArtifactRequest, ArtifactResponse, RequestReader, encode_response

if TYPE_CHECKING:
    from mesh_node.node import MeshNode

log = logging.getLogger("mesh_node.transfer.serve")

CHUNK_BYTES: Final = 4 * 1024 * 1024  # one pread (thread) and one send per 4 MiB
MIN_PACED_CHUNK_BYTES: Final = 64 * 1024  # the smallest read under an upload rate limit
# Said to a requester that got no slot in time: not an authorization answer, it may retry.
PEER_BUSY: Final = "artifact server busy"


class RateLimit:
    """Paces bytes to ``bytes_per_s`` over every request of the node (0: no limit)."""

    def __init__(self, bytes_per_s: int) -> None:
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0  # trio clock: when the link is ours again

    def chunk_bytes(self, most: int) -> int:
        """The read size: ``most``, or under a limit at most 1/8 s of it (smooth pacing
        rather than a 4 MiB burst and a long pause)."""
        if self.bytes_per_s <= 0:
            return most
        return max(MIN_PACED_CHUNK_BYTES, min(most, self.bytes_per_s // 8))

    async def take(self, n: int) -> None:
        if self.bytes_per_s <= 0:
            return
        now = trio.current_time()
        start = max(self._free_at, now)
        self._free_at = start + n / self.bytes_per_s
        await trio.sleep_until(start)


class ArtifactHandler:
    """The kind 0x03 handler (``ArtifactService.streams``): one call per stream."""

    def __init__(
        self,
        node: MeshNode,
        server: ArtifactServer,
        records: TransferLog,
        *,
        gate: RequestGate | None = None,
        per_link: int = PER_LINK,
        per_node: int = PER_NODE,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.node = node
        self.server = server
        self.records = records
        self.gate = gate if gate is not None else RequestGate()
        self.slots = RequestSlots(per_link, per_node)
        self.chunk_bytes = chunk_bytes
        self.rate = RateLimit(node.settings.artifact_serve_bytes_per_s)
        self._warm: dict[str, trio.Event] = {}
        self.siblings = SiblingBook(node)

    # --- warming ----------------------------------------------------------------------------
    async def warm(self, topology: SplitTopology) -> None:
        """Verify the topology's package once (single flight) so requests are answered from
        the verification cache. A problem is logged; requests then refuse what is wrong."""
        tid = topology.topology_id
        done = self._warm.get(tid)
        if done is not None:
            await done.wait()
            return
        done = self._warm[tid] = trio.Event()
        # Forget other topologies, but not the replicas this node coordinates:
        # their requests alternate, and each forgotten warm-up held them back again.
        current = {a.topology.topology_id for a in coordinated(self.node)}
        for old in [k for k in self._warm if k != tid and k not in current]:
            self._warm.pop(old).set()
        try:
            report = await trio.to_thread.run_sync(self.server.warm, topology)
            log.info(
                "topology %s: package verified for serving (%d hashed, %d cached)",
                tid,
                report.hashed,
                report.cached,
            )
        except SkippyError as exc:
            log.warning("topology %s: cannot verify the package for serving: %s", tid, exc)
        finally:
            done.set()

    # --- one stream ---------------------------------------------------------------------------
    async def __call__(self, inbound: InboundStream) -> None:
        stream, peer = inbound.stream, inbound.peer
        policy = node_policy(self.node.settings, self.node.identity, self.node.wall_clock())
        request = await self._read_request(stream, policy)
        if request is None:
            return
        if isinstance(request, ServeOutcome):  # malformed: answered with the broken rule
            await self._refuse(stream, request, peer)
            return
        async with self.slots.slot(peer.node_id, self.node.timeouts.idle_s) as held:
            if not held:
                await self._busy(stream, peer, request)
                return
            await self._serve(stream, inbound, policy, request)

    async def _read_request(
        self, stream: MeshStream, policy: NodePolicy
    ) -> ArtifactRequest | ServeOutcome | None:
        try:
            return await read_request(stream, RequestReader(), self.node.timeouts.handshake_s)
        except ArtifactWireError as exc:
            return refuse_malformed(policy, exc)
        except trio.TooSlowError:
            stream.reset("timeout", "no complete request within the handshake timeout")
            return None

    async def _busy(
        self, stream: MeshStream, peer: AuthenticatedPeer, request: ArtifactRequest
    ) -> None:
        # Said once per interval, with the rest summed (``RequestGate``), not once a request.
        self.gate.refused(peer, pc.KIND_ARTIFACT_TRANSFER, "server_busy", request.relative_path)
        self.records.counters.refusals["server_busy"] += 1
        await self._send_header(stream, encode_response(ArtifactResponse.refusal(PEER_BUSY)))

    async def _refuse(
        self, stream: MeshStream, outcome: ServeOutcome, peer: AuthenticatedPeer
    ) -> None:
        d = outcome.decision
        # Precise in the log, generic to the peer (skippy.transfer.authorize).
        self.gate.refused(
            peer, pc.KIND_ARTIFACT_TRANSFER, d.reason, f"{d.detail} {d.to_log()}".strip()
        )
        self.records.counters.refusals[d.reason] += 1
        await self._send_header(stream, outcome.header)

    async def _send_header(self, stream: MeshStream, header: bytes) -> None:
        with trio.move_on_after(self.node.timeouts.idle_s):
            await stream.send_all(header)
            await stream.send_eof()

    async def _serve(
        self,
        stream: MeshStream,
        inbound: InboundStream,
        policy: NodePolicy,
        request: ArtifactRequest,
    ) -> None:
        active = self.node.service(TopologyService).active_for(inbound.peer.node_id)
        topology = active.topology if active is not None else None
        if (
            active is not None
            and request.topology_id != active.topology.topology_id
            and peer_refusal(policy, peer_facts(inbound.peer)) is None  # else refused anyway
        ):
            # A sibling replica's node, under that replica's topology as this
            # node's coordinator signed it (``mesh_node.transfer.siblings``); else refused
            # against this node's own topology, as before.
            sibling = await self.siblings.lookup(active, request)
            if sibling is not None:
                topology = sibling
        if active is not None and active.role == "coordinator" and policy.mode != "disabled":
            await self.warm(active.topology)
        outcome = await trio.to_thread.run_sync(
            self.server.serve, policy, peer_facts(inbound.peer), topology, request
        )
        body = outcome.body
        if body is None:
            await self._refuse(stream, outcome, inbound.peer)
            return
        peer_id = inbound.peer.node_id
        counters = self.records.counters
        rec = self.records.start(
            "serve",
            request.relative_path,
            total=outcome.response.total_size,
            peer_id=peer_id,
            offset=request.offset,
        )
        counters.served_requests += 1
        counters.serving_now += 1
        counters.serving_peak = max(counters.serving_peak, counters.serving_now)
        log.info("serving %s from byte %d to %s", request.relative_path, request.offset, peer_id)
        idle = self.node.timeouts.idle_s
        error: str | None = "cancelled"
        sent_all = False
        try:
            await self._send_within(stream, outcome.header, idle)
            chunk_bytes = self.rate.chunk_bytes(self.chunk_bytes)
            while True:
                chunk = await trio.to_thread.run_sync(body.read, chunk_bytes)
                if not chunk:
                    break
                await self.rate.take(len(chunk))
                await self._send_within(stream, chunk, idle)
                rec.bytes_done += len(chunk)
                counters.served_bytes += len(chunk)
            sent_all = True
            await stream.send_eof()
            with trio.move_on_after(idle):
                await stream.receive_some()  # the requester's end of stream (or its reset)
            error = None
        except StreamReset as exc:
            # A requester closes its stream once it holds the whole body (its reader counts
            # the bytes); a close that overtakes our end of stream (our last, empty read is
            # on a thread) resets it. Every byte was sent: that is a served artifact.
            error = None if sent_all and exc.actual == CLOSED_EARLY else exc.code
            log.info("serving %s to %s ended: %s", request.relative_path, peer_id[:12], exc)
        except SkippyError as exc:  # our file went wrong under us: the peer keeps its partial
            error = exc.code
            if not isinstance(exc, MeshError):
                log.warning("serving %s failed: %s", request.relative_path, exc)
                stream.reset("artifact_unavailable", PEER_UNAVAILABLE)
            else:
                log.info("serving %s to %s ended: %s", request.relative_path, peer_id[:12], exc)
        finally:
            body.close()
            counters.serving_now -= 1
            self.records.finish(rec, verified=error is None, error=error)

    async def _send_within(self, stream: MeshStream, data: bytes, idle_s: float) -> None:
        """One send that must make progress within the write-idle timeout."""
        with trio.move_on_after(idle_s) as scope:
            await stream.send_all(data)
        if scope.cancelled_caught:
            stream.reset("stalled", "the requester read nothing within the idle timeout")
            raise StreamStalled("the requester read nothing within the idle timeout")
