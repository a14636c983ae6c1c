"""Artifact entries and the (role, artifact) pairs selection and verification iterate: the
value objects both manifest versions share (moved out of ``skippy.package.manifest``, which
re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Artifact:
    """One GGUF file of the package (spec "Each artifact entry MUST include")."""

    path: str
    tensor_count: int
    tensor_bytes: int
    artifact_bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "tensor_count": self.tensor_count,
            "tensor_bytes": self.tensor_bytes,
            "artifact_bytes": self.artifact_bytes,
            "sha256": self.sha256,
        }


@dataclass(frozen=True, kw_only=True)
class LayerArtifact(Artifact):
    layer_index: int

    def to_dict(self) -> dict[str, Any]:
        return {"layer_index": self.layer_index, **super().to_dict()}


@dataclass(frozen=True, kw_only=True)
class ProjectorArtifact(Artifact):
    kind: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **super().to_dict()}


@dataclass(frozen=True)
class ArtifactRef:
    """An artifact together with the role it plays; what selection and verification iterate."""

    role: str
    artifact: Artifact
    layer_index: int | None = None

    @property
    def path(self) -> str:
        return self.artifact.path
