"""This machine's host fingerprint, advertised in the Hello.

Peers with the same fingerprint run on the same machine: their stages share its cores, so a
stage runtime with ``serving.threads = "auto"`` takes its share instead of all of them. The
fingerprint is a salted SHA-256 of the machine id and the boot id, so it reveals only "same
machine since the same boot" to peers, not the id itself, and changes at every reboot.
"""

from __future__ import annotations

import hashlib
import socket
from functools import cache
from pathlib import Path
from typing import Final

SALT: Final = b"mesh-node host fingerprint v1\0"
HOST_ID_HEX_CHARS: Final = 32
_SOURCES: Final = ("/etc/machine-id", "/var/lib/dbus/machine-id", "/proc/sys/kernel/random/boot_id")


@cache
def host_fingerprint() -> str:
    parts = []
    for source in _SOURCES:
        try:
            parts.append(Path(source).read_bytes().strip())
        except OSError:
            continue
    if not parts:  # no machine or boot id readable: the host name is the next best thing
        parts.append(socket.gethostname().encode())
    digest = hashlib.sha256(SALT + b"\0".join(parts)).hexdigest()
    return digest[:HOST_ID_HEX_CHARS]
