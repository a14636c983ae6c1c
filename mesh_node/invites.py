"""Invites: ``mesh-node invite`` issues a token (``protocol.invite``), ``run``/``serve --join``
take one and dial its addresses as configured peers.

An invite tells a joining node which mesh to join (the owner key that signs it) and where its
nodes listen; it grants nothing by itself: trust still comes from owner certificates, so a
joiner accepts only an invite of its own (verified) owner or of an owner in its
``trusted_owners``. The decisions (``invite_for``, ``join_peers``) are pure; every refusal
is an ``InviteRefused`` with a stable code (exit 2), raised before anything is written or
dialed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from mesh_node.errors import InviteRefused
from mesh_node.identity import LocalIdentity
from mesh_node.settings import HostPort, NodeSettings, PeerAddress, parse_peer_address
from protocol.certificates import OwnerStatus, public_bytes
from protocol.errors import ProtocolError
from protocol.invite import Invite, InviteAddress, check_validity, decode_invite, encode_invite
from skippy.errors import UsageError

DEFAULT_TTL_S = 24 * 3600
MAX_TTL_S = 30 * 86400
_TTL_RE = re.compile(r"^\s*(\d+)\s*([smhd]?)\s*$")
_TTL_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_WILDCARDS = frozenset({"0.0.0.0", "::", ""})

_HINTS = {
    "malformed_invite": "paste the whole line `mesh-node invite` printed",
    "invite_signature": "the token was changed after it was signed: ask for a new invite",
    "invite_expired": "ask the mesh's operator for a new one (mesh-node invite --ttl)",
    "invite_not_yet_valid": "check this machine's clock, or ask for a new invite",
}


def parse_ttl(text: str) -> int:
    """Seconds from ``90``, ``30m``, ``24h`` or ``7d`` (1 s .. 30 days)."""
    m = _TTL_RE.match(text)
    seconds = int(m.group(1)) * _TTL_UNITS[m.group(2)] if m else 0
    if not 1 <= seconds <= MAX_TTL_S:
        raise UsageError(
            f"--ttl: expected a lifetime such as 30m, 24h or 7d (at most 30d), not {text!r}",
            code="usage",
        )
    return seconds


def invite_for(
    identity: LocalIdentity,
    owner_key: Ed25519PrivateKey,
    addresses: Sequence[HostPort],
    *,
    ttl_s: int,
    now_s: float,
) -> Invite:
    """The invite to this node's mesh, reaching it at ``addresses``: refused unless the
    node's certificate is valid and issued by ``owner_key``."""
    owner_id = public_bytes(owner_key.public_key())
    cert_owner, status = identity.owner(now_s)
    if cert_owner != owner_id.hex() or status != "verified":
        why = (
            "has no owner certificate"
            if cert_owner is None
            else f"is certified by owner {cert_owner[:12]}…, not by this key"
            if cert_owner != owner_id.hex()
            else "has an owner certificate that does not verify now"
        )
        raise InviteRefused(
            f"this node {why}: an invite is signed by the owner its certificate chains to",
            code="invite_owner_mismatch",
            remediation="pass --owner with the key that certified this node "
            "(mesh-node owner sign)",
        )
    usable = [a for a in addresses if a.host not in _WILDCARDS and a.port != 0]
    if not usable:
        raise InviteRefused(
            "this node listens on no address a joiner could dial",
            code="invite_no_address",
            remediation="pass --address HOST:PORT (where other machines reach this node)",
        )
    now = int(now_s)
    return Invite(
        owner_id,
        now,
        now + ttl_s,
        tuple(
            InviteAddress("direct", PeerAddress(a.host, a.port).url, identity.node_id)
            for a in dict.fromkeys(usable)
        ),
    )


def issue_token(invite: Invite, owner_key: Ed25519PrivateKey) -> str:
    return encode_invite(invite, owner_key)


def read_invite(token: str, now_s: float) -> Invite:
    """The invite of ``token``, its form, signature and validity window checked."""
    try:
        invite = decode_invite(token)
        check_validity(invite, now_s)
    except ProtocolError as exc:
        raise InviteRefused(
            f"invite refused: {exc.message}", code=exc.code, remediation=_HINTS.get(exc.code)
        ) from None
    return invite


def join_peers(
    invite: Invite,
    *,
    own_owner_id: str | None,
    own_owner_status: OwnerStatus,
    trusted_owners: Sequence[str],
    own_node_id: str,
) -> tuple[PeerAddress, ...]:
    """The peers to dial for ``invite`` (its direct addresses, each with the id that must
    answer), or ``invite_other_mesh`` when its owner is neither this node's verified owner
    nor trusted."""
    mesh = invite.owner_id.hex()
    ours = own_owner_id == mesh and own_owner_status == "verified"
    if not ours and mesh not in trusted_owners:
        held = (
            "no verified owner certificate"
            if own_owner_id is None or own_owner_status != "verified"
            else f"owner {own_owner_id[:12]}…"
        )
        raise InviteRefused(
            f"the invite is for the mesh of owner {mesh[:12]}… (fingerprint "
            f"{invite.fingerprint}); this node has {held} and does not trust that owner",
            code="invite_other_mesh",
            expected=mesh,
            actual=own_owner_id,
            remediation="have that owner certify this node (mesh-node owner sign), or list "
            "the owner in trusted_owners",
        )
    peers = tuple(
        parse_peer_address(f"{a.url}#{a.node_id}", "invite")
        for a in invite.addresses
        if a.kind == "direct" and a.node_id != own_node_id
    )
    if not peers:
        raise InviteRefused(
            "the invite names no address this node can dial (only its own, or only kinds "
            "it does not use)",
            code="invite_no_address",
        )
    return peers


def settings_joining(
    settings: NodeSettings, identity: LocalIdentity, token: str, now_s: float
) -> NodeSettings:
    """``settings`` with the invite's nodes added to the configured peers (nothing written)."""
    invite = read_invite(token, now_s)
    own_owner, status = identity.owner(now_s)
    peers = join_peers(
        invite,
        own_owner_id=own_owner,
        own_owner_status=status,
        trusted_owners=settings.trusted_owners,
        own_node_id=identity.node_id,
    )
    known = {str(p) for p in settings.peers}
    return replace(settings, peers=settings.peers + tuple(p for p in peers if str(p) not in known))


def check_join_for_owner(token: str, owner_id: str | None, now_s: float) -> Invite:
    """Before a fresh data directory's node exists (``serve --join`` without ``--config``):
    the token must be valid and of ``owner_id``, the owner key found there, if any."""
    invite = read_invite(token, now_s)
    join_peers(
        invite,
        own_owner_id=owner_id,
        own_owner_status="verified" if owner_id is not None else "unverified",
        trusted_owners=(),
        own_node_id="",
    )
    return invite
