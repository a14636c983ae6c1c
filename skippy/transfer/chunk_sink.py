"""The receiving side of a chunked transfer: chunks from any source, each checked against its
signed digest, written at its offset in the hidden partial.

The same partial, lock and install as ``ArtifactSink`` (``skippy.transfer.sink``): one
``blobs/.<sha256>.<pid>.<nanos>.part`` per artifact, the artifact's install lock held from
``open_chunk_sink`` to ``finish``/``abort``, ``skippy.atomic.publish`` then the snapshot link
and the verification record. What differs:

- ``write_chunk(index, data)`` checks the chunk first (``skippy.transfer.chunks.
  chunk_matches``: its own SHA-256, or its link of the SHA-256 chain); a wrong chunk raises
  ``IntegrityError`` (``chunk_digest_mismatch``) and touches nothing (the caller asks another
  source for it). A right one is written at its offset (``os.pwrite``; chunks may arrive in
  any order and from several threads at once);
- a resume keeps every chunk of the partial that matches its digest (a whole-file prefix
  left by ``ArtifactSink`` resumes too: its complete chunks verify);
- ``finish`` checks the whole file's SHA-256 before the install (spec "Peer Cache
  Transfer": installed "only after size and SHA-256 verification"). With a chain the chunks'
  checks computed it already (``skippy.transfer.sha256_chain``: the last chunk's link is the
  manifest's digest, reached from the initial value through every chunk), so no byte is
  hashed twice; with plain digests it is computed over the bytes written, in order, as the
  verified prefix grows. A mismatch deletes the partial;
- ``keep_prefix_only`` cuts the partial to its verified prefix before a whole-file fallback,
  which can resume only a prefix.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from skippy.atomic import LockBusy, exclusive_lock
from skippy.consume.verify import VerifyCache
from skippy.errors import IntegrityError, UsageError
from skippy.transfer.chunks import (
    ChunkSpan,
    check_chain,
    chunk_matches,
    chunk_spans,
    verified_chunks,
)
from skippy.transfer.errors import InstallBusy, PartialChanged
from skippy.transfer.fetch_plan import FetchItem
from skippy.transfer.hubcache import RepoCache
from skippy.transfer.partials import covered
from skippy.transfer.sink import ArtifactSink, _identity

log = logging.getLogger(__name__)


class ChunkSink(ArtifactSink):
    """One artifact received chunk by chunk. ``verified``: the indices in place."""

    def __init__(
        self,
        cache: RepoCache,
        item: FetchItem,
        *,
        digests: tuple[bytes, ...],
        chunk_bytes: int,
        manifest_sha256: str,
        verify_cache: VerifyCache | None,
        durable: bool,
        lock: contextlib.ExitStack,
        chain: bool = False,
    ) -> None:
        super().__init__(
            cache,
            item,
            manifest_sha256=manifest_sha256,
            verify_cache=verify_cache,
            durable=durable,
            lock=lock,
        )
        if item.size is None:
            raise UsageError("a chunked transfer needs the declared size", code="sink_order")
        self.spans: tuple[ChunkSpan, ...] = chunk_spans(item.size, chunk_bytes)
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
        self.verified: set[int] = set()
        self._total = item.size
        # The whole-file SHA-256, fed in chunk order as the verified prefix grows (chunks come
        # roughly in order, so the bytes are hashed from memory, and no second read is needed).
        self._whole = hashlib.sha256()
        self._hashed = 0  # chunks [0, _hashed) are in ``_whole``
        self._order = threading.Lock()  # write_chunk runs on several threads at once

    # --- opening (ArtifactSink's recipe; chunks instead of a prefix) ----------------------
    def _resume(self, path: Path, seen: os.stat_result) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise PartialChanged(
                f"partial {path.name} changed while it was opened ({exc.strerror})",
                path=self.item.path,
            ) from None
        try:
            if _identity(os.fstat(fd)) != _identity(seen):
                raise PartialChanged(
                    f"partial {path.name} changed while it was opened", path=self.item.path
                )
            good = verified_chunks(
                fd, self.spans, self.digests, chain=self.chain, sha256=self.item.sha256
            )
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._partial = fd, path
        self.verified = good
        self.offset = sum(self.spans[i].length for i in good)
        log.info(
            "resuming %s with %d of %d chunks verified", self.item.path, len(good), len(self.spans)
        )
        self._advance(-1, ())  # the verified prefix, read back once
        if self.complete:  # a whole partial (a crash before the rename): install or restart
            if self._whole_digest() == self.item.sha256:
                self._install()
            else:
                self._drop_partial()
                self.verified = set()
                self._whole, self._hashed = hashlib.sha256(), 0
                self._total = self.item.size

    def _fresh(self) -> None:
        super()._fresh()
        if self._fd is not None and self._partial is not None:  # reopen readable: finish hashes
            os.close(self._fd)
            self._fd = os.open(self._partial, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)

    # --- receiving ------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return len(self.verified) == len(self.spans)

    def write_chunk(self, index: int, data: bytes | bytearray | memoryview) -> bool:
        """Check chunk ``index`` against its digest, then write it at its offset; False when
        it was already in place (an end-game duplicate: the first verified copy won)."""
        return self.write_chunk_parts(index, [memoryview(data)])

    def write_chunk_parts(self, index: int, parts: Sequence[memoryview]) -> bool:
        """``write_chunk`` for a chunk received as pieces (views of the stream's records:
        hashed and written as they are, never joined into one copy). Two verified copies of
        one chunk hold the same bytes, so writing both at once is harmless."""
        self._expect_receiving()
        if self._fd is None or not 0 <= index < len(self.spans):
            raise UsageError(f"no chunk {index} to write", code="sink_order")
        span = self.spans[index]
        if sum(len(p) for p in parts) != span.length or not chunk_matches(
            self.digests, span, parts, chain=self.chain, sha256=self.item.sha256
        ):
            raise IntegrityError(
                f"{self.item.path}: chunk {index} (bytes {span.start}..{span.stop}) does not "
                "match its signed digest",
                code="chunk_digest_mismatch",
                path=self.item.path,
            )
        if index in self.verified:
            return False
        pos = span.start
        for part in parts:
            view = part
            while view:
                written = os.pwrite(self._fd, view, pos)
                view, pos = view[written:], pos + written
        with self._order:
            if index in self.verified:  # the other copy finished while this one was written
                return False
            self.verified.add(index)
            self.offset += span.length
            self.received_bytes += span.length
            self._advance(index, parts)
        return True

    def _advance(self, index: int, parts: Sequence[memoryview]) -> None:
        """Feed the whole-file hash every verified chunk that now continues its prefix:
        ``parts`` for chunk ``index``, the partial's bytes for the others (plain digests
        only: a chain's checks are the whole-file hash)."""
        while not self.chain and self._hashed < len(self.spans) and self._hashed in self.verified:
            span = self.spans[self._hashed]
            if self._hashed == index:
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
        hashes the prefix (a whole file read back, for chunks that came out of order), and
        the event loop asks this; copying a set of ints is one step under the GIL."""
        return frozenset(self.verified)

    def open_verified(self, start: int, stop: int) -> int | None:
        """A new read descriptor of the partial when ``[start, stop)`` is a run of chunks that
        were each checked against their signed digest and written (a partial
        holder serves only those, ``skippy.transfer.partials.covered``); None otherwise. The
        caller keeps ``finish``/``abort`` from running meanwhile (they close the partial); a
        chunk is in ``verified`` only once it is written, so no lock is needed here."""
        fd = self._fd
        if fd is None or self.state != "receiving":
            return None
        if not covered(self.verified_now(), self.spans, start, stop):
            return None
        return os.dup(fd)

    def finish(self) -> Path:
        """Every chunk verified: check the whole-file SHA-256, install, return the path."""
        self._expect_receiving()
        if not self.complete or self._fd is None:
            raise IntegrityError(
                f"{self.item.path}: {len(self.spans) - len(self.verified)} chunks still missing",
                code="artifact_truncated",
                path=self.item.path,
            )
        digest = self._whole_digest()
        if digest != self.item.sha256:
            self._discard()
            raise IntegrityError(
                f"{self.item.path} assembled from chunks hashes to {digest}, the manifest "
                f"declares {self.item.sha256}; the partial was deleted",
                code="artifact_sha256_mismatch",
                path=self.item.path,
                expected=self.item.sha256,
                actual=digest,
            )
        self._install()
        return self.link

    def _whole_digest(self) -> str:
        """The SHA-256 of the chunks in order (every one verified and hashed by now)."""
        if self._fd is None:
            raise UsageError("the partial is closed", code="sink_order")
        with self._order:
            self._advance(-1, ())
            if self.chain:
                if not self.complete:
                    raise UsageError("chunks are missing from the chain", code="sink_order")
                digest = self.item.sha256  # the last chunk's check reached it (module doc)
            elif self._hashed != len(self.spans):
                raise UsageError("chunks are missing from the whole-file hash", code="sink_order")
            else:
                digest = self._whole.hexdigest()
            os.ftruncate(self._fd, self.item.size or 0)  # a longer stale partial ends here
            return digest

    def keep_prefix_only(self) -> int:
        """Cut the partial to its longest run of verified chunks from byte 0 (a whole-file
        fetch resumes from there); returns that length."""
        end = 0
        for span in self.spans:
            if span.index not in self.verified:
                break
            end = span.stop
        if self._fd is not None and self.state == "receiving":
            os.ftruncate(self._fd, end)
            self.verified = {s.index for s in self.spans if s.stop <= end}
            self.offset = end
        return end


def open_chunk_sink(
    cache: RepoCache,
    item: FetchItem,
    *,
    digests: tuple[bytes, ...],
    chunk_bytes: int,
    manifest_sha256: str,
    verify_cache: VerifyCache | None,
    durable: bool = False,
    chain: bool = False,
) -> ChunkSink:
    """``skippy.transfer.sink.open_sink`` for a chunked transfer: the install lock (or
    ``InstallBusy``), then installed (``present``), resuming verified chunks, or fresh."""
    lock = contextlib.ExitStack()
    try:
        lock.enter_context(exclusive_lock(cache.lock_path(item.sha256), timeout_s=0.0))
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
    except BaseException:
        lock.close()
        raise
    try:
        sink._start()
    except BaseException:
        sink._close_fd()
        lock.close()
        raise
    return sink
