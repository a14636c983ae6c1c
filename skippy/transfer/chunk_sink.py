"""The receiving side of every peer transfer: one artifact into the hub cache, chunk by chunk,
each chunk checked, resumable, installed atomically.

Spec "Peer Cache Transfer": "Received artifacts are written to a fresh hidden partial file and
installed atomically only after size and SHA-256 verification." The recipe:

- the partial is ``blobs/.<sha256>.<pid>.<nanos>.part``, beside its destination blob
  (``skippy.atomic.resumable_partial_for``); a fetch resumes the largest partial no bigger
  than the expected size and deletes the others (the manifest, whose size only the response
  tells and which is at most 16 MiB, always starts afresh);
- the artifact is cut into chunks (``skippy.transfer.chunks``), each checked against its
  link: the coordinator's signed SHA-256 chain (``skippy.transfer.sha256_chain``: the last
  link is the manifest's digest, so the chunks' checks prove the whole file in one pass), or
  plain per-chunk digests (a node whose libcrypto cannot be driven; the whole file is then
  hashed once more, in order, before the install). Without a list (a file the coordinator
  did not list, the manifest) the file is one chunk whose only link is the manifest's SHA-256;
- bytes are written as they arrive (``stream``: a run of chunks in order from one source;
  ``write``: the same for a one-chunk sink) and a chunk counts only once its last byte passed
  its check; ``write_chunk`` checks a chunk held whole in memory first (a second copy of a
  slow chunk). A chunk that fails its check is never counted; a one-chunk sink deletes its
  partial then (``artifact_sha256_mismatch``);
- a resume keeps every chunk of the partial that passes its check, and the unchecked bytes
  of the chunk the partial ends in (a *head*: a cut transfer continues from its exact byte,
  and those bytes are checked with the rest of their chunk); a partial that changes while it
  is opened is an error (``partial_changed``);
- installing is ``skippy.atomic.publish`` of the partial onto ``blobs/<sha256>`` and an atomic
  relative symlink ``snapshots/<commit>/<path> -> ../../blobs/<sha256>``: the layout
  huggingface_hub itself reads; a verification record is written so the stage's own
  verification is instant;
- one fetch per artifact and node: the install lock (``RepoCache.lock_path``, the same file
  huggingface_hub locks for that blob) is held from ``open_chunk_sink`` to
  ``finish``/``abort``. The lock only saves work; the rename is what makes the install
  correct.

Every method is synchronous and bounded: a trio shell calls them with
``trio.to_thread.run_sync`` (several threads may write different chunks at once).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

from skippy.atomic import (
    LockBusy,
    atomic_symlink,
    exclusive_lock,
    find_partials,
    fsync_path,
    publish,
    resumable_partial_for,
)
from skippy.constants import MANIFEST_MAX_BYTES
from skippy.consume.verify import FileStamp, VerifyCache, cache_key
from skippy.errors import IntegrityError, ManifestError, UnsafePath, UsageError
from skippy.paths import resolve_under
from skippy.transfer import sha256_chain
from skippy.transfer.chunks import (
    ChunkSpan,
    check_chain,
    chunk_matches,
    chunk_spans,
    verified_chunks,
)
from skippy.transfer.errors import InstallBusy, PartialChanged, TransferRefused
from skippy.transfer.fetch_plan import FetchItem
from skippy.transfer.hubcache import RepoCache, verified_file
from skippy.transfer.partials import covered
from skippy.transfer.wire import ArtifactResponse

log = logging.getLogger(__name__)

SinkState = Literal["present", "receiving", "installed", "closed"]
_READ_BYTES = 1024 * 1024  # a head read back for its chunk's check, this much at a time


class _Hasher(Protocol):
    """A chunk's check as bytes arrive: ``sha256_chain.ChainHasher`` or a plain SHA-256."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def digest(self) -> bytes: ...


class ChunkSink:
    """One artifact being received. Make it with ``open_chunk_sink``; then, unless
    ``present``/``installed``: ``accept`` each response header, write bytes (``stream``,
    ``write`` or ``write_chunk``), ``finish`` once every chunk is verified, or ``abort`` on
    any failure (also done by ``with``). ``verified``: the chunks in place."""

    def __init__(
        self,
        cache: RepoCache,
        item: FetchItem,
        *,
        digests: tuple[bytes, ...] | None,
        chunk_bytes: int | None,
        manifest_sha256: str,
        verify_cache: VerifyCache | None,
        durable: bool,
        lock: contextlib.ExitStack,
        chain: bool = False,
    ) -> None:
        self.cache = cache
        self.item = item
        self.manifest_sha256 = manifest_sha256
        self.verify_cache = verify_cache
        self.durable = durable
        self._lock = lock
        self.blob = cache.blob_path(item.sha256)
        self.link = cache.snapshot_path(item.path)
        self.state: SinkState = "receiving"
        self.installed: Path | None = None  # the snapshot path once present or installed
        self._partial: Path | None = None
        self._fd: int | None = None
        self.spans: tuple[ChunkSpan, ...] = ()
        if digests is None:  # one chunk: the file, checked against the manifest's SHA-256
            self.digests: tuple[bytes, ...] = (bytes.fromhex(item.sha256),)
            self.chain = False
            if item.size is not None:
                self.spans = _whole_span(item.size)
        else:
            if item.size is None or chunk_bytes is None:
                raise UsageError("a chunked transfer needs the declared size", code="sink_order")
            self.spans = chunk_spans(item.size, chunk_bytes)
            if len(digests) != len(self.spans):
                raise IntegrityError(
                    f"{item.path}: {len(digests)} chunk digests for {len(self.spans)} chunks",
                    code="chunk_digests_invalid",
                    path=item.path,
                )
            if chain:
                check_chain(digests, item.sha256, chunk_bytes)
            self.digests = digests
            self.chain = chain
        self.whole = digests is None
        self.verified: set[int] = set()
        self.offset = 0  # bytes in place: verified chunks and unchecked bytes being written
        self.received_bytes = 0  # bytes written by this sink (not what a resume found)
        self._total = item.size
        self._written: dict[int, int] = {}  # chunk -> its unchecked bytes in place
        self._heads: dict[int, int] = {}  # chunk -> where its unchecked bytes end (a resume)
        self._head_hashes: dict[int, _Hasher] = {}  # chunk -> its head, hashed
        self._owners: dict[int, ChunkStream] = {}  # chunk -> the stream writing it
        self._stream: ChunkStream | None = None  # the one ``write`` feeds
        # Plain digests only: the whole-file SHA-256, fed in chunk order as the verified prefix
        # grows (a chain's checks, and a one-chunk sink's, are the whole-file check).
        self._whole = hashlib.sha256()
        self._hashed = 0  # chunks [0, _hashed) are in ``_whole``
        self._order = threading.Lock()  # writers run on several threads at once

    # --- opening --------------------------------------------------------------------------
    def _start(self) -> None:
        if self._find_installed():
            return
        chosen = self._pick_partial()
        if chosen is not None:
            self._resume(*chosen)
            if self.state != "receiving":  # a complete partial was installed
                return
        if self._fd is None:
            self._fresh()

    def _find_installed(self) -> bool:
        """The file is already in the cache, verified: nothing to receive. A verified blob
        without its snapshot link (another revision has it) only needs the link."""
        try:
            resolve_under(
                self.cache.snapshot_dir, self.item.path, containment_root=self.cache.repo_root
            )
            linked = self._verified_file(self.link)
        except UnsafePath:
            linked = False  # a link leading out is replaced by the install
        if not linked:
            if not self._verified_file(self.blob):
                return False
            self._link()
        self._done("present")
        return True

    def _verified_file(self, path: Path) -> bool:
        return verified_file(
            path,
            self.item,
            manifest_sha256=self.manifest_sha256,
            verify_cache=self.verify_cache,
        )

    def _pick_partial(self) -> tuple[Path, os.stat_result] | None:
        """The largest partial no bigger than the expected size; every other one is deleted
        (larger ones cannot be this file's, smaller ones are superseded)."""
        sized: list[tuple[Path, os.stat_result]] = []
        for p in find_partials(self.blob):
            try:
                st = p.lstat()
            except FileNotFoundError:
                continue
            sized.append((p, st))
        sized.sort(key=lambda ps: -ps[1].st_size)
        chosen = None
        for p, st in sized:
            usable = (
                self.item.size is not None
                and stat.S_ISREG(st.st_mode)
                and st.st_size <= self.item.size
            )
            if usable and chosen is None:
                chosen = (p, st)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        return chosen

    def _resume(self, path: Path, seen: os.stat_result) -> None:
        """Continue ``path``: keep its chunks that pass their checks, and the unchecked head
        of the chunk it ends in. A partial whose every chunk is in place (a crash between the
        last write and the rename) is installed now, or deleted if its digest is wrong."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError as exc:  # ELOOP: a symlink appeared where the partial was
            raise PartialChanged(
                f"partial {path.name} changed while it was opened ({exc.strerror})",
                path=self.item.path,
            ) from None
        try:
            if _identity(os.fstat(fd)) != _identity(seen):
                raise PartialChanged(
                    f"partial {path.name} changed while it was opened", path=self.item.path
                )
            before = os.fstat(fd)
            good = verified_chunks(
                fd, self.spans, self.digests, chain=self.chain, sha256=self.item.sha256
            )
            heads: dict[int, int] = {}
            for span in self.spans:
                stop = min(span.stop, before.st_size)
                if span.index in good or stop <= span.start:
                    continue
                end = _written_end(fd, span.start, stop)
                if span.start < end < span.stop:  # the head, hashed once now
                    heads[span.index] = end
                    self._head_hashes[span.index] = self._hasher(span.index)
                    _read_into(fd, span.start, end, self._head_hashes[span.index], path.name)
            if _identity(os.fstat(fd)) != _identity(before):
                raise PartialChanged(
                    f"partial {path.name} changed while it was read", path=self.item.path
                )
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._partial = fd, path
        self.verified = good
        self.offset = sum(self.spans[i].length for i in good)
        for index, end in heads.items():
            start = self.spans[index].start
            self._heads[index] = end
            self._written[index] = end - start
            self.offset += end - start
        log.info(
            "resuming %s at %d bytes (%d of %d chunks verified)",
            self.item.path, self.offset, len(good), len(self.spans),
        )
        self._advance(-1, ())  # the verified prefix, read back once (plain digests)
        if self.whole and not good and not heads and self.spans:  # whole, and wrong
            self._drop_partial()
            return
        if self.complete:  # a whole partial (a crash before the rename): install or restart
            if self._whole_digest() == self.item.sha256:
                self._install()
            else:
                self._drop_partial()

    def _hasher(self, index: int) -> _Hasher:
        """What checks chunk ``index``: its link of the chain, or a plain SHA-256."""
        if self.chain:
            start = sha256_chain.start_of(self.digests, index)
            return sha256_chain.ChainHasher(start, self.spans[index].start)
        return hashlib.sha256()

    def _fresh(self) -> None:
        path = resumable_partial_for(self.blob)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(
            path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        self._partial = path

    # --- receiving ------------------------------------------------------------------------
    @property
    def present(self) -> bool:
        """True when nothing had to be received (the file was already installed)."""
        return self.state == "present"

    @property
    def complete(self) -> bool:
        return self._total is not None and len(self.verified) == len(self.spans)

    def start_of(self, index: int) -> int:
        """Where a request for chunk ``index`` starts: after its head, if a resume found one."""
        return self._heads.get(index, self.spans[index].start)

    def accept(self, response: ArtifactResponse) -> None:
        """Check a response header against what the manifest declares. A refusal raises
        ``TransferRefused``; every failure here keeps the partial."""
        self._expect_receiving()
        if not response.accepted:
            raise TransferRefused(
                f"the peer refused {self.item.path}: {response.error}",
                path=self.item.path,
                actual=response.error,
            )
        if response.sha256 != self.item.sha256:
            raise IntegrityError(
                f"the peer serves {self.item.path} with SHA-256 {response.sha256}, the "
                f"manifest declares {self.item.sha256}",
                code="peer_artifact_mismatch",
                path=self.item.path,
                expected=self.item.sha256,
                actual=response.sha256,
            )
        if self.item.size is None and response.total_size > MANIFEST_MAX_BYTES:
            raise ManifestError(
                f"the peer's {self.item.path} is {response.total_size} bytes, over the "
                f"{MANIFEST_MAX_BYTES}-byte cap",
                code="manifest_too_large",
                path=self.item.path,
                actual=response.total_size,
            )
        if self.item.size is not None and response.total_size != self.item.size:
            raise IntegrityError(
                f"the peer serves {self.item.path} as {response.total_size} bytes, the "
                f"manifest declares {self.item.size}",
                code="peer_artifact_mismatch",
                path=self.item.path,
                expected=self.item.size,
                actual=response.total_size,
            )
        if self.offset > response.total_size:
            raise IntegrityError(
                f"resume offset {self.offset} is past the peer's {response.total_size} bytes",
                code="peer_artifact_mismatch",
                path=self.item.path,
            )
        if self._total is None:  # the manifest: its size is what the response says
            self._total = response.total_size
            self.spans = _whole_span(response.total_size)

    def stream(self, pos: int) -> ChunkStream:
        """A writer of the artifact's bytes in order from byte ``pos`` (a chunk's start, or
        the end of its head)."""
        self._expect_receiving()
        if self._total is None:
            raise UsageError("accept() the response header before writing", code="sink_order")
        return ChunkStream(self, pos)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append body bytes of a one-chunk sink at ``offset``: the whole file as one stream,
        resumed where the partial ends."""
        if self._stream is None:
            if not self.whole:
                raise UsageError("write() feeds a one-chunk sink: use stream()", code="sink_order")
            self._stream = self.stream(self.offset)
        self._stream.write([memoryview(data)])

    def write_chunk(self, index: int, data: bytes | bytearray | memoryview) -> bool:
        """Check chunk ``index`` against its digest, then write it at its offset; False when
        it was already in place (an end-game duplicate: the first verified copy won)."""
        return self.write_chunk_parts(index, [memoryview(data)])

    def write_chunk_parts(self, index: int, parts: Sequence[memoryview]) -> bool:
        """``write_chunk`` for a chunk received as pieces (views of the stream's records:
        hashed and written as they are, never joined into one copy). Two verified copies of
        one chunk hold the same bytes, so writing both at once is harmless; a stream writing
        the same chunk stops writing once this one is verified."""
        self._expect_receiving()
        if self._fd is None or not 0 <= index < len(self.spans):
            raise UsageError(f"no chunk {index} to write", code="sink_order")
        span = self.spans[index]
        if sum(len(p) for p in parts) != span.length or not chunk_matches(
            self.digests, span, parts, chain=self.chain, sha256=self.item.sha256
        ):
            raise self._mismatch(span)
        if index in self.verified:
            return False
        with self._order:
            if index in self.verified:  # the other copy finished while this one was checked
                return False
            pos = span.start
            for part in parts:
                pos = _pwrite_all(self._fd, part, pos)
            self.received_bytes += span.length
            self._counted(index)
            self._advance(index, parts)
        return True

    def _counted(self, index: int) -> None:
        """Chunk ``index`` is verified in place (under ``_order``)."""
        self.verified.add(index)
        self.offset += self.spans[index].length - self._written.pop(index, 0)
        self._heads.pop(index, None)

    def _mismatch(self, span: ChunkSpan) -> IntegrityError:
        if self.whole:
            return IntegrityError(
                f"{self.item.path} received from the peer does not hash to the manifest's "
                f"SHA-256 {self.item.sha256}",
                code="artifact_sha256_mismatch",
                path=self.item.path,
                paths=(self.item.path,),
                expected=self.item.sha256,
            )
        return IntegrityError(
            f"{self.item.path}: chunk {span.index} (bytes {span.start}..{span.stop}) does not "
            "match its signed digest",
            code="chunk_digest_mismatch",
            path=self.item.path,
        )

    def _advance(self, index: int, parts: Sequence[memoryview]) -> None:
        """Plain digests: feed the whole-file hash every verified chunk that now continues
        its prefix: ``parts`` for chunk ``index`` when given, the partial's bytes otherwise."""
        if self.chain or self.whole:
            return
        while self._hashed < len(self.spans) and self._hashed in self.verified:
            span = self.spans[self._hashed]
            if self._hashed == index and parts:
                for part in parts:
                    self._whole.update(part)
            else:
                if self._fd is None:
                    raise UsageError("the partial is closed", code="sink_order")
                got = os.pread(self._fd, span.length, span.start)
                if len(got) != span.length:
                    raise PartialChanged(
                        f"the partial of {self.item.path} shrank while it was hashed",
                        path=self.item.path,
                    )
                self._whole.update(got)
            self._hashed += 1

    def verified_now(self) -> frozenset[int]:
        """The verified chunks as of now. Not under ``_order``: a writer holds it while it
        hashes the prefix, and the event loop asks this; copying a set of ints is one step
        under the GIL."""
        return frozenset(self.verified)

    def open_verified(self, start: int, stop: int) -> int | None:
        """A new read descriptor of the partial when ``[start, stop)`` is a run of chunks that
        were each checked against their signed digest and written (a partial holder serves
        only those, ``skippy.transfer.partials.covered``); None otherwise. The caller keeps
        ``finish``/``abort`` from running meanwhile (they close the partial); a chunk is in
        ``verified`` only once it is written, so no lock is needed here."""
        fd = self._fd
        if fd is None or self.state != "receiving" or self.whole:
            return None
        if not covered(self.verified_now(), self.spans, start, stop):
            return None
        return os.dup(fd)

    def finish(self) -> Path:
        """Every chunk verified: check the whole-file SHA-256, install, return the path. A
        missing chunk (a short body) keeps the partial; a wrong digest deletes it."""
        self._expect_receiving()
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if not self.complete or self._fd is None:
            missing = len(self.spans) - len(self.verified)
            raise IntegrityError(
                f"{self.item.path}: the body ended after {self.offset} of {self._total} bytes "
                f"({missing} chunks not verified)",
                code="artifact_truncated",
                path=self.item.path,
                expected=self._total,
                actual=self.offset,
            )
        digest = self._whole_digest()
        if digest != self.item.sha256:
            self._discard()
            raise IntegrityError(
                f"{self.item.path} assembled from chunks hashes to {digest}, the manifest "
                f"declares {self.item.sha256}; the partial was deleted",
                code="artifact_sha256_mismatch",
                path=self.item.path,
                paths=(self.item.path,),
                expected=self.item.sha256,
                actual=digest,
            )
        self._install()
        return self.link

    def _whole_digest(self) -> str:
        """The SHA-256 of the chunks in order (every one verified, and hashed by now)."""
        if self._fd is None:
            raise UsageError("the partial is closed", code="sink_order")
        with self._order:
            self._advance(-1, ())
            if not self.spans:  # an empty file: nothing was checked
                digest = hashlib.sha256(b"").hexdigest()
            elif self.chain or self.whole:
                if not self.complete:
                    raise UsageError("chunks are missing from the chain", code="sink_order")
                digest = self.item.sha256  # the last chunk's check reached it (module doc)
            elif self._hashed != len(self.spans):
                raise UsageError("chunks are missing from the whole-file hash", code="sink_order")
            else:
                digest = self._whole.hexdigest()
            os.ftruncate(self._fd, self._total or 0)  # a longer stale partial ends here
            return digest

    def abort(self) -> None:
        """Stop receiving, keep the partial for a later resume, release the lock. Safe to
        call in any state and more than once."""
        if self.state != "receiving":
            return
        self._close_fd()
        self.state = "closed"
        self._lock.close()

    def __enter__(self) -> ChunkSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    # --- internals ------------------------------------------------------------------------
    def _expect_receiving(self) -> None:
        if self.state != "receiving":
            raise UsageError(f"the sink is {self.state}, not receiving", code="sink_order")

    def _install(self) -> None:
        if self._partial is None or self._fd is None:
            raise UsageError("nothing to install", code="sink_order")
        self._close_fd()
        publish(self._partial, self.blob, durable=self.durable)
        self._partial = None
        self._link()
        if self.durable:
            fsync_path(self.link.parent)
        self._record()
        self._done("installed")

    def _link(self) -> None:
        target = os.path.relpath(self.blob, self.link.parent)
        atomic_symlink(target, self.link)

    def _record(self) -> None:
        if self.item.ref is None or self.verify_cache is None:
            return
        try:
            st = self.link.stat()
        except OSError:
            return
        key = cache_key(self.manifest_sha256, self.item.ref, FileStamp.of(st))
        self.verify_cache.record(key, self.item.sha256, st.st_size)

    def _done(self, state: SinkState) -> None:
        self.state = state
        self.installed = self.link
        self._lock.close()

    def _drop_partial(self) -> None:
        """Delete the partial (its bytes are wrong) and forget what was checked."""
        self._close_fd()
        if self._partial is not None:
            with contextlib.suppress(FileNotFoundError):
                self._partial.unlink()
            self._partial = None
        self.verified = set()
        self._written.clear()
        self._heads.clear()
        self._head_hashes.clear()
        self.offset = 0
        self._whole, self._hashed = hashlib.sha256(), 0

    def _discard(self) -> None:
        """Give up on bytes proven wrong: delete the partial, release the lock."""
        self._close_fd()
        if self._partial is not None:
            with contextlib.suppress(FileNotFoundError):
                self._partial.unlink()
            self._partial = None
        self.state = "closed"
        self._lock.close()

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ChunkStream:
    """The artifact's bytes in order from one position (one response body): written as they
    arrive, each chunk checked when its last byte is in. A chunk another stream is writing,
    or already verified, is passed over (its bytes are not written). Not thread-safe itself:
    one stream is fed by one thread at a time."""

    def __init__(self, sink: ChunkSink, pos: int) -> None:
        self.sink = sink
        self.pos = pos
        self._index: int | None = None  # the chunk being written (None: between chunks)
        self._mine = False  # this stream writes that chunk
        self._chunk_bytes = 0  # bytes of that chunk this stream wrote
        self._from_head = False  # that chunk continues a head this stream did not write
        self.verified: list[int] = []  # chunks this stream verified (the caller drains it)
        self.credit = 0  # bytes this stream wrote of the chunks it verified (drained too)
        self._hash: _Hasher | None = None
        if sink.spans and pos < sink.spans[-1].stop:
            span = sink.spans[self._chunk_at(pos)]
            if pos != span.start and pos != sink._heads.get(span.index):
                raise UsageError(
                    f"a stream starts at a chunk or at its head, not at byte {pos}",
                    code="sink_order",
                )

    def _chunk_at(self, pos: int) -> int:
        spans = self.sink.spans
        size = spans[0].length if spans else 1
        return min(pos // size, len(spans) - 1)

    def write(self, parts: Sequence[memoryview]) -> None:
        """Write ``parts`` (the next bytes of the body); the chunks they complete and that
        pass their checks are added to ``verified``. A chunk that fails its check raises
        ``IntegrityError`` (the chunks verified before it stay in ``verified``)."""
        sink = self.sink
        for part in parts:
            view = part
            while view:
                if not sink.spans or self.pos >= sink.spans[-1].stop:
                    self.close()
                    if sink.whole:
                        sink._discard()
                    raise IntegrityError(
                        f"the peer sent more than the {sink._total} bytes of {sink.item.path}",
                        code="artifact_size_mismatch",
                        path=sink.item.path,
                    )
                if self._index is None:
                    self._enter(self._chunk_at(self.pos))
                index = self._index
                if index is None:
                    raise UsageError("no chunk entered", code="sink_order")
                span = sink.spans[index]
                piece = view[: span.stop - self.pos]
                view = view[len(piece) :]
                if self._mine:
                    self._put(index, piece)
                self.pos += len(piece)
                if self.pos == span.stop and self._end(index):
                    self.verified.append(index)

    def _enter(self, index: int) -> None:
        sink = self.sink
        span = sink.spans[index]
        self._index = index
        self._chunk_bytes = 0
        with sink._order:
            owner = sink._owners.get(index)
            self._mine = index not in sink.verified and owner is None
            if not self._mine:
                return
            sink._owners[index] = self
            head = sink._heads.pop(index, None)
            hashed = sink._head_hashes.pop(index, None)
            if head != self.pos:  # no head kept, or one this stream rewrites from the start
                sink.offset -= sink._written.pop(index, 0)
        self._from_head = self.pos > span.start
        if self._from_head:  # continuing a head: its bytes were hashed when it was kept
            if hashed is None or head != self.pos:
                raise UsageError(f"no head of chunk {index} ends at {self.pos}", code="sink_order")
            self._hash = hashed
        else:
            self._hash = sink._hasher(index)

    def _put(self, index: int, piece: memoryview) -> None:
        sink = self.sink
        if self._hash is None:
            raise UsageError("no chunk entered", code="sink_order")
        self._hash.update(piece)
        with sink._order:
            if index in sink.verified:  # another copy won: this one writes no more of it
                self._release(index)
                return
            if sink._fd is None:
                raise UsageError("the partial is closed", code="sink_order")
            _pwrite_all(sink._fd, piece, self.pos)
            self._chunk_bytes += len(piece)
            sink._written[index] = sink._written.get(index, 0) + len(piece)
            sink.offset += len(piece)
            sink.received_bytes += len(piece)

    def _end(self, index: int) -> bool:
        """The chunk's last byte is in: check it (True: verified by this stream)."""
        sink = self.sink
        mine, hasher = self._mine, self._hash
        self._index, self._hash = None, None
        if not mine:
            return False
        span = sink.spans[index]
        if hasher is None:
            raise UsageError("no chunk entered", code="sink_order")
        if isinstance(hasher, sha256_chain.ChainHasher):
            if index == len(sink.spans) - 1:
                ok = hasher.digest() == bytes.fromhex(sink.item.sha256)
            else:
                ok = hasher.offset % sha256_chain.BLOCK_BYTES == 0 and (
                    hasher.state() == sink.digests[index]
                )
        else:
            ok = hasher.digest() == sink.digests[index]
        with sink._order:
            self._release(index)
            if index in sink.verified:
                return False
            if not ok:
                sink.offset -= sink._written.pop(index, 0)
            else:
                sink._counted(index)
                sink._advance(index, ())
                self.credit += self._chunk_bytes
        if not ok:
            if self._from_head:  # this node's own bytes may be the wrong ones: start over
                if sink.whole:
                    sink._discard()
                raise PartialChanged(
                    f"chunk {index} of {sink.item.path}, continued from the partial, does not "
                    "match: asking for it from its start",
                    path=sink.item.path,
                )
            error = sink._mismatch(span)
            if sink.whole:
                sink._discard()
            raise error
        return True

    def _release(self, index: int) -> None:
        """(under ``_order``) This stream stops writing chunk ``index``."""
        sink = self.sink
        if sink._owners.get(index) is self:
            del sink._owners[index]
        self._mine = False

    def close(self) -> None:
        """The body stopped: a chunk left half-written keeps its bytes as a head (a later
        request for it may continue from there)."""
        sink = self.sink
        index = self._index
        if index is None:
            return
        with sink._order:
            if self._mine and index not in sink.verified and self.pos > sink.spans[index].start:
                sink._heads[index] = self.pos
                if self._hash is not None:
                    sink._head_hashes[index] = self._hash
            self._release(index)
        self._index, self._hash = None, None


def _read_into(fd: int, start: int, stop: int, hasher: _Hasher, name: str) -> None:
    """Hash bytes ``[start, stop)`` of ``fd``, a piece at a time."""
    at = start
    while at < stop:
        got = os.pread(fd, min(_READ_BYTES, stop - at), at)
        if not got:
            raise PartialChanged(f"partial {name} shrank while it was read")
        hasher.update(got)
        at += len(got)


def _written_end(fd: int, start: int, stop: int) -> int:
    """Where the bytes a stream wrote into ``[start, stop)`` of a partial end: after the
    last byte that is not zero (a stream writes a chunk from its start, in order; what lies
    beyond is a hole or a later stream's). Trailing zeros it did write are left out, which
    only costs asking for them again; a region that never held data is skipped unread."""
    try:
        data_at = os.lseek(fd, start, os.SEEK_DATA)
    except OSError:  # ENXIO: no data from ``start`` to the end of the file
        return start
    if data_at >= stop:
        return start
    end, at = start, start
    while at < stop:
        got = os.pread(fd, min(_READ_BYTES, stop - at), at)
        if not got:
            break
        kept = len(got.rstrip(b"\0"))
        if kept:
            end = at + kept
        at += len(got)
    return end


def _whole_span(size: int) -> tuple[ChunkSpan, ...]:
    return (ChunkSpan(0, 0, size),) if size > 0 else ()


def _pwrite_all(fd: int, data: memoryview, pos: int) -> int:
    view = data
    while view:
        written = os.pwrite(fd, view, pos)
        view, pos = view[written:], pos + written
    return pos


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def open_chunk_sink(
    cache: RepoCache,
    item: FetchItem,
    *,
    manifest_sha256: str,
    verify_cache: VerifyCache | None,
    digests: tuple[bytes, ...] | None = None,
    chunk_bytes: int | None = None,
    chain: bool = False,
    lock_timeout_s: float = 0.0,
    durable: bool = False,
) -> ChunkSink:
    """Take the artifact's install lock (or ``InstallBusy`` past ``lock_timeout_s``) and get
    ready to receive it: already installed (``sink.present``), resuming a partial
    (``sink.offset`` > 0), or from scratch. ``digests`` (with ``chunk_bytes``, ``chain``):
    the coordinator's signed list for this file; None: one chunk, the manifest's SHA-256.
    ``manifest_sha256`` (the topology's) keys the verification records; ``durable`` fsyncs
    before and after the rename."""
    lock = contextlib.ExitStack()
    try:
        lock.enter_context(exclusive_lock(cache.lock_path(item.sha256), timeout_s=lock_timeout_s))
    except LockBusy:
        raise InstallBusy(
            f"another fetch of {item.path} is installing it on this node",
            path=item.path,
            remediation="wait for it; the file will then be found installed",
        ) from None
    try:
        sink = ChunkSink(
            cache,
            item,
            digests=digests,
            chunk_bytes=chunk_bytes,
            manifest_sha256=manifest_sha256,
            verify_cache=verify_cache,
            durable=durable,
            lock=lock,
            chain=chain,
        )
        sink._start()
    except BaseException:
        with contextlib.suppress(UnboundLocalError):
            sink._close_fd()
        lock.close()
        raise
    return sink
