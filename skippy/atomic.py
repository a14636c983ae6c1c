"""The one atomic-install recipe (spec "Peer Cache Transfer": received artifacts are written
to a fresh hidden partial file and installed atomically only after verification).

A unique hidden temp name in the destination folder, the caller streams into it (hashing as
it goes), the caller's checks run inside the ``with`` block, and only a block that exits
cleanly is renamed into place. The temp file is unlinked in ``finally`` on any failure, so a
reader never trusts a half-written file and a crash leaves only a hidden ``.partial``.

Resumable installs (peer transfer) keep their partial across failures instead: it is named
``.<name>.<pid>.<nanos>.part`` beside the destination (``resumable_partial_for``), found again
by ``find_partials`` and installed with the same ``publish`` step as ``atomic_install``.
``exclusive_lock`` is the advisory lock that makes concurrent installers do the work once;
locks only save work, the rename is what makes an install correct.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from skippy.errors import EXIT_USAGE, SkippyError

PARTIAL_SUFFIX = ".partial"
RESUMABLE_SUFFIX = ".part"
_LOCK_POLL_S = 0.02


def temp_name_for(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.{uuid.uuid4().hex[:12]}{PARTIAL_SUFFIX}"


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries (the renames into it), to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, dest: Path, *, durable: bool) -> None:
    """Rename a finished, closed temp file onto ``dest`` (the step every install ends with).

    ``durable`` fsyncs the data first and the folder after, so ``dest`` survives a power loss
    whole; without it the rename is atomic against a process crash only.
    """
    if durable:
        fsync_path(tmp)
    os.replace(tmp, dest)
    if durable:
        fsync_path(dest.parent)


@contextlib.contextmanager
def atomic_install(dest: Path, *, durable: bool = False) -> Iterator[BinaryIO]:
    """Yield a binary file that becomes ``dest`` only if the block exits without error.

    Without ``durable`` the rename is atomic against a crash of the *process* (a reader sees
    the old file or the whole new one) but not against a power loss: the kernel may persist
    the rename before the data, leaving ``dest`` empty or short after a reboot. ``durable``
    fsyncs the file before the rename and the folder after it, so ``dest`` survives a power
    loss whole. A caller that installs many files and fsyncs them later (``fsync_path``) may
    skip it per file.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name_for(dest)
    f = open(tmp, "xb")  # noqa: SIM115 - closed below on every path
    try:
        yield f
        f.flush()
        if durable:
            os.fsync(f.fileno())
        f.close()
        publish(tmp, dest, durable=False)
        if durable:
            fsync_path(dest.parent)
    finally:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write_bytes(dest: Path, data: bytes, *, durable: bool = True) -> None:
    with atomic_install(dest, durable=durable) as f:
        f.write(data)


def atomic_symlink(target: str, link: Path) -> None:
    """Make ``link`` a symlink to ``target``, replacing whatever was there in one rename (a
    reader sees the old entry or the new link, never a missing name)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.parent / f".{link.name}.{uuid.uuid4().hex[:12]}{PARTIAL_SUFFIX}"
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


# --- resumable partials ---------------------------------------------------------------------
def resumable_partial_for(dest: Path) -> Path:
    """A fresh hidden partial name beside ``dest``: ``.<name>.<pid>.<nanos>.part``."""
    return dest.parent / f".{dest.name}.{os.getpid()}.{time.time_ns()}{RESUMABLE_SUFFIX}"


def find_partials(dest: Path) -> list[Path]:
    """Every resumable partial of ``dest`` left in its folder (by any process, alive or not).
    Only names of exactly the ``resumable_partial_for`` shape match."""
    pattern = re.compile(
        rf"\A\.{re.escape(dest.name)}\.\d+\.\d+{re.escape(RESUMABLE_SUFFIX)}\Z", re.ASCII
    )
    try:
        names = os.listdir(dest.parent)
    except FileNotFoundError:
        return []
    return sorted(dest.parent / n for n in names if pattern.match(n))


# --- locks ------------------------------------------------------------------------------------
class LockBusy(SkippyError, BlockingIOError):
    """Another holder kept the lock past the timeout."""

    code = "lock_busy"
    exit_code = EXIT_USAGE


@contextlib.contextmanager
def exclusive_lock(path: Path, *, timeout_s: float | None = 0.0) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` for the block.

    ``path`` is a lock file (created if needed) or an existing directory (locked itself, so a
    folder that will be published gets no lock file). ``timeout_s`` 0 tries once, ``None``
    waits as long as it takes; otherwise the lock is polled until the deadline, so a caller
    on a worker thread (``trio.to_thread``) is never stuck for longer than it asked. Closing
    the descriptor releases the lock, also when the process dies. flock conflicts between
    two descriptors of one process too, so threads of one node exclude each other.
    """
    if path.is_dir():
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if timeout_s is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LockBusy(f"{path} is held by another installer") from None
                    time.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)
