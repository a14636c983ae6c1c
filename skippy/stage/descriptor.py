"""The stage descriptor a node sends with its ready report, and the coordinator's check (pure).

"When every required part is installed and verified, the worker reports
ready to the coordinator". The report carries this descriptor: which package (ref and
manifest SHA-256) and which stage (index, half-open layer range) the node holds, and how many
artifacts and bytes it verified for it. The coordinator checks it against the topology it
signed (``admission_problem``) before it counts the stage as ready.

Extends this value into the admission descriptor once a runtime has loaded the
stage: ``runtime`` (``skippy.runtime.admission.RuntimeFacts``, the loaded stage's
``AdmissionDescriptor.facts``: model id, activation width and dtype, runtime version, engine,
context, vocabulary) is present exactly when the node serves the stage, and a coordinator that
serves checks it against its own with the admission vocabulary's one rule
(``admission_problem(..., expect=)``, ``runtime_problem``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from skippy.errors import UsageError
from skippy.package.manifest import ArtifactRef
from skippy.package.ranges import LayerRange
from skippy.package.topology import MAX_PACKAGE_REF_CHARS, SplitTopology, StageAssignment
from skippy.runtime.admission import (
    SHA256_RE,
    RuntimeFacts,
    descriptor_int,
    invalid_descriptor,
    runtime_problem,
)

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
OPTIONAL_KEYS: Final = frozenset({"runtime"})


@dataclass(frozen=True)
class StageDescriptor:
    """What a node holds, verified, for one stage of one package."""

    package_ref: str
    manifest_sha256: str
    stage_index: int
    layers: LayerRange
    artifact_count: int  # the stage's required artifacts, all present and verified
    artifact_bytes: int
    runtime: RuntimeFacts | None = None  # the loaded runtime, when the node serves the stage

    def __post_init__(self) -> None:
        if not isinstance(self.package_ref, str) or not (
            0 < len(self.package_ref) <= MAX_PACKAGE_REF_CHARS
        ):
            raise invalid_descriptor("package_ref must be a non-empty string", self.package_ref)
        if not isinstance(self.manifest_sha256, str) or not SHA256_RE.match(self.manifest_sha256):
            raise invalid_descriptor("manifest_sha256 must be 64 lowercase hex characters")

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
            **({} if self.runtime is None else {"runtime": self.runtime.to_dict()}),
        }

    @classmethod
    def from_dict(cls, data: object) -> StageDescriptor:
        """Strict parse of a peer's descriptor: exactly ``KEYS`` (plus ``runtime``), exact
        types."""
        if not isinstance(data, Mapping) or not KEYS <= set(data) <= KEYS | OPTIONAL_KEYS:
            got = sorted(map(str, data))[:16] if isinstance(data, Mapping) else type(data).__name__
            raise invalid_descriptor(
                f"a stage descriptor has exactly the fields {sorted(KEYS)}", got
            )
        try:
            layers = LayerRange(
                descriptor_int(data, "layer_start"),
                descriptor_int(data, "layer_end"),
                descriptor_int(data, "layer_count"),
            )
        except UsageError as exc:
            raise invalid_descriptor(exc.message) from None
        return cls(
            package_ref=data["package_ref"],
            manifest_sha256=data["manifest_sha256"],
            stage_index=descriptor_int(data, "stage_index"),
            layers=layers,
            artifact_count=descriptor_int(data, "artifact_count"),
            artifact_bytes=descriptor_int(data, "artifact_bytes"),
            runtime=RuntimeFacts.from_dict(data["runtime"]) if "runtime" in data else None,
        )


def admission_problem(
    descriptor: StageDescriptor,
    topology: SplitTopology,
    node_id: str,
    *,
    expect: RuntimeFacts | None = None,
) -> tuple[str, str] | None:
    """Why the coordinator must not count ``node_id``'s report for ``topology`` (a reason code
    and a sentence), or None when the descriptor names exactly the stage the topology gives it.
    With ``expect`` (a serving coordinator's own runtime), the stage must also be loaded in a
    runtime that agrees with it (``runtime_problem``)."""
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
    if expect is not None:
        return runtime_problem(descriptor.runtime, expect)
    return None
