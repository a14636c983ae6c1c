"""Bounds on what refused requests may cost: per peer and stream kind, and node-wide.

A refusal is work (a stream, a task, a request read and decided, an answer, a log line) that
buys the requester nothing, so a hostile link could ask for refusals as fast as its link
carries them: 1,000-2,500 a second on the artifact kinds cost a node most of a core and
megabytes of log a minute. ``RequestGate`` makes them cheap beyond a budget:

- every refused request takes a token from the (peer, kind) bucket (``REFUSALS_BURST``,
  refilled at ``REFUSALS_PER_S``; into debt when the requests admitted together overdraw
  it); while that bucket is empty, the node refuses the peer's
  new streams of that kind at the open (``admit``: one reset frame, no task, no read, no log
  line), so a refused peer can make the node do real work at most at the refill rate;
- an untrusted peer's refusals also take from one node-wide bucket: strangers with fresh
  identities share it. While it is empty, an untrusted peer that was refused recently is
  refused at the open too; trusted peers never wait on strangers;
- the log gets the first refusal per peer and kind in an interval in full (for at most
  ``SUMMARY_PEERS`` of them), then one summary line per ``SUMMARY_INTERVAL_S`` naming at most
  ``SUMMARY_PEERS`` peers (``summary``), never a line per refusal.

Served requests take no tokens: what a peer may have is bounded by the handlers' slots
(``RequestSlots``: requests served at once per peer and per node).

``TokenBucket`` is the node's one token bucket: ``MeshNode`` paces new connections per source
address with it too.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Final

import trio

from mesh_node.identity import short_id
from mesh_node.peers import AuthenticatedPeer

log = logging.getLogger("mesh_node.request_gate")

REFUSALS_BURST: Final = 32.0  # refused requests one peer may cost per kind at once ...
REFUSALS_PER_S: Final = 8.0  # ... and per second after that
NODE_REFUSALS_BURST: Final = 128.0  # untrusted peers' refusals, all together ...
NODE_REFUSALS_PER_S: Final = 32.0  # ... and per second
MAX_TRACKED: Final = 4096  # (peer, kind) buckets; the stalest is forgotten first
SUMMARY_INTERVAL_S: Final = 10.0
SUMMARY_PEERS: Final = 8  # peers named in one summary line; the rest are counted
LIMITED: Final = ("rate_limited", "too many refused requests; retry later")
PER_LINK: Final = 4  # requests served at once to one peer (a worker fetches <= 4 at a time)
PER_NODE: Final = 16  # requests served at once by this node, per kind


@dataclass
class TokenBucket:
    """``capacity`` tokens, refilled at ``per_s`` a second (trio's clock, or any clock)."""

    capacity: float
    per_s: float
    tokens: float = math.inf  # full until first charged
    at: float = 0.0

    def __post_init__(self) -> None:
        self.tokens = min(self.tokens, self.capacity)

    def level(self, now: float) -> float:
        return min(self.capacity, self.tokens + (now - self.at) * self.per_s)

    def charge(self, now: float) -> None:
        """One token, into debt if there is none (down to ``-capacity``): work admitted
        while tokens were left but charged after them is paid for all the same."""
        self.tokens, self.at = max(-self.capacity, self.level(now) - 1), now

    def has(self, now: float) -> bool:
        return self.level(now) >= 1

    def full(self, now: float) -> bool:
        return self.level(now) >= self.capacity


@dataclass
class _Tally:
    refused: Counter[str] = field(default_factory=Counter)  # reason -> count
    limited: int = 0  # refused at the open


class RequestGate:
    """The refusal budget of one service's stream kinds (see the module doc)."""

    def __init__(
        self,
        *,
        burst: float = REFUSALS_BURST,
        per_s: float = REFUSALS_PER_S,
        node_burst: float = NODE_REFUSALS_BURST,
        node_per_s: float = NODE_REFUSALS_PER_S,
    ) -> None:
        self.burst, self.per_s = burst, per_s
        self._buckets: dict[tuple[str, int], TokenBucket] = {}
        self._node = TokenBucket(node_burst, node_per_s)
        self._tally: dict[tuple[str, int], _Tally] = {}  # since the last summary
        self.counters: Counter[str] = Counter()  # refused / limited, since start

    def _bucket(self, peer_id: str, kind: int) -> TokenBucket:
        key = (peer_id, kind)
        bucket = self._buckets.pop(key, None) or TokenBucket(self.burst, self.per_s)
        self._buckets[key] = bucket  # re-inserted: most recent last
        while len(self._buckets) > MAX_TRACKED:
            del self._buckets[next(iter(self._buckets))]
        return bucket

    def admit(self, peer: AuthenticatedPeer, kind: int) -> tuple[str, str] | None:
        """At a stream's open: ``None`` to run its handler, else the refusal to answer."""
        now = trio.current_time()
        bucket = self._buckets.get((peer.node_id, kind))
        if bucket is None:
            return None
        if bucket.has(now) and (
            peer.trusted or self._node.has(now) or bucket.full(now)
        ):
            return None
        self.counters["limited"] += 1
        self._tally.setdefault((peer.node_id, kind), _Tally()).limited += 1
        return LIMITED

    def refused(self, peer: AuthenticatedPeer, kind: int, reason: str, detail: str = "") -> None:
        """A handler refused ``peer``'s request of ``kind``: charge it, log it (the first in
        an interval in full, the rest in the summary)."""
        now = trio.current_time()
        self._bucket(peer.node_id, kind).charge(now)
        if not peer.trusted:
            self._node.charge(now)
        self.counters["refused"] += 1
        key = (peer.node_id, kind)
        tally = self._tally.get(key)
        if tally is None:
            tally = self._tally[key] = _Tally()
        if sum(tally.refused.values()) == 0 and len(self._tally) <= SUMMARY_PEERS:
            log.info(
                "refused a kind %#04x request of %s: %s%s (more in the next summary)",
                kind,
                short_id(peer.node_id),
                reason,
                f" ({detail})" if detail else "",
            )
        tally.refused[reason] += 1

    def summary(self) -> str | None:
        """One line for what was refused since the last summary (None if nothing more than
        the first lines said); starts the next interval."""
        tally, self._tally = self._tally, {}
        busy = {k: t for k, t in tally.items() if t.limited or sum(t.refused.values()) > 1}
        if not busy:
            return None
        ranked = sorted(
            busy.items(), key=lambda kv: -(kv[1].limited + sum(kv[1].refused.values()))
        )
        parts = []
        for (peer_id, kind), t in ranked[:SUMMARY_PEERS]:
            reasons = ", ".join(f"{r} {n}" for r, n in t.refused.most_common(3))
            parts.append(
                f"{short_id(peer_id)} kind {kind:#04x}: {sum(t.refused.values())} refused"
                f"{f' ({reasons})' if reasons else ''}, {t.limited} at the open"
            )
        more = len(ranked) - SUMMARY_PEERS
        tail = f"; and {more} more peers" if more > 0 else ""
        return f"refused requests in the last {SUMMARY_INTERVAL_S:g} s: {'; '.join(parts)}{tail}"

    async def run(self) -> None:
        """Log ``summary`` every ``SUMMARY_INTERVAL_S`` until cancelled."""
        while True:
            await trio.sleep(SUMMARY_INTERVAL_S)
            line = self.summary()
            if line is not None:
                log.warning("%s", line)


class RequestSlots:
    """Requests served at once: at most ``per_link`` per peer and ``per_node`` in all. A
    request waits at most ``wait_s`` for its slots (then the handler answers busy)."""

    def __init__(self, per_link: int = PER_LINK, per_node: int = PER_NODE) -> None:
        self.per_link = per_link
        self.node = trio.CapacityLimiter(per_node)
        self._links: dict[str, trio.CapacityLimiter] = {}

    @asynccontextmanager
    async def slot(self, peer_id: str, wait_s: float) -> AsyncIterator[bool]:
        """Yields True holding both slots, False when either did not come within ``wait_s``."""
        link = self._links.setdefault(peer_id, trio.CapacityLimiter(self.per_link))
        try:
            if not await _acquire(link, wait_s):
                yield False
                return
            try:
                if not await _acquire(self.node, wait_s):
                    yield False
                    return
                try:
                    yield True
                finally:
                    self.node.release()
            finally:
                link.release()
        finally:
            stats = link.statistics()
            if stats.borrowed_tokens == 0 and stats.tasks_waiting == 0:
                self._links.pop(peer_id, None)


async def _acquire(slots: trio.CapacityLimiter, wait_s: float) -> bool:
    with trio.move_on_after(wait_s):
        await slots.acquire()
        return True
    return False
