"""The one atomic-install recipe (spec "Peer Cache Transfer": received artifacts are written
to a fresh hidden partial file and installed atomically only after verification).

A unique hidden temp name in the destination folder, the caller streams into it (hashing as
it goes), the caller's checks run inside the ``with`` block, and only a block that exits
cleanly is renamed into place. The temp file is unlinked in ``finally`` on any failure, so a
reader never trusts a half-written file and a crash leaves only a hidden ``.partial``.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

PARTIAL_SUFFIX = ".partial"


def temp_name_for(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.{uuid.uuid4().hex[:12]}{PARTIAL_SUFFIX}"


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries (the renames into it), to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        os.replace(tmp, dest)
        if durable:
            fsync_path(dest.parent)
    finally:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write_bytes(dest: Path, data: bytes, *, durable: bool = True) -> None:
    with atomic_install(dest, durable=durable) as f:
        f.write(data)
