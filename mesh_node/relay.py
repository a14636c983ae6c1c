"""Relays: links through a mesh node for peers that cannot be dialled (the relay service).

Both halves of a circuit are here, as one ``NodeService`` (``mesh_node.node_service``):

- **the relay** (``[relay] enable = true``): a dialer opens a ``mesh-relay/1`` stream of kind
  ``KIND_CIRCUIT_CONNECT`` naming a target; the relay checks its policy and limits
  (``circuit_refusal``, pure), opens a ``KIND_CIRCUIT_INCOMING`` stream on its link to the
  target naming the source as its handshake proved it, and once both said ``ok`` copies the
  bytes of the two streams into each other (``forward_bytes``), bounded in rate, total and
  lifetime. It reads none of them: the two ends run a WebSocket and the Noise handshake over
  the circuit (``mesh_node.circuit``).
- **a relayed node** (``relays = [...]``): keeps a link to each of its relays, advertises them
  in its hello (gossip carries them on to peers that read them), accepts circuits only from
  those relays, and dials relayed addresses (``ws://relay#<id>/relayed/<node id>``) for the
  node core (``MeshNode.set_circuit_dialer``).

A circuit's link is an ordinary link: it ends when either of its streams ends (the relay's
link lost, the relay gone, a limit reached), and the node reports it as any broken link.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mesh_node.circuit import CircuitStream
from mesh_node.errors import MeshError, RelayRefused
from mesh_node.identity import short_id
from mesh_node.link import MeshStream, websocket_settings
from mesh_node.metrics import PREFIX, SectionCollector
from mesh_node.node import MeshNode
from mesh_node.node_service import FeatureBits, StreamKind
from mesh_node.peers import InboundStream
from mesh_node.settings import RelayedAddress, RelaySettings
from mesh_node.websocket import HandshakeError, WebSocket, accept_over, client_over
from protocol import constants as pc
from protocol import relay_messages as wire
from protocol.errors import ProtocolError
from protocol.link_cipher import offered_subprotocols
from protocol.ws_upgrade import UpgradeRefused

log = logging.getLogger("mesh_node.relay")
COPY_BYTES = 256 * 1024  # one read of a circuit's stream, forwarded before the next
# Circuit asks per source node (token bucket): a peer asking in a loop costs the relay a
# stream, a decode and a decision each time; past this it is refused at once (relay_rate).
ASKS_PER_S = 10.0
ASK_BURST = 20
MAX_TRACKED_SOURCES = 1024  # rate entries; the stalest is forgotten first


@dataclass
class CircuitMeter:
    """One circuit's bytes, and the limits it runs under (each direction paced alone)."""

    source: str
    target: str
    bytes_per_s: int  # 0: no cap
    max_bytes: int  # both directions together; 0: no cap
    forwarded: int = 0
    over: bool = False  # stopped at ``max_bytes``

    def allow(self, nbytes: int) -> bool:
        """Count ``nbytes`` about to be forwarded; False once past ``max_bytes``."""
        self.forwarded += nbytes
        if self.max_bytes and self.forwarded > self.max_bytes:
            self.over = True
        return not self.over


# The relay's copy of a circuit's bytes; tests inject a relay that misbehaves.
Forward = Callable[[MeshStream, MeshStream, CircuitMeter], Awaitable[None]]


async def forward_bytes(src: MeshStream, dst: MeshStream, meter: CircuitMeter) -> None:
    """Copy ``src`` into ``dst`` until ``src`` ends (then ``dst`` ends too), paced to
    ``meter.bytes_per_s``; past ``meter.max_bytes`` both are reset."""
    start = trio.current_time()
    sent = 0
    while True:
        data = await src.receive_some(COPY_BYTES)
        if not data:
            await dst.send_eof()
            return
        if not meter.allow(len(data)):
            why = "the relay's per-circuit byte limit was reached"
            src.reset("relay_circuit_bytes", why)
            dst.reset("relay_circuit_bytes", why)
            return
        await dst.send_all(data)
        sent += len(data)
        if meter.bytes_per_s:
            await trio.sleep_until(start + sent / meter.bytes_per_s)


def circuit_refusal(
    settings: RelaySettings,
    *,
    source: str,
    source_trusted: bool,
    target: str,
    target_trusted: bool | None,
    target_accepts: bool,
    open_total: int,
    open_by_peer: Mapping[str, int],
) -> tuple[str, str] | None:
    """Why a circuit from ``source`` to ``target`` is refused, or None (pure).
    ``target_trusted`` is None when the relay has no link to the target."""
    if settings.allow == "trusted" and not source_trusted:
        return ("relay_forbidden", "this relay serves trusted peers only ([relay] allow)")
    if target == source:
        return ("relay_bad_target", "a circuit to oneself")
    if target_trusted is None or not target_accepts:
        return ("relay_no_target", "the target is not linked to this relay as a relayed node")
    if settings.allow == "trusted" and not target_trusted:
        return ("relay_forbidden", "the target is not a trusted peer of this relay")
    if open_total >= settings.circuits:
        return ("relay_busy", f"the relay has {settings.circuits} circuits open (its limit)")
    for who in (source, target):
        if open_by_peer.get(who, 0) >= settings.circuits_per_peer:
            return (
                "relay_peer_busy",
                f"{short_id(who)} has {settings.circuits_per_peer} circuits open (the limit)",
            )
    return None


def take_ask(bucket: tuple[float, float] | None, now_s: float) -> tuple[bool, tuple[float, float]]:
    """One circuit ask against a source's bucket ``(tokens, when)`` (None: a full one); whether
    it is allowed and the bucket after it (pure)."""
    tokens, then = bucket if bucket is not None else (float(ASK_BURST), now_s)
    tokens = min(float(ASK_BURST), tokens + (now_s - then) * ASKS_PER_S)
    if tokens < 1:
        return False, (tokens, now_s)
    return True, (tokens - 1, now_s)


@dataclass
class RelayCounters:
    circuits_total: int = 0
    bytes_forwarded: int = 0
    refused: dict[str, int] = field(default_factory=dict)


class RelayService:
    """The relay and relayed halves of circuits (the module docstring)."""

    config_table: str | None = "relay"

    def __init__(self, node: MeshNode, *, forward: Forward = forward_bytes) -> None:
        self.node = node
        self.settings = node.settings.relay
        self.relays = {a.node_id: a for a in node.settings.relays if a.node_id is not None}
        self._forward = forward
        self.open: dict[int, CircuitMeter] = {}
        self.counters = RelayCounters()
        self._asks: dict[str, tuple[float, float]] = {}  # source -> its bucket, oldest first
        node.set_circuit_dialer(self.dial)

    # --- NodeService ------------------------------------------------------------------------
    def streams(self) -> Sequence[StreamKind]:
        kinds = [self._kind(pc.KIND_CIRCUIT_INCOMING, self._on_incoming)]
        if self.settings.enable:
            kinds.append(self._kind(pc.KIND_CIRCUIT_CONNECT, self._on_connect))
        return kinds

    @staticmethod
    def _kind(kind: int, handler: Callable[[InboundStream], Awaitable[None]]) -> StreamKind:
        return StreamKind(kind, handler, name=pc.MESH_RELAY, major=pc.MESH_RELAY_MAJOR)

    def features(self, now_s: float) -> FeatureBits:
        bits = {pc.BIT_RELAYED} | ({pc.BIT_RELAY} if self.settings.enable else set())
        return {pc.FEATURE_MESH_RELAY: frozenset(bits)}

    def status_sections(self) -> Mapping[str, Any]:
        return {"relay": self.status()}

    def status(self) -> dict[str, Any]:
        return {
            "enabled": self.settings.enable,
            "allow": self.settings.allow,
            "relays": sorted(str(a) for a in self.relays.values()),
            "circuits_open": len(self.open),
            "circuits_total": self.counters.circuits_total,
            "bytes_forwarded": self.counters.bytes_forwarded
            + sum(m.forwarded for m in self.open.values()),
            "refused": dict(sorted(self.counters.refused.items())),
            "circuits": [
                {"source": m.source, "target": m.target, "bytes": m.forwarded}
                for m in self.open.values()
            ],
        }

    def collectors(self) -> Sequence[Collector]:
        return [SectionCollector(self.status, relay_families)]

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await self.node.started.wait()  # its hello names its listen address
        for address in self.relays.values():
            self.node.keep_linked(address)
        await trio.sleep_forever()

    # --- the relay -----------------------------------------------------------------------------
    def _refuse(self, code: str) -> None:
        self.counters.refused[code] = self.counters.refused.get(code, 0) + 1

    def _admit_ask(self, source: str) -> bool:
        allowed, bucket = take_ask(self._asks.pop(source, None), trio.current_time())
        self._asks[source] = bucket  # re-inserted: most recent last
        while len(self._asks) > MAX_TRACKED_SOURCES:
            del self._asks[next(iter(self._asks))]
        return allowed

    async def _on_connect(self, inbound: InboundStream) -> None:
        stream, source = inbound.stream, inbound.peer.node_id
        if not self._admit_ask(source):
            self._refuse("relay_rate")  # counted, not logged: a loop must not fill the log
            stream.reset("relay_rate", f"more than {ASKS_PER_S:g} circuit asks a second")
            return
        timeout_s = self.node.timeouts.handshake_s
        try:
            with trio.fail_after(timeout_s):
                message = wire.decode(await stream.receive_message() or b"", self.node.limits)
        except (ProtocolError, trio.TooSlowError) as exc:
            self._refuse("bad_circuit_message")
            stream.reset("bad_circuit_message", str(exc))
            return
        if not isinstance(message, wire.CircuitConnect):
            self._refuse("bad_circuit_message")
            stream.reset("bad_circuit_message", "a circuit starts with a connect")
            return
        target = message.target.hex()
        peer = self.node.peer(target)
        linked = peer is not None and peer.connected
        authenticated = self.node.authenticated(target) if linked else None
        refusal = circuit_refusal(
            self.settings,
            source=source,
            source_trusted=inbound.peer.trusted,
            target=target,
            target_trusted=None if authenticated is None else authenticated.trusted,
            target_accepts=peer is not None
            and peer.has_features(pc.FEATURE_MESH_RELAY, frozenset({pc.BIT_RELAYED})),
            open_total=len(self.open),
            open_by_peer=self._open_by_peer(),
        )
        if refusal is None:
            await self._splice(stream, source, target)
            return
        await self._answer_refused(stream, *refusal)

    async def _answer_refused(self, stream: MeshStream, code: str, reason: str) -> None:
        self._refuse(code)
        # Debug only: the counters (status, /metrics) show refusals; a stranger asking in a
        # loop must not fill the log.
        log.debug("circuit refused: %s: %s", code, reason)
        with trio.move_on_after(self.node.timeouts.handshake_s):
            try:
                await stream.send_message(wire.encode(wire.CircuitRefused(code, reason)))
                await stream.send_eof()
            except (MeshError, trio.ClosedResourceError):
                pass

    def _open_by_peer(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for m in self.open.values():
            for who in (m.source, m.target):
                counts[who] = counts.get(who, 0) + 1
        return counts

    async def _splice(self, source_stream: MeshStream, source: str, target: str) -> None:
        meter = CircuitMeter(
            source, target, self.settings.circuit_bytes_per_s, self.settings.circuit_bytes
        )
        key = id(meter)
        self.open[key] = meter  # counted from now: concurrent asks see it
        try:
            try:
                target_stream = await self.node.open_stream(
                    target, pc.KIND_CIRCUIT_INCOMING, name=pc.MESH_RELAY, major=pc.MESH_RELAY_MAJOR
                )
            except MeshError as exc:
                await self._answer_refused(source_stream, "relay_no_target", str(exc))
                return
            async with target_stream:
                try:
                    with trio.fail_after(self.node.timeouts.handshake_s):
                        offer = wire.CircuitIncoming(bytes.fromhex(source))
                        await target_stream.send_message(wire.encode(offer))
                        answer = wire.decode(
                            await target_stream.receive_message() or b"", self.node.limits
                        )
                except (MeshError, ProtocolError, trio.TooSlowError) as exc:
                    await self._answer_refused(source_stream, "relay_no_target", str(exc))
                    return
                if isinstance(answer, wire.CircuitRefused):
                    await self._answer_refused(source_stream, answer.code, answer.reason)
                    return
                try:
                    await source_stream.send_message(wire.encode(wire.CircuitOk()))
                except (MeshError, trio.ClosedResourceError):
                    return
                self.counters.circuits_total += 1
                log.info("circuit open: %s -> %s", short_id(source), short_id(target))
                with trio.move_on_after(self.settings.circuit_lifetime_s):
                    await self._run_circuit(source_stream, target_stream, meter)
        finally:
            del self.open[key]
            self.counters.bytes_forwarded += meter.forwarded

    async def _run_circuit(self, a: MeshStream, b: MeshStream, meter: CircuitMeter) -> None:
        """Both directions until both ended; a failure of either ends the circuit."""

        async def one_way(src: MeshStream, dst: MeshStream) -> None:
            try:
                await self._forward(src, dst, meter)
            except (MeshError, trio.BrokenResourceError, trio.ClosedResourceError):
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one_way, a, b)
            nursery.start_soon(one_way, b, a)
        if nursery.cancel_scope.cancelled_caught or meter.over:
            for s in (a, b):
                s.reset("relay_circuit_ended", "the other end of the circuit is gone")

    # --- a relayed node ----------------------------------------------------------------------
    async def _on_incoming(self, inbound: InboundStream) -> None:
        stream, relay_id = inbound.stream, inbound.peer.node_id
        if relay_id not in self.relays:
            # Only the relays this node chose may hand it circuits.
            stream.reset("relay_not_chosen", "this node takes circuits only from its relays")
            return
        try:
            with trio.fail_after(self.node.timeouts.handshake_s):
                message = wire.decode(await stream.receive_message() or b"", self.node.limits)
                if not isinstance(message, wire.CircuitIncoming):
                    raise ProtocolError("bad_circuit_message", "a circuit offer was expected")
                await stream.send_message(wire.encode(wire.CircuitOk()))
        except (ProtocolError, trio.TooSlowError) as exc:
            stream.reset("bad_circuit_message", str(exc))
            return
        circuit = CircuitStream(stream, self.node.peer_memory, relay_id)
        ws_settings = websocket_settings(self.node.limits, self.node.timeouts)
        ws: WebSocket | None = None
        try:
            request = await accept_over(circuit, ws_settings)
            await self.node.accept_link(request)
            ws = request.websocket
        except (HandshakeError, UpgradeRefused, trio.TooSlowError, trio.BrokenResourceError) as exc:
            log.info("circuit from relay %s: no link (%s)", short_id(relay_id), exc)
        finally:
            with trio.CancelScope(shield=True):
                if ws is not None and ws.closed is None:
                    with trio.move_on_after(ws_settings.disconnect_s):
                        await ws.aclose()
                await circuit.aclose()

    async def dial(self, address: RelayedAddress) -> None:
        """A link to ``address.node_id`` through a circuit on its relay (the node core's dial
        loop calls this, and retries). Raises ``RelayRefused`` with the relay's code,
        ``PeerUnavailable`` without a link to the relay (one is dialed meanwhile), or what a
        failed handshake raises."""
        relay = address.relay
        relay_id = relay.node_id
        assert relay_id is not None  # RelayedAddress checks it (typing)
        linked = self.node.peer(relay_id)
        if linked is None or not linked.connected:
            self.node.keep_linked(relay)  # then open_stream fails: the dial loop retries
        stream = await self.node.open_stream(
            relay_id, pc.KIND_CIRCUIT_CONNECT, name=pc.MESH_RELAY, major=pc.MESH_RELAY_MAJOR
        )
        circuit = CircuitStream(stream, self.node.peer_memory, relay_id)
        try:
            with trio.fail_after(self.node.timeouts.handshake_s):
                ask = wire.CircuitConnect(bytes.fromhex(address.node_id))
                await stream.send_message(wire.encode(ask))
                answer = wire.decode(await stream.receive_message() or b"", self.node.limits)
            if isinstance(answer, wire.CircuitRefused):
                raise RelayRefused(
                    f"relay {short_id(relay_id)} refused a circuit to "
                    f"{short_id(address.node_id)}: {answer.code}: {answer.reason}",
                    actual=answer.code,
                )
            if not isinstance(answer, wire.CircuitOk):
                raise ProtocolError("bad_circuit_message", "the relay answered out of turn")
            ws_settings = websocket_settings(self.node.limits, self.node.timeouts)
            offered = offered_subprotocols(self.node.link_ciphers)
            authority = f"relay-{relay_id[:12]}"
            async with client_over(circuit, authority, ws_settings, offered) as ws:
                await self.node.link_over(ws, expected=address.node_id, what=str(address))
        finally:
            with trio.CancelScope(shield=True):
                await circuit.aclose()


def relay_families(section: Mapping[str, Any]) -> list[Metric]:
    """The relay's circuits and bytes (pure, from its status section)."""
    open_ = GaugeMetricFamily(
        f"{PREFIX}_relay_circuits_open",
        "Circuits this relay splices now",
        value=section["circuits_open"],
    )
    total = CounterMetricFamily(
        f"{PREFIX}_relay_circuits",
        "Circuits this relay opened since the node started",
        value=section["circuits_total"],
    )
    forwarded = CounterMetricFamily(
        f"{PREFIX}_relay_forwarded_bytes",
        "Circuit bytes this relay forwarded (both directions, ciphertext)",
        value=section["bytes_forwarded"],
    )
    refused = CounterMetricFamily(
        f"{PREFIX}_relay_refused_circuits", "Circuits this relay refused, by code", labels=["code"]
    )
    for code, n in section["refused"].items():
        refused.add_metric([code], n)
    return [open_, total, forwarded, refused]
