"""Stage selection (spec "Layer Selection"): the parts a stage with a layer range loads.

Pure: a manifest and a ``LayerRange`` in, the selection out. Load order is the package's
split order (metadata, embeddings, layers ascending, output). With ``tied_embeddings`` the
final stage also gets the embeddings artifact (it projects logits through them), and so does
the final stage of a package whose generation defaults name native-MTP (NextN) layers: its
draft head embeds the next token (``head_embeddings``).
Projectors are selected independently: an explicit path wins; otherwise stage 0 (or a single
stage) gets the first declared ``mmproj``; downstream stages get none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skippy.constants import (
    DEFAULT_PROJECTOR_KIND,
    ROLE_COMMON,
    ROLE_EMBEDDINGS,
    ROLE_LAYER,
    ROLE_METADATA,
    ROLE_OUTPUT,
    ROLE_PROJECTOR,
)
from skippy.errors import ManifestError, UsageError
from skippy.package.manifest import ArtifactRef, PackageManifest
from skippy.package.ownership import owner_of
from skippy.package.plan import tail_layers
from skippy.package.ranges import LayerRange
from skippy.package.v2_view import ManifestV2


@dataclass(frozen=True)
class StageSelection:
    manifest: PackageManifest
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
    m: PackageManifest,
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
    if isinstance(m, ManifestV2):
        parts = _select_v2(m, layers)
        projector = None if text_only else _select_projector(m, layers, projector_path)
        return StageSelection(m, layers, tuple(parts), projector)
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
    if layers.owns_input or (layers.owns_output and head_embeddings(m)):
        parts.append(ArtifactRef(ROLE_EMBEDDINGS, m.shared.embeddings))
    for i in layers:
        if i not in by_index:
            raise ManifestError(f"layer {i} has no entry in the manifest", code="missing_layer")
        parts.append(by_index[i])
    if layers.owns_output:
        parts.append(ArtifactRef(ROLE_OUTPUT, m.shared.output))
    projector = None if text_only else _select_projector(m, layers, projector_path)
    return StageSelection(m, layers, tuple(parts), projector)


def head_embeddings(m: PackageManifest) -> bool:
    """Whether the final stage holds the token embeddings: a tied model's projects logits
    through them, and a NextN draft head (``generation`` names native-MTP layers) embeds the
    token it drafts after with them."""
    return m.tied_embeddings or tail_layers(m.layer_count, m.generation) > 0


def _needs(name: str, layer: int | None, layers: LayerRange, tied: bool) -> bool:
    """Whether a stage over ``layers`` computes with this tensor: its own layers' tensors; the
    input boundary's (token embeddings) at stage 0, and at the final stage of a tied model;
    the output boundary's at the final stage; any other non-layer tensor (``rope_freqs``) at
    every stage (the v1 rule puts those in shared/metadata.gguf, which every stage loads)."""
    if layer is not None:
        return layer in layers
    role = owner_of(name).role
    if role == ROLE_EMBEDDINGS:
        return layers.owns_input or (layers.owns_output and tied)
    if role == ROLE_OUTPUT:
        return layers.owns_output
    return True


def stage_tensor_names(m: PackageManifest, layers: LayerRange) -> set[str] | None:
    """The tensors a v2 stage computes with (``_needs``), from the catalog; None for v1 or
    a v2 manifest whose carrier is not resolved."""
    if not isinstance(m, ManifestV2) or m.catalog is None:
        return None
    tied = head_embeddings(m)
    return {t.name for t in m.catalog if _needs(t.name, t.layer, layers, tied)}


def _select_v2(m: ManifestV2, layers: LayerRange) -> list[ArtifactRef]:
    """Package v2 (spec "v2 stages"): the carrier plus every artifact holding a tensor the stage
    needs. Upstream derives the tensor set from the compute graph with a native planner; we
    know our architectures' tensor roles, so the set is the layer ordinals plus the boundary
    tensors (``_needs``). Without the carrier resolved (a peer's bare manifest) the rule is
    the superset: the carrier, every common part and the stage's layer parts."""
    refs = list(m.artifacts())
    if not refs or refs[0].role != ROLE_METADATA:
        raise ManifestError(
            "the v2 root names no metadata carrier", code="invalid_metadata_artifact"
        )
    cat = m.catalog
    if cat is None:
        keep = {
            r.path
            for r in refs
            if r.role == ROLE_COMMON or (r.role == ROLE_LAYER and r.layer_index in layers)
        }
    else:
        tied = head_embeddings(m)
        keep = {t.path for t in cat if _needs(t.name, t.layer, layers, tied)}
    have_layers = {r.layer_index for r in refs if r.role == ROLE_LAYER}
    for i in layers:
        if i not in have_layers:
            raise ManifestError(f"layer {i} has no artifact in the package", code="missing_layer")
    return [refs[0]] + [
        r for r in refs[1:] if r.role in (ROLE_COMMON, ROLE_LAYER) and r.path in keep
    ]


def _select_projector(
    m: PackageManifest, layers: LayerRange, projector_path: str | None
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
