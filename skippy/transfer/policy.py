"""Who may receive artifacts from this node: the trust modes (pure).

The pure core of ``mesh_node.transfer.policy``, its shell.

Spec "Peer Cache Transfer": peer artifact transfer "is not advertised or served by default";
``trusted`` enables "same-owner or explicitly trusted-owner transfer", ``open`` is "for lab
deployments that intentionally allow any peer". The mode word table lives in
``skippy.config.parse_artifact_transfer``; this module takes the parsed mode as a value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

from skippy.config import ArtifactTransfer
from skippy.errors import UsageError

OwnerStatus = Literal["verified", "unverified", "invalid"]
OWNER_STATUSES: Final = ("verified", "unverified", "invalid")


@dataclass(frozen=True)
class NodePolicy:
    """This node's side of the decision: its mode, its own owner and its trust store."""

    mode: ArtifactTransfer
    own_owner_id: str | None = None
    own_owner_verified: bool = False
    trusted_owners: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.mode not in ("disabled", "trusted", "open"):
            raise UsageError(
                f"unknown artifact transfer mode {self.mode!r}", code="invalid_transfer_policy"
            )
        # Owner ids are hex keys: compare them in one case.
        object.__setattr__(
            self, "trusted_owners", frozenset(o.lower() for o in self.trusted_owners)
        )
        if self.own_owner_id is not None:
            object.__setattr__(self, "own_owner_id", self.own_owner_id.lower())


@dataclass(frozen=True)
class PeerFacts:
    """What the authenticated link proved about the requesting peer."""

    peer_id: bytes  # the 32-byte node id the link's handshake authenticated
    owner_id: str | None = None
    owner_status: OwnerStatus = "unverified"

    def __post_init__(self) -> None:
        if self.owner_status not in OWNER_STATUSES:
            raise UsageError(
                f"unknown owner status {self.owner_status!r}", code="invalid_transfer_policy"
            )


def would_serve(policy: NodePolicy) -> bool:
    """Whether this node serves artifacts to anybody at all: the ``artifact-transfer`` feature
    bit is advertised exactly when this is true. ``trusted`` serves only when this node's own
    owner is verified (without it no peer can be "same owner")."""
    if policy.mode == "open":
        return True
    if policy.mode == "trusted":
        return policy.own_owner_verified and policy.own_owner_id is not None
    return False


def peer_refusal(policy: NodePolicy, peer: PeerFacts) -> str | None:
    """Why ``policy`` refuses ``peer`` (an internal reason code), or None when it admits it.

    ``open``: any authenticated peer, whatever its owner status. ``trusted``: this node's
    owner is verified, and the peer's owner is verified and is that owner or listed in
    ``trusted_owners``. ``disabled``: nobody.
    """
    if policy.mode == "disabled":
        return "transfer_disabled"
    if policy.mode == "open":
        return None
    if not policy.own_owner_verified or policy.own_owner_id is None:
        return "own_owner_unverified"
    if peer.owner_status == "invalid":
        return "peer_owner_invalid"
    if peer.owner_status != "verified" or peer.owner_id is None:
        return "peer_owner_unverified"
    owner = peer.owner_id.lower()
    if owner != policy.own_owner_id and owner not in policy.trusted_owners:
        return "peer_owner_untrusted"
    return None
