"""Stage selection (spec "Layer Selection"): the parts a stage with a layer range loads.

Pure: a manifest and a ``LayerRange`` in, the selection out. Load order is the package's
split order (metadata, embeddings, layers ascending, output). With ``tied_embeddings`` the
final stage also gets the embeddings artifact (it projects logits through them).
Projectors are selected independently: an explicit path wins; otherwise stage 0 (or a single
stage) gets the first declared ``mmproj``; downstream stages get none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skippy.constants import (
    DEFAULT_PROJECTOR_KIND,
    ROLE_EMBEDDINGS,
    ROLE_LAYER,
    ROLE_METADATA,
    ROLE_OUTPUT,
    ROLE_PROJECTOR,
)
from skippy.errors import ManifestError, UsageError
from skippy.package.manifest import ArtifactRef, Manifest
from skippy.package.ranges import LayerRange


@dataclass(frozen=True)
class StageSelection:
    manifest: Manifest
    layers: LayerRange
    parts: tuple[ArtifactRef, ...]  # in load (split) order; never includes projectors
    projector: ArtifactRef | None = None

    @property
    def all_refs(self) -> tuple[ArtifactRef, ...]:
        return self.parts + ((self.projector,) if self.projector else ())

    @property
    def total_bytes(self) -> int:
        return sum(r.artifact.artifact_bytes for r in self.all_refs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_id": self.manifest.model_id,
            "layer_start": self.layers.start,
            "layer_end": self.layers.stop,
            "owns_input": self.layers.owns_input,
            "owns_output": self.layers.owns_output,
            "parts": [_part_dict(r) for r in self.parts],
            "projector": _part_dict(self.projector) if self.projector else None,
            "total_bytes": self.total_bytes,
            "package_bytes": self.manifest.total_artifact_bytes(),
        }


def _part_dict(r: ArtifactRef) -> dict[str, Any]:
    return {
        "role": r.role,
        "layer_index": r.layer_index,
        "path": r.path,
        "sha256": r.artifact.sha256,
        "artifact_bytes": r.artifact.artifact_bytes,
    }


def select_stage(
    m: Manifest,
    layers: LayerRange,
    *,
    projector_path: str | None = None,
    text_only: bool = False,
) -> StageSelection:
    """``text_only``: a runtime that cannot load projectors selects none (spec
    "Compatibility": such runtimes may still serve text stages)."""
    if layers.layer_count != m.layer_count:
        raise UsageError(
            f"layer range {layers} was built for {layers.layer_count} layers, the package has "
            f"{m.layer_count}",
            code="invalid_layer_range",
        )
    by_index: dict[int, ArtifactRef] = {}
    for ref in m.artifacts():
        if ref.role == ROLE_LAYER and ref.layer_index is not None:
            if ref.layer_index in by_index:
                raise ManifestError(
                    f"layer {ref.layer_index} appears twice in the manifest",
                    code="duplicate_layer",
                )
            by_index[ref.layer_index] = ref
    parts = [ArtifactRef(ROLE_METADATA, m.shared.metadata)]
    if layers.owns_input or (layers.owns_output and m.tied_embeddings):
        parts.append(ArtifactRef(ROLE_EMBEDDINGS, m.shared.embeddings))
    for i in layers:
        if i not in by_index:
            raise ManifestError(f"layer {i} has no entry in the manifest", code="missing_layer")
        parts.append(by_index[i])
    if layers.owns_output:
        parts.append(ArtifactRef(ROLE_OUTPUT, m.shared.output))
    projector = None if text_only else _select_projector(m, layers, projector_path)
    return StageSelection(m, layers, tuple(parts), projector)


def _select_projector(
    m: Manifest, layers: LayerRange, projector_path: str | None
) -> ArtifactRef | None:
    if projector_path is not None:
        for p in m.projectors:
            if p.path == projector_path:
                return ArtifactRef(ROLE_PROJECTOR, p)
        raise UsageError(
            f"projector {projector_path!r} is not declared in the manifest; consumers must not "
            "infer projectors from files next to the package",
            code="undeclared_projector",
        )
    if not layers.owns_input:
        return None
    for p in m.projectors:
        if p.kind == DEFAULT_PROJECTOR_KIND:
            return ArtifactRef(ROLE_PROJECTOR, p)
    return None
