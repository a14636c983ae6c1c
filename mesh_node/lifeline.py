"""When a node stops by itself: its ``data_dir`` vanished, or the lab that started it is gone.

A lab (``mesh-node lab``, ``mesh_node.lab.cluster``) holds an exclusive ``flock`` on one file,
its lifeline, for as long as it runs, and writes that file's path into every node's config
(``lab_lock``). The kernel drops the lock when the lab's process ends, however it ends (a
``SIGKILL`` included), so a node that can take a shared lock on it, or finds it gone, knows its
lab is gone: it stops, like on ``SIGTERM``, instead of redialling peers that will not come
back. A node started by hand from a lab's config (to restart a killed worker) has the same key
and stops with the lab too. A node whose ``data_dir`` was removed (its control socket and
caches with it) stops the same way, lab or not: nothing could reach or use it any more.

Why a lock and not ``PR_SET_PDEATHSIG``: the death signal follows the *thread* that forked
the child, and trio starts processes from a worker thread that exits after 10 s idle, which
would kill every node 10 s into the lab; it also says nothing to a node a person started.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import Final

import trio

log = logging.getLogger("mesh_node.lifeline")

POLL_S: Final = 1.0  # how soon a node notices; one stat and one open per second


def hold(path: Path) -> int:
    """Create ``path`` and hold its exclusive lock (the lab's side); the descriptor, which
    the caller keeps open for as long as its nodes should live (closing it releases them)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def holder_alive(path: Path) -> bool:
    """Whether some process still holds ``path``'s lock (a missing file: nobody does)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the shared lock, if it was taken
    return False


def reason_to_stop(data_dir: Path, lab_lock: Path | None) -> str | None:
    """Why this node should stop by itself now, or ``None``."""
    if not data_dir.is_dir():
        return f"data_dir {data_dir} was removed"
    if lab_lock is not None and not holder_alive(lab_lock):
        return f"the lab that started this node is gone (nothing holds {lab_lock})"
    return None


async def wait_for_reason(data_dir: Path, lab_lock: Path | None, poll_s: float = POLL_S) -> str:
    """Return, with the reason, once this node should stop by itself."""
    while True:
        reason = reason_to_stop(data_dir, lab_lock)
        if reason is not None:
            return reason
        await trio.sleep(poll_s)
