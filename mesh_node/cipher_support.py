"""Which Noise ciphers this node offers its peers, best first (protocol/link_cipher).

AES-256-GCM only where the CPU has AES instructions (x86 ``aes``, Arm ``aes`` in
/proc/cpuinfo): there it is the faster cipher (~1.5x here); without them a table-free software
AES is several times slower than ChaCha20-Poly1305. ChaCha20-Poly1305 is always supported (it
is what every node speaks when nothing else is agreed).
"""

from __future__ import annotations

from pathlib import Path

from protocol.link_cipher import DEFAULT_CIPHER, LinkCipher

CPUINFO = Path("/proc/cpuinfo")


def has_hardware_aes(cpuinfo: str) -> bool:
    """True when a ``flags`` (x86) or ``Features`` (Arm) line of /proc/cpuinfo lists ``aes``."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features") and "aes" in value.split():
            return True
    return False


def ciphers_for(cpuinfo: str) -> tuple[LinkCipher, ...]:
    if has_hardware_aes(cpuinfo):
        return (LinkCipher.AESGCM, DEFAULT_CIPHER)
    return (DEFAULT_CIPHER,)


def local_ciphers() -> tuple[LinkCipher, ...]:
    """This machine's ciphers; only the default where /proc/cpuinfo cannot be read."""
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        text = ""
    return ciphers_for(text)
