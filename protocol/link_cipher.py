"""Which AEAD a link's Noise channel uses, and how two nodes agree on it before Noise starts.

AES-256-GCM is ~1.5x faster per core than ChaCha20-Poly1305 where the CPU
has AES instructions (measured here: 2.8 vs 1.85 GB/s for 64 KiB records). The Noise protocol
name fixes the cipher before the first handshake message, and the Hello arrives only after the
handshake, so the choice is made in the WebSocket upgrade, before Noise starts: the dialer
offers the WebSocket subprotocol ``skippy-mesh-aesgcm`` (the feature's announcement) and
the listener selects it only if it supports it too. An older node neither offers nor selects it:
both ends then speak ``Noise_XX_25519_ChaChaPoly_SHA256`` exactly as before. The chosen name is
hashed into the handshake (Noise section 5.2, ``InitializeSymmetric(protocol_name)``), so two
ends that disagree fail the handshake instead of misreading records. Stripping the offer (an
active attacker) can only select ChaCha20-Poly1305, which is equally secure, only slower.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Final

from protocol import constants as c
from protocol.errors import ProtocolError


class LinkCipher(enum.Enum):
    """A Noise cipher function a link may use; ``value`` is its name in the protocol name."""

    CHACHAPOLY = "ChaChaPoly"
    AESGCM = "AESGCM"

    @property
    def noise_name(self) -> bytes:
        return c.NOISE_PROTOCOL_AESGCM if self is LinkCipher.AESGCM else c.NOISE_PROTOCOL_NAME

    @property
    def label(self) -> str:
        """How status pages and logs name it."""
        return "aes-256-gcm" if self is LinkCipher.AESGCM else "chacha20-poly1305"


DEFAULT_CIPHER: Final = LinkCipher.CHACHAPOLY  # what every node speaks; needs no negotiation
# The WebSocket subprotocol that stands for each negotiable cipher (the default has none).
_SUBPROTOCOLS: Final = {LinkCipher.AESGCM: c.WS_SUBPROTOCOL_AESGCM}


def offered_subprotocols(supported: Sequence[LinkCipher]) -> list[str]:
    """What a dialer offers in its upgrade request, in its order of preference."""
    return [_SUBPROTOCOLS[x] for x in supported if x in _SUBPROTOCOLS]


def select_subprotocol(
    proposed: Sequence[str], supported: Sequence[LinkCipher]
) -> tuple[LinkCipher, str | None]:
    """The listener's choice: the first of its own ``supported`` ciphers that the dialer
    proposed, with the subprotocol to answer; the default cipher (no subprotocol) otherwise.
    Unknown proposals are ignored (a newer dialer may offer more)."""
    for cipher in supported:
        token = _SUBPROTOCOLS.get(cipher)
        if token is not None and token in proposed:
            return cipher, token
    return DEFAULT_CIPHER, None


def cipher_for_selected(selected: str | None, offered: Sequence[str]) -> LinkCipher:
    """The dialer's view of the listener's answer: no subprotocol means the default cipher
    (an older listener); anything it did not offer is refused (``protocol.ws_upgrade`` checks
    this too)."""
    if selected is None:
        return DEFAULT_CIPHER
    for cipher, token in _SUBPROTOCOLS.items():
        if token == selected and token in offered:
            return cipher
    raise ProtocolError("handshake_failed", f"the listener selected {selected!r}, never offered")
