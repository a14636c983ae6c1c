"""Direct links for relayed peers: observed addresses, the addresses a node offers, and the
direct dial (the I/O the node core's upgrade of a relayed link runs; ``MeshNode._go_direct``).

A peer tells a node, in its hello, the address that node's end of a TCP link appears at
(``Hello.observed``): behind NAT, the router's public address. The node offers its listen
port at the addresses its peers observed (``offered_addresses``) in the hellos it sends, and
when two nodes are linked through a relay each dials the other's offered addresses and its
listen address (``dial_candidates``). Nothing a peer says is trusted beyond trying a dial:
an address is used only if it is an IP literal with a port (``parse_host_port``), the dialer
demands the expected node id in the Noise handshake, and a connection that reached someone
else ends there.

Each direct dial is bound to the node's listen port (``open_direct``; the listener shares it,
``SO_REUSEPORT``): behind a NAT that keeps ports and drops unsolicited packets, two nodes
dialling each other at once meet in a TCP simultaneous open. Then both sockets are dialers;
the node with the smaller id speaks first (the WebSocket client and Noise initiator), the
other waits ``ROLE_WAIT_S`` for it (``peer_spoke_first``) and, hearing nothing, takes the
client's part itself (it reached the other's listener).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from typing import Final

import trio

from protocol.constants import MAX_DIRECT_ADDRESSES

# When a relayed link's upgrade dials (seconds after the peer's hello): a few tries, since a
# simultaneous open needs both sides' packets to cross at their NATs.
UPGRADE_DELAYS_S: Final = (0.0, 1.0, 3.0)
# How long the node with the larger id waits, on a connected direct socket, for the other to
# speak first (a simultaneous open) before it speaks itself.
ROLE_WAIT_S: Final = 0.5
MAX_OBSERVERS: Final = 16  # observed addresses remembered (most recent first)


def parse_host_port(text: str | None) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` for IPv6) with an IP literal a node may dial, else None
    (pure). Refused: names (no resolver is asked on a peer's word), the unspecified,
    multicast and broadcast addresses, link-local ones (they need a scope), port 0."""
    if not text or len(text) > 64:
        return None
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    port = int(port_text)
    if not 0 < port < 65536:
        return None
    if ip.is_unspecified or ip.is_multicast or ip.is_link_local:
        return None
    if isinstance(ip, ipaddress.IPv4Address) and ip == ipaddress.IPv4Address("255.255.255.255"):
        return None
    return str(ip), port


def host_port_text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_host_port(listen_url: str | None) -> tuple[str, int] | None:
    """A hello's ``ws://host:port`` listen address as a dial candidate, or None (pure)."""
    if not listen_url or not listen_url.startswith("ws://"):
        return None
    return parse_host_port(listen_url[len("ws://") :])


def offered_addresses(observed_hosts: Iterable[str], listen_port: int | None) -> tuple[str, ...]:
    """What a node offers for direct links: its listen port at each address its peers
    observed (most recent first), at most ``MAX_DIRECT_ADDRESSES`` (pure)."""
    if not listen_port:
        return ()
    out: list[str] = []
    for host in observed_hosts:
        text = host_port_text(host, listen_port)
        if parse_host_port(text) is not None and text not in out:
            out.append(text)
    return tuple(out[:MAX_DIRECT_ADDRESSES])


def dial_candidates(direct: Sequence[str], listen_url: str | None) -> list[tuple[str, int]]:
    """Where to dial a relayed peer directly (pure): the addresses it offered, then its
    listen address; invalid ones dropped, each once."""
    out: list[tuple[str, int]] = []
    for parsed in [*(parse_host_port(t) for t in direct[:MAX_DIRECT_ADDRESSES]),
                   listen_host_port(listen_url)]:  # fmt: skip
        if parsed is not None and parsed not in out:
            out.append(parsed)
    return out


def speaks_first(own_id: str, peer_id: str) -> bool:
    """On a direct socket both ends dialled, the smaller node id speaks first (pure)."""
    return own_id < peer_id


async def open_direct(
    host: str, port: int, local_port: int | None, timeout_s: float
) -> trio.SocketStream:
    """A TCP connection to ``host:port``, from ``local_port`` when it can be bound (the
    listen port: what a port-keeping NAT maps, and what the other side dials), else from any
    port. Raises ``OSError`` or ``trio.TooSlowError``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        if local_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                await sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", local_port))
            except OSError:
                sock.close()  # the port is not ours to share: dial from any port
                sock = trio.socket.socket(family, socket.SOCK_STREAM)
        with trio.fail_after(timeout_s):
            await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def peer_spoke_first(stream: trio.SocketStream, wait_s: float) -> bool:
    """Whether the other end sent something within ``wait_s`` (a peer that dialled us at
    the same moment, speaking first as ``speaks_first`` says); nothing is read."""
    with trio.move_on_after(wait_s):
        await trio.lowlevel.wait_readable(stream.socket)
        return True
    return False
