"""Fixed-size chunks of an artifact and their SHA-256 digests.

An artifact of ``size`` bytes is cut into ``ceil(size / chunk_bytes)`` chunks, every one
``chunk_bytes`` long but the last. The coordinator computes, from its verified copy, one
32-byte digest per chunk (``digest_chunks``, which proves the whole-file SHA-256 in the same
pass) and keeps them in a ``ChunkDigestStore`` beside its verification records; a receiver
checks every chunk as it arrives, and the whole file before the install. Two kinds of list:

- ``chain`` (feature bit ``chunk-chain``; ``skippy.transfer.sha256_chain``): the SHA-256
  chaining value after each chunk, the file's digest last. Each chunk is checked on its own
  from the link before it, and once every chunk has passed the receiver has computed the
  file's SHA-256 itself: one hash per byte;
- plain (peers without the bit): each chunk's own SHA-256; the receiver hashes the file a
  second time, in order, before the install.

``ChunkScheduler`` is the pure decision of which chunk a source fetches next: a shared queue
that every source takes from (a faster source takes more), a chunk that failed goes back to
the front for another source, and nothing is handed out twice at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from skippy.atomic import atomic_write_bytes
from skippy.errors import IntegrityError, UsageError
from skippy.transfer import sha256_chain

CHUNK_BYTES: Final = 8 * 1024 * 1024  # the default: ~31 chunks for gemma3-270m's 253 MB
MIN_CHUNK_BYTES: Final = 4 * 1024  # small enough for the synthetic test packages
MAX_CHUNK_BYTES: Final = 64 * 1024 * 1024  # a chunk is held in memory while it is checked
MAX_CHUNKS: Final = 1 << 16  # per artifact: bounds a digest list (2 MiB at most)
DIGEST_BYTES: Final = 32
_READ_BYTES: Final = 1024 * 1024
PROVEN_THREADS: Final = 2  # threads hashing a proven file's chunks (this machine: 2 cores)


def check_chunk_bytes(chunk_bytes: object) -> int:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise UsageError("chunk_bytes must be an integer", code="invalid_chunk_bytes")
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise UsageError(
            f"chunk_bytes must be in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}, got {chunk_bytes}",
            code="invalid_chunk_bytes",
        )
    return chunk_bytes


def chain_fits(chunk_bytes: int) -> bool:
    """Chunks of this size can carry a SHA-256 chain (whole 64-byte blocks) and this process
    can compute one (libcrypto loaded)."""
    return chunk_bytes % sha256_chain.BLOCK_BYTES == 0 and sha256_chain.available()


def check_chain(digests: tuple[bytes, ...], sha256: str, chunk_bytes: int) -> None:
    """A chain list must end at the manifest's SHA-256 and cut at whole blocks
    (``IntegrityError`` ``chunk_digests_invalid``, before a byte is asked for)."""
    if chunk_bytes % sha256_chain.BLOCK_BYTES or not digests or digests[-1].hex() != sha256:
        raise IntegrityError(
            f"a chunk chain of {chunk_bytes}-byte chunks must cut at whole SHA-256 blocks and "
            f"end at the artifact's SHA-256 {sha256}",
            code="chunk_digests_invalid",
            expected=sha256,
        )


@dataclass(frozen=True)
class ChunkSpan:
    """Chunk ``index``: the half-open byte range ``[start, stop)`` of the artifact."""

    index: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop or self.index < 0:
            raise UsageError(f"invalid chunk {self.index}: {self.start}..{self.stop}")

    @property
    def length(self) -> int:
        return self.stop - self.start


def chunk_count(size: int, chunk_bytes: int) -> int:
    if size <= 0:
        raise UsageError(f"an artifact of {size} bytes has no chunks", code="invalid_chunk_size")
    return -(-size // check_chunk_bytes(chunk_bytes))


def chunk_spans(size: int, chunk_bytes: int) -> tuple[ChunkSpan, ...]:
    """Every chunk of an artifact of ``size`` bytes, in order. An artifact needing more than
    ``MAX_CHUNKS`` is refused (``too_many_chunks``): choose bigger chunks."""
    count = chunk_count(size, chunk_bytes)
    if count > MAX_CHUNKS:
        raise UsageError(
            f"{size} bytes in chunks of {chunk_bytes} makes {count} chunks, over {MAX_CHUNKS}",
            code="too_many_chunks",
        )
    return tuple(
        ChunkSpan(i, i * chunk_bytes, min(size, (i + 1) * chunk_bytes)) for i in range(count)
    )


def chunk_digest(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def pack_digests(digests: Iterable[bytes]) -> bytes:
    return b"".join(digests)


def unpack_digests(blob: bytes, count: int) -> tuple[bytes, ...]:
    """``count`` digests packed back to back; anything else is an ``IntegrityError``."""
    if len(blob) != count * DIGEST_BYTES:
        raise IntegrityError(
            f"a digest list of {len(blob)} bytes is not {count} SHA-256 digests",
            code="chunk_digests_invalid",
            expected=count * DIGEST_BYTES,
            actual=len(blob),
        )
    return tuple(blob[i : i + DIGEST_BYTES] for i in range(0, len(blob), DIGEST_BYTES))


def digest_chunks(
    path: Path,
    *,
    size: int,
    sha256: str,
    chunk_bytes: int,
    proven: bool = False,
    chain: bool = False,
) -> tuple[bytes, ...]:
    """One read of ``path``: the per-chunk digests, returned only when the whole file is
    ``size`` bytes and hashes to ``sha256`` (the digests vouch for nothing else). ``proven``:
    the caller verified this very file already (its verification record: at
    bring-up the coordinator computes these while every worker waits), so only its size is
    checked here, and the file is hashed once, not twice. ``chain``: the SHA-256 chain
    (``chain_fits`` first), whose last link is the whole file's digest, so it proves the file
    in its one pass whether or not it was ``proven``."""
    spans = chunk_spans(size, chunk_bytes)
    if chain:
        return _digest_chain(path, spans, size, sha256)
    if proven:
        return _digest_proven(path, spans, size)
    whole = hashlib.sha256()
    digests: list[bytes] = []
    with open(path, "rb", buffering=0) as f:
        for span in spans:
            part = hashlib.sha256()
            left = span.length
            while left:
                data = f.read(min(left, _READ_BYTES))
                if not data:
                    break
                part.update(data)
                whole.update(data)
                left -= len(data)
            if left:
                raise IntegrityError(
                    f"{path.name} ended inside chunk {span.index}",
                    code="artifact_size_mismatch",
                    expected=size,
                )
            digests.append(part.digest())
        if f.read(1):
            raise IntegrityError(
                f"{path.name} is longer than {size} bytes", code="artifact_size_mismatch"
            )
    if whole.hexdigest() != sha256:
        raise IntegrityError(
            f"{path.name} hashes to {whole.hexdigest()}, not {sha256}",
            code="artifact_sha256_mismatch",
            expected=sha256,
            actual=whole.hexdigest(),
        )
    return tuple(digests)


def _read_span(fd: int, view: memoryview, span: ChunkSpan, name: str, size: int) -> None:
    """Fill ``view`` (``span.length`` bytes) from ``fd`` at the span's offset."""
    got = 0
    while got < span.length:
        n = os.preadv(fd, [view[got:]], span.start + got)
        if not n:
            raise IntegrityError(
                f"{name} ended inside chunk {span.index}",
                code="artifact_size_mismatch",
                expected=size,
            )
        got += n


def _digest_chain(
    path: Path, spans: tuple[ChunkSpan, ...], size: int, sha256: str
) -> tuple[bytes, ...]:
    """The file's SHA-256 chain: one sequential pass (each link needs the one before), the
    next chunk read on a second thread while this one is hashed; the last link must be
    ``sha256`` (so the file is proven by the same pass)."""
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        if os.fstat(fd).st_size != size:
            raise IntegrityError(
                f"{path.name} is not {size} bytes", code="artifact_size_mismatch", expected=size
            )
        longest = max(span.length for span in spans)
        bufs = [bytearray(longest), bytearray(longest)]

        def read(i: int) -> memoryview:
            view = memoryview(bufs[i % 2])[: spans[i].length]
            _read_span(fd, view, spans[i], path.name, size)
            return view

        hasher = sha256_chain.ChainHasher()
        links: list[bytes] = []
        with ThreadPoolExecutor(1) as reader:
            nxt = reader.submit(read, 0)
            for i in range(len(spans)):
                view = nxt.result()
                if i + 1 < len(spans):
                    nxt = reader.submit(read, i + 1)  # into the other buffer
                hasher.update(view)
                links.append(hasher.state() if i + 1 < len(spans) else hasher.digest())
    chain = tuple(links)
    if chain[-1].hex() != sha256:
        raise IntegrityError(
            f"{path.name} hashes to {chain[-1].hex()}, not {sha256}",
            code="artifact_sha256_mismatch",
            expected=sha256,
            actual=chain[-1].hex(),
        )
    return chain


def _digest_proven(path: Path, spans: tuple[ChunkSpan, ...], size: int) -> tuple[bytes, ...]:
    """The chunks' digests of a proven file, ``PROVEN_THREADS`` chunks at a time (each chunk
    on its own: hashlib releases the GIL, so two cores hash twice as fast).

    Each chunk is read whole into its thread's buffer and hashed in one call: the GIL is
    taken twice per chunk, not twice per MiB. Beside a thread running Python (at bring-up the
    coordinator reads its tokenizer's vocabulary while every worker waits for these), each
    taking waits up to the interpreter's switch interval: with 1 MiB reads the embeddings'
    178 MB took 0.7-1.0 s here instead of 0.07 s."""
    local = threading.local()
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        if os.fstat(fd).st_size != size:
            raise IntegrityError(
                f"{path.name} is not {size} bytes", code="artifact_size_mismatch", expected=size
            )

        def one(span: ChunkSpan) -> bytes:
            buf: bytearray | None = getattr(local, "buf", None)
            if buf is None or len(buf) < span.length:
                buf = local.buf = bytearray(span.length)
            view = memoryview(buf)[: span.length]
            _read_span(fd, view, span, path.name, size)
            return hashlib.sha256(view).digest()

        with ThreadPoolExecutor(PROVEN_THREADS) as pool:
            return tuple(pool.map(one, spans))


class ChunkDigestStore:
    """Digest lists by (artifact SHA-256, chunk size, kind), one small file each.
    Content-addressed: a list is stored only after ``digest_chunks`` proved the whole file,
    so it stays true for every copy of that artifact (no file stamp needed)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def beside(cls, verify_root: Path) -> ChunkDigestStore:
        """Next to a ``VerifyCache``'s records (``<skippy cache>/verify`` ->
        ``<skippy cache>/chunk-digests``)."""
        return cls(verify_root.parent / "chunk-digests")

    def _path(self, sha256: str, chunk_bytes: int, chain: bool) -> Path:
        return self.root / f"{sha256}.{chunk_bytes}.{'sha256chain' if chain else 'sha256s'}"

    def get(
        self, sha256: str, size: int, chunk_bytes: int, *, chain: bool = False
    ) -> tuple[bytes, ...] | None:
        try:
            blob = self._path(sha256, chunk_bytes, chain).read_bytes()
        except OSError:
            return None
        try:
            digests = unpack_digests(blob, chunk_count(size, chunk_bytes))
            if chain:
                check_chain(digests, sha256, chunk_bytes)
            return digests
        except IntegrityError:
            return None  # a stale or damaged record: computed again

    def put(
        self, sha256: str, chunk_bytes: int, digests: tuple[bytes, ...], *, chain: bool = False
    ) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(
            self._path(sha256, chunk_bytes, chain), pack_digests(digests), durable=False
        )

    def digests_for(
        self, path: Path, *, size: int, sha256: str, chunk_bytes: int, chain: bool = False
    ) -> tuple[bytes, ...]:
        """The stored list, else computed from ``path`` (proven whole) and stored."""
        cached = self.get(sha256, size, chunk_bytes, chain=chain)
        if cached is not None:
            return cached
        digests = digest_chunks(
            path, size=size, sha256=sha256, chunk_bytes=chunk_bytes, chain=chain
        )
        with contextlib.suppress(OSError):  # storing only saves work next time
            self.put(sha256, chunk_bytes, digests, chain=chain)
        return digests


def chunk_matches(
    digests: tuple[bytes, ...],
    span: ChunkSpan,
    parts: Iterable[bytes | bytearray | memoryview],
    *,
    chain: bool,
    sha256: str,
) -> bool:
    """``parts`` (``span.length`` bytes in all) are chunk ``span.index``'s right bytes: its
    own SHA-256 equals its digest, or, in a chain, it leads from the link before it to its
    own (the last chunk to ``sha256``, the artifact's)."""
    if chain:
        whole = bytes.fromhex(sha256)
        return sha256_chain.check_chunk(digests, span.index, span.start, parts, whole)
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.digest() == digests[span.index]


def verified_chunks(
    fd: int,
    spans: tuple[ChunkSpan, ...],
    digests: tuple[bytes, ...],
    *,
    chain: bool = False,
    sha256: str = "",
) -> set[int]:
    """Which chunks of a partial file already hold their right bytes (a resume keeps them)."""
    have = os.fstat(fd).st_size
    good: set[int] = set()
    for span in spans:
        if span.stop > have:
            break
        data = os.pread(fd, span.length, span.start)
        if len(data) == span.length and chunk_matches(
            digests, span, (data,), chain=chain, sha256=sha256
        ):
            good.add(span.index)
    return good


class ChunkScheduler:
    """Which chunk a source fetches next (pure). Chunks already verified are never handed
    out; ``take`` hands a chunk to one source at a time; ``failed`` puts it first in line for
    whichever source asks next (the caller stops asking the source that failed it).

    End-game (``take_duplicate``): once nothing is left to hand out, a source with nothing to
    do may fetch a chunk another source still has in flight, so one slow source cannot hold
    the whole file back; the first verified copy wins (``finished``), the other is cancelled
    or dropped by the caller. A chunk is duplicated at most once at a time."""

    def __init__(
        self, count: int, done: Iterable[int] = (), order: Iterable[int] | None = None
    ) -> None:
        self.count = count
        self.done: set[int] = {i for i in done if 0 <= i < count}
        self.in_flight: Counter[int] = Counter()  # chunk -> copies being fetched
        self._taken_at: dict[int, float] = {}  # chunk -> when its first copy was asked for
        # ``order`` (``partial-serve``): this fetch's own order, so counterparts
        # fetching the same file start at opposite ends (``skippy.transfer.partials``).
        seq = range(count) if order is None else order
        self._pending: deque[int] = deque(i for i in seq if 0 <= i < count and i not in self.done)

    @property
    def complete(self) -> bool:
        return len(self.done) == self.count

    @property
    def waiting(self) -> int:
        """Chunks nobody is fetching yet."""
        return len(self._pending)

    def take(self, now: float = 0.0, allow: Callable[[int], bool] | None = None) -> int | None:
        """The next chunk to fetch, or None when every chunk is done or in flight. ``now``
        (any clock) dates the copy for ``take_duplicate``. ``allow`` (a partial
        holder has only some chunks; the coordinator leaves those others hold): the first
        waiting chunk it allows, the others keep their places."""
        while self._pending and (self._pending[0] in self.done or self.in_flight[self._pending[0]]):
            self._pending.popleft()  # finished (or taken again) meanwhile by a duplicate copy
        for index in self._pending:
            if index in self.done or self.in_flight[index]:
                continue
            if allow is not None and not allow(index):
                continue
            self._pending.remove(index)
            self.in_flight[index] += 1
            self._taken_at[index] = now
            return index
        return None

    def take_run(
        self, most: int, now: float = 0.0, allow: Callable[[int], bool] | None = None
    ) -> list[int]:
        """Up to ``most`` chunks in a row (one range request): the next chunk to
        fetch, then the chunks that follow it while they are next in line (and ``allow``ed);
        [] as ``take`` gives None."""
        first = self.take(now, allow)
        if first is None:
            return []
        run = [first]
        while len(run) < most and self._pending and self._pending[0] == run[-1] + 1:
            index = self._pending[0]
            if index in self.done or self.in_flight[index]:
                break
            if allow is not None and not allow(index):
                break
            self._pending.popleft()
            self.in_flight[index] += 1
            self._taken_at[index] = now
            run.append(index)
        return run

    def touch(self, index: int, now: float) -> None:
        """A run reached chunk ``index``: its copy's age (for ``take_duplicate``) starts now,
        not when the run was asked for, so a run's later chunks are not stragglers early."""
        if index in self._taken_at:
            self._taken_at[index] = now

    def take_duplicate(
        self,
        busy: Iterable[int] = (),
        now: float = 0.0,
        min_age_s: float = 0.0,
        allow: Callable[[int], bool] | None = None,
    ) -> int | None:
        """End-game: a chunk in flight with exactly one copy, taken at least ``min_age_s``
        before ``now`` (a straggler, not a copy just asked for) and not in ``busy`` (the
        caller's own chunks), the oldest first; None while chunks still wait for a first copy."""
        if self._pending:
            return None
        mine = set(busy)
        for index in sorted(self.in_flight, key=lambda i: (self._taken_at.get(i, 0.0), i)):
            if self.in_flight[index] != 1 or index in mine:
                continue
            if allow is not None and not allow(index):
                continue
            if now - self._taken_at.get(index, 0.0) < min_age_s:
                break  # the oldest copy is too young: so is every other
            self.in_flight[index] += 1
            return index
        return None

    def finished(self, index: int) -> bool:
        """A copy of ``index`` was verified; True for the first (the one that counts)."""
        self._release(index)
        if index in self.done:
            return False
        self.done.add(index)
        return True

    def failed(self, index: int) -> None:
        """A copy came back wrong or not at all: first in line again, unless another copy is
        still in flight or one was already verified."""
        self._release(index)
        if index not in self.done and not self.in_flight[index]:
            self._pending.appendleft(index)

    def _release(self, index: int) -> None:
        if self.in_flight[index] > 1:
            self.in_flight[index] -= 1
        else:
            self.in_flight.pop(index, None)


def run_length(waiting: int, streams: int, most: int) -> int:
    """How many chunks in a row one stream asks for: enough that per-request costs
    (a request, an authorization, a stream whose window starts small) are paid once per run,
    few enough that the waiting chunks still spread over every stream (``streams`` of them,
    over every holder: each gets its share; the runs shrink as the file's end nears, which
    keeps the end-game's stragglers small), at most ``most`` (1: one chunk a request)."""
    if most <= 1 or streams <= 0:
        return 1
    return max(1, min(most, -(-waiting // streams)))
