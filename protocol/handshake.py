"""The Noise XX handshake as a sans-IO state machine, with identities bound the libp2p way.

``Noise_XX_25519_ChaChaPoly_SHA256``, or ``Noise_XX_25519_AESGCM_SHA256`` when both ends
chose it in the WebSocket upgrade (``protocol.link_cipher``; the ``noiseprotocol`` package
does all of it: no home-made crypto). Each
side's X25519 static key is fresh per link; its long-term Ed25519 identity signs that static key
inside the encrypted handshake payload (as in libp2p), so the peer id is derived from a key that
proved itself, never claimed. The payload may carry the node's owner certificate.

Messages: (1) initiator -> e (empty payload); (2) responder -> e, ee, s, es + its identity;
(3) initiator -> s, se + its identity. The initiator checks the responder's id (the ``#<id>``
of the address it dialed) before it reveals its own identity in message 3: an impostor learns
nothing but an ephemeral key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from noise.connection import Keypair, NoiseConnection
from noise.constants import MAX_NONCE
from noise.exceptions import (
    NoiseHandshakeError,
    NoiseInvalidMessage,
    NoiseMaxNonceError,
    NoiseValidationError,
    NoiseValueError,
)

from protocol import constants as c
from protocol import frames as f
from protocol.certificates import OwnerCertificate, public_bytes, sign_domain, verify_domain
from protocol.errors import ProtocolError
from protocol.link_cipher import DEFAULT_CIPHER, LinkCipher

_NOISE_ERRORS = (
    NoiseHandshakeError,
    NoiseInvalidMessage,
    NoiseMaxNonceError,
    NoiseValidationError,
    NoiseValueError,
    InvalidTag,
    ValueError,
    TypeError,
    IndexError,
)


@dataclass(frozen=True)
class PeerIdentity:
    """What the handshake proved about the peer."""

    node_id: bytes  # its Ed25519 identity key
    certificate: OwnerCertificate | None


class SecureChannel:
    """Noise transport ciphers for one link: plaintext records <-> one WebSocket message.

    The nonces are Noise's own counters, so a tampered, replayed, dropped or reordered record
    fails authentication and the link is dead (``decrypt_failed`` is fatal)."""

    def __init__(
        self, encrypt: Any, decrypt: Any, limits: c.Limits, cipher: LinkCipher = DEFAULT_CIPHER
    ) -> None:
        self._enc = encrypt
        self._dec = decrypt
        self.limits = limits
        self.cipher = cipher
        self._aead, self._nonce = _in_place_encryption(encrypt)

    def seal(self, plaintexts: list[bytes]) -> bytes:
        """One WebSocket message: each record's length, then its ciphertext."""
        self.sealed_size(plaintexts)  # every record's size checked before a nonce is used
        parts: list[bytes] = []
        for pt in plaintexts:
            ct = self._enc.encrypt_with_ad(None, pt)
            parts.append(f.record_prefix(len(ct)))
            parts.append(ct)
        return b"".join(parts)

    def sealed_size(self, plaintexts: list[bytes]) -> int:
        """The bytes ``seal`` makes of ``plaintexts``; ``frame_too_large`` for a record over
        the Noise maximum (nothing is encrypted then)."""
        size = 0
        for pt in plaintexts:
            if len(pt) > c.MAX_RECORD_PLAINTEXT:
                raise ProtocolError(
                    "frame_too_large", "a record exceeds the Noise maximum", fatal=False
                )
            size += c.RECORD_LENGTH_BYTES + len(pt) + c.NOISE_TAG_BYTES
        return size

    def seal_into(self, plaintexts: list[bytes], buf: bytearray, at: int) -> int:
        """``seal``'s bytes written into ``buf`` from ``at`` (``sealed_size`` of them; the
        end is returned): each ciphertext encrypted straight into its place where the AEAD
        can (cryptography's ``encrypt_into``), so a writer that frames the message itself
        allocates and joins no ciphertext (~0.25 of ~1.15 ms/MiB of the
        sender's sealing here). The nonces are the Noise cipher state's own, in order."""
        self.sealed_size(plaintexts)
        view = memoryview(buf)
        state, aead = self._enc, self._aead
        for pt in plaintexts:
            n = len(pt) + c.NOISE_TAG_BYTES
            view[at : at + c.RECORD_LENGTH_BYTES] = f.record_prefix(n)
            at += c.RECORD_LENGTH_BYTES
            if aead is None:
                view[at : at + n] = state.encrypt_with_ad(None, pt)
            else:  # CipherState.encrypt_with_ad's own steps (Noise section 5.1)
                if state.n >= MAX_NONCE:
                    raise NoiseMaxNonceError("Nonce has depleted!")
                aead.encrypt_into(self._nonce(state.n), pt, None, view[at : at + n])
                state.n += 1
            at += n
        return at

    def open(self, message: bytes | bytearray | memoryview) -> list[bytes]:
        out = []
        for record in f.split_records(message, self.limits):
            try:
                out.append(self._dec.decrypt_with_ad(None, record))
            except _NOISE_ERRORS:
                raise ProtocolError(
                    "decrypt_failed",
                    "a record failed authentication (tampered, replayed or reordered)",
                ) from None
        return out


def _in_place_encryption(state: Any) -> tuple[Any, Any]:
    """The AEAD object and nonce format under a noiseprotocol ``CipherState`` when the AEAD
    can encrypt into a caller's buffer (``encrypt_into``, in recent cryptography releases), else
    (None, None): ``seal_into`` then copies ``encrypt_with_ad``'s output. noiseprotocol 0.3
    keeps them as ``state.cipher.cipher`` and ``state.cipher.format_nonce``."""
    wrapper = getattr(state, "cipher", None)
    aead = getattr(wrapper, "cipher", None)
    nonce = getattr(wrapper, "format_nonce", None)
    if aead is None or nonce is None or not hasattr(aead, "encrypt_into"):
        return None, None
    if not isinstance(getattr(state, "n", None), int):
        return None, None
    return aead, nonce


class Handshake:
    def __init__(
        self,
        *,
        initiator: bool,
        identity: Ed25519PrivateKey,
        certificate: OwnerCertificate | None = None,
        expected_peer: bytes | None = None,
        limits: c.Limits = c.DEFAULT_LIMITS,
        cipher: LinkCipher = DEFAULT_CIPHER,
    ) -> None:
        self.initiator = initiator
        self.cipher = cipher
        self.limits = limits
        self._identity = identity
        self._certificate = certificate
        self._expected = expected_peer
        static = X25519PrivateKey.generate()
        static_priv = static.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        static_pub = static.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self._payload = msgpack.packb(
            {
                "v": c.HANDSHAKE_PAYLOAD_VERSION,
                "key": public_bytes(identity.public_key()),
                "sig": sign_domain(identity, c.SIG_DOMAIN_STATIC_KEY, static_pub),
                "cert": certificate.to_wire() if certificate is not None else None,
            }
        )
        self._noise = NoiseConnection.from_name(cipher.noise_name)
        self._noise.set_keypair_from_private_bytes(Keypair.STATIC, static_priv)
        self._noise.set_prologue(c.NOISE_PROLOGUE)
        if initiator:
            self._noise.set_as_initiator()
        else:
            self._noise.set_as_responder()
        self._noise.start_handshake()
        self._hs = self._noise.noise_protocol.handshake_state  # keeps rs after the split
        self._step = 0
        self.peer: PeerIdentity | None = None
        self.channel: SecureChannel | None = None

    @property
    def complete(self) -> bool:
        return self.channel is not None

    def start(self) -> bytes:
        """The initiator's first message."""
        if not self.initiator or self._step != 0:
            raise ProtocolError("handshake_state", "only the initiator starts, once", fatal=False)
        self._step = 1
        return bytes(self._noise.write_message(b""))

    def receive(self, message: bytes) -> bytes | None:
        """Consume the peer's next handshake message; return ours to send, if any."""
        if self.complete:
            raise ProtocolError("handshake_state", "the handshake is already complete")
        if len(message) > self.limits.max_handshake_message_bytes:
            raise ProtocolError(
                "handshake_too_large", f"a handshake message of {len(message)} bytes"
            )
        if self.initiator and self._step == 1:  # message 2
            payload = self._read(message)
            self.peer = self._verify_payload(payload)
            if self._expected is not None and self.peer.node_id != self._expected:
                raise ProtocolError(
                    "identity_mismatch",
                    f"dialed {self._expected.hex()} but the peer proved {self.peer.node_id.hex()}",
                )
            out = bytes(self._noise.write_message(self._payload))
            self._finish()
            return out
        if not self.initiator and self._step == 0:  # message 1
            if self._read(message):
                raise ProtocolError("handshake_failed", "message 1 carries no payload")
            self._step = 1
            return bytes(self._noise.write_message(self._payload))
        if not self.initiator and self._step == 1:  # message 3
            payload = self._read(message)
            self.peer = self._verify_payload(payload)
            self._finish()
            return None
        raise ProtocolError("handshake_state", "unexpected handshake message")

    def _read(self, message: bytes) -> bytes:
        try:
            return bytes(self._noise.read_message(bytes(message)))
        except _NOISE_ERRORS as exc:
            raise ProtocolError(
                "handshake_failed", f"bad handshake message ({type(exc).__name__})"
            ) from None

    def _verify_payload(self, payload: bytes) -> PeerIdentity:
        data = f.unpack_bounded(payload, self.limits)
        if not isinstance(data, dict) or set(data) != {"v", "key", "sig", "cert"}:
            raise ProtocolError("handshake_failed", "the identity payload has unexpected fields")
        if data["v"] != c.HANDSHAKE_PAYLOAD_VERSION:
            raise ProtocolError("handshake_failed", f"identity payload version {data['v']!r}")
        key, sig = data["key"], data["sig"]
        if not isinstance(key, bytes) or not isinstance(sig, bytes):
            raise ProtocolError("handshake_failed", "identity key and signature are bytes")
        remote_static = getattr(self._hs.rs, "public_bytes", None)
        if not isinstance(remote_static, bytes) or not verify_domain(
            key, sig, c.SIG_DOMAIN_STATIC_KEY, remote_static
        ):
            raise ProtocolError(
                "identity_signature", "the peer's identity key did not sign its Noise static key"
            )
        cert = None
        if data["cert"] is not None:
            try:
                cert = OwnerCertificate.from_wire(data["cert"])
            except ProtocolError as exc:
                raise ProtocolError("handshake_failed", exc.message) from None
        return PeerIdentity(node_id=key, certificate=cert)

    def _finish(self) -> None:
        proto = self._noise.noise_protocol
        self.channel = SecureChannel(
            proto.cipher_state_encrypt, proto.cipher_state_decrypt, self.limits, self.cipher
        )
        self._step = 2
