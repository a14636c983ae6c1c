"""``authorize()``: may this peer have this artifact? (pure)

The serving node refuses with one generic ``artifact unavailable`` (``artifact transfer
disabled`` when the mode is disabled) unless all hold:

- the requester id equals the link's authenticated peer id, and the trust mode admits the
  peer's owner (``skippy.transfer.policy``);
- an active topology matches the request's topology id, run id, package ref and manifest
  SHA-256, and assigns the requester the named stage;
- the path is the manifest, or in that stage's servable set (``skippy.transfer.required``,
  which asks the one selection rule);
- the manifest this node holds hashes to the topology's SHA-256 and is at most 16 MiB; any
  other path is declared in it, and its declared size and SHA-256 equal the request's
  expectations when given.

The checks on the file itself (it lies inside the package's ``models--ns--repo`` folder after
following symlinks, its size and SHA-256 equal the declaration) need the disk and live in
``skippy.transfer.serve``, which refuses the same way. The peer sees only the generic
message; ``reason`` (a stable snake_case code) and ``detail`` are for logs and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from skippy.constants import MANIFEST_MAX_BYTES, MANIFEST_NAME
from skippy.errors import SkippyError, UsageError
from skippy.package.manifest import ArtifactRef, PackageManifest
from skippy.package.refs import parse_hf_package_ref
from skippy.package.topology import SplitTopology, StageAssignment
from skippy.paths import is_safe_relative_path
from skippy.transfer.policy import NodePolicy, PeerFacts, peer_refusal
from skippy.transfer.required import servable_refs
from skippy.transfer.wire import ArtifactRequest

PEER_UNAVAILABLE: Final = "artifact unavailable"
PEER_DISABLED: Final = "artifact transfer disabled"
ALLOWED: Final = "allowed"

# Every reason ``authorize`` (and the serving shell's file checks) can give, for metrics.
REFUSAL_REASONS: Final = frozenset(
    {
        "transfer_disabled",
        "requester_mismatch",
        "own_owner_unverified",
        "peer_owner_unverified",
        "peer_owner_invalid",
        "peer_owner_untrusted",
        "no_active_topology",
        "topology_mismatch",
        "run_mismatch",
        "package_mismatch",
        "manifest_mismatch",
        "requester_not_in_topology",
        "stage_mismatch",
        "manifest_not_held",
        "held_manifest_mismatch",
        "manifest_too_large",
        "topology_manifest_mismatch",
        "held_manifest_invalid",
        "unsafe_path",
        "undeclared_path",
        "not_in_stage",
        "expectation_mismatch",
        # file checks (skippy.transfer.serve)
        "malformed_request",
        "artifact_missing",
        "resolved_outside_repo",
        "artifact_size_mismatch",
        "artifact_sha256_mismatch",
        "artifact_changed",
        "offset_beyond_end",
        "artifact_unreadable",
    }
)


@dataclass(frozen=True)
class HeldManifest:
    """The manifest this node holds for the topology's package: parsed, with the SHA-256
    and length of the exact bytes parsed."""

    manifest: PackageManifest
    sha256: str
    size: int


@dataclass(frozen=True)
class ManifestProblem:
    """Why this node cannot vouch for the topology's manifest (it is missing, too large,
    hashes differently or does not parse): one of the ``manifest_*`` / ``held_*`` reasons."""

    reason: str
    detail: str


@dataclass(frozen=True)
class Decision:
    """The decision record: allowed, or refused with what the peer is told and why."""

    allowed: bool
    reason: str  # ALLOWED or one of REFUSAL_REASONS
    detail: str  # a precise sentence for the log; never sent to the peer
    peer_message: str = ""  # what the peer is told: "" when allowed
    stage: StageAssignment | None = None
    artifact: ArtifactRef | None = None  # the manifest entry; None for the manifest itself

    def to_log(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "allowed": self.allowed,
            "reason": self.reason,
            "detail": self.detail,
        }
        if self.stage is not None:
            out["stage_id"] = self.stage.stage_id
        return out


def refuse(
    reason: str,
    detail: str,
    *,
    stage: StageAssignment | None = None,
    peer_message: str | None = None,
) -> Decision:
    """A refusal. The peer hears ``artifact unavailable`` (``artifact transfer disabled``
    when the mode is disabled) unless the caller names a reason that reveals nothing about
    this node (a malformed request is told what is malformed)."""
    if reason not in REFUSAL_REASONS:
        raise UsageError(f"unknown refusal reason {reason!r}", code="invalid_refusal_reason")
    if peer_message is None:
        peer_message = PEER_DISABLED if reason == "transfer_disabled" else PEER_UNAVAILABLE
    return Decision(False, reason, detail, peer_message, stage=stage)


def authorize(
    policy: NodePolicy,
    peer: PeerFacts,
    topology: SplitTopology | None,
    held: HeldManifest | ManifestProblem | None,
    request: ArtifactRequest,
) -> Decision:
    """Decide one request; see the module docstring for the rules and their order."""
    why = peer_refusal(policy, peer)
    if why == "transfer_disabled":
        return refuse(why, "artifact transfer is disabled on this node")
    if request.requester_id != peer.peer_id:
        return refuse(
            "requester_mismatch",
            f"requester_id {request.requester_hex[:12]} is not the link's authenticated peer "
            f"{peer.peer_id.hex()[:12]}",
        )
    if why is not None:
        return refuse(
            why,
            f"mode {policy.mode} refuses peer {peer.peer_id.hex()[:12]} (owner "
            f"{(peer.owner_id or '-')[:12]}, {peer.owner_status})",
        )
    if topology is None:
        return refuse("no_active_topology", "this node has no active split topology")
    mismatch = _topology_mismatch(topology, request)
    if mismatch is not None:
        return refuse(*mismatch)
    stage = topology.stage_of(request.requester_hex)
    if stage is None:
        return refuse(
            "requester_not_in_topology",
            f"peer {request.requester_hex[:12]} has no stage in topology "
            f"{topology.topology_id}",
        )
    if stage.stage_id != request.stage_id:
        return refuse(
            "stage_mismatch",
            f"the topology assigns the peer stage {stage.stage_id!r}, the request names "
            f"{request.stage_id!r}",
            stage=stage,
        )
    return _authorize_path(topology, held, request, stage)


def _topology_mismatch(topology: SplitTopology, request: ArtifactRequest) -> tuple[str, str] | None:
    if request.topology_id != topology.topology_id:
        return "topology_mismatch", (
            f"request names topology {request.topology_id!r}, the active one is "
            f"{topology.topology_id!r}"
        )
    if request.run_id != topology.run_id:
        return "run_mismatch", (
            f"request names run {request.run_id!r}, the active one is {topology.run_id!r}"
        )
    try:
        same_package = parse_hf_package_ref(topology.package_ref) == parse_hf_package_ref(
            request.package_ref
        )
    except UsageError:  # the topology names a local package: nothing to serve
        same_package = False
    if not same_package:
        return "package_mismatch", (
            f"request names {request.package_ref}, the topology {topology.package_ref}"
        )
    if request.manifest_sha256 != topology.manifest_sha256:
        return "manifest_mismatch", (
            f"request names manifest {request.manifest_sha256[:12]}, the topology "
            f"{topology.manifest_sha256[:12]}"
        )
    return None


def _authorize_path(
    topology: SplitTopology,
    held: HeldManifest | ManifestProblem | None,
    request: ArtifactRequest,
    stage: StageAssignment,
) -> Decision:
    if isinstance(held, ManifestProblem):
        return refuse(held.reason, held.detail, stage=stage)
    if held is None:
        return refuse(
            "manifest_not_held",
            f"this node holds no verified manifest for {topology.package_ref}",
            stage=stage,
        )
    if held.sha256 != topology.manifest_sha256:
        return refuse(
            "held_manifest_mismatch",
            f"the manifest held here hashes to {held.sha256[:12]}, the topology names "
            f"{topology.manifest_sha256[:12]}",
            stage=stage,
        )
    if held.size > MANIFEST_MAX_BYTES:
        return refuse(
            "manifest_too_large",
            f"the manifest is {held.size} bytes, over the {MANIFEST_MAX_BYTES}-byte cap",
            stage=stage,
        )
    if not is_safe_relative_path(request.relative_path):  # the wire checked; stay safe
        return refuse("unsafe_path", f"unsafe path {request.relative_path!r}", stage=stage)
    if request.relative_path == MANIFEST_NAME:
        return _expect(request, stage, None, held.size, held.sha256)
    if held.manifest.layer_count != topology.layer_count:
        return refuse(
            "topology_manifest_mismatch",
            f"the topology splits {topology.layer_count} layers, the manifest has "
            f"{held.manifest.layer_count}",
            stage=stage,
        )
    declared = {r.path: r for r in held.manifest.artifacts()}
    ref = declared.get(request.relative_path)
    if ref is None:
        return refuse(
            "undeclared_path",
            f"{request.relative_path} is not declared in the manifest",
            stage=stage,
        )
    try:
        servable = servable_refs(held.manifest, stage.layers)
    except SkippyError as exc:  # a manifest with a missing or repeated layer
        return refuse("held_manifest_invalid", exc.message, stage=stage)
    if request.relative_path not in servable:
        return refuse(
            "not_in_stage",
            f"{request.relative_path} is not needed by stage {stage.stage_id} (layers "
            f"{stage.layers})",
            stage=stage,
        )
    return _expect(request, stage, ref, ref.artifact.artifact_bytes, ref.artifact.sha256.lower())


def _expect(
    request: ArtifactRequest,
    stage: StageAssignment,
    ref: ArtifactRef | None,
    size: int,
    sha256: str,
) -> Decision:
    if request.expected_size is not None and request.expected_size != size:
        return refuse(
            "expectation_mismatch",
            f"{request.relative_path}: the request expects {request.expected_size} bytes, "
            f"the manifest declares {size}",
            stage=stage,
        )
    if request.expected_sha256 is not None and request.expected_sha256 != sha256:
        return refuse(
            "expectation_mismatch",
            f"{request.relative_path}: the request expects SHA-256 "
            f"{request.expected_sha256[:12]}, the manifest declares {sha256[:12]}",
            stage=stage,
        )
    if request.offset > size:
        return refuse(
            "offset_beyond_end",
            f"{request.relative_path}: offset {request.offset} is past its {size} bytes",
            stage=stage,
        )
    if request.length is not None and request.offset + request.length > size:
        return refuse(
            "offset_beyond_end",
            f"{request.relative_path}: range {request.offset}+{request.length} is past its "
            f"{size} bytes",
            stage=stage,
        )
    return Decision(
        True, ALLOWED, f"{request.relative_path} for stage {stage.stage_id}", "", stage, ref
    )
