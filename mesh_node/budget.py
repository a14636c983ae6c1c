"""The node-wide budget for memory held on behalf of peers (issue #19 item 3).

Each link already bounds itself (32 streams x 4 MiB window, one queued WebSocket message, a
1 MiB control backlog), but 32 links x 32 streams x a 1 MiB message prefix is a gigabyte: the
node needs one cap over all of them. Every byte a peer makes this node hold (received stream
data not yet read by its handler, a partly received length-prefixed message) is *taken* from
this budget before it is buffered, and *given* back when it is consumed or when its stream or
link ends. A take that does not fit resets only the stream that wanted it (``memory_budget``).

Fairness: while the node holds less than half the budget, any link may take; above half, a
link may hold at most its share (``budget / links``, never less than ``FLOOR_BYTES``, which
is one largest stream message), so many hostile links cannot starve a new honest one.

Plain bookkeeping, one thread (trio's): no locks.
"""

from __future__ import annotations

from typing import Final

# One whole stream message (1 MiB + its 4-byte prefix) and some stream data always fit.
FLOOR_BYTES: Final = 2 * 1024 * 1024


class PeerMemory:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.total = 0
        self.peak = 0
        self.refusals = 0
        self._held: dict[int, int] = {}  # per link key
        self._peak: dict[int, int] = {}

    def open(self, key: int) -> None:
        self._held.setdefault(key, 0)
        self._peak.setdefault(key, 0)

    def close(self, key: int) -> int:
        """The link ended: everything it held is released. Returns the most it held."""
        self.total -= self._held.pop(key, 0)
        return self._peak.pop(key, 0)

    def held(self, key: int) -> int:
        return self._held.get(key, 0)

    def share(self) -> int:
        return max(FLOOR_BYTES, self.budget_bytes // max(1, len(self._held)))

    def take(self, key: int, nbytes: int) -> bool:
        """Reserve ``nbytes`` for link ``key`` before buffering them; False: do not buffer."""
        if nbytes <= 0:
            return True
        held = self._held.get(key, 0)
        after = self.total + nbytes
        if after > self.budget_bytes or (
            after > self.budget_bytes // 2 and held + nbytes > self.share()
        ):
            self.refusals += 1
            return False
        self._held[key] = held + nbytes
        if key in self._peak:
            self._peak[key] = max(self._peak[key], held + nbytes)
        self.total = after
        self.peak = max(self.peak, after)
        return True

    def give(self, key: int, nbytes: int) -> None:
        """Bytes link ``key`` held were consumed or dropped."""
        if nbytes <= 0 or key not in self._held:
            return
        n = min(nbytes, self._held[key])
        self._held[key] -= n
        self.total -= n

    def to_dict(self) -> dict[str, int]:
        return {
            "budget_bytes": self.budget_bytes,
            "held_bytes": self.total,
            "peak_bytes": self.peak,
            "links": len(self._held),
            "refusals": self.refusals,
        }
