"""A package-v2 root seen through the consumers' vocabulary.

``ManifestV2`` answers what selection, preflight, fetch, verification and peer transfer ask
of a v1 ``Manifest``: the model, its layer count, every artifact as an ``ArtifactRef`` with a
role (the carrier as ``metadata``, the common group as ``common``, layer parts as ``layer``
with their ordinal, sidecars as ``projector``, publisher files as ``publisher``), the
projectors, the byte total. With its carrier resolved it also holds the ``TensorCatalog``,
which stage selection uses to pick exactly the artifacts holding a stage's tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from skippy.constants import (
    OUTPUT_WEIGHT_TENSOR,
    ROLE_COMMON,
    ROLE_LAYER,
    ROLE_METADATA,
    ROLE_PROJECTOR,
    ROLE_PUBLISHER,
    TOKEN_EMBEDDING_TENSOR,
)
from skippy.errors import ManifestError
from skippy.findings import Finding
from skippy.package.artifact_ref import Artifact, ArtifactRef, ProjectorArtifact
from skippy.package.catalog import TensorCatalog
from skippy.package.v2_carrier import layer_ordinal
from skippy.package.v2_root import (
    CatalogArtifact,
    PackageRootV2,
    V2SourceModel,
    check_root,
    parse_root,
)


@dataclass(frozen=True)
class ManifestV2:
    root: PackageRootV2
    catalog: TensorCatalog | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # v2 has no additive fields

    schema_version = 2

    @property
    def model_id(self) -> str:
        return self.root.model_id

    @property
    def layer_count(self) -> int:
        return self.root.layer_count

    @property
    def package_id(self) -> str:
        return self.root.package_id

    @property
    def format(self) -> str:
        return self.root.format

    @property
    def generation(self) -> Mapping[str, Any] | None:
        return self.root.generation

    @property
    def created_at_unix_secs(self) -> int:
        return self.root.created_at_unix_secs

    @property
    def skippy_abi_version(self) -> str:
        return self.root.native_abi_version

    @property
    def activation_width(self) -> int | None:
        return None  # v2 dropped it: the carrier's {arch}.embedding_length says it

    @property
    def source_model(self) -> V2SourceModel:
        return self.root.source_model

    def speculative_block(self) -> Mapping[str, Any] | None:
        """The part of ``generation`` the v1 speculative machinery reads (spec "v2 generation": the
        same ``speculative_decoding`` shape; ``request_defaults`` is v2's own)."""
        gen = self.root.generation
        if gen is None or "speculative_decoding" not in gen:
            return None
        return {"speculative_decoding": gen["speculative_decoding"]}

    @property
    def tied_embeddings(self) -> bool:
        c = self.catalog
        return c is not None and TOKEN_EMBEDDING_TENSOR in c and OUTPUT_WEIGHT_TENSOR not in c

    def with_catalog(self, catalog: TensorCatalog) -> ManifestV2:
        return ManifestV2(self.root, catalog)

    def _artifact(self, a: CatalogArtifact) -> Artifact:
        tensors = self.catalog.in_artifact(a.id) if self.catalog is not None else []
        return Artifact(
            path=a.path,
            tensor_count=len(tensors),
            tensor_bytes=sum(t.nbytes for t in tensors),
            artifact_bytes=a.byte_size,
            sha256=a.sha256,
        )

    @property
    def projectors(self) -> tuple[ProjectorArtifact, ...]:
        out = []
        for s in self.root.sidecars:
            try:
                a = self.root.artifact(s.artifact_id)
            except KeyError:
                continue  # unknown_artifact: a check_root finding
            out.append(
                ProjectorArtifact(
                    kind=s.kind,
                    path=a.path,
                    tensor_count=0,
                    tensor_bytes=0,
                    artifact_bytes=a.byte_size,
                    sha256=a.sha256,
                )
            )
        return tuple(out)

    def artifact_id_of(self, path: str) -> str:
        for a in self.root.artifacts:
            if a.path == path:
                return a.id
        raise KeyError(path)

    def metadata_ref(self) -> ArtifactRef:
        meta = self.root.metadata_artifact
        if meta is None:
            raise ManifestError(
                f"source_model.metadata_artifact_id {self.root.source_model.metadata_artifact_id!r}"
                " names no catalog artifact",
                code="invalid_metadata_artifact",
            )
        return ArtifactRef(ROLE_METADATA, self._artifact(meta))

    def artifacts(self) -> Iterator[ArtifactRef]:
        """Every artifact in load order: carrier, common parts, layer parts (by layer, then
        id), then projectors and publisher files (never part of a stage's load set)."""
        r = self.root
        if r.metadata_artifact is not None:
            yield self.metadata_ref()
        side = {s.artifact_id for s in r.sidecars}
        pub = {p.artifact_id for p in r.publisher_metadata}
        payload = r.payload_artifacts()
        for a in payload:
            if layer_ordinal(a.path) is None:
                yield ArtifactRef(ROLE_COMMON, self._artifact(a))
        layered = [(layer_ordinal(a.path), a) for a in payload]
        for layer, a in sorted(
            ((n, a) for n, a in layered if n is not None), key=lambda x: (x[0], x[1].id)
        ):
            yield ArtifactRef(ROLE_LAYER, self._artifact(a), layer)
        for p in self.projectors:
            yield ArtifactRef(ROLE_PROJECTOR, p)
        for a in r.artifacts:
            if a.id in pub and a.id not in side:
                yield ArtifactRef(ROLE_PUBLISHER, self._artifact(a))

    def total_artifact_bytes(self) -> int:
        return sum(a.byte_size for a in self.root.artifacts)

    def to_dict(self) -> dict[str, Any]:
        return self.root.canonical(for_identity=False)


def dump_root(root: PackageRootV2) -> bytes:
    """The bytes written as ``model-package.json``: struct order, two-space indent, UTF-8,
    trailing newline (the id is over the compact canonical form, not these bytes)."""
    return (
        json.dumps(root.canonical(for_identity=False), indent=2, ensure_ascii=False) + "\n"
    ).encode("utf-8")


def manifest_v2_from_data(data: Mapping[str, Any]) -> ManifestV2:
    return ManifestV2(parse_root(data))


def check_manifest_v2(m: ManifestV2) -> list[Finding]:
    return check_root(m.root)
