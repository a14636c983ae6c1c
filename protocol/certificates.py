"""Owner certificates: an owner's Ed25519 key signs (node id, owner id, not-before, not-after).

Pure: values in, values out; time is passed in as a number. A peer's owner status is
``verified`` only when its certificate's signature checks, it is within its validity window and
it names the key that authenticated the link; ``unverified`` without a certificate; ``invalid``
otherwise.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from protocol import constants as c
from protocol.errors import ProtocolError

OwnerStatus = Literal["verified", "unverified", "invalid"]
CERT_VERSION = 1
_TIMES = struct.Struct(">qq")
_MAX_TIME = 2**62


@dataclass(frozen=True)
class OwnerCertificate:
    node_id: bytes
    owner_id: bytes
    not_before: int  # unix seconds
    not_after: int
    signature: bytes

    def __post_init__(self) -> None:
        for name in ("node_id", "owner_id"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != c.KEY_BYTES:
                raise ProtocolError("malformed_certificate", f"{name} must be {c.KEY_BYTES} bytes")
        if not isinstance(self.signature, bytes) or len(self.signature) != c.SIGNATURE_BYTES:
            raise ProtocolError("malformed_certificate", "the signature must be 64 bytes")
        for name in ("not_before", "not_after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_TIME:
                raise ProtocolError("malformed_certificate", f"{name} must be unix seconds")

    @staticmethod
    def signed_bytes(node_id: bytes, owner_id: bytes, not_before: int, not_after: int) -> bytes:
        return c.SIG_DOMAIN_OWNER_CERT + node_id + owner_id + _TIMES.pack(not_before, not_after)

    @classmethod
    def issue(
        cls, owner_key: Ed25519PrivateKey, node_id: bytes, not_before: int, not_after: int
    ) -> OwnerCertificate:
        owner_id = public_bytes(owner_key.public_key())
        sig = owner_key.sign(cls.signed_bytes(node_id, owner_id, not_before, not_after))
        return cls(node_id, owner_id, not_before, not_after, sig)

    def signature_valid(self) -> bool:
        return _signature_ok(
            self.owner_id,
            self.signature,
            self.signed_bytes(self.node_id, self.owner_id, self.not_before, self.not_after),
        )

    def status_for(self, authenticated_node_id: bytes, now_s: float) -> tuple[OwnerStatus, str]:
        """This certificate's verdict for the key that authenticated a link, at ``now_s``."""
        if self.node_id != authenticated_node_id:
            return "invalid", "the certificate names another node"
        if not self.signature_valid():
            return "invalid", "the owner signature does not verify"
        if not self.not_before <= now_s < self.not_after:
            return "invalid", "the certificate is expired or not yet valid"
        return "verified", ""

    # --- forms: wire (msgpack, bytes) and file (JSON, hex) ----------------------------------
    def to_wire(self) -> dict[str, Any]:
        return {
            "v": CERT_VERSION,
            "node": self.node_id,
            "owner": self.owner_id,
            "nbf": self.not_before,
            "naf": self.not_after,
            "sig": self.signature,
        }

    @classmethod
    def from_wire(cls, data: object) -> OwnerCertificate:
        if not isinstance(data, dict) or set(data) != {"v", "node", "owner", "nbf", "naf", "sig"}:
            raise ProtocolError("malformed_certificate", "unexpected certificate fields")
        if data["v"] != CERT_VERSION:
            raise ProtocolError("malformed_certificate", f"certificate version {data['v']!r}")
        return cls(data["node"], data["owner"], data["nbf"], data["naf"], data["sig"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": CERT_VERSION,
            "node_id": self.node_id.hex(),
            "owner_id": self.owner_id.hex(),
            "not_before": self.not_before,
            "not_after": self.not_after,
            "signature": self.signature.hex(),
        }

    @classmethod
    def from_dict(cls, data: object) -> OwnerCertificate:
        keys = {"version", "node_id", "owner_id", "not_before", "not_after", "signature"}
        if not isinstance(data, dict) or set(data) != keys:
            raise ProtocolError(
                "malformed_certificate", f"a certificate has exactly {sorted(keys)}"
            )
        if data["version"] != CERT_VERSION:
            raise ProtocolError("malformed_certificate", f"certificate version {data['version']!r}")
        try:
            node, owner, sig = (
                bytes.fromhex(data[k]) for k in ("node_id", "owner_id", "signature")
            )
        except (TypeError, ValueError):
            raise ProtocolError("malformed_certificate", "ids and signature are hex") from None
        return cls(node, owner, data["not_before"], data["not_after"], sig)


def public_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def sign_domain(key: Ed25519PrivateKey, domain: bytes, data: bytes) -> bytes:
    """An Ed25519 signature over ``domain + data`` (every signature has its own domain)."""
    return key.sign(domain + data)


def verify_domain(public: bytes, signature: bytes, domain: bytes, data: bytes) -> bool:
    if len(public) != c.KEY_BYTES or len(signature) != c.SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, domain + data)
    except (InvalidSignature, ValueError):
        return False
    return True


@functools.lru_cache(maxsize=256)
def _signature_ok(owner_id: bytes, signature: bytes, message: bytes) -> bool:
    """Ed25519 verification, remembered: a node asks of its own certificate (and each peer's)
    on every artifact or source request and every status document, ~67 us each here; the
    same three inputs always give the same answer (a certificate's fields are length-checked
    when it is made, so each entry is ~200 bytes)."""
    return verify_domain(owner_id, signature, b"", message)
