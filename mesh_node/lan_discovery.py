"""LAN discovery: nodes of one owner find each other by multicast DNS (``lan_discovery = true``
in the node TOML; off by default).

A thin trio shell over ``protocol.mdns``: one UDP socket on port 5353 in the group
224.0.0.251. At start, and then at growing intervals (1, 2, 4 ... 60 s), the node asks for the
mesh's service and announces its own instance: a random name per start, its listen port and
its owner's fingerprint, nothing else (no node id, no model, no inventory). It answers a query
at most once per ``MIN_ANSWER_INTERVAL_S``. An announcement with this node's fingerprint from
another instance is a node of the same owner: the one of the two whose instance name sorts
first dials the other (``MeshNode.dial_learned``: the address the datagram came from, the
announced port), so the pair does not link twice; the Noise handshake and the owner
certificate then decide trust as for any dial. Multicast stays on the link (routers do not
forward 224.0.0.251), so only the LAN's nodes meet. Datagrams that are not mDNS, or not ours,
are dropped and counted, never logged one by one.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import trio
from prometheus_client.registry import Collector

from mesh_node.node import MeshNode
from mesh_node.node_service import FeatureBits, StreamKind
from mesh_node.settings import PeerAddress
from protocol.errors import ProtocolError
from protocol.invite import owner_fingerprint
from protocol.mdns import (
    MAX_MESSAGE_BYTES,
    MDNS_GROUP,
    MDNS_PORT,
    Announcement,
    announcements_in,
    asks_for,
    decode_message,
    encode_announcement,
    encode_query,
)

log = logging.getLogger(__name__)

FIRST_INTERVAL_S = 1.0
MAX_INTERVAL_S = 60.0
MIN_ANSWER_INTERVAL_S = 1.0
MAX_FOUND = 64  # instances remembered (a LAN full of strangers cannot grow this)


class LanDiscovery:
    """The ``NodeService`` of LAN discovery (see the module doc)."""

    config_table: str | None = None  # its one switch is a top-level key (lan_discovery)

    def __init__(self, node: MeshNode, *, port: int = MDNS_PORT) -> None:
        self.node = node
        self.port = port
        self.instance = secrets.token_hex(8)
        self.found: dict[str, str] = {}  # instance -> ws://ip:port of a same-owner node
        self.dropped = 0  # datagrams that were not a well-formed mDNS message
        self.state = "starting"
        self._last_answer = -MIN_ANSWER_INTERVAL_S

    def streams(self) -> Sequence[StreamKind]:
        return ()

    def features(self, now_s: float) -> FeatureBits:
        return {}

    def status_sections(self) -> Mapping[str, Any]:
        return {
            "lan_discovery": {
                "state": self.state,
                "instance": self.instance,
                "found": sorted(self.found.values()),
                "dropped": self.dropped,
            }
        }

    def collectors(self) -> Sequence[Collector]:
        return ()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await self.node.started.wait()
        owner, status = self.node.identity.owner(time.time())
        if owner is None or status != "verified":
            self.state = "off: this node has no verified owner certificate to announce"
            log.warning("LAN discovery %s", self.state[5:])
            return
        listen_port = int((self.node.listen_url or ":0").rsplit(":", 1)[1])
        ann = Announcement(self.instance, listen_port, owner_fingerprint(bytes.fromhex(owner)))
        try:
            sock = await _open_socket(self.port)
        except OSError as exc:
            self.state = f"off: cannot join {MDNS_GROUP}:{self.port}: {exc.strerror or exc}"
            log.warning("LAN discovery %s", self.state)
            return
        self.state = "on"
        with sock:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._announce_loop, sock, ann)
                await self._receive_loop(sock, ann)

    async def _send(self, sock: trio.socket.SocketType, payload: bytes) -> None:
        try:
            await sock.sendto(payload, (MDNS_GROUP, self.port))
        except OSError as exc:  # no route for multicast yet, an interface going down
            log.debug("mDNS send failed: %s", exc)

    async def _announce_loop(self, sock: trio.socket.SocketType, ann: Announcement) -> None:
        interval = FIRST_INTERVAL_S
        while True:
            await self._send(sock, encode_query())
            await self._send(sock, encode_announcement(ann))
            await trio.sleep(interval)
            interval = min(interval * 2, MAX_INTERVAL_S)

    async def _receive_loop(self, sock: trio.socket.SocketType, ann: Announcement) -> None:
        while True:
            data, (host, _port) = await sock.recvfrom(MAX_MESSAGE_BYTES + 1)
            try:
                message = decode_message(data)
            except ProtocolError:
                self.dropped += 1
                continue
            if asks_for(message):
                now = trio.current_time()
                if now - self._last_answer >= MIN_ANSWER_INTERVAL_S:
                    self._last_answer = now
                    await self._send(sock, encode_announcement(ann))
            for other in announcements_in(message):
                if other.instance == ann.instance or other.fingerprint != ann.fingerprint:
                    continue  # our own (looped back), or another owner's node
                self._found(other, host)

    def _found(self, other: Announcement, host: str) -> None:
        address = PeerAddress(host, other.port)
        if other.instance not in self.found and len(self.found) >= MAX_FOUND:
            return
        first = other.instance not in self.found
        self.found[other.instance] = address.url
        if first:
            log.info("LAN discovery: a node of this owner at %s", address.url)
        if self.instance > other.instance:
            return  # the other node dials us
        linked = {p.address for p in self.node.peers(connected_only=True)}
        if address.url not in linked:
            self.node.dial_learned(address)


async def _open_socket(port: int) -> trio.socket.SocketType:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):  # another mDNS responder on this host keeps its own
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        await sock.bind(("0.0.0.0", port))
        group = socket.inet_aton(MDNS_GROUP) + socket.inet_aton("0.0.0.0")
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, group)
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 255)  # RFC 6762 section 11
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
    except OSError:
        sock.close()
        raise
    return sock
