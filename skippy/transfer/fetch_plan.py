"""The worker's fetch plan (pure): the manifest first, then what its stage lacks.

On its topology a worker fetches ``model-package.json`` first (checked
against the topology's SHA-256), computes its required set from the verified manifest, skips
what is already present and verified, and fetches the rest. Which artifacts are present is a
question for the cache (``skippy.transfer.hubcache.verified_present``); this module only
decides.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from skippy.constants import MANIFEST_MAX_BYTES, MANIFEST_NAME
from skippy.errors import TopologyError
from skippy.package.manifest import ArtifactRef, PackageManifest
from skippy.package.topology import SplitTopology, StageAssignment
from skippy.transfer.required import stage_refs
from skippy.transfer.wire import ArtifactRequest


@dataclass(frozen=True)
class FetchItem:
    """One file to bring into the hub cache, with what it must hash and weigh to."""

    path: str
    sha256: str  # lowercase hex
    size: int | None  # None: the manifest, whose size only the response tells (capped)
    ref: ArtifactRef | None = None  # the manifest entry; None for the manifest itself

    @property
    def is_manifest(self) -> bool:
        return self.ref is None

    @property
    def max_size(self) -> int:
        """The most bytes this item may have: its declared size, or the manifest cap."""
        return self.size if self.size is not None else MANIFEST_MAX_BYTES

    @classmethod
    def of(cls, ref: ArtifactRef) -> FetchItem:
        return cls(ref.path, ref.artifact.sha256.lower(), ref.artifact.artifact_bytes, ref)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "sha256": self.sha256,
            "size": self.size,
            "role": self.ref.role if self.ref else "manifest",
        }


def manifest_item(topology: SplitTopology) -> FetchItem:
    """The first fetch of every worker: the manifest the topology names by SHA-256."""
    return FetchItem(MANIFEST_NAME, topology.manifest_sha256, None)


@dataclass(frozen=True)
class FetchPlan:
    """What one worker needs (``required``, in load order), which of it is already
    verified in its cache (``present``), and what to fetch (``fetch``, largest first: with
    a bounded number of concurrent transfers that finishes soonest)."""

    stage: StageAssignment
    required: tuple[ArtifactRef, ...]
    present: tuple[str, ...]
    fetch: tuple[FetchItem, ...]

    @property
    def bytes_required(self) -> int:
        return sum(r.artifact.artifact_bytes for r in self.required)

    @property
    def bytes_to_fetch(self) -> int:
        return sum(i.max_size for i in self.fetch)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage_id": self.stage.stage_id,
            "stage_index": self.stage.stage_index,
            "layer_start": self.stage.layers.start,
            "layer_end": self.stage.layers.stop,
            "required": [r.path for r in self.required],
            "present": list(self.present),
            "fetch": [i.to_dict() for i in self.fetch],
            "bytes_required": self.bytes_required,
            "bytes_to_fetch": self.bytes_to_fetch,
        }


def plan_fetch(
    manifest: PackageManifest,
    manifest_sha256: str,
    topology: SplitTopology,
    node_id: str,
    present: Collection[str],
    *,
    projector_path: str | None = None,
    text_only: bool = False,
) -> FetchPlan:
    """The plan for ``node_id`` (64 hex) under ``topology``; ``manifest`` must be the one the
    topology names (its SHA-256) and ``present`` the paths already verified in the cache."""
    if manifest_sha256.lower() != topology.manifest_sha256:
        raise TopologyError(
            f"the manifest hashes to {manifest_sha256}, the topology names "
            f"{topology.manifest_sha256}",
            code="topology_manifest_mismatch",
            expected=topology.manifest_sha256,
            actual=manifest_sha256,
        )
    if manifest.layer_count != topology.layer_count:
        raise TopologyError(
            f"the topology splits {topology.layer_count} layers, the manifest has "
            f"{manifest.layer_count}",
            code="topology_manifest_mismatch",
        )
    stage = topology.stage_of(node_id)
    if stage is None:
        raise TopologyError(
            f"node {node_id[:12]} has no stage in topology {topology.topology_id}",
            code="not_in_topology",
        )
    required = stage_refs(
        manifest, stage.layers, projector_path=projector_path, text_only=text_only
    )
    have = set(present)
    order = sorted(
        (r for r in required if r.path not in have),
        key=lambda r: -r.artifact.artifact_bytes,  # stable: ties keep load order
    )
    return FetchPlan(
        stage=stage,
        required=required,
        present=tuple(r.path for r in required if r.path in have),
        fetch=tuple(FetchItem.of(r) for r in order),
    )


def request_for(
    item: FetchItem,
    topology: SplitTopology,
    stage: StageAssignment,
    requester_id: bytes,
    *,
    offset: int = 0,
) -> ArtifactRequest:
    """The wire request for ``item`` from the worker holding ``stage``, resuming at
    ``offset`` (what the sink reports)."""
    return ArtifactRequest(
        requester_id=requester_id,
        topology_id=topology.topology_id,
        run_id=topology.run_id,
        stage_id=stage.stage_id,
        package_ref=topology.package_ref,
        manifest_sha256=topology.manifest_sha256,
        relative_path=item.path,
        offset=offset,
        expected_size=item.size,
        expected_sha256=item.sha256,
    )
