"""Invite tokens: an owner's signed, expiring word on which mesh to join and where to dial.

Pure: bytes and numbers in, values out (time is passed in). A token is one line of text,
``skippy-invite1.<body>.<signature>`` (both base64url, unpadded): the body is a JSON object

- ``v``: 1;
- ``mesh``: the mesh's identity, the owner key's public key (64 hex): the key that signs the
  token and every certificate of the mesh's nodes;
- ``fp``: the owner's fingerprint (``owner_fingerprint``), what an operator compares by eye;
- ``iat`` / ``exp``: issued-at and expiry, unix seconds;
- ``addrs``: where to dial, each ``{"kind", "url", "node"}``: ``direct`` is a node's own
  ``ws://HOST:PORT`` and the id that must answer there; ``relayed`` (``url`` a relay's
  address, ``via`` the relay's id, ``node`` the target reached through it) is carried and
  checked, for joiners that can use it;

and the signature is the owner's Ed25519 over ``SIG_DOMAIN_INVITE + body`` (the exact bytes,
so no canonical form is needed). Decoding checks the form and the signature; whether the
token is still valid and for this node's mesh is ``check_validity`` and the caller's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Final

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol import constants as c
from protocol.certificates import public_bytes, verify_domain
from protocol.errors import ProtocolError

INVITE_PREFIX: Final = "skippy-invite1."
INVITE_VERSION: Final = 1
ADDRESS_KINDS: Final = ("direct", "relayed")
MAX_INVITE_CHARS: Final = 8192
MAX_INVITE_ADDRESSES: Final = 16
MAX_URL_CHARS: Final = 300
# A token issued by a host whose clock runs a little ahead is still usable at once.
CLOCK_SKEW_S: Final = 300
_FINGERPRINT_DOMAIN: Final = b"skippy-mesh-owner-fingerprint/1\x00"
_HEX64: Final = re.compile(r"^[0-9a-f]{64}$")
_BODY_KEYS: Final = frozenset({"v", "mesh", "fp", "iat", "exp", "addrs"})
_MAX_TIME: Final = 2**62


def owner_fingerprint(owner_id: bytes) -> str:
    """16 hex characters naming an owner (a hash of its key, not the key itself)."""
    return hashlib.sha256(_FINGERPRINT_DOMAIN + owner_id).hexdigest()[:16]


@dataclass(frozen=True)
class InviteAddress:
    kind: str  # one of ADDRESS_KINDS
    url: str  # ws://HOST:PORT: the node itself (direct) or the relay (relayed)
    node_id: str  # who must answer the handshake (64 hex)
    via: str | None = None  # relayed: the relay's node id

    def __post_init__(self) -> None:
        if self.kind not in ADDRESS_KINDS:
            raise ProtocolError("malformed_invite", f"unknown address kind {self.kind!r}")
        if not isinstance(self.url, str) or not self.url.startswith("ws://"):
            raise ProtocolError("malformed_invite", "an address's url is ws://HOST:PORT")
        if len(self.url) > MAX_URL_CHARS:
            raise ProtocolError("malformed_invite", "an address's url is too long")
        if not isinstance(self.node_id, str) or not _HEX64.match(self.node_id):
            raise ProtocolError("malformed_invite", "an address's node is 64 lowercase hex")
        relayed = self.kind == "relayed"
        if relayed != (self.via is not None):
            raise ProtocolError("malformed_invite", "`via` is for relayed addresses, and needed")
        if self.via is not None and (not isinstance(self.via, str) or not _HEX64.match(self.via)):
            raise ProtocolError("malformed_invite", "an address's via is 64 lowercase hex")

    def to_wire(self) -> dict[str, str]:
        out = {"kind": self.kind, "url": self.url, "node": self.node_id}
        if self.via is not None:
            out["via"] = self.via
        return out

    @classmethod
    def from_wire(cls, data: object) -> InviteAddress:
        if not isinstance(data, dict) or not {"kind", "url", "node"} <= set(data) <= {
            "kind",
            "url",
            "node",
            "via",
        }:
            raise ProtocolError("malformed_invite", "an address is {kind, url, node[, via]}")
        return cls(data["kind"], data["url"], data["node"], data.get("via"))


@dataclass(frozen=True)
class Invite:
    owner_id: bytes  # the mesh's identity: the signing owner's public key
    issued_s: int
    expires_s: int
    addresses: tuple[InviteAddress, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.owner_id, bytes) or len(self.owner_id) != c.KEY_BYTES:
            raise ProtocolError("malformed_invite", f"mesh must be {c.KEY_BYTES} bytes")
        for name in ("issued_s", "expires_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_TIME:
                raise ProtocolError("malformed_invite", f"{name} must be unix seconds")
        if self.expires_s <= self.issued_s:
            raise ProtocolError("malformed_invite", "the invite expires before it is issued")
        if not 1 <= len(self.addresses) <= MAX_INVITE_ADDRESSES:
            raise ProtocolError(
                "malformed_invite", f"an invite carries 1..{MAX_INVITE_ADDRESSES} addresses"
            )

    @property
    def fingerprint(self) -> str:
        return owner_fingerprint(self.owner_id)

    def body(self) -> bytes:
        doc = {
            "v": INVITE_VERSION,
            "mesh": self.owner_id.hex(),
            "fp": self.fingerprint,
            "iat": self.issued_s,
            "exp": self.expires_s,
            "addrs": [a.to_wire() for a in self.addresses],
        }
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": self.owner_id.hex(),
            "owner_fingerprint": self.fingerprint,
            "issued_at": self.issued_s,
            "expires_at": self.expires_s,
            "addresses": [a.to_wire() for a in self.addresses],
        }


def encode_invite(invite: Invite, owner_key: Ed25519PrivateKey) -> str:
    """The token: ``invite`` signed by ``owner_key`` (which must be its mesh's owner)."""
    if public_bytes(owner_key.public_key()) != invite.owner_id:
        raise ProtocolError("invite_owner_mismatch", "the signing key is not the mesh's owner")
    body = invite.body()
    sig = owner_key.sign(c.SIG_DOMAIN_INVITE + body)
    return INVITE_PREFIX + _b64(body) + "." + _b64(sig)


def decode_invite(token: str) -> Invite:
    """The invite a token carries, its form and owner signature checked: ``malformed_invite``
    for anything that is not a token, ``invite_signature`` when the signature does not verify
    (a changed byte, or a token signed by another key than the one it names)."""
    if not isinstance(token, str) or len(token) > MAX_INVITE_CHARS:
        raise ProtocolError("malformed_invite", f"an invite is at most {MAX_INVITE_CHARS} chars")
    token = token.strip()
    if not token.startswith(INVITE_PREFIX):
        raise ProtocolError("malformed_invite", f"an invite starts with {INVITE_PREFIX!r}")
    parts = token[len(INVITE_PREFIX) :].split(".")
    if len(parts) != 2:
        raise ProtocolError("malformed_invite", "an invite is PREFIX.BODY.SIGNATURE")
    body, sig = (_unb64(p) for p in parts)
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError("malformed_invite", "the invite's body is not JSON") from None
    if not isinstance(doc, dict) or set(doc) != _BODY_KEYS:
        raise ProtocolError("malformed_invite", f"an invite's body has {sorted(_BODY_KEYS)}")
    if doc["v"] != INVITE_VERSION:
        raise ProtocolError("malformed_invite", f"invite version {doc['v']!r}")
    mesh = doc["mesh"]
    if not isinstance(mesh, str) or not _HEX64.match(mesh):
        raise ProtocolError("malformed_invite", "mesh is 64 lowercase hex")
    addrs = doc["addrs"]
    if not isinstance(addrs, list) or len(addrs) > MAX_INVITE_ADDRESSES:
        raise ProtocolError("malformed_invite", "addrs is a list")
    invite = Invite(
        bytes.fromhex(mesh),
        doc["iat"],
        doc["exp"],
        tuple(InviteAddress.from_wire(a) for a in addrs),
    )
    # The signature is checked before the fingerprint is compared: a changed byte anywhere
    # is one verdict, whatever field it landed in.
    if not verify_domain(invite.owner_id, sig, c.SIG_DOMAIN_INVITE, body):
        raise ProtocolError("invite_signature", "the owner's signature does not verify")
    if doc["fp"] != invite.fingerprint:
        raise ProtocolError("malformed_invite", "the fingerprint is not the mesh owner's")
    return invite


def check_validity(invite: Invite, now_s: float) -> None:
    """``invite_expired`` past its expiry, ``invite_not_yet_valid`` before its issue time
    (beyond ``CLOCK_SKEW_S``)."""
    if now_s >= invite.expires_s:
        raise ProtocolError("invite_expired", "the invite has expired")
    if now_s + CLOCK_SKEW_S < invite.issued_s:
        raise ProtocolError("invite_not_yet_valid", "the invite is issued in the future")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    if not text or not re.fullmatch(r"[A-Za-z0-9_-]+", text):
        raise ProtocolError("malformed_invite", "an invite's parts are base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise ProtocolError("malformed_invite", "an invite's parts are base64url") from None
