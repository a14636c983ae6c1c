"""A relay's circuit as a link's transport: the bytes of a stream on this node's link to the
relay, which the relay splices to a stream on its link to the other end. A WebSocket, the
Noise handshake and a ``Link`` run over it exactly as over TCP (``mesh_node.budgeted_tcp``), so
the relay sees only the WebSocket frames of Noise ciphertext: a byte it alters, replays or
drops fails the link's record decryption, and it cannot complete a handshake as either end.

Memory: what the relay link delivers is already counted against this node's peer-memory
budget while it sits in the stream's receive window (at most one window per circuit); what the
circuit's WebSocket has read and not yet parsed is at most one message
(``Limits.max_ws_message_bytes``). The circuit's own account in the budget is opened so the
link over it has its share and turns like any other.
"""

from __future__ import annotations

import math
from itertools import count

import trio

from mesh_node.budget import PeerMemory
from mesh_node.errors import MeshError
from mesh_node.link import MeshStream

_ids = count(1)


class CircuitStream:
    """A ``mesh_node.budgeted_tcp.LinkTransport`` over ``stream``, a circuit through the relay
    ``relay_id`` (so a link over it can say which relay it goes through)."""

    def __init__(self, stream: MeshStream, budget: PeerMemory, relay_id: str) -> None:
        self.stream = stream
        self.relay_id: str | None = relay_id
        self.budget = budget
        self.key = id(self)
        self.name = f"circuit-{next(_ids)}"
        self.trusted = False
        self.waited_at = -math.inf
        self.peer_address = f"relay:{relay_id[:12]}"
        self._closed = False
        budget.open(self.key)

    def __repr__(self) -> str:
        return self.name

    def established(self, *, trusted: bool) -> None:
        self.set_trusted(trusted)

    def claim(self) -> None:
        """The node serves this circuit (its account is closed with the link, or here)."""

    def set_trusted(self, trusted: bool) -> None:
        self.trusted = trusted
        self.budget.set_trusted(self.key, trusted)

    def delivered(self, payload_bytes: int) -> None:
        """Nothing is held here beyond the relay link's stream window (counted there)."""

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """The circuit's next bytes (``b""`` at its end, or when the relay reset it)."""
        try:
            return await self.stream.receive_some(max_bytes)
        except (MeshError, trio.ClosedResourceError):
            return b""

    async def drain(self) -> None:
        while await self.receive_some():
            pass

    def send_now(self, data: bytes | bytearray | memoryview) -> int:
        return 0  # a stream's sends wait for the relay link's credit: always ``send_all``

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self.stream.send_all(data)
        except (MeshError, trio.ClosedResourceError) as exc:
            raise trio.BrokenResourceError(f"the circuit ended: {exc}") from None

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self.budget.close(self.key)
        await self.stream.aclose()
