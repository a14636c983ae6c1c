"""The node-wide budget for memory held on behalf of peers.

Each link already bounds itself (32 streams x 4 MiB window, one WebSocket message in parsing, a
1 MiB control backlog), but 32 links x 32 streams x a 1 MiB message prefix is a gigabyte: the
node needs one cap over all of them. Every byte a peer makes this node hold is *taken* from
this budget before it is buffered, and *given* back when it is consumed or when its stream or
link ends:
- at the transport (``mesh_node.budgeted_tcp.BudgetedStream``): bytes read from the socket,
  held by the link's WebSocket (the parts of a message not yet whole) until the link's
  reader has taken the message; a read waits for room (TCP pushes back on the peer);
- in the link: received stream data not yet read by its handler, a partly received
  length-prefixed message. A take that does not fit resets only that stream
  (``memory_budget``).

Pools and fairness: untrusted accounts (a pending handshake, a peer whose owner we do not
trust) together hold at most ``UNTRUSTED_FRACTION`` of the budget, so strangers can never
crowd out a trusted peer; trusted ones may use all of it. Within a pool, while it holds less
than half its capacity any account may take; above half, an account may hold at most its
share (capacity / accounts in the pool, never less than ``FLOOR_BYTES``: one largest stream
message plus one WebSocket message, so every link can always make progress).

Plain bookkeeping, one thread (trio's): no locks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import trio

from mesh_node.turns import Turnstile

MIB: Final = 1024 * 1024
# A whole stream message (1 MiB + its prefix) and the WebSocket message completing it.
FLOOR_BYTES: Final = 4 * MIB
# The part of the budget all untrusted accounts together may hold.
UNTRUSTED_FRACTION: Final = 0.5
WAKE_BYTES: Final = 64 * 1024  # freed bytes that wake reads waiting for room
# Untrusted reads together, while strangers hold over this part of their pool (``pace``).
PRESSURE_FRACTION: Final = 0.75
PRESSURE_BYTES_PER_S: Final = 32 * MIB


class PeerMemory:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.untrusted_cap = int(budget_bytes * UNTRUSTED_FRACTION)
        self.total = 0
        self.peak = 0
        self.refusals = 0  # takes refused (a stream reset)
        self.stalls = 0  # transport reads that waited for room
        self._held: dict[int, int] = {}  # per account (a link, or a connection before it)
        self._peak: dict[int, int] = {}
        self._trusted: set[int] = set()
        self._pool_total = [0, 0]  # [untrusted, trusted]
        self._freed = trio.lowlevel.ParkingLot()
        # Per account: how to make it let go of bytes (a link resets its largest stream).
        self._shedders: dict[int, Callable[[], int]] = {}
        self.preempted = 0
        self._freed_since_wake = 0
        self._paced_until = 0.0  # trio clock
        self.paced = 0
        self.turns = Turnstile()

    # --- accounts -----------------------------------------------------------------------------
    def open(self, key: int, *, trusted: bool = False) -> None:
        if key not in self._held:
            self._held[key] = 0
            self._peak[key] = 0
            if trusted:
                self._trusted.add(key)

    def close(self, key: int) -> int:
        """The account ended: everything it held is released. Returns the most it held."""
        held = self._held.pop(key, 0)
        self._shedders.pop(key, None)
        self.total -= held
        self._pool_total[key in self._trusted] -= held
        self._trusted.discard(key)
        self._wake()
        return self._peak.pop(key, 0)

    def set_trusted(self, key: int, trusted: bool) -> None:
        """The account's peer became trusted or stopped being trusted (its bytes move pool)."""
        if key not in self._held or (key in self._trusted) == trusted:
            return
        held = self._held[key]
        self._pool_total[not trusted] -= held
        self._pool_total[trusted] += held
        if trusted:
            self._trusted.add(key)
        else:
            self._trusted.discard(key)
        self._wake()

    def on_pressure(self, key: int, shed: Callable[[], int]) -> None:
        """``shed()`` releases some of what ``key`` holds (returns how much): called when a
        fairer account needs room (``take_some``)."""
        if key in self._held:
            self._shedders[key] = shed

    def _preempt(self, key: int) -> bool:
        """Room for ``key``, which holds less than its share, from the largest holder over
        its pool's even split (capacity / accounts) that holds more than ``key``: one of the
        same pool, or an untrusted one (strangers never crowd out a trusted peer, nor a
        newcomer among them). True if something was released."""
        trusted = key in self._trusted
        mine = self._held[key]
        if mine >= self.share(trusted=trusted):
            return False
        over: list[tuple[int, int]] = []
        for other, held in self._held.items():
            pool = other in self._trusted
            eligible = other != key and other in self._shedders and (pool == trusted or not pool)
            if eligible and held > max(mine, self._even(pool)):
                over.append((held, other))
        for _, other in sorted(over, reverse=True):
            if self._shedders[other]() > 0:
                self.preempted += 1
                return True
        return False

    def _even(self, trusted: bool) -> int:
        accounts = len(self._trusted) if trusted else len(self._held) - len(self._trusted)
        return self._capacity(trusted) // max(1, accounts)

    def held(self, key: int) -> int:
        return self._held.get(key, 0)

    def is_trusted(self, key: int) -> bool:
        return key in self._trusted

    # --- decisions -----------------------------------------------------------------------------
    def share(self, *, trusted: bool = False) -> int:
        """The most one account of a pool may hold once its pool is above half."""
        accounts = len(self._trusted) if trusted else len(self._held) - len(self._trusted)
        return max(FLOOR_BYTES, self._capacity(trusted) // max(1, accounts))

    def _capacity(self, trusted: bool) -> int:
        return self.budget_bytes if trusted else self.untrusted_cap

    def room(self, key: int) -> int:
        """The most ``take(key, n)`` would grant now (0 for an account that is not open)."""
        if key not in self._held:
            return 0
        trusted = key in self._trusted
        capacity, pooled = self._capacity(trusted), self._pool_total[trusted]
        fair = max(capacity // 2 - pooled, self.share(trusted=trusted) - self._held[key])
        return max(0, min(fair, capacity - pooled, self.budget_bytes - self.total))

    def take(self, key: int, nbytes: int) -> bool:
        """Reserve ``nbytes`` for ``key`` before buffering them; False: do not buffer."""
        if nbytes <= 0:
            return True
        if nbytes > self.room(key):
            self.refusals += 1
            return False
        self._add(key, nbytes)
        return True

    def take_some_now(self, key: int, want: int) -> int:
        """``take_some`` without waiting: the bytes reserved (1..``want``), 0 if the account
        closed, -1 if there is no room now (then ``take_some`` waits, or makes room)."""
        if key not in self._held:
            return 0
        got = min(want, self.room(key))
        if got <= 0:
            return -1
        self._add(key, got)
        return got

    async def take_some(self, key: int, want: int) -> int:
        """Reserve between 1 and ``want`` bytes for ``key``, waiting until there is room (a
        transport read: the bytes stay in the kernel meanwhile). 0 if the account closed."""
        while True:
            if key not in self._held:
                await trio.lowlevel.checkpoint()
                return 0
            got = min(want, self.room(key))
            if got > 0:
                self._add(key, got)
                await trio.lowlevel.checkpoint()
                return got
            if self._preempt(key):
                continue
            self.stalls += 1
            await self._freed.park()

    def under_pressure(self) -> bool:
        """Strangers hold more than ``PRESSURE_FRACTION`` of what they may: the signature of
        a flood (honest transfers, even several at once into one node, hold far less)."""
        return self._pool_total[0] > self.untrusted_cap * PRESSURE_FRACTION

    async def pace(self, key: int, nbytes: int) -> None:
        """After an untrusted account read ``nbytes``: under pressure, all untrusted reads
        together proceed at ``PRESSURE_BYTES_PER_S`` (one virtual clock, first come first
        served), so that a flood cannot keep the event loop busy and an honest trusted link
        is answered within milliseconds. Trusted accounts, and everyone without pressure,
        are never paced."""
        if key in self._trusted or not self.under_pressure():
            return
        now = trio.current_time()
        self._paced_until = max(now, self._paced_until) + nbytes / PRESSURE_BYTES_PER_S
        self.paced += 1
        await trio.sleep(self._paced_until - now)

    async def take_turn(self, key: int) -> bool:
        """An untrusted account's next work item (a read, a message, a stream handler's
        step) waits its turn: one stranger's item per batch of the scheduler
        (``mesh_node.turns``), so a trusted link is served between two of them however many
        strangers are busy; under pressure (a flood) strangers also rest half of the time
        (``Turnstile.turn(rest=True)``). Alone, a stranger waits one scheduler pass (a
        checkpoint); trusted accounts return at once, without a checkpoint. True if it
        queued behind another stranger."""
        if key in self._trusted:
            return False
        return await self.turns.turn(rest=self.under_pressure(), key=key)

    def _add(self, key: int, nbytes: int) -> None:
        held = self._held[key] + nbytes
        self._held[key] = held
        self._peak[key] = max(self._peak[key], held)
        self._pool_total[key in self._trusted] += nbytes
        self.total += nbytes
        self.peak = max(self.peak, self.total)

    def give(self, key: int, nbytes: int) -> None:
        """Bytes ``key`` held were consumed or dropped."""
        if nbytes <= 0 or key not in self._held:
            return
        n = min(nbytes, self._held[key])
        self._held[key] -= n
        self._pool_total[key in self._trusted] -= n
        self.total -= n
        self._wake(n)

    def _wake(self, freed: int = WAKE_BYTES) -> None:
        """Wake waiting reads once enough was freed to matter (many small gives would wake
        every stalled link again and again; each also looks again every 0.25 s)."""
        self._freed_since_wake += freed
        if self._freed_since_wake >= WAKE_BYTES and self._freed.statistics().tasks_waiting:
            self._freed_since_wake = 0
            self._freed.unpark_all()

    def to_dict(self) -> dict[str, int]:
        return {
            "budget_bytes": self.budget_bytes,
            "untrusted_cap_bytes": self.untrusted_cap,
            "held_bytes": self.total,
            "held_untrusted_bytes": self._pool_total[0],
            "peak_bytes": self.peak,
            "links": len(self._held),
            "refusals": self.refusals,
            "stalls": self.stalls,
            "preempted": self.preempted,
            "paced": self.paced,
            "turns_queued": self.turns.queued,
            "turns_rested": self.turns.rests,
        }
