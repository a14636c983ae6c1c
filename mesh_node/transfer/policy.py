"""This node's artifact-transfer policy and what a link proved about its peer, as the plain
values ``skippy.transfer.policy`` decides on. One decision: the ``artifact-transfer`` feature
bit, the handler registration and every request's authorization all come from
``node_policy``.

The shell of ``skippy.transfer.policy``, its pure core.
"""

from __future__ import annotations

from mesh_node.identity import LocalIdentity
from mesh_node.peers import AuthenticatedPeer
from mesh_node.settings import NodeSettings
from skippy.transfer.policy import NodePolicy, PeerFacts


def node_policy(settings: NodeSettings, identity: LocalIdentity, now_s: float) -> NodePolicy:
    """The policy in force at ``now_s`` (the node's own certificate may expire)."""
    owner_id, status = identity.owner(now_s)
    return NodePolicy(
        mode=settings.artifact_transfer,
        own_owner_id=owner_id,
        own_owner_verified=status == "verified",
        trusted_owners=frozenset(settings.trusted_owners),
    )


def peer_facts(peer: AuthenticatedPeer) -> PeerFacts:
    """The requester as the link's handshake authenticated it (never as it claims)."""
    return PeerFacts(bytes.fromhex(peer.node_id), peer.owner_id, peer.owner_status)
