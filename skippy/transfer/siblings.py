"""Sibling replicas: which other topology a holder may serve under (pure).

The pure core of ``mesh_node.transfer.siblings``, its shell.

A coordinator running R replicas of one package signs R topologies; a node of replica 0
holds verified copies of files replica 1's nodes need. It may serve them under replica 1's
topology when that topology is a *sibling* of its own: signed by the same coordinator (the
mesh shell checks the signature against the coordinator of this node's own topology, and
asks only that coordinator for it) and naming the same package and revision (package ref and
manifest SHA-256) and the same layer count. The request is then authorized against the
sibling topology exactly as against its own (``skippy.transfer.authorize``: the requester's
stage there, its servable set, pinned refs, both sides' trust mode). A peer outside every
sibling topology, or one whose topology names another revision, is refused as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from skippy.errors import UsageError
from skippy.package.refs import parse_hf_package_ref
from skippy.package.topology import SplitTopology


def sibling_refusal(own: SplitTopology, candidate: SplitTopology) -> tuple[str, str] | None:
    """Why ``candidate`` (already known to be signed by ``own``'s coordinator) is no sibling
    of ``own``, as ``(code, message)``; ``None`` when it is one."""
    if candidate.topology_id == own.topology_id:
        return ("same_topology", "a topology is not its own sibling")
    try:
        same_package = parse_hf_package_ref(own.package_ref) == parse_hf_package_ref(
            candidate.package_ref
        )
    except UsageError:  # a local package: nothing is served from it
        same_package = False
    if not same_package:
        return (
            "package_mismatch",
            f"the sibling names {candidate.package_ref}, this node's topology "
            f"{own.package_ref}",
        )
    if candidate.manifest_sha256 != own.manifest_sha256:
        return (
            "manifest_mismatch",
            f"the sibling names revision {candidate.manifest_sha256[:12]}, this node's "
            f"topology {own.manifest_sha256[:12]}",
        )
    if candidate.layer_count != own.layer_count:
        return ("layer_count_mismatch", "the sibling splits another number of layers")
    return None


def names_own_revision(own: SplitTopology, package_ref: str, manifest_sha256: str) -> bool:
    """A request naming another topology may be a sibling's only when it names ``own``'s
    package and revision: the holder asks its coordinator about nothing else."""
    try:
        same = parse_hf_package_ref(own.package_ref) == parse_hf_package_ref(package_ref)
    except UsageError:
        return False
    return same and manifest_sha256 == own.manifest_sha256


def vouch(
    topologies: Sequence[SplitTopology],
    asker_id: str,
    topology_id: str,
    requester_id: str,
    stage_id: str,
) -> tuple[SplitTopology | None, str]:
    """The coordinator's decision on a holder's question (kind 0x05): of ``topologies`` (the
    ones it coordinates now), the one named ``topology_id``, when ``asker_id`` holds a stage
    in one of them, the named one is a sibling of the asker's, and it gives ``requester_id``
    the stage ``stage_id``. Returns (the topology or ``None``, why not, for the log)."""
    own = next((t for t in topologies if t.stage_of(asker_id) is not None), None)
    wanted = next((t for t in topologies if t.topology_id == topology_id), None)
    if own is None:
        return None, "the asker holds no stage here"
    if wanted is None:
        return None, f"{topology_id[:32]!r} is not a current topology here"
    refusal = sibling_refusal(own, wanted)
    if refusal is not None:
        return None, refusal[1]
    stage = wanted.stage_of(requester_id)
    if stage is None or stage.stage_id != stage_id:
        return None, "the requester holds no such stage there"
    return wanted, ""
