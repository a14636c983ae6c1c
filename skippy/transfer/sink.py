"""The receiving side: one artifact from a peer into the hub cache, resumable and verified.

Spec "Peer Cache Transfer": "Received artifacts are written to a fresh hidden partial file and
installed atomically only after size and SHA-256 verification." What a resumable fetch adds,
all here:

- the partial is ``blobs/.<sha256>.<pid>.<nanos>.part``, beside its destination blob
  (``skippy.atomic.resumable_partial_for``);
- a fetch resumes from the largest partial no bigger than the expected size and deletes the
  others (the manifest, whose size is unknown and at most 16 MiB, always starts afresh); the
  resumed prefix is hashed once, and a partial that changes meanwhile is an error
  (``partial_changed``);
- bytes are hashed as they are written; at the end size and SHA-256 must equal the
  declaration, else the partial is deleted (``artifact_sha256_mismatch``); any other failure
  (refusal, disconnect, truncation, a disk error) keeps it for the next attempt;
- installing is ``skippy.atomic.publish`` of the partial onto ``blobs/<sha256>`` and an atomic
  relative symlink ``snapshots/<commit>/<path> -> ../../blobs/<sha256>``: the layout
  huggingface_hub itself reads, so ``hf_hub_download(..., local_files_only=True)`` and
  ``skippy.consume.resolve`` find the file offline; a verification record is written so
  the stage's own verification is instant;
- one fetch per artifact and node: the install lock (``RepoCache.lock_path``, the same file
  huggingface_hub locks for that blob) is held from ``open_sink`` to ``finish``/``abort``.
  The second fetch waits (``lock_timeout_s``) or gets ``InstallBusy``, then finds the file
  installed. The lock only saves work; the rename is what makes the install correct.

Every method is synchronous and bounded (one chunk, one rename): a trio shell calls them
with ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import Literal

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
from skippy.errors import InputUnreadable, IntegrityError, ManifestError, UnsafePath, UsageError
from skippy.hashing import copy_range
from skippy.paths import resolve_under
from skippy.transfer.errors import InstallBusy, PartialChanged, TransferRefused
from skippy.transfer.fetch_plan import FetchItem
from skippy.transfer.hubcache import RepoCache, verified_file
from skippy.transfer.wire import ArtifactResponse

log = logging.getLogger(__name__)

SinkState = Literal["present", "receiving", "installed", "closed"]


class ArtifactSink:
    """One artifact being received. Make it with ``open_sink``; then, unless ``present``:
    send a request at ``offset``, ``accept`` the response header, ``write`` each body chunk,
    ``finish`` at the end of the body, or ``abort`` on any failure (also done by ``with``)."""

    def __init__(
        self,
        cache: RepoCache,
        item: FetchItem,
        *,
        manifest_sha256: str,
        verify_cache: VerifyCache | None,
        durable: bool,
        lock: contextlib.ExitStack,
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
        self.offset = 0  # where the request resumes: the bytes already in the partial
        self.received_bytes = 0  # body bytes written by this sink (not counting the prefix)
        self.installed: Path | None = None  # the snapshot path once present or installed
        self._partial: Path | None = None
        self._fd: int | None = None
        self._hash = hashlib.sha256()
        self._total: int | None = None

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
            linked = self._verified(self.link)
        except UnsafePath:
            linked = False  # a link leading out is replaced by the install
        if not linked:
            if not self._verified(self.blob):
                return False
            self._link()
        self._done("present")
        return True

    def _verified(self, path: Path) -> bool:
        return verified_file(
            path,
            self.item,
            manifest_sha256=self.manifest_sha256,
            verify_cache=self.verify_cache,
        )

    def _pick_partial(self) -> tuple[Path, os.stat_result] | None:
        """The largest partial no bigger than the expected size; every other one is deleted
        (larger ones cannot be prefixes, smaller ones are superseded)."""
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
        """Continue ``path``: hash its prefix (read once) and write after it. A partial that
        is already whole (a crash between the last write and the rename) is installed now,
        or deleted if its digest is wrong."""
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
            before = os.fstat(fd)
            if _identity(before) != _identity(seen):
                raise PartialChanged(
                    f"partial {path.name} changed while it was opened", path=self.item.path
                )
            try:
                copy_range(fd, 0, before.st_size, self._hash.update)
            except InputUnreadable:
                raise PartialChanged(
                    f"partial {path.name} shrank while it was read", path=self.item.path
                ) from None
            if _identity(os.fstat(fd)) != _identity(before):
                raise PartialChanged(
                    f"partial {path.name} changed while it was read", path=self.item.path
                )
            os.lseek(fd, before.st_size, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._partial = fd, path
        self.offset = before.st_size
        log.info("resuming %s at byte %d of %s", self.item.path, self.offset, self.item.size)
        if self.offset == self.item.size:
            self._total = self.offset
            if self._hash.hexdigest() == self.item.sha256:
                self._install()
            else:
                self._drop_partial()  # whole but corrupt: start again from byte 0

    def _fresh(self) -> None:
        path = resumable_partial_for(self.blob)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._partial = path

    # --- receiving ------------------------------------------------------------------------
    @property
    def present(self) -> bool:
        """True when nothing had to be received (the file was already installed)."""
        return self.state == "present"

    def accept(self, response: ArtifactResponse) -> None:
        """Check the response header against what the manifest declares. A refusal raises
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
        self._total = response.total_size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append one body chunk to the partial, hashing it."""
        self._expect_receiving()
        if self._total is None or self._fd is None:
            raise UsageError("accept() the response header before writing", code="sink_order")
        if self.offset + len(data) > self._total:
            self._discard()
            raise IntegrityError(
                f"the peer sent more than the {self._total} bytes of {self.item.path}",
                code="artifact_size_mismatch",
                path=self.item.path,
            )
        self._hash.update(data)
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self.offset += len(data)
        self.received_bytes += len(data)

    def finish(self) -> Path:
        """The body ended: verify size and SHA-256, install, return the snapshot path. A
        digest mismatch deletes the partial; a short body keeps it."""
        self._expect_receiving()
        if self._total is None:
            raise UsageError("accept() the response header before finishing", code="sink_order")
        if self.offset != self._total:
            raise IntegrityError(
                f"{self.item.path}: the body ended after {self.offset} of {self._total} bytes",
                code="artifact_truncated",
                path=self.item.path,
                expected=self._total,
                actual=self.offset,
            )
        digest = self._hash.hexdigest()
        if digest != self.item.sha256:
            self._discard()
            raise IntegrityError(
                f"{self.item.path} received from the peer hashes to {digest}, the manifest "
                f"declares {self.item.sha256}; the partial was deleted",
                code="artifact_sha256_mismatch",
                path=self.item.path,
                paths=(self.item.path,),
                expected=self.item.sha256,
                actual=digest,
            )
        self._install()
        return self.link

    def abort(self) -> None:
        """Stop receiving, keep the partial for a later resume, release the lock. Safe to
        call in any state and more than once."""
        if self.state != "receiving":
            return
        self._close_fd()
        self.state = "closed"
        self._lock.close()

    def __enter__(self) -> ArtifactSink:
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
        """Delete the partial (its bytes are wrong) and forget what was hashed."""
        self._close_fd()
        if self._partial is not None:
            with contextlib.suppress(FileNotFoundError):
                self._partial.unlink()
            self._partial = None
        self.offset = 0
        self._hash = hashlib.sha256()
        self._total = None

    def _discard(self) -> None:
        """Give up on bytes proven wrong: delete the partial, release the lock."""
        self._drop_partial()
        self.state = "closed"
        self._lock.close()

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def open_sink(
    cache: RepoCache,
    item: FetchItem,
    *,
    manifest_sha256: str,
    verify_cache: VerifyCache | None,
    lock_timeout_s: float = 0.0,
    durable: bool = False,
) -> ArtifactSink:
    """Take the artifact's install lock and get ready to receive it: already installed
    (``sink.present``), resuming a partial (``sink.offset`` > 0), or from scratch.

    ``lock_timeout_s`` bounds the wait for a concurrent fetch of the same artifact (0: try
    once); past it ``InstallBusy`` is raised. ``manifest_sha256`` (the topology's) keys the
    verification records. ``durable`` fsyncs before and after the rename.
    """
    lock = contextlib.ExitStack()
    try:
        lock.enter_context(exclusive_lock(cache.lock_path(item.sha256), timeout_s=lock_timeout_s))
    except LockBusy:
        raise InstallBusy(
            f"another fetch of {item.path} is installing it on this node",
            path=item.path,
            remediation="wait for it; the file will then be found installed",
        ) from None
    sink = ArtifactSink(
        cache,
        item,
        manifest_sha256=manifest_sha256,
        verify_cache=verify_cache,
        durable=durable,
        lock=lock,
    )
    try:
        sink._start()
    except BaseException:
        sink._close_fd()
        lock.close()
        raise
    return sink
