"""Serving across sibling replicas of one coordinator (kind 0x05, ``sibling-serve``).

The shell of ``skippy.transfer.siblings``, its pure core.

A holder (a worker of replica 0) gets a chunk request naming replica 1's topology, which it
never accepted. It asks *its own* coordinator for that topology (``SiblingBook.lookup``, one
question per topology id: answers cached for ``SIBLING_TTL_S``, a refusal for ``MISS_TTL_S``,
a question that got no answer, the link or the stream having failed, for ``RETRY_TTL_S``);
the coordinator answers only a node holding a stage in one of its active topologies, and
only with one of its *current* topologies that is a sibling of the asker's
(``SiblingTopologyHandler``). The holder checks the signature against its coordinator's node
id and the sibling rules (``skippy.transfer.siblings.sibling_refusal``: same package and
revision), then authorizes the request against that topology exactly as against its own
(``ArtifactHandler``). Nothing is
gossiped: a node learns a sibling topology only when one of its members asks it for a file.

Wire: the question is the requester's ``ArtifactRequest`` as the holder received it (the
same framing as kind 0x03/0x04); the answer is an accepted response whose body is the
``TopologyOffer`` encoding (the topology and the coordinator's signature), or a refusal.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import trio

from mesh_node.errors import MeshError
from mesh_node.identity import short_id
from mesh_node.peers import AuthenticatedPeer, InboundStream
from mesh_node.request_gate import RequestGate, RequestSlots
from mesh_node.topology import ActiveTopology, TopologyService, topology_signature_valid
from mesh_node.transfer.requests import read_request
from protocol import constants as pc
from protocol.errors import ProtocolError
from protocol.messages import TopologyOffer, decode_control_message
from skippy.errors import SkippyError
from skippy.package.topology import SplitTopology
from skippy.transfer.errors import ArtifactWireError
from skippy.transfer.siblings import names_own_revision, sibling_refusal, vouch
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

log = logging.getLogger("mesh_node.transfer.siblings")

SIBLING_TTL_S: Final = 30.0  # a learned sibling topology is asked for again after this
MISS_TTL_S: Final = 5.0  # a topology id the coordinator would not vouch for, remembered
# A question that got no answer (the link to the coordinator or the stream failed, or it
# timed out) says nothing about the topology: asked again this soon. When it was remembered
# for MISS_TTL_S, one lost answer made this holder refuse a sibling replica's chunk requests
# for 5 s (seen at a 7-node bring-up: 19 refusals in 1.5 s).
RETRY_TTL_S: Final = 0.5
MAX_SIBLINGS: Final = 16  # topologies remembered per node (hits and misses)
MAX_OFFER_BYTES: Final = 1024 * 1024
SIBLING_BITS: Final = frozenset(
    {pc.BIT_ARTIFACT_TRANSFER, pc.BIT_SWARM_TRANSFER, pc.BIT_SIBLING_SERVE}
)


def speaks_siblings(node: MeshNode, node_id: str) -> bool:
    """This node and the linked ``node_id`` both serve across sibling replicas."""
    return node.settings.swarm_transfer and node.speaks(node_id, SIBLING_BITS)


def coordinated(node: MeshNode) -> list[ActiveTopology]:
    """Every topology this node coordinates now: its own and its replicas'."""
    service = node.service(TopologyService)
    out = [a for a in [service.active, *(s.active for s in service.siblings)] if a is not None]
    return [a for a in out if a.role == "coordinator"]


def sibling_topologies(node: MeshNode, own: SplitTopology) -> list[ActiveTopology]:
    """The coordinator's current topologies that are siblings of ``own``."""
    return [a for a in coordinated(node) if sibling_refusal(own, a.topology) is None]


# --- the coordinator ------------------------------------------------------------------------
class SiblingTopologyHandler:
    """The kind 0x05 handler (``ArtifactService.streams``): one answer per stream."""

    def __init__(self, node: MeshNode, gate: RequestGate | None = None) -> None:
        self.node = node
        self.gate = gate if gate is not None else RequestGate()
        # As many answers at once as artifact requests served (kind 0x03's bounds).
        self.slots = RequestSlots()

    async def __call__(self, inbound: InboundStream) -> None:
        stream = inbound.stream
        try:
            request = await read_request(stream, RequestReader(), self.node.timeouts.handshake_s)
        except (ArtifactWireError, trio.TooSlowError) as exc:
            self.gate.refused(inbound.peer, pc.KIND_SIBLING_TOPOLOGY, "malformed")
            stream.reset("malformed", f"no valid sibling request: {type(exc).__name__}")
            return
        async with self.slots.slot(inbound.peer.node_id, self.node.timeouts.idle_s) as held:
            if held:
                body = self.answer(inbound.peer, request)
            else:
                self.gate.refused(inbound.peer, pc.KIND_SIBLING_TOPOLOGY, "server_busy")
                body = None
        with trio.move_on_after(self.node.timeouts.idle_s):
            if body is None:
                await stream.send_all(encode_response(ArtifactResponse.refusal("unavailable")))
            else:
                digest = hashlib.sha256(body).hexdigest()
                await stream.send_all(
                    encode_response(ArtifactResponse.accept(len(body), digest)) + body
                )
            await stream.send_eof()

    def answer(self, asker: AuthenticatedPeer, request: ArtifactRequest) -> bytes | None:
        """The signed sibling topology ``request`` names, for ``asker`` (``vouch``)."""
        asker_id = asker.node_id
        topologies = coordinated(self.node)
        wanted, why = vouch(
            [a.topology for a in topologies],
            asker_id,
            request.topology_id,
            request.requester_hex,
            request.stage_id,
        )
        signed = next((a for a in topologies if a.topology is wanted), None)
        if signed is None:  # logged summed per interval (``RequestGate``)
            self.gate.refused(asker, pc.KIND_SIBLING_TOPOLOGY, "no_sibling_topology", why)
            return None
        return TopologyOffer(signed.topology.to_dict(), signed.signature).encode()


# --- the holder ---------------------------------------------------------------------------
def unanswered(exc: BaseException) -> bool:
    """A failed sibling question that got no answer at all: the link or the stream failed
    (``MeshError``: reset, closed, peer gone), it timed out, or the answer was cut short. A
    refusal, a malformed answer or a bad signature is an answer (remembered longer)."""
    if isinstance(exc, ArtifactWireError):
        return exc.code == "artifact_wire_truncated"
    return isinstance(exc, (MeshError, trio.TooSlowError))


@dataclass
class _Entry:
    topology: SplitTopology | None  # None: the coordinator would not vouch for it
    expires_at: float
    done: trio.Event


class SiblingBook:
    """A holder's sibling topologies, learned from its coordinator on demand (bounded)."""

    def __init__(self, node: MeshNode) -> None:
        self.node = node
        self._entries: dict[str, _Entry] = {}

    async def lookup(self, own: ActiveTopology, request: ArtifactRequest) -> SplitTopology | None:
        """The sibling topology ``request`` names, checked, or ``None`` (not a sibling, or
        the coordinator or this node does not serve siblings)."""
        if own.role != "worker" or not speaks_siblings(self.node, own.coordinator_id):
            return None
        if not names_own_revision(own.topology, request.package_ref, request.manifest_sha256):
            return None  # never a sibling: nothing to ask
        key = request.topology_id
        now = trio.current_time()
        entry = self._entries.get(key)
        if entry is not None and (not entry.done.is_set() or entry.expires_at > now):
            await entry.done.wait()
            return self._usable(own, entry.topology)
        entry = _Entry(None, now + MISS_TTL_S, trio.Event())
        self._remember(key, entry)
        try:
            found, lost = await self._ask(own, request)
            if found is not None:
                entry.topology, entry.expires_at = found, trio.current_time() + SIBLING_TTL_S
            elif lost:
                entry.expires_at = trio.current_time() + RETRY_TTL_S
        finally:
            entry.done.set()
        return self._usable(own, entry.topology)

    def _usable(self, own: ActiveTopology, topology: SplitTopology | None) -> SplitTopology | None:
        # Checked again at each use: this node's own topology may have changed since.
        if topology is None or sibling_refusal(own.topology, topology) is not None:
            return None
        return topology

    def _remember(self, key: str, entry: _Entry) -> None:
        self._entries[key] = entry
        if len(self._entries) > MAX_SIBLINGS:
            done = [k for k, e in self._entries.items() if e.done.is_set() and k != key]
            for old in sorted(done, key=lambda k: self._entries[k].expires_at)[
                : len(self._entries) - MAX_SIBLINGS
            ]:
                del self._entries[old]

    async def _ask(
        self, own: ActiveTopology, request: ArtifactRequest
    ) -> tuple[SplitTopology | None, bool]:
        """(the checked sibling topology or None, whether the question went unanswered)."""
        coordinator = own.coordinator_id
        try:
            body = await self._fetch(coordinator, request)
            if body is None:
                return None, False
            offer = decode_control_message(body, self.node.limits)
            if not isinstance(offer, TopologyOffer):
                raise ArtifactWireError("not a topology", code="sibling_malformed")
            topology = SplitTopology.from_dict(offer.topology)
        except (SkippyError, MeshError, ProtocolError, trio.TooSlowError) as exc:
            log.info("no sibling topology from %s: %s", short_id(coordinator), exc)
            return None, unanswered(exc)
        if not topology_signature_valid(topology, coordinator, offer.signature):
            log.warning("a sibling topology from %s does not verify", short_id(coordinator))
            return None, False
        refusal = sibling_refusal(own.topology, topology)
        if refusal is not None or topology.topology_id != request.topology_id:
            log.warning("%s sent no sibling topology: %s", short_id(coordinator), refusal)
            return None, False
        log.info(
            "learned sibling topology %s from %s", topology.topology_id, short_id(coordinator)
        )
        return topology, False

    async def _fetch(self, coordinator: str, request: ArtifactRequest) -> bytes | None:
        timeouts = self.node.timeouts
        body = bytearray()
        header: ArtifactResponse | None = None
        with trio.fail_after(timeouts.handshake_s + timeouts.idle_s):
            stream = await self.node.open_stream(coordinator, pc.KIND_SIBLING_TOPOLOGY)
            async with stream:
                await stream.send_all(encode_request(request))
                await stream.send_eof()
                reader = ResponseReader(0)
                while not reader.done:
                    data = await stream.receive_some()
                    if not data:
                        reader.eof()
                    for event in reader.feed(data):
                        if isinstance(event, ResponseHeader):
                            header = event.response
                            if header.accepted and header.total_size > MAX_OFFER_BYTES:
                                raise ArtifactWireError(
                                    "the sibling topology is too large", code="sibling_malformed"
                                )
                        elif isinstance(event, BodyData):
                            body += event.data
        if header is None or not header.accepted:
            return None
        return bytes(body)

