"""One read of each byte: hash the source and the package while comparing their tensor bytes
(for validate-package).

Two passes run at once, one per core: the *source pass* reads the source shards in file order
and hashes them; the *package pass* reads every artifact in turn and hashes it. Tensor bytes
are read in chunks aligned to the tensor's start, so a chunk of tensor ``T`` is the same bytes
on both sides, keyed ``(T, chunk index)``. Whichever pass reaches a chunk first parks its
buffer in a ``Rendezvous``; the second compares against it (a ``memcmp``) and hands the buffer
back (chunks up to 1 MiB are copied into a recycled 1 MiB buffer instead, so small tensors
do not pin 4 MiB buffers, and chunks up to 64 KiB into a copy of their own size, so norms and
biases do not pin 1 MiB each). No byte is read twice, and the two passes stay close.

Memory is bounded by a pool of parked buffers (``PARK_BUDGET_BYTES``). When it is empty the
source pass leaves a marker instead (the package pass then re-reads those source bytes; the
source files stay open until the end), and the package pass waits for the source pass to free
a buffer: only one side ever waits, so the passes cannot deadlock, and the package pass stops
waiting once the source pass is over (nothing is left to meet).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass, field

from skippy.errors import InputUnreadable
from skippy.gguf.reader import TensorInfo
from skippy.hashing import CHUNK_BYTES

PARK_BUDGET_BYTES = 64 * 1024 * 1024  # peak RSS target of validate-package is 200 MiB
# A chunk up to this size is parked as a copy into a recycled small buffer rather than by
# handing over a 4 MiB one (most layer tensors are smaller than a chunk). Recycling matters:
# fresh buffers of this size come from mmap, and their page faults cost more than the copy.
_SMALL_CHUNK = CHUNK_BYTES // 4
# A chunk up to this size is parked as an exact-size copy, counted at its size and freed after
# its meeting: it comes from malloc's heap (below glibc's 128 KiB mmap threshold), so it costs
# no page faults, and a model's many tiny tensors (norms: a few KiB) no longer take 1 MiB of
# the budget each; with that they could exhaust it when one pass ran far ahead (seen under load).
_TINY_CHUNK = 64 * 1024

OnBytes = Callable[[int], None]
Key = tuple[str, int]  # (tensor name, chunk index)


@dataclass
class _Parked:
    buf: bytearray | None  # None: a marker, re-read ``n`` bytes of ``fd`` at ``offset``
    n: int
    fd: int
    offset: int
    pool: str  # "big": a recycled 4 MiB buffer, "small": a recycled 1 MiB one, "tiny": a copy


@dataclass
class Rendezvous:
    """Where the two passes meet; see the module docstring. Thread-safe."""

    budget_bytes: int = PARK_BUDGET_BYTES
    differing: set[str] = field(default_factory=set)  # tensor names whose bytes differ
    compared: set[str] = field(default_factory=set)
    # name -> (shard, offset) of every source tensor, once the source header is parsed
    source_positions: dict[str, tuple[int, int]] | None = None
    reread_bytes: int = 0  # source bytes read a second time (markers): 0 when memory sufficed
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _parked: dict[Key, _Parked] = field(default_factory=dict)
    _free: list[bytearray] = field(default_factory=list)
    _free_small: list[bytearray] = field(default_factory=list)
    _held: int = 0  # bytes allocated for parking (buffers are recycled; tiny copies are freed)
    _source_done: bool = False
    _positions_known: threading.Event = field(default_factory=threading.Event)

    def publish_positions(self, positions: dict[str, tuple[int, int]]) -> None:
        """The source header is parsed: tell the package pass where each tensor lies."""
        self.source_positions = positions
        self._positions_known.set()

    def wait_positions(self) -> dict[str, tuple[int, int]] | None:
        """The source's tensor positions (None if the source pass failed before them)."""
        self._positions_known.wait()
        return self.source_positions

    def source_finished(self) -> None:
        with self._cond:
            self._source_done = True
            self._cond.notify_all()
        self._positions_known.set()

    def _park(self, key: Key, buf: bytearray, n: int, fd: int, offset: int) -> bytearray | None:
        """With the lock held: park ``buf[:n]`` for the other pass and return the buffer to
        read the next chunk into, or None when the budget has no room (nothing parked)."""
        if n <= _TINY_CHUNK:
            if self._held + n > self.budget_bytes:
                return None
            self._held += n
            self._parked[key] = _Parked(bytearray(memoryview(buf)[:n]), n, fd, offset, "tiny")
            return buf
        if n <= _SMALL_CHUNK:
            small = self._allocate(self._free_small, _SMALL_CHUNK)
            if small is None:
                return None
            memoryview(small)[:n] = memoryview(buf)[:n]
            self._parked[key] = _Parked(small, n, fd, offset, "small")
            return buf
        fresh = self._allocate(self._free, CHUNK_BYTES)
        if fresh is None:
            return None
        self._parked[key] = _Parked(buf, n, fd, offset, "big")
        return fresh

    def _allocate(self, free: list[bytearray], size: int) -> bytearray | None:
        if free:
            return free.pop()
        if self._held + size > self.budget_bytes:
            return None
        self._held += size
        return bytearray(size)

    def meet_source(self, key: Key, buf: bytearray, n: int, fd: int, offset: int) -> bytearray:
        """The source pass reached ``key`` (its bytes in ``buf[:n]``, read from ``fd`` at
        ``offset``); returns the buffer to read the next chunk into. Never waits."""
        with self._cond:
            other = self._parked.pop(key, None)
            if other is None:
                nxt = self._park(key, buf, n, fd, offset)
                if nxt is None:  # no room: a marker; the package pass re-reads these bytes
                    self._parked[key] = _Parked(None, n, fd, offset, "big")
                self._cond.notify_all()  # a package pass waiting at ``key`` can go on
                return nxt if nxt is not None else buf
        if other.buf is None:  # the package pass never leaves markers (its files close early)
            raise RuntimeError(f"package chunk {key} was parked without its bytes")
        self._record(key[0], _same(buf, n, other.buf, other.n))
        self._release(other)
        return buf

    def meet_package(self, key: Key, buf: bytearray, n: int, scratch: list[bytearray]) -> bytearray:
        """The package pass reached ``key``; returns the buffer for its next chunk. Without
        room to park it waits (for a buffer, or for the source pass to reach ``key``) while the
        source pass runs, so it never leaves a marker."""
        with self._cond:
            while True:
                other = self._parked.pop(key, None)
                if other is not None:
                    break
                known = self.source_positions
                if self._source_done or (known is not None and key[0] not in known):
                    return buf  # no source chunk will ever come
                nxt = self._park(key, buf, n, -1, -1)
                if nxt is not None:
                    return nxt
                self._cond.wait()
        theirs = other.buf
        if theirs is None:  # the source pass had no room: re-read its bytes
            if not scratch:
                scratch.append(bytearray(CHUNK_BYTES))
            theirs = scratch[0]
            _read_full(other.fd, memoryview(theirs), other.n, other.offset, "the source")
            with self._cond:
                self.reread_bytes += other.n
        self._record(key[0], _same(buf, n, theirs, other.n))
        self._release(other)
        return buf

    def _release(self, parked: _Parked) -> None:
        with self._cond:
            if parked.pool == "tiny":
                self._held -= parked.n
            elif parked.buf is not None:
                (self._free_small if parked.pool == "small" else self._free).append(parked.buf)
            self._cond.notify_all()

    def _record(self, name: str, same: bool) -> None:
        with self._cond:
            self.compared.add(name)
            if not same:
                self.differing.add(name)


def _same(a: bytearray, n: int, b: bytearray, m: int) -> bool:
    """``a[:n] == b[:m]`` as one memcmp, without copying (bytearray.startswith takes any
    buffer; a memoryview comparison would go element by element)."""
    return n == m and a.startswith(memoryview(b)[:n])


def _read_full(fd: int, view: memoryview, n: int, offset: int, what: str) -> None:
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:n]], offset + got)
        if k <= 0:
            raise InputUnreadable(
                f"{what} shrank while being read (at byte {offset + got})", code="unexpected_eof"
            )
        got += k


def walk_file(
    fd: int,
    size: int,
    tensors: Sequence[TensorInfo],
    on_tensor_chunk: Callable[[Key, bytearray, int, int], bytearray] | None,
    *,
    what: str,
    on_bytes: OnBytes,
    cancel: threading.Event,
) -> str:
    """Hash a whole file in one sequential pass and return its digest. Tensor bytes are read in
    chunks aligned to each tensor's start and handed to ``on_tensor_chunk(key, buf, n, offset)``,
    which returns the buffer for the next read (it may keep the one it got)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK_BYTES)

    def span(start: int, stop: int, name: str | None) -> None:
        nonlocal buf
        pos, index = start, 0
        while pos < stop:
            if cancel.is_set():
                raise CancelledError("comparison cancelled")
            n = min(CHUNK_BYTES, stop - pos)
            _read_full(fd, memoryview(buf), n, pos, what)
            h.update(memoryview(buf)[:n])
            on_bytes(n)
            if name is not None and on_tensor_chunk is not None:
                buf = on_tensor_chunk((name, index), buf, n, pos)
            pos += n
            index += 1

    pos = 0
    for t in sorted(tensors, key=lambda t: t.data_start):
        span(pos, t.data_start, None)
        span(t.data_start, t.data_end, t.name)
        pos = t.data_end
    span(pos, size, None)
    return h.hexdigest()


def source_chunk(rdv: Rendezvous, fd: int) -> Callable[[Key, bytearray, int, int], bytearray]:
    def meet(key: Key, buf: bytearray, n: int, offset: int) -> bytearray:
        return rdv.meet_source(key, buf, n, fd, offset)

    return meet


def package_chunk(rdv: Rendezvous) -> Callable[[Key, bytearray, int, int], bytearray]:
    scratch: list[bytearray] = []  # for re-reading marked source chunks; allocated if needed

    def meet(key: Key, buf: bytearray, n: int, offset: int) -> bytearray:
        return rdv.meet_package(key, buf, n, scratch)

    return meet
