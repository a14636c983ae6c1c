"""plan's inputs: each part's bytes, from a package's manifest or from a source GGUF exactly
as write-package would write it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from skippy.constants import (
    MAX_LAYER_COUNT,
    ROLE_COMMON,
    ROLE_EMBEDDINGS,
    ROLE_LAYER,
    ROLE_METADATA,
    ROLE_OUTPUT,
)
from skippy.errors import ModelError
from skippy.gguf.writer import fragment_bytes
from skippy.package.experts import active_layer_bytes, routed_layer_bytes
from skippy.package.manifest import PackageManifest
from skippy.package.ownership import has_tied_embeddings
from skippy.package.plan import ModelSizes, tail_layers
from skippy.package.v2_view import ManifestV2
from skippy.produce.fragments import plan_fragments
from skippy.produce.inspect import arch_int
from skippy.produce.model_experts import package_experts, source_experts
from skippy.produce.source import SourceModelFiles


def sizes_from_manifest(m: PackageManifest) -> ModelSizes:
    if isinstance(m, ManifestV2):
        return _sizes_v2(m)
    per_layer = [0] * m.layer_count
    for ref in m.artifacts():
        if (
            ref.role == ROLE_LAYER
            and ref.layer_index is not None
            and ref.layer_index < len(per_layer)
        ):
            per_layer[ref.layer_index] = ref.artifact.artifact_bytes
    return ModelSizes(
        layer_bytes=tuple(per_layer),
        metadata_bytes=m.shared.metadata.artifact_bytes,
        embeddings_bytes=m.shared.embeddings.artifact_bytes,
        output_bytes=m.shared.output.artifact_bytes,
        tied_embeddings=m.tied_embeddings,
        tail_layers=tail_layers(m.layer_count, m.generation),
    )


def _sizes_v2(m: ManifestV2) -> ModelSizes:
    """A v2 package in plan's terms: the carrier is the metadata part, every layer's parts
    its layer bytes, and the common group counts as the boundary stages' extra (as tied
    embeddings: the first and the last stage load it)."""
    per_layer = [0] * m.layer_count
    common = 0
    for ref in m.artifacts():
        if ref.role == ROLE_LAYER and ref.layer_index is not None:
            if ref.layer_index < len(per_layer):
                per_layer[ref.layer_index] += ref.artifact.artifact_bytes
        elif ref.role == ROLE_COMMON:
            common += ref.artifact.artifact_bytes
    return ModelSizes(
        layer_bytes=tuple(per_layer),
        metadata_bytes=m.metadata_ref().artifact.artifact_bytes,
        embeddings_bytes=common,
        output_bytes=0,
        tied_embeddings=True,
        tail_layers=tail_layers(m.layer_count, m.generation),
    )


def sizes_from_source(path: Path) -> ModelSizes:
    """Each part's bytes exactly as write-package would write it (headers, the metadata and
    tokenizer, padding), so ``plan`` of a GGUF equals ``plan`` of its package."""
    with SourceModelFiles(path) as src:
        n = arch_int(src.head, "block_count")
        if n is None or not 1 <= n <= MAX_LAYER_COUNT:
            raise ModelError(
                f"{path} declares block count {n!r}; expected 1..{MAX_LAYER_COUNT}",
                code="invalid_block_count",
                path=str(path),
            )
        plans = plan_fragments(
            kv_records=[(f.key, src.head.raw_field(f.key)) for f in src.kv_fields()],
            tensors=src.tensors,
            layer_count=n,
        )
        size = {
            (plan.role, plan.layer_index): fragment_bytes(
                plan.kv_records, [t.info for t in plan.tensors], src.alignment
            )
            for plan in plans
        }
        layers = tuple(size[(ROLE_LAYER, i)] for i in range(n))
        experts = source_experts(src)
        nextn = arch_int(src.head, "nextn_predict_layers") or 0
        return ModelSizes(
            layer_bytes=layers,
            metadata_bytes=size[(ROLE_METADATA, None)],
            embeddings_bytes=size[(ROLE_EMBEDDINGS, None)],
            output_bytes=size[(ROLE_OUTPUT, None)],
            tied_embeddings=has_tied_embeddings(t.info.name for t in src.tensors),
            layer_active_bytes=active_layer_bytes(layers, experts) if experts.moe else (),
            layer_expert_bytes=routed_layer_bytes(n, experts) if experts.moe else (),
            tail_layers=nextn if 0 < nextn < n else 0,
        )


def sizes_from_package(
    package_dir: Path, m: PackageManifest, *, containment_root: Path | None = None
) -> ModelSizes:
    """``sizes_from_manifest`` with each layer's active bytes (a mixture of experts) read from
    the package's own headers; every byte counts as active when they are not all here."""
    sizes = sizes_from_manifest(m)
    experts = package_experts(package_dir, m, containment_root=containment_root)
    if experts is None or not experts.moe:
        return sizes
    return replace(
        sizes,
        layer_active_bytes=active_layer_bytes(sizes.layer_bytes, experts),
        layer_expert_bytes=routed_layer_bytes(sizes.layer_count, experts),
    )
