"""Emulated WAN links for labs, tests and benchmarks: a userspace relay.

This kernel has no netem (runtime-facts.md): delay and jitter need a userspace link. ``Netem`` runs
one TCP relay per ordered pair of nodes (``route(src, dst)``: the address ``src`` dials to
reach ``dst``) on loopback; a node is pointed at its relays through its ``dial_via`` table
(``mesh_node.settings``), so every link, configured or learned by gossip, crosses one relay. Each
relay forwards bytes both ways and applies, per direction of the data (``src -> dst`` uses
``links.spec(src, dst)``, the answers ``links.spec(dst, src)``):

* a one-way delay of half the spec's round-trip time, plus uniform jitter (+-``jitter_s``),
  never reordering bytes (TCP does not);
* a rate limit: bytes leave at most at ``rate_bytes_per_s``, one bottleneck per direction
  shared by every connection between the two nodes (a token bucket one chunk deep);
* random faults per forwarded chunk: ``loss`` drops the whole connection (both ends see a
  reset, as after a NAT timeout or a middlebox), ``stall`` holds the direction for
  ``stall_s`` (a retransmission timeout);
* on command, ``partition(node)`` cuts every link of a node: ``blackhole`` stops forwarding
  (connections stay open and silent, new ones are accepted and held, like dropped packets),
  ``reset`` resets them and refuses new ones; ``heal(node)`` restores forwarding.

What happens is recorded in ``Netem.events`` (times from trio's clock, which tests may
replace): tests check delays, rates and faults against that log instead of a wall clock.
The decisions (``DelayLine``) are pure: time and randomness are passed in. Test and lab
tooling, never the node's data path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import logging
import os
import random
import re
import socket
import struct
import time
import tomllib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final, Literal

import trio
from trio.testing import MockClock

from skippy.errors import UsageError

log = logging.getLogger("mesh_node.lab.netem")

CHUNK_BYTES: Final = 64 * 1024  # one read from a socket: the unit faults and the log see
MIN_QUEUE_BYTES: Final = 4 * 1024 * 1024  # per direction, besides the bytes in flight
MAX_EVENTS: Final = 200_000
# trio's sleeps wake up to ~1 ms late: epoll's timeout is whole milliseconds, rounded up. A
# relay that slept until each chunk was due added that to every frame (measured 2026-12-01:
# +0.5 ms median, +3.3 ms p90 per one-way pass at 5 ms, loaded), so it sleeps until this much
# before the deadline and then yields to the loop until the deadline has passed.
TIMER_SLACK_S: Final = 0.0015
# A timerfd fires on time, but waking the relay's thread from idle takes ~0.3-0.5 ms on this
# VM (its log's lateness with a pure timerfd wait: 0.30-0.54 ms median against 0.11-0.16 with
# the yield loop): it sleeps to this much before the frame is due, then yields.
TIMERFD_SLACK_S: Final = 0.0006
WRITE_BATCH_BYTES: Final = 1024 * 1024  # chunks due together leave in one write, up to this
MAX_BATCH: Final = 64
PartitionMode = Literal["blackhole", "reset"]


# --- link specs and their spelling ------------------------------------------------------------
@dataclass(frozen=True)
class LinkSpec:
    """One direction of an emulated link. ``rtt_s`` is the round trip the pair adds: each
    direction delays by half of it."""

    rtt_s: float = 0.0
    jitter_s: float = 0.0  # one-way, uniform in [-jitter_s, +jitter_s]
    rate_bytes_per_s: float | None = None  # None: unlimited
    loss: float = 0.0  # per chunk: probability the connection is dropped
    stall: float = 0.0  # per chunk: probability the direction stalls for stall_s
    stall_s: float = 0.2

    def __post_init__(self) -> None:
        for name in ("rtt_s", "jitter_s", "stall_s"):
            if getattr(self, name) < 0:
                raise UsageError(f"link {name} must not be negative", code="usage")
        if self.rate_bytes_per_s is not None and self.rate_bytes_per_s <= 0:
            raise UsageError("a link rate must be positive", code="usage")
        for name in ("loss", "stall"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UsageError(f"link {name} must be a probability (0..100%)", code="usage")

    @property
    def one_way_s(self) -> float:
        return self.rtt_s / 2

    @property
    def shaped(self) -> bool:
        return self != LinkSpec()

    def describe(self) -> str:
        parts = [f"rtt {self.rtt_s * 1000:g} ms"]
        if self.jitter_s:
            parts.append(f"jitter {self.jitter_s * 1000:g} ms")
        if self.rate_bytes_per_s is not None:
            parts.append(f"rate {format_rate(self.rate_bytes_per_s)}")
        if self.loss:
            parts.append(f"loss {self.loss * 100:g}%")
        if self.stall:
            parts.append(f"stall {self.stall * 100:g}% x {self.stall_s * 1000:g} ms")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rtt_ms": self.rtt_s * 1000,
            "jitter_ms": self.jitter_s * 1000,
            "rate_bits_per_s": (
                None if self.rate_bytes_per_s is None else self.rate_bytes_per_s * 8
            ),
            "loss": self.loss,
            "stall": self.stall,
            "stall_ms": self.stall_s * 1000,
        }


_DURATION_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s)?\s*$")
_RATE_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps|b)?(?:/s)?\s*$", re.I)
_PERCENT_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%)?\s*$")


def parse_duration(text: str, what: str) -> float:
    """Seconds from ``20ms``, ``1.5s``, ``500us`` or a bare number of milliseconds."""
    m = _DURATION_RE.match(text)
    if m is None:
        raise UsageError(f"{what}: expected a duration such as 20ms or 1.5s, not {text!r}")
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}[m.group(2)]
    return float(m.group(1)) * scale


def parse_rate(text: str, what: str) -> float:
    """Bytes per second from ``100Mbit``, ``1Gbit``, ``512kbit`` (bits) or ``20MB`` (bytes)."""
    m = _RATE_RE.match(text)
    if m is None or float(m.group(1)) <= 0:
        raise UsageError(f"{what}: expected a rate such as 100Mbit or 1Gbit, not {text!r}")
    scale = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    unit = m.group(3) or "bit"
    bits = unit.lower() in ("bit", "bps") or (unit == "b")  # b = bits, B = bytes (tc's words)
    return float(m.group(1)) * scale / (8 if bits else 1)


def parse_probability(text: str, what: str) -> float:
    """A probability from ``0.1%`` or ``0.001``."""
    m = _PERCENT_RE.match(text)
    value = None if m is None else float(m.group(1)) / (100 if m.group(2) else 1)
    if value is None or not 0 <= value <= 1:
        raise UsageError(f"{what}: expected a probability such as 0.1% or 0.001, not {text!r}")
    return value


def format_rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


@dataclass(frozen=True)
class LinkTable:
    """Every direction's spec: ``default``, overridden per ordered pair of node labels."""

    default: LinkSpec = field(default_factory=LinkSpec)
    pairs: Mapping[tuple[str, str], LinkSpec] = field(default_factory=dict)

    def spec(self, src: str, dst: str) -> LinkSpec:
        return self.pairs.get((src, dst), self.default)

    @property
    def shaped(self) -> bool:
        return self.default.shaped or any(s.shaped for s in self.pairs.values())


_SPEC_KEYS: Final = frozenset({"latency", "jitter", "rate", "loss", "stall", "stall_time"})


def spec_from_words(words: Mapping[str, Any], base: LinkSpec, where: str) -> LinkSpec:
    """A spec from a lab file's table (``latency = "20ms"``, ``rate = "100Mbit"``, ...); keys it
    does not name keep ``base``'s values."""
    unknown = set(words) - _SPEC_KEYS
    if unknown:
        raise UsageError(
            f"{where}: unknown link key(s) {', '.join(sorted(unknown))} "
            f"(known: {', '.join(sorted(_SPEC_KEYS))})"
        )

    def text(key: str) -> str | None:
        value = words.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise UsageError(f"{where}.{key}: expected a string such as 20ms, 100Mbit or 0.1%")
        return str(value)

    values: dict[str, Any] = {}
    if (v := text("latency")) is not None:
        values["rtt_s"] = parse_duration(v, f"{where}.latency")
    if (v := text("jitter")) is not None:
        values["jitter_s"] = parse_duration(v, f"{where}.jitter")
    if (v := text("rate")) is not None:
        values["rate_bytes_per_s"] = parse_rate(v, f"{where}.rate")
    if (v := text("loss")) is not None:
        values["loss"] = parse_probability(v, f"{where}.loss")
    if (v := text("stall")) is not None:
        values["stall"] = parse_probability(v, f"{where}.stall")
    if (v := text("stall_time")) is not None:
        values["stall_s"] = parse_duration(v, f"{where}.stall_time")
    return LinkSpec(**{**base.__dict__, **values})


def link_table_from_toml(doc: Mapping[str, Any], default: LinkSpec) -> LinkTable:
    """A lab file's links: ``[links]`` (every link) and ``[[links.pair]]`` entries with ``a``
    and ``b`` (node indexes; both directions unless ``oneway = true``) and the same keys::

        [links]
        latency = "5ms"
        [[links.pair]]
        a = 0
        b = 2
        latency = "50ms"
        rate = "10Mbit"
    """
    unknown = set(doc) - {"links"}
    if unknown:
        raise UsageError(f"lab file: unknown section(s) {', '.join(sorted(unknown))}")
    links = doc.get("links", {})
    if not isinstance(links, Mapping):
        raise UsageError("lab file: [links] must be a table")
    pairs_raw = links.get("pair", [])
    if not isinstance(pairs_raw, list):
        raise UsageError("lab file: links.pair must be an array of tables ([[links.pair]])")
    base = spec_from_words({k: v for k, v in links.items() if k != "pair"}, default, "links")
    pairs: dict[tuple[str, str], LinkSpec] = {}
    for i, entry in enumerate(pairs_raw):
        where = f"links.pair[{i}]"
        if not isinstance(entry, Mapping):
            raise UsageError(f"{where}: expected a table")
        a, b, oneway = entry.get("a"), entry.get("b"), entry.get("oneway", False)
        if not (isinstance(a, int) and isinstance(b, int)) or a == b or a < 0 or b < 0:
            raise UsageError(f"{where}: a and b must be two different node indexes")
        if not isinstance(oneway, bool):
            raise UsageError(f"{where}.oneway: expected true or false")
        words = {k: v for k, v in entry.items() if k not in ("a", "b", "oneway")}
        spec = spec_from_words(words, base, where)
        pairs[(f"n{a}", f"n{b}")] = spec
        if not oneway:
            pairs[(f"n{b}", f"n{a}")] = spec
    return LinkTable(base, pairs)


def load_lab_file(path: Path, default: LinkSpec) -> LinkTable:
    """``mesh-node lab --links FILE``: read and check a lab file (``link_table_from_toml``)."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise UsageError(
            f"cannot read lab file {path}: {exc.strerror}", code="unreadable_input"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(
            f"lab file {path} is not valid TOML: {exc}", code="invalid_config"
        ) from None
    return link_table_from_toml(doc, default)


# --- the pure part: when each chunk arrives ---------------------------------------------------
@dataclass(frozen=True)
class Scheduled:
    depart_s: float  # when its last byte leaves the rate bottleneck
    arrive_s: float  # when it is delivered to the far side
    drop: bool = False  # the connection is dropped instead
    stalled: bool = False  # a stall was added before it


class DelayLine:
    """One direction of one pair of nodes: the rate bottleneck (shared by its connections)
    and the delay, jitter and fault draws. ``schedule`` is pure given ``now`` and the RNG."""

    def __init__(self, spec: LinkSpec, rng: random.Random) -> None:
        self.spec = spec
        self.rng = rng
        self._free_at = -float("inf")  # the bottleneck is busy until then

    def schedule(self, nbytes: int, now: float, not_before: float) -> Scheduled:
        """A chunk read at ``now``; ``not_before`` is its connection's last arrival (bytes of
        one connection never overtake each other)."""
        spec = self.spec
        if spec.loss and self.rng.random() < spec.loss:
            return Scheduled(now, now, drop=True)
        depart = now
        if spec.rate_bytes_per_s is not None:
            depart = max(now, self._free_at) + nbytes / spec.rate_bytes_per_s
            self._free_at = depart
        delay = spec.one_way_s
        if spec.jitter_s:
            delay = max(0.0, delay + self.rng.uniform(-spec.jitter_s, spec.jitter_s))
        stalled = bool(spec.stall) and self.rng.random() < spec.stall
        arrive = max(not_before, depart + delay + (spec.stall_s if stalled else 0.0))
        return Scheduled(depart, arrive, stalled=stalled)

    def queue_limit(self) -> int:
        """Bytes a direction may hold: what is in flight at the link's rate plus a queue."""
        if self.spec.rate_bytes_per_s is None:
            return MIN_QUEUE_BYTES + int(self.spec.rtt_s * 1e9)  # ~8 Gbit/s in flight
        in_flight = self.spec.rate_bytes_per_s * (self.spec.one_way_s + self.spec.jitter_s)
        return MIN_QUEUE_BYTES + int(in_flight)


def sleep_target(now: float, deadline: float, slack_s: float = TIMER_SLACK_S) -> float | None:
    """Until when a relay may sleep before a chunk due at ``deadline`` (``None``: no sleep,
    it is due or too close for a timer that can be ``slack_s`` late; yield until it instead)."""
    if deadline - now <= slack_s:
        return None
    return deadline - slack_s


class _ITimerSpec(ctypes.Structure):
    _fields_ = [
        ("interval_s", ctypes.c_long),
        ("interval_ns", ctypes.c_long),
        ("value_s", ctypes.c_long),
        ("value_ns", ctypes.c_long),
    ]


_CLOCK_MONOTONIC, _TFD_NONBLOCK, _TFD_CLOEXEC, _TFD_TIMER_ABSTIME = 1, 0o4000, 0o2000000, 1


@functools.cache
def _libc_timerfd() -> tuple[Any, Any] | None:
    """``timerfd_create`` and ``timerfd_settime`` (Linux); None elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        create, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    create.argtypes, create.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_ITimerSpec), ctypes.c_void_p]
    settime.restype = ctypes.c_int
    return create, settime


async def _timerfd_wait(deadline: float) -> bool:
    """Sleep until ``deadline`` (trio's clock) on an absolute CLOCK_MONOTONIC timerfd: epoll
    wakes when it fires, to tens of microseconds, where trio's own timed sleeps wake in whole
    milliseconds, rounded up. False (nothing waited) where there is no timerfd."""
    fns = _libc_timerfd()
    if fns is None:
        return False
    create, settime = fns
    fd = create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
    if fd < 0:
        return False
    try:
        # trio's clock and CLOCK_MONOTONIC differ by an offset: go by the time left
        at = time.monotonic() + max(0.0, deadline - trio.current_time())
        whole = int(at)
        spec = _ITimerSpec(0, 0, whole, max(1, int((at - whole) * 1e9)))
        if settime(fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            return False
        await trio.lowlevel.wait_readable(fd)
        return True
    finally:
        trio.lowlevel.notify_closing(fd)
        os.close(fd)


async def wait_until(deadline: float) -> None:
    """Until ``deadline`` on trio's clock, neither early nor ~1 ms late: a sleep to just
    before it (on Linux a timerfd to ``TIMERFD_SLACK_S`` before it, ``_timerfd_wait``;
    elsewhere trio's timer to ``TIMER_SLACK_S`` before it), then checkpoints (other relays
    keep running) until it has passed: the shorter the yielding, the more of a core is left to
    the stages beside it. Under a ``MockClock`` sleeps are exact and time moves only while
    every task sleeps: plain sleep."""
    if isinstance(trio.lowlevel.current_clock(), MockClock):
        await trio.sleep_until(deadline)
        return
    target = sleep_target(trio.current_time(), deadline, TIMERFD_SLACK_S)
    if target is None or not await _timerfd_wait(target):
        target = sleep_target(trio.current_time(), deadline)
        if target is not None:
            await trio.sleep_until(target)
    while trio.current_time() < deadline:  # never early (a timer may fire a hair before)
        await trio.lowlevel.checkpoint()


# --- the event log ----------------------------------------------------------------------------
EventKind = Literal[
    "accept", "connect", "chunk", "drop", "stall", "close", "refuse", "hold", "partition", "heal"
]


@dataclass(frozen=True)
class NetemEvent:
    t: float  # trio clock
    kind: EventKind
    src: str  # the data's sender (for "chunk"); the dialer otherwise
    dst: str
    conn: int = 0
    nbytes: int = 0
    read_s: float = 0.0  # chunk: when the relay read it
    arrive_s: float = 0.0  # chunk: when it was due at the far side
    sent_s: float = 0.0  # chunk: when the relay finished writing it
    detail: str = ""


# --- the relays -------------------------------------------------------------------------------
class _Direction:
    """One direction of one relayed connection: a reader that schedules, a writer that delivers
    on time. Bounded: the reader stops reading when ``queue_limit`` bytes wait."""

    def __init__(self, netem: Netem, conn: _Connection, src: str, dst: str) -> None:
        self.netem, self.conn, self.src, self.dst = netem, conn, src, dst
        self.line = netem._line(src, dst)
        self.queue: deque[tuple[Scheduled, float, bytes]] = deque()
        self.queued = 0
        self.last_arrive = -float("inf")
        self.changed = trio.lowlevel.ParkingLot()  # no Event allocated per chunk

    def _poke(self) -> None:
        self.changed.unpark_all()

    async def read(self, stream: trio.SocketStream) -> None:
        while True:
            while self.queued >= self.line.queue_limit():
                await self.changed.park()
            data = await stream.receive_some(CHUNK_BYTES)
            if not data:
                self.queue.append((Scheduled(0.0, self.last_arrive), 0.0, b""))  # EOF marker
                self._poke()
                return
            now = trio.current_time()
            s = self.line.schedule(len(data), now, self.last_arrive)
            if s.drop:
                self.netem._record("drop", self.src, self.dst, self.conn.id, len(data), now)
                self.conn.reset("loss")
                return
            if s.stalled:
                self.netem._record("stall", self.src, self.dst, self.conn.id, len(data), now)
            self.last_arrive = s.arrive_s
            self.queue.append((s, now, data))
            self.queued += len(data)
            self._poke()

    async def write(self, stream: trio.SocketStream) -> None:
        while True:
            while not self.queue:
                await self.changed.park()
            s, _, data = self.queue[0]
            if s.arrive_s > trio.current_time():  # due now (0 ms links): no extra loop pass
                if len(self.queue) == 1:  # a lone frame (a token, an ack): exactly on time
                    await wait_until(s.arrive_s)
                else:  # a stream of chunks: a timer at most ~1 ms late, never a yield loop
                    await trio.sleep_until(s.arrive_s)
            await self.netem._wait_unblocked(self.src, self.dst)
            if not data:
                await stream.send_eof()
                self.queue.popleft()
                return
            # Every chunk due by now leaves in one write (after a late wake-up, a busy link).
            n = due_count(
                [(q[0].arrive_s, len(q[2])) for q in itertools.islice(self.queue, MAX_BATCH)],
                trio.current_time(),
                WRITE_BATCH_BYTES,
            )
            batch = [self.queue.popleft() for _ in range(n)]
            await stream.send_all(batch[0][2] if n == 1 else b"".join(q[2] for q in batch))
            self.queued -= sum(len(q[2]) for q in batch)
            self._poke()
            sent = trio.current_time()
            for sched, read_s, chunk in batch:
                self.netem._record(
                    "chunk", self.src, self.dst, self.conn.id, len(chunk), read_s,
                    read_s=read_s, arrive_s=sched.arrive_s, sent_s=sent,
                )


def due_count(queue: list[tuple[float, int]], now: float, max_bytes: int) -> int:
    """How many leading chunks of ``queue`` (arrival time, bytes) one write may carry: those
    due by ``now``, up to ``max_bytes`` (at least the first, which the caller waited for),
    never past an end-of-stream marker (0 bytes)."""
    count, size = 0, 0
    for arrive_s, nbytes in queue:
        if count and (arrive_s > now or nbytes == 0 or size + nbytes > max_bytes):
            break
        count, size = count + 1, size + nbytes
        if nbytes == 0:
            break
    return count


class _Connection:
    def __init__(self, netem: Netem, cid: int, src: str, dst: str) -> None:
        self.netem, self.id, self.src, self.dst = netem, cid, src, dst
        self.scope = trio.CancelScope()
        self.streams: list[trio.SocketStream] = []
        self.reason: str | None = None

    def reset(self, why: str) -> None:
        """Abort both ends with a TCP reset (SO_LINGER 0), as a middlebox would."""
        if self.reason is None:
            self.reason = why
        for stream in self.streams:
            _abort(stream)
        self.scope.cancel()


def _abort(stream: trio.SocketStream) -> None:
    with contextlib.suppress(OSError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class Netem:
    """Relays between labelled nodes; see the module docstring. Use ``open_netem``."""

    def __init__(self, links: LinkTable, *, seed: int = 0) -> None:
        self.links = links
        self.seed = seed
        self.events: deque[NetemEvent] = deque(maxlen=MAX_EVENTS)
        self.counts: dict[str, int] = {}
        self._lines: dict[tuple[str, str], DelayLine] = {}
        self._routes: dict[tuple[str, str], int] = {}  # (src, dst) -> relay port
        self._targets: dict[str, Callable[[], tuple[str, int] | None]] = {}
        self._connections: set[_Connection] = set()
        self._partitions: dict[str, PartitionMode] = {}
        self._healed = trio.Event()
        self._next_id = 0
        self._nursery: trio.Nursery | None = None

    # --- set-up ---------------------------------------------------------------------------------
    def _line(self, src: str, dst: str) -> DelayLine:
        line = self._lines.get((src, dst))
        if line is None:
            rng = random.Random(f"{self.seed}:{src}->{dst}")  # reproducible per direction
            line = self._lines[(src, dst)] = DelayLine(self.links.spec(src, dst), rng)
        return line

    def set_links(self, links: LinkTable) -> None:
        """Change every link's spec from now on (chunks already scheduled keep theirs): one
        running lab can be measured at several latencies."""
        self.links = links
        for (src, dst), line in self._lines.items():
            line.spec = links.spec(src, dst)

    def set_target(self, node: str, target: Callable[[], tuple[str, int] | None]) -> None:
        """Where ``node`` listens (looked up per connection: a restarted node may move)."""
        self._targets[node] = target

    async def route(self, src: str, dst: str) -> str:
        """Start (once) the relay that ``src`` dials to reach ``dst``; its ``ws://`` address."""
        port = self._routes.get((src, dst))
        if port is None:
            if self._nursery is None:
                raise RuntimeError("Netem is not running: use open_netem()")

            async def handler(stream: trio.SocketStream) -> None:
                await self._relay(stream, src, dst)

            listeners = await self._nursery.start(
                partial(trio.serve_tcp, handler, 0, host="127.0.0.1")
            )
            port = listeners[0].socket.getsockname()[1]
            self._routes[(src, dst)] = port
        return f"ws://127.0.0.1:{port}"

    def routes(self) -> dict[tuple[str, str], str]:
        return {k: f"ws://127.0.0.1:{p}" for k, p in self._routes.items()}

    # --- faults on command ------------------------------------------------------------------------
    def partition(self, node: str, mode: PartitionMode = "blackhole") -> None:
        """Cut every link of ``node`` until ``heal(node)``."""
        self._partitions[node] = mode
        self._record("partition", node, "*", detail=mode)
        if mode == "reset":
            for conn in list(self._connections):
                if node in (conn.src, conn.dst):
                    conn.reset("partition")

    def heal(self, node: str | None = None) -> None:
        """Restore ``node``'s links (every node's when None)."""
        for name in [node] if node is not None else list(self._partitions):
            if self._partitions.pop(name, None) is not None:
                self._record("heal", name, "*")
        self._healed.set()
        self._healed = trio.Event()

    def drop_connections(self, node: str | None = None) -> int:
        """Reset every relayed connection (of ``node``); how many. The nodes redial."""
        hit = [c for c in self._connections if node is None or node in (c.src, c.dst)]
        for conn in hit:
            conn.reset("dropped on command")
        return len(hit)

    def _blocked(self, src: str, dst: str) -> PartitionMode | None:
        return self._partitions.get(src) or self._partitions.get(dst)

    async def _wait_unblocked(self, src: str, dst: str) -> None:
        while self._blocked(src, dst) is not None:
            await self._healed.wait()

    # --- relaying ---------------------------------------------------------------------------------
    async def _relay(self, client: trio.SocketStream, src: str, dst: str) -> None:
        self._next_id += 1
        conn = _Connection(self, self._next_id, src, dst)
        conn.streams.append(client)
        self._connections.add(conn)
        self._record("accept", src, dst, conn.id)
        try:
            with conn.scope:
                mode = self._blocked(src, dst)
                if mode == "reset":
                    self._record("refuse", src, dst, conn.id, detail="partition")
                    conn.reset("partition")
                    return
                if mode == "blackhole":
                    self._record("hold", src, dst, conn.id)
                    await self._wait_unblocked(src, dst)
                target = self._targets.get(dst, lambda: None)()
                if target is None:
                    self._record("refuse", src, dst, conn.id, detail="no target")
                    return
                try:
                    upstream = await trio.open_tcp_stream(*target)
                except OSError as exc:
                    self._record("refuse", src, dst, conn.id, detail=str(exc))
                    return
                conn.streams.append(upstream)
                self._record("connect", src, dst, conn.id)
                forward, back = _Direction(self, conn, src, dst), _Direction(self, conn, dst, src)

                async def guarded(
                    task: Callable[[trio.SocketStream], Any], s: trio.SocketStream
                ) -> None:
                    # One broken end ends the connection: the other end sees a reset too.
                    try:
                        await task(s)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                        conn.reset(type(exc).__name__)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(guarded, forward.read, client)
                    nursery.start_soon(guarded, forward.write, upstream)
                    nursery.start_soon(guarded, back.read, upstream)
                    nursery.start_soon(guarded, back.write, client)
        finally:
            self._connections.discard(conn)
            self._record("close", src, dst, conn.id, detail=conn.reason or "")
            with trio.CancelScope(shield=True):
                for stream in conn.streams:
                    if conn.reason is not None:
                        _abort(stream)
                    await stream.aclose()

    def _record(
        self,
        kind: EventKind,
        src: str,
        dst: str,
        conn: int = 0,
        nbytes: int = 0,
        t: float | None = None,
        **extra: Any,
    ) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = trio.current_time() if t is None else t
        self.events.append(NetemEvent(now, kind, src, dst, conn, nbytes, **extra))

    # --- reading the log ------------------------------------------------------------------------
    def chunks(self, src: str, dst: str) -> Iterator[NetemEvent]:
        return (e for e in self.events if e.kind == "chunk" and (e.src, e.dst) == (src, dst))

    def report(self, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The emulated links and what happened on them (for the lab report)."""
        names = sorted({n for pair in self._routes for n in pair})
        links = []
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                ab, ba = self.links.spec(a, b), self.links.spec(b, a)
                links.append(
                    {
                        "a": a,
                        "b": b,
                        "a_to_b": ab.to_dict(),
                        "b_to_a": ba.to_dict(),
                        "text": (
                            ab.describe() if ab == ba else f"{ab.describe()} / {ba.describe()}"
                        ),
                        "bytes": sum(
                            e.nbytes
                            for e in self.events
                            if e.kind == "chunk" and {e.src, e.dst} == {a, b}
                        ),
                    }
                )
        return {
            "links": links,
            "counts": dict(sorted(self.counts.items())),
            "partitioned": sorted(self._partitions),
        }


@asynccontextmanager
async def open_netem(links: LinkTable, *, seed: int = 0) -> AsyncIterator[Netem]:
    """A running ``Netem``; every relay and connection ends with the block."""
    netem = Netem(links, seed=seed)
    async with trio.open_nursery() as nursery:
        netem._nursery = nursery
        try:
            yield netem
        finally:
            nursery.cancel_scope.cancel()
            netem._nursery = None


__all__ = [
    "DelayLine",
    "LinkSpec",
    "LinkTable",
    "Netem",
    "NetemEvent",
    "Scheduled",
    "due_count",
    "format_rate",
    "link_table_from_toml",
    "load_lab_file",
    "open_netem",
    "parse_duration",
    "parse_probability",
    "parse_rate",
    "sleep_target",
    "wait_until",
]
