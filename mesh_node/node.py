"""The mesh node's core: listener and dialers, membership, gossip, heartbeats (in each link),
the subprotocol registry, events and the status document. Configuration arrives as a
``mesh_node.settings.NodeSettings``; every protocol decision is made in ``protocol/``.

It knows no application: services (split topology, artifact transfer, the stage host,
serving) declare their stream kinds, feature bits, status sections and metrics through
``mesh_node.node_service.NodeService`` and are added by the composition root
(``mesh_node.composition``). See docs/architecture.md, "Adding a service".

API for services: ``add_service(service)``, ``service(Type)``, ``register_subprotocol(kind,
handler)``, ``open_stream(node_id, kind)``, ``peers()``, ``peer(node_id)``, ``subscribe()``.
"""

from __future__ import annotations

import errno
import logging
import math
import random
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio
from prometheus_client.registry import Collector

from mesh_node.budget import PeerMemory
from mesh_node.budgeted_tcp import budgeted_listeners
from mesh_node.cipher_support import local_ciphers
from mesh_node.errors import MeshError, PeerUnavailable
from mesh_node.hostid import host_fingerprint
from mesh_node.identity import LocalIdentity, owner_of, short_id, trust_decision
from mesh_node.link import (
    Link,
    LinkTimeouts,
    MeshStream,
    StreamDecision,
    secure_handshake,
    websocket_settings,
)
from mesh_node.memory_release import MemoryReleaser
from mesh_node.node_service import NodeService, merge_features
from mesh_node.peers import (
    AuthenticatedPeer,
    InboundStream,
    NodeEvent,
    PeerDown,
    PeerInfo,
    PeerUp,
    StreamAdmission,
    SubprotocolHandler,
    status_document,
)
from mesh_node.request_gate import TokenBucket
from mesh_node.settings import (
    DialAddress,
    HostPort,
    NodeSettings,
    PeerAddress,
    RelayedAddress,
    parse_peer_address,
)
from mesh_node.websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocket,
    WebSocketRequest,
    connect,
    serve_websockets,
)
from protocol import constants as pc
from protocol.certificates import OwnerCertificate
from protocol.errors import ProtocolError
from protocol.frames import SubprotocolOpen
from protocol.handshake import Handshake, PeerIdentity, SecureChannel
from protocol.link_cipher import (
    LinkCipher,
    cipher_for_selected,
    offered_subprotocols,
    select_subprotocol,
)
from protocol.messages import (
    ComputeCost,
    Devices,
    Hello,
    PeerRecord,
    Peers,
    decode_link_message,
)
from skippy.errors import UsageError

log = logging.getLogger("mesh_node.node")
MAX_PENDING_HANDSHAKES = 32  # inbound connections that have not authenticated yet
MAX_LEARNED_DIALS = 3  # attempts at a gossip-learned address before it is forgotten
MAX_DIAL_LOOPS = 64  # concurrent dial loops (configured peers always get one)
MAX_MEMBERS = 1024  # membership entries; the longest-silent disconnected one goes first
EVENT_QUEUE = 256  # per subscriber; an overflowing subscriber is closed (it can resubscribe)
# Link ends that may be a network's doing, not the peer's: the connection broke, or
# its writes stalled. Any other end (silence past peer_loss_timeout_s, a goodbye, a protocol
# fault, shutdown) is a peer loss at once.
BROKEN_CONNECTION_REASONS = frozenset({"connection_closed", "peer_not_reading"})
# Admission (docs/security.md "Admission"): a connection claims a handshake
# slot before its WebSocket upgrade is accepted, waiting at most QUEUE_WAIT_S for one.
MAX_PENDING_PER_ADDRESS = 8  # handshakes pending (queued or running) from one source address
NEW_LINKS_PER_S_PER_ADDRESS = 10.0  # sustained new connections per source address ...
NEW_LINKS_BURST_PER_ADDRESS = 20.0  # ... after a burst of this many
MAX_TRACKED_ADDRESSES = 4096  # rate-limit entries; the stalest is forgotten first
CLOSE_LINKS_SLACK_S = 0.25  # close_links waits up to disconnect_s plus this for its links
QUEUE_WAIT_S = 2.0  # the longest a connection waits for a handshake slot (then 503)
# After a link that held this much of the peer budget closes, free heap goes back to the OS.
TRIM_AFTER_BYTES = 1024 * 1024
S = TypeVar("S")
# Dials a relayed address (a circuit through its relay, then the link over it): the relay
# service's, when the node runs one.
CircuitDialer = Callable[[RelayedAddress], Awaitable[None]]


def relay_addresses(advertised: tuple[str, ...]) -> tuple[PeerAddress, ...]:
    """The relays a hello or gossip names that can be used (with their ids); the rest are
    ignored, as any address we cannot dial is (pure)."""
    out = []
    for text in advertised:
        try:
            address = parse_peer_address(text, "relays")
        except UsageError:
            continue
        if address.node_id is not None:
            out.append(address)
    return tuple(out)


def dial_plan(node_id: str, address: str, relays: tuple[PeerAddress, ...]) -> list[DialAddress]:
    """How to reach a node gossip told us of (pure): through each relay it names (it says it
    cannot be dialled; a dial loop per relay, so a lost relay leaves the others), else at its
    listen address. The seam for a direct upgrade (hole punching): a plan that tries the
    observed address first goes here."""
    if relays:
        return [RelayedAddress(relay, node_id) for relay in relays]
    try:
        return [parse_peer_address(f"{address}#{node_id}")]
    except UsageError:
        return []  # an address we cannot dial is simply not used


@dataclass
class _Member:
    peer: AuthenticatedPeer
    link: Link | None = None
    address: str | None = None
    features: dict[str, tuple[str, ...]] = field(default_factory=dict)
    memory_budget_bytes: int = 0
    hello: bool = False  # ever advertised (a member is listed only after its hello)
    host_id: str | None = None  # its machine's fingerprint, from its hello
    boot: str | None = None  # its process's random id, from its hello: new at every restart
    compute: ComputeCost | None = None  # its calibrated speed, from its hello
    devices: Devices | None = None  # its ggml devices and their memory, from its hello
    down_reported: bool = False  # a PeerDown was emitted since its last PeerUp
    hello_link: Link | None = None  # the link its latest hello came on
    last_seen: float = 0.0  # trio clock
    bytes_received: int = 0  # over this member's closed links (a live link adds its own)
    bytes_sent: int = 0
    disconnected: trio.Event = field(default_factory=trio.Event)
    certificate: OwnerCertificate | None = None  # what its link's handshake presented
    trust_until: float = math.inf  # wall clock: when ``peer`` must be evaluated again
    relays: tuple[PeerAddress, ...] = ()  # relays its hello says it is reachable through


def listen_error(listen: HostPort, exc: OSError) -> UsageError:
    """A ``listen`` address that cannot be bound, as one clear error (no traceback)."""
    where = f"{listen.host}:{listen.port}"
    if isinstance(exc, socket.gaierror):
        return UsageError(
            f"listen address {where}: the host does not resolve ({exc.strerror or exc})",
            code="listen_unresolvable",
            actual=where,
            remediation="set listen to an IP address or a resolvable name, e.g. 127.0.0.1:7000",
        )
    if exc.errno == errno.EADDRINUSE:
        return UsageError(
            f"listen address {where} is already in use",
            code="listen_in_use",
            actual=where,
            remediation="stop the other process or pick another port (0 = any free port)",
        )
    return UsageError(
        f"cannot listen on {where}: {exc.strerror or exc}",
        code="listen_bind_failed",
        actual=where,
        remediation="listen on an address of this machine (127.0.0.1, ::1, 0.0.0.0)",
    )


def dial_backoff_cap_s(heartbeat_interval_s: float) -> float:
    """The longest wait between two dials of one address: a node that comes back is linked
    again within a couple of heartbeats, and a dead address costs little."""
    return max(1.0, 2 * heartbeat_interval_s)


def jittered(delay_s: float) -> float:
    """``delay_s`` scaled by a random factor in [0.5, 1.0) (equal jitter)."""
    return delay_s * (0.5 + random.random() / 2)


def dial_failure(exc: BaseException) -> str:
    """Why a dial failed, in words (trio's errors often have an empty ``str``)."""
    if isinstance(exc, ConnectionRejected):
        return f"the peer rejected the WebSocket upgrade (HTTP {exc.status_code})"
    if isinstance(exc, ConnectionClosed):
        reason = exc.reason
        code = getattr(reason, "code", None)
        why = getattr(reason, "reason", None)
        return f"the connection closed during the handshake (code {code}: {why or '-'})"
    if isinstance(exc, trio.TooSlowError):
        return "no answer within handshake_timeout_s"
    if isinstance(exc, ProtocolError):
        return f"handshake refused [{exc.code}]: {exc.message}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({type(exc).__name__})"
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup) and cause.exceptions:
        cause = cause.exceptions[0]  # trio: "all attempts to connect ... failed" from a group
    if isinstance(exc, OSError) and isinstance(cause, OSError):
        return f"{exc}: {dial_failure(cause)}"
    text = str(exc)
    if text:
        return f"{type(exc).__name__}: {text}"
    inner = exc.__cause__ or exc.__context__  # HandshakeError() wraps the OSError
    return dial_failure(inner) if inner is not None else type(exc).__name__


class MeshNode:
    def __init__(
        self,
        settings: NodeSettings,
        identity: LocalIdentity,
        *,
        limits: pc.Limits | None = None,
        wall_clock: Callable[[], float] = time.time,
        link_ciphers: tuple[LinkCipher, ...] | None = None,
    ) -> None:
        self.settings = settings
        # Noise ciphers this node offers and accepts, best first.
        self.link_ciphers = link_ciphers if link_ciphers is not None else local_ciphers()
        self.identity = identity
        self.node_id = identity.node_id
        self.limits = limits or pc.Limits(
            handshake_timeout_s=settings.handshake_timeout_s,
            idle_timeout_s=settings.idle_timeout_s,
        )
        self.timeouts = LinkTimeouts(
            handshake_s=settings.handshake_timeout_s,
            idle_s=settings.idle_timeout_s,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            peer_loss_s=settings.peer_loss_timeout_s,
            # How long a closing WebSocket waits for the peer's close frame; short, since a
            # shutting-down or vanished peer never answers.
            disconnect_s=min(1.0, settings.handshake_timeout_s / 4),
        )
        self.wall_clock = wall_clock
        self.listen_url: str | None = None
        self.host_id = host_fingerprint()  # advertised: peers on this machine share its cores
        self.boot_id = secrets.token_hex(8)  # advertised: a restart is told from a reconnect
        # Advertised when set: the stage runtime's calibration, measured by the
        # shell that starts the node (mesh_node.calibration), never here.
        self.compute: ComputeCost | None = None
        # Advertised when set: this node's devices (mesh_node.device_adverts), read by the
        # same shell.
        self.devices: Devices | None = None
        self._members: dict[str, _Member] = {}
        self._handlers: dict[tuple[str, int, int], SubprotocolHandler] = {}
        self._admissions: dict[tuple[str, int, int], StreamAdmission] = {}
        self._subscribers: list[trio.MemorySendChannel[NodeEvent]] = []
        self._dialing: set[str] = set()  # addresses with a dial loop
        self._closing = False  # close_links ran: no new links either way
        self._memory_release = MemoryReleaser()
        self._handshake_slots = trio.CapacityLimiter(MAX_PENDING_HANDSHAKES)
        self._pending_by_address: dict[str, int] = {}
        self._admission_rates: dict[str, TokenBucket] = {}  # by source address
        # Memory held for peers, all links together.
        self.peer_memory = PeerMemory(settings.security.peer_memory_budget_bytes)
        self.admission = {
            "rejected_busy": 0,
            "rejected_address": 0,
            "evicted_untrusted": 0,
            "rejected_closing": 0,  # connections refused after close_links (shutdown)
        }
        self._nursery: trio.Nursery | None = None
        self.started = trio.Event()
        self._started_at: float | None = None  # trio clock, when run() began serving
        self._services: list[NodeService] = []  # in the order added (and run)
        self._circuit_dialer: CircuitDialer | None = None

    # --- services ---------------------------------------------------------------------------------
    def add_service(self, service: NodeService) -> None:
        """Add a service before the node runs: its stream kinds are served from now on, its
        bits advertised, its status sections shown, its collectors exposed, and ``run``
        started with the node."""
        if self._nursery is not None:
            raise UsageError("services are added before the node runs", code="node_running")
        streams = list(service.streams())
        keys = [(s.name, s.major, s.kind) for s in streams]
        taken = [k for k in keys if k in self._handlers] + [k for k in keys if keys.count(k) > 1]
        if taken:  # checked first: a refused service leaves nothing registered
            name, major, kind = taken[0]
            raise UsageError(f"a handler for {name}/{major} kind {kind:#x} is already registered")
        for stream in streams:
            self.register_subprotocol(
                stream.kind, stream.handler, name=stream.name, major=stream.major,
                admit=stream.admit,
            )  # fmt: skip
        self._services.append(service)

    def service(self, kind: type[S]) -> S:
        """The added service of type ``kind`` (``UsageError`` if none was added)."""
        for service in self._services:
            if isinstance(service, kind):
                return service
        raise UsageError(f"this node runs no {kind.__name__}", code="no_such_service")

    def set_circuit_dialer(self, dialer: CircuitDialer) -> None:
        """Relayed addresses (``ws://relay#id/relayed/<node id>``) are dialed by ``dialer``
        (the relay service); without one they are not dialed."""
        self._circuit_dialer = dialer

    def keep_linked(self, address: PeerAddress) -> None:
        """Dial ``address`` and keep its link, as a configured peer (a relay this node is
        reachable through)."""
        self._start_dialing(address, persistent=True)

    async def link_over(self, ws: WebSocket, *, expected: str, what: str) -> None:
        """Dial side of a link over an open WebSocket on a relay's circuit: the same Noise
        handshake as over TCP, demanding ``expected``'s identity; serves the link until it
        ends (``what``: the address, for the log). Raises ``ProtocolError`` or
        ``trio.TooSlowError`` when the handshake fails."""
        await self._handshake_and_serve(ws, bytes.fromhex(expected), what)

    async def accept_link(self, request: WebSocketRequest) -> None:
        """Accept side of a link whose upgrade arrived on a relay's circuit: the admission,
        handshake and link of any inbound connection (its source address is the relay)."""
        await self._on_request(request)

    def collectors(self) -> list[Collector]:
        """Every service's metrics collectors (``/metrics``, beside the node's own)."""
        return [c for service in self._services for c in service.collectors()]

    # --- the registration API -----------------------------------------------------------------
    def register_subprotocol(
        self,
        kind: int,
        handler: SubprotocolHandler,
        *,
        name: str = pc.SKIPPY_STAGE,
        major: int = pc.SKIPPY_STAGE_MAJOR,
        admit: StreamAdmission | None = None,
    ) -> None:
        """Serve streams a peer opens with envelope ``{name, major}`` and stream ``kind``.
        Each stream runs ``handler`` in its link's nursery; the stream is closed (or reset, if
        the handler raised) when it returns. One handler per (name, major, kind). ``admit``,
        if given, may refuse an open before any task runs (a budget of refusals)."""
        key = (name, major, kind)
        if key in self._handlers:
            raise UsageError(f"a handler for {name}/{major} kind {kind:#x} is already registered")
        self._handlers[key] = handler
        if admit is not None:
            self._admissions[key] = admit

    async def open_stream(
        self,
        node_id: str,
        kind: int,
        *,
        name: str = pc.SKIPPY_STAGE,
        major: int = pc.SKIPPY_STAGE_MAJOR,
    ) -> MeshStream:
        """Open a ``{name, major}`` stream of ``kind`` to a connected peer; waits for the
        peer's accept. ``PeerUnavailable`` without a link, ``StreamRefused`` (with the peer's
        reason) when it has no such handler or too many streams."""
        member = self._members.get(node_id)
        if member is None or member.link is None:
            raise PeerUnavailable(f"no link to peer {short_id(node_id)}", path=node_id)
        return await member.link.open_stream(SubprotocolOpen(name=name, major=major, kind=kind))

    def peers(self, *, connected_only: bool = False) -> list[PeerInfo]:
        now = trio.current_time()
        return [
            self._info(m, now)
            for m in self._members.values()
            if m.hello and (m.link is not None or not connected_only)
        ]

    def peer(self, node_id: str) -> PeerInfo | None:
        m = self._members.get(node_id)
        return self._info(m, trio.current_time()) if m is not None and m.hello else None

    def speaks(self, node_id: str, bits: frozenset[str]) -> bool:
        """``node_id`` is linked now and its Hello advertised every skippy-stage bit of
        ``bits`` (a wire behaviour both ends must know before it is used)."""
        info = self.peer(node_id)
        return (
            info is not None
            and info.connected
            and info.has_features(pc.FEATURE_SKIPPY_STAGE, bits)
        )

    @asynccontextmanager
    async def subscribe(self) -> AsyncIterator[trio.MemoryReceiveChannel[NodeEvent]]:
        """Node events (``PeerUp``, ``PeerDown``, ``TopologyChanged``) from now on. A
        subscriber that falls ``EVENT_QUEUE`` events behind has its channel closed."""
        send, receive = trio.open_memory_channel[NodeEvent](EVENT_QUEUE)
        self._subscribers.append(send)
        try:
            async with receive:
                yield receive
        finally:
            if send in self._subscribers:
                self._subscribers.remove(send)
            send.close()

    def emit(self, event: NodeEvent) -> None:
        for send in list(self._subscribers):
            try:
                send.send_nowait(event)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.remove(send)
                send.close()

    @property
    def features(self) -> dict[str, tuple[str, ...]]:
        """What the hello advertises: the services' feature bits (``merge_features``)."""
        now = self.wall_clock()
        return merge_features(service.features(now) for service in self._services)

    def authenticated(self, node_id: str) -> AuthenticatedPeer | None:
        """The peer as its link proved it, its trust evaluated *now* (a certificate may have
        expired since the handshake). None without a membership entry."""
        member = self._members.get(node_id)
        if member is None:
            return None
        self._refresh_trust(member)
        return member.peer

    def verified_node_ids(self) -> set[str]:
        """This node and its members, each authenticated by its link's handshake (the sanity
        bound on how many stages a topology may name). Ids heard in gossip are not among
        them: any peer, a stranger too, can list invented ones."""
        return {self.node_id, *self._members}

    def _evaluate(
        self, node_id: str, cert: OwnerCertificate | None
    ) -> tuple[AuthenticatedPeer, float]:
        """The trust decision for a peer now, and until when it holds (wall clock)."""
        now = self.wall_clock()
        own_owner, own_status = self.identity.owner(now)
        owner_id, owner_status = owner_of(cert, bytes.fromhex(node_id), now)
        trusted, reason = trust_decision(
            owner_id,
            owner_status,
            own_owner_id=own_owner,
            own_owner_status=own_status,
            trusted_owners=self.settings.trusted_owners,
        )
        until = math.inf
        for c in (cert, self.identity.certificate):
            if c is None:
                continue
            # The next moment a status can change: a certificate becomes valid, or expires.
            if now < c.not_before:
                until = min(until, c.not_before)
            elif now < c.not_after:
                until = min(until, c.not_after)
        peer = AuthenticatedPeer(node_id, owner_id, owner_status, trusted, reason)
        return peer, until

    def _refresh_trust(self, member: _Member) -> bool:
        """Re-evaluate ``member``'s trust if its validity window ended; True if it changed."""
        if self.wall_clock() < member.trust_until:
            return False
        before = member.peer
        member.peer, member.trust_until = self._evaluate(before.node_id, member.certificate)
        if member.peer.trusted == before.trusted and member.peer.owner_status == (
            before.owner_status
        ):
            return False
        log.warning(
            "peer %s: owner %s, trusted %s (was %s, %s): %s",
            short_id(before.node_id),
            member.peer.owner_status,
            member.peer.trusted,
            before.owner_status,
            before.trusted,
            member.peer.trust_reason,
        )
        if member.link is not None:
            member.link.transport.set_trusted(member.peer.trusted)  # its budget pool
        if before.trusted and not member.peer.trusted and member.link is not None:
            stopped = member.link.reset_inbound("trust_expired", "this peer is no longer trusted")
            if stopped:
                log.warning(
                    "peer %s: stopped %d streams it had open", short_id(before.node_id), stopped
                )
        return True

    async def _watch_trust(self, member: _Member, link: Link) -> None:
        """Until the link ends: re-evaluate trust when a certificate's validity ends."""
        while not link.closed.is_set() and not math.isinf(member.trust_until):
            delay = member.trust_until - self.wall_clock()
            # Wall-clock time may jump: wake at least once a minute to look again.
            with trio.move_on_after(min(max(delay, 0.01), 60.0)):
                await link.closed.wait()
            self._refresh_trust(member)

    def status(self) -> dict[str, Any]:
        owner_id, owner_status = self.identity.owner(self.wall_clock())
        doc = status_document(
            node_id=self.node_id,
            listen=self.listen_url,
            owner_id=owner_id,
            owner_status=owner_status,
            features=self.features,
            memory_budget_bytes=self.settings.memory_budget_bytes,
            artifact_transfer=self.settings.artifact_transfer,
            peers=self.peers(),
            uptime_s=0.0 if self._started_at is None else trio.current_time() - self._started_at,
        )
        doc["security"] = {  # the budgets and admission counters
            "peer_memory": self.peer_memory.to_dict(),
            "admission": dict(self.admission),
        }
        doc["compute"] = None if self.compute is None else self.compute.to_wire()
        doc["devices"] = None if self.devices is None else self.devices.to_wire()
        for service in self._services:
            doc.update(service.status_sections())
        return doc

    # --- running -------------------------------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, run the services, dial the configured peers, and serve until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            listen = self.settings.listen
            try:
                # Every accepted connection's reads are taken from the peer-memory budget
                # from its first byte (mesh_node.budgeted_tcp).
                listeners = await budgeted_listeners(listen.host, listen.port, self.peer_memory)
            except OSError as exc:
                raise listen_error(listen, exc) from None
            for service in self._services:  # ready before the first peer can reach them
                await nursery.start(service.run)
            ws_settings = websocket_settings(self.limits, self.timeouts)
            await nursery.start(serve_websockets, self._on_request, listeners, nursery, ws_settings)
            host = listen.host if ":" not in listen.host else f"[{listen.host}]"
            self.listen_url = f"ws://{host}:{listeners[0].port}"
            for address in self.settings.peers:
                self._start_dialing(address, persistent=True)
            nursery.start_soon(self._memory_release.run)
            self._started_at = trio.current_time()
            self.started.set()
            task_status.started(f"{self.listen_url}#{self.node_id}")

    def dial_learned(self, address: PeerAddress) -> None:
        """Dial an address a service learned (LAN discovery) as gossip's are dialed: bounded
        in number, given up after repeated failures, trusted only once authenticated."""
        self._start_dialing(address, persistent=False)

    def _start_dialing(self, address: DialAddress, *, persistent: bool) -> None:
        key = str(address)
        if key in self._dialing or self._nursery is None:
            return
        if not persistent and len(self._dialing) >= MAX_DIAL_LOOPS:
            return  # gossip cannot make us run unboundedly many dialers
        self._dialing.add(key)
        self._nursery.start_soon(self._dial_loop, address, persistent)

    async def _dial_loop(self, address: DialAddress, persistent: bool) -> None:
        """Dial ``address`` and keep its link: after a loss or a failure, dial again with
        exponential backoff (from 50 ms up to ``dial_backoff_cap_s``) and jitter, so that
        nodes cut off together do not all dial back at the same instant."""
        delay, failures = 0.05, 0
        cap = dial_backoff_cap_s(self.settings.heartbeat_interval_s)
        try:
            while not self._closing:
                member = self._members.get(address.node_id or "")
                if member is not None and member.link is not None:
                    await member.disconnected.wait()  # linked (maybe by its dial): wait for loss
                    delay, failures = 0.05, 0
                    continue
                try:
                    if await self._dial(address):
                        delay, failures = 0.05, 0
                    elif not persistent:
                        return  # ourselves, or a node already linked: nothing to keep
                    # a configured address that is ourselves or a duplicate: backed off below
                except (
                    OSError,
                    HandshakeError,
                    ConnectionRejected,
                    ConnectionClosed,
                    ProtocolError,
                    trio.TooSlowError,
                    trio.BrokenResourceError,
                    MeshError,  # a relay refused the circuit, or its link is gone
                ) as exc:
                    failures += 1
                    log.info("dial %s failed: %s", address, dial_failure(exc))
                    if not persistent and failures >= MAX_LEARNED_DIALS:
                        return
                await trio.sleep(jittered(delay))
                delay = min(delay * 2, cap)
        finally:
            self._dialing.discard(str(address))

    async def close_links(self) -> None:
        """Shutdown, before the node's tasks are cancelled: close every link, each saying
        goodbye and completing its WebSocket close while both ends' readers still run, and
        wait for them (bounded); no link is dialed or accepted afterwards. Cancelling a link
        instead cancels its WebSocket reader too, so its close would wait the whole
        ``disconnect_s`` for a frame nothing reads."""
        self._closing = True
        waits = []
        for member in self._members.values():
            if member.link is not None:
                waits.append(member.disconnected)
                member.link.close("shutdown", "the node is shutting down")
        with trio.move_on_after(self.timeouts.disconnect_s + CLOSE_LINKS_SLACK_S):
            for event in waits:
                await event.wait()

    async def _dial(self, address: DialAddress) -> bool:
        """Dial ``address`` and serve the link until it ends: ``False`` when no link was kept
        (the node there is this one, or one already linked)."""
        if isinstance(address, RelayedAddress):
            if self._circuit_dialer is None:
                raise PeerUnavailable(f"{address}: this node runs no relay service")
            await self._circuit_dialer(address)
            return True
        expected = bytes.fromhex(address.node_id) if address.node_id else None
        offered = offered_subprotocols(self.link_ciphers)
        # `dial_via`: reach this peer through another address (a relay, a tunnel);
        # the handshake still demands the peer's own id.
        via = self.settings.dial_via.get(address.node_id or "")
        target = via if via is not None else address
        async with connect(
            target.host,
            target.port,
            self.peer_memory,
            websocket_settings(self.limits, self.timeouts),
            offered,
        ) as ws:
            return await self._handshake_and_serve(ws, expected, str(address))

    async def _handshake_and_serve(self, ws: WebSocket, expected: bytes | None, what: str) -> bool:
        """The dialer's Noise handshake over ``ws`` (TCP or a circuit), then the link until it
        ends: ``False`` when it was not kept (``_serve_link``)."""
        offered = offered_subprotocols(self.link_ciphers)
        hs = Handshake(
            initiator=True,
            identity=self.identity.key,
            certificate=self.identity.certificate,
            expected_peer=expected,
            limits=self.limits,
            cipher=cipher_for_selected(ws.subprotocol, offered),
        )
        try:
            peer, channel = await secure_handshake(ws, hs, self.timeouts.handshake_s)
        except ProtocolError as exc:
            if exc.code == "identity_mismatch":
                log.warning("dial %s: %s (fails closed)", what, exc.message)
            raise
        return await self._serve_link(ws, peer, channel, initiator=True)

    async def _on_request(self, request: WebSocketRequest) -> None:
        try:
            await self._accept(request)
        except (ConnectionClosed, trio.BrokenResourceError, OSError) as exc:
            log.info("inbound connection aborted: %s", type(exc).__name__)

    def _admit_address(self, address: str) -> bool:
        """Per source address: at most ``MAX_PENDING_PER_ADDRESS`` pending handshakes and
        ``NEW_LINKS_PER_S_PER_ADDRESS`` new connections a second (token bucket)."""
        if self._pending_by_address.get(address, 0) >= MAX_PENDING_PER_ADDRESS:
            return False
        now = trio.current_time()
        bucket = self._admission_rates.pop(address, None) or TokenBucket(
            NEW_LINKS_BURST_PER_ADDRESS, NEW_LINKS_PER_S_PER_ADDRESS
        )
        self._admission_rates[address] = bucket  # re-inserted: most recent last
        while len(self._admission_rates) > MAX_TRACKED_ADDRESSES:
            del self._admission_rates[next(iter(self._admission_rates))]
        if not bucket.has(now):
            return False
        bucket.charge(now)
        return True

    async def _accept(self, request: WebSocketRequest) -> None:
        transport = request.stream  # the connection's budgeted stream
        transport.claim()
        try:
            await self._accept_upgrade(request)
        finally:  # the link (if any) is done: release what is left
            self.peer_memory.close(transport.key)

    async def _accept_upgrade(self, request: WebSocketRequest) -> None:
        address = request.stream.peer_address
        if self._closing:
            self.admission["rejected_closing"] += 1
            await request.reject(503, body=b"the node is shutting down")
            return
        if not self._admit_address(address):
            self.admission["rejected_address"] += 1
            await request.reject(429, body=b"too many connections from this address")
            return
        self._pending_by_address[address] = self._pending_by_address.get(address, 0) + 1
        try:
            # The slot is claimed before the upgrade is accepted, and waited for at most
            # QUEUE_WAIT_S: a burst of silent connections cannot queue without a deadline.
            acquired = False
            with trio.move_on_after(min(QUEUE_WAIT_S, self.timeouts.handshake_s)):
                await self._handshake_slots.acquire()
                acquired = True
            if not acquired:
                self.admission["rejected_busy"] += 1
                await request.reject(503, body=b"too many pending handshakes")
                return
            try:
                cipher, selected = select_subprotocol(
                    request.proposed_subprotocols, self.link_ciphers
                )
                ws = await request.accept(subprotocol=selected)
                hs = Handshake(
                    initiator=False,
                    identity=self.identity.key,
                    certificate=self.identity.certificate,
                    limits=self.limits,
                    cipher=cipher,
                )
                try:
                    peer, channel = await secure_handshake(ws, hs, self.timeouts.handshake_s)
                except (ProtocolError, trio.TooSlowError) as exc:
                    log.info("inbound handshake failed: %s", exc)
                    with trio.move_on_after(self.timeouts.disconnect_s):
                        await ws.aclose(code=1008, reason="handshake failed")
                    return
            finally:
                self._handshake_slots.release()
        finally:
            left = self._pending_by_address.get(address, 1) - 1
            if left > 0:
                self._pending_by_address[address] = left
            else:
                self._pending_by_address.pop(address, None)
        await self._serve_link(ws, peer, channel, initiator=False)

    # --- links and membership -------------------------------------------------------------------
    async def _serve_link(
        self,
        ws: WebSocket,
        identity: PeerIdentity,
        channel: SecureChannel,
        *,
        initiator: bool,
    ) -> bool:
        """Run the link until it ends; ``False`` when it was not kept (this node itself, a
        duplicate of a link kept instead, a full membership)."""
        node_id = identity.node_id.hex()
        if node_id == self.node_id:
            log.info("refusing a link to myself")
            return False
        peer, trust_until = self._evaluate(node_id, identity.certificate)
        link = Link(
            ws,
            channel,
            identity,
            initiator=initiator,
            limits=self.limits,
            timeouts=self.timeouts,
            on_stream=self._decide_stream,
            on_message=self._on_message,
            budget=self.peer_memory,
        )
        ws.stream.established(trusted=peer.trusted)  # its bytes in the peer's pool
        member = self._members.get(node_id)
        if member is not None and member.link is not None:
            if not self._prefer_new(member.link, link):
                log.info("duplicate link to %s: keeping the existing one", short_id(node_id))
                return False
            old = member.link
            member.link = None  # so the old link's end is not reported as a peer loss
            old.close("duplicate", "a preferred link replaced this one")
            member.disconnected.set()  # wake dial loops waiting on the old link's event
        if member is None:
            if not self._make_room(for_trusted=peer.trusted):
                log.warning(
                    "membership full (%d): refusing %s", len(self._members), short_id(node_id)
                )
                return False
            member = self._members[node_id] = _Member(peer=peer)
        member.peer, member.link = peer, link
        member.certificate, member.trust_until = identity.certificate, trust_until
        member.disconnected = trio.Event()
        member.last_seen = trio.current_time()
        log.info(
            "link up: %s (%s, owner %s, trusted %s)",
            short_id(node_id),
            "dialed" if initiator else "accepted",
            peer.owner_status,
            peer.trusted,
        )
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(link.run)
                nursery.start_soon(self._watch_trust, member, link)
                hello = Hello(
                    listen=self.listen_url,
                    features=self.features,
                    memory_budget_bytes=self.settings.memory_budget_bytes,
                    host=self.host_id,
                    boot=self.boot_id,
                    compute=self.compute,
                    relays=tuple(str(a) for a in self.settings.relays),
                    devices=self.devices,
                )
                link.mux.send_link_message(hello.encode())
                link.wake_writer()
        finally:
            if link.budget_peak >= TRIM_AFTER_BYTES:
                self._memory_release.request()  # one trim for links closing together
            member.bytes_received += link.bytes_received
            member.bytes_sent += link.bytes_sent
            if member.link is link:
                member.link = None
                member.last_seen = link.last_received
                member.disconnected.set()
                reason = link.close_reason or ("closed", "")
                log.info("link down: %s (%s: %s)", short_id(node_id), *reason)
                if member.hello:
                    self._link_lost(node_id, member, link, reason)
        return True

    # --- a dropped connection is not a lost peer ----------------------------------------------
    def _link_lost(
        self, node_id: str, member: _Member, link: Link, reason: tuple[str, str]
    ) -> None:
        """Report the peer lost (``PeerDown``) now when it went silent (``peer_lost``) or said
        goodbye; a connection that merely broke (a reset, a NAT or middlebox drop) gets until
        the same deadline a silent link would have, ``peer_loss_timeout_s`` after the last
        byte it received, to come back (the dial loop redials at once): then nobody hears of
        it. A crashed peer is therefore reported at that deadline too: the socket cannot tell
        a crash from a network reset."""
        down = PeerDown(node_id, f"{reason[0]}: {reason[1]}")
        deadline = link.last_received + self.settings.peer_loss_timeout_s
        if reason[0] not in BROKEN_CONNECTION_REASONS or self._nursery is None:
            self._peer_down(member, down)
            return
        log.info(
            "link to %s broke (%s); waiting up to %.1f s for it to come back",
            short_id(node_id),
            reason[0],
            max(0.0, deadline - trio.current_time()),
        )
        self._nursery.start_soon(self._report_unless_relinked, member, down, deadline)

    async def _report_unless_relinked(
        self, member: _Member, down: PeerDown, deadline: float
    ) -> None:
        await trio.sleep_until(deadline)
        if member.down_reported:
            return  # reported meanwhile (it came back as a new process)
        if member.link is None and self._members.get(down.node_id) is member:
            self._peer_down(member, down)
        else:
            log.info("link to %s came back in time: not a peer loss", short_id(down.node_id))

    def _peer_down(self, member: _Member, down: PeerDown) -> None:
        member.down_reported = True
        self.emit(down)

    def _make_room(self, *, for_trusted: bool = False) -> bool:
        """Keep membership bounded: forget the longest-silent disconnected peer if full; for
        a trusted newcomer, evict the longest-silent untrusted connected one (untrusted peers
        never lock trusted ones out)."""
        if len(self._members) < min(MAX_MEMBERS, self.settings.security.max_members):
            return True
        gone = [(m.last_seen, nid) for nid, m in self._members.items() if m.link is None]
        if gone:
            del self._members[min(gone)[1]]
            return True
        if not for_trusted:
            return False
        untrusted = [
            (m.link.last_received if m.link is not None else m.last_seen, nid)
            for nid, m in self._members.items()
            if not m.peer.trusted
        ]
        if not untrusted:
            return False
        victim_id = min(untrusted)[1]
        victim = self._members.pop(victim_id)
        self.admission["evicted_untrusted"] += 1
        log.warning("membership full: evicting untrusted %s for a trusted peer", victim_id[:12])
        if victim.link is not None:
            victim.link.close("evicted", "membership is full and a trusted peer needs the place")
        return True

    def _prefer_new(self, old: Link, new: Link) -> bool:
        """Both ends keep the same one of two simultaneous links: the one dialed by the smaller
        node id; a redial by the same side replaces its older link."""
        if old.closed.is_set() or old.close_reason is not None:
            return True

        def dialer(link: Link) -> str:
            return self.node_id if link.initiator else link.node_id

        preferred = min(self.node_id, new.node_id)
        return dialer(new) == preferred or dialer(new) == dialer(old)

    def _decide_stream(self, link: Link, open_: SubprotocolOpen) -> StreamDecision:
        handler = self._handlers.get((open_.name, open_.major, open_.kind))
        if handler is None:
            names = {k[0] for k in self._handlers}
            majors = {k[1] for k in self._handlers if k[0] == open_.name}
            if open_.name not in names:
                return ("unknown_subprotocol", f"no subprotocol named {open_.name!r}")
            if open_.major not in majors:
                return ("unsupported_major", f"{open_.name} major {open_.major} is not served")
            return (
                "unknown_kind",
                f"{open_.name}/{open_.major} has no stream kind {open_.kind:#x}",
            )
        member = self._members.get(link.node_id)
        if member is None or member.link is not link:
            return ("link_replaced", "this link is being replaced")
        self._refresh_trust(member)  # every authorization sees trust as of now
        peer = member.peer
        admit = self._admissions.get((open_.name, open_.major, open_.kind))
        refusal = admit(peer, open_.kind) if admit is not None else None
        if refusal is not None:
            return refusal  # refused at the open: no task, no read

        async def run(stream: MeshStream) -> None:
            await handler(InboundStream(peer, open_.name, open_.major, open_.kind, stream))

        return run

    def _on_message(self, link: Link, payload: bytes) -> None:
        message = decode_link_message(payload, self.limits)  # ProtocolError kills the link
        member = self._members.get(link.node_id)
        if member is None or member.link is not link:
            return
        member.last_seen = trio.current_time()
        if isinstance(message, Hello):
            member.address = message.listen
            member.features = dict(message.features)
            member.memory_budget_bytes = message.memory_budget_bytes
            member.host_id = message.host
            member.compute = message.compute
            member.devices = message.devices
            member.relays = relay_addresses(message.relays)
            first_on_link = member.hello_link is not link
            member.hello, member.hello_link = True, link
            restarted = member.boot is not None and message.boot != member.boot
            member.boot = message.boot
            if first_on_link:
                if restarted and not member.down_reported:
                    # Relinked before its loss was reported, but as a new process: whatever
                    # it held (a loaded stage, sessions) is gone, so it is a loss after all.
                    self._peer_down(member, PeerDown(link.node_id, "restarted: a new process"))
                member.down_reported = False
                self._gossip_about(link.node_id, member)
                self.emit(PeerUp(self._info(member, trio.current_time())))
        elif isinstance(message, Peers):
            for record in message.peers:
                node_id = record.node_id.hex()
                known = self._members.get(node_id)
                if node_id == self.node_id or (known is not None and known.link is not None):
                    continue
                relays = relay_addresses(record.relays) if self._circuit_dialer else ()
                # Learned, not trusted: it counts only once dialed and authenticated.
                for address in dial_plan(node_id, record.address, relays):
                    self._start_dialing(address, persistent=False)

    def _gossip_about(self, node_id: str, member: _Member) -> None:
        """Tell the new peer whom we know, and everyone else about the new peer."""
        others = [
            self._record(nid, m, to=member)
            for nid, m in self._members.items()
            if nid != node_id and m.link is not None and m.address
        ][: self.limits.max_gossip_peers]
        self._send_message(member, Peers(tuple(others)).encode())
        if member.address:
            for nid, m in self._members.items():
                if nid != node_id and m.link is not None:
                    self._send_message(m, Peers((self._record(node_id, member, to=m),)).encode())

    def _record(self, node_id: str, about: _Member, *, to: _Member) -> PeerRecord:
        """Gossip about ``about`` for ``to``: its relays only to a peer that reads them (an
        older node refuses a peer entry with keys it does not know)."""
        assert about.address is not None  # callers gossip only members with one (typing)
        reads = pc.BIT_RELAYED in to.features.get(pc.FEATURE_MESH_RELAY, ())
        relays = tuple(str(r) for r in about.relays) if reads else ()
        return PeerRecord(bytes.fromhex(node_id), about.address, relays)

    def _send_message(self, member: _Member, payload: bytes) -> None:
        if member.link is None:
            return
        try:
            member.link.mux.send_link_message(payload)
            member.link.wake_writer()
        except ProtocolError as exc:
            member.link.close(exc.code, exc.message)

    def _info(self, m: _Member, now: float) -> PeerInfo:
        seen = m.link.last_received if m.link is not None else m.last_seen
        return PeerInfo(
            peer=m.peer,
            address=m.address,
            features=dict(m.features),
            memory_budget_bytes=m.memory_budget_bytes,
            host_id=m.host_id,
            compute=m.compute,
            devices=m.devices,
            connected=m.link is not None,
            last_seen_s=max(0.0, now - seen) if math.isfinite(seen) else 0.0,
            rtt_s=m.link.rtt_s if m.link is not None else None,
            rtt_min_s=m.link.rtt_min_s if m.link is not None else None,
            bytes_received=m.bytes_received + (m.link.bytes_received if m.link else 0),
            bytes_sent=m.bytes_sent + (m.link.bytes_sent if m.link else 0),
            link_cipher=m.link.channel.cipher.label if m.link is not None else None,
            relay=m.link.transport.relay_id if m.link is not None else None,
        )
