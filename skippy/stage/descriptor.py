"""The stage descriptor a node sends with its ready report, and the coordinator's check (pure).

Issue #8 section 4: "When every required part is installed and verified, the worker reports
ready to the coordinator". The report carries this descriptor: which package (ref and
manifest SHA-256) and which stage (index, half-open layer range) the node holds, and how many
artifacts and bytes it verified for it. The coordinator checks it against the topology it
signed (``admission_problem``) before it counts the stage as ready.

Issue #10 extends this value into the admission descriptor (activation width, activation
dtype, runtime version) once a runtime has loaded the stage: add the fields here (and to
``KEYS``), and their checks to ``admission_problem``; the ready message carries whatever
``to_dict`` gives.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from skippy.errors import TopologyError, UsageError
from skippy.package.manifest import ArtifactRef
from skippy.package.ranges import LayerRange
from skippy.package.topology import MAX_PACKAGE_REF_CHARS, SplitTopology, StageAssignment

KEYS: Final = frozenset(
    {
        "package_ref",
        "manifest_sha256",
        "stage_index",
        "layer_start",
        "layer_end",
        "layer_count",
        "artifact_count",
        "artifact_bytes",
    }
)
_SHA256_RE: Final = re.compile(r"\A[0-9a-f]{64}\Z")
_MAX_INT: Final = 1 << 62


def _bad(message: str, actual: object = None) -> TopologyError:
    return TopologyError(message, code="invalid_stage_descriptor", actual=actual)


def _int(data: Mapping[str, Any], key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
        raise _bad(f"{key} must be a non-negative integer", value)
    return value


@dataclass(frozen=True)
class StageDescriptor:
    """What a node holds, verified, for one stage of one package."""

    package_ref: str
    manifest_sha256: str
    stage_index: int
    layers: LayerRange
    artifact_count: int  # the stage's required artifacts, all present and verified
    artifact_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.package_ref, str) or not (
            0 < len(self.package_ref) <= MAX_PACKAGE_REF_CHARS
        ):
            raise _bad("package_ref must be a non-empty string", self.package_ref)
        if not isinstance(self.manifest_sha256, str) or not _SHA256_RE.match(self.manifest_sha256):
            raise _bad("manifest_sha256 must be 64 lowercase hex characters")

    @classmethod
    def for_stage(
        cls, topology: SplitTopology, stage: StageAssignment, required: tuple[ArtifactRef, ...]
    ) -> StageDescriptor:
        return cls(
            package_ref=topology.package_ref,
            manifest_sha256=topology.manifest_sha256,
            stage_index=stage.stage_index,
            layers=stage.layers,
            artifact_count=len(required),
            artifact_bytes=sum(r.artifact.artifact_bytes for r in required),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "package_ref": self.package_ref,
            "manifest_sha256": self.manifest_sha256,
            "stage_index": self.stage_index,
            "layer_start": self.layers.start,
            "layer_end": self.layers.stop,
            "layer_count": self.layers.layer_count,
            "artifact_count": self.artifact_count,
            "artifact_bytes": self.artifact_bytes,
        }

    @classmethod
    def from_dict(cls, data: object) -> StageDescriptor:
        """Strict parse of a peer's descriptor: exactly ``KEYS``, exact types."""
        if not isinstance(data, Mapping) or set(data) != KEYS:
            got = sorted(map(str, data))[:16] if isinstance(data, Mapping) else type(data).__name__
            raise _bad(f"a stage descriptor has exactly the fields {sorted(KEYS)}", got)
        try:
            layers = LayerRange(
                _int(data, "layer_start"), _int(data, "layer_end"), _int(data, "layer_count")
            )
        except UsageError as exc:
            raise _bad(exc.message) from None
        return cls(
            package_ref=data["package_ref"],
            manifest_sha256=data["manifest_sha256"],
            stage_index=_int(data, "stage_index"),
            layers=layers,
            artifact_count=_int(data, "artifact_count"),
            artifact_bytes=_int(data, "artifact_bytes"),
        )


def admission_problem(
    descriptor: StageDescriptor, topology: SplitTopology, node_id: str
) -> tuple[str, str] | None:
    """Why the coordinator must not count ``node_id``'s report for ``topology`` (a reason code
    and a sentence), or None when the descriptor names exactly the stage the topology gives it."""
    stage = topology.stage_of(node_id)
    if stage is None:
        return "not_in_topology", "the reporting node holds no stage in this topology"
    if descriptor.package_ref != topology.package_ref:
        return "package_mismatch", "the descriptor names another package"
    if descriptor.manifest_sha256 != topology.manifest_sha256:
        return "manifest_mismatch", "the descriptor names another manifest"
    if descriptor.stage_index != stage.stage_index:
        return "stage_mismatch", (
            f"the descriptor names stage {descriptor.stage_index}, the node holds stage "
            f"{stage.stage_index}"
        )
    if descriptor.layers != stage.layers:
        return "layers_mismatch", (
            f"the descriptor names layers {descriptor.layers}, the stage is {stage.layers}"
        )
    return None
