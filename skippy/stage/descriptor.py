"""The stage descriptor a node sends with its ready report, and the coordinator's check (pure).

"When every required part is installed and verified, the worker reports
ready to the coordinator". The report carries this descriptor: which package (ref and
manifest SHA-256) and which stage (index, half-open layer range) the node holds, and how many
artifacts and bytes it verified for it. The coordinator checks it against the topology it
signed (``admission_problem``) before it counts the stage as ready.

Extends this value into the admission descriptor once a runtime has loaded the
stage: ``runtime`` (``RuntimeFacts``: model id, activation width and dtype, runtime version,
engine, context, vocabulary) is present exactly when the node serves the stage, and a
coordinator that serves checks it against its own (``admission_problem(..., expect=)``).
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
OPTIONAL_KEYS: Final = frozenset({"runtime"})
RUNTIME_KEYS: Final = frozenset(
    {"model_id", "width", "activation_dtype", "runtime_version", "engine", "n_ctx", "vocab"}
)
MAX_TEXT_CHARS: Final = 256
_SHA256_RE: Final = re.compile(r"\A[0-9a-f]{64}\Z")
_MAX_INT: Final = 1 << 62


def _bad(message: str, actual: object = None) -> TopologyError:
    return TopologyError(message, code="invalid_stage_descriptor", actual=actual)


def _int(data: Mapping[str, Any], key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
        raise _bad(f"{key} must be a non-negative integer", value)
    return value


def _text(data: Mapping[str, Any], key: str) -> str:
    value = data[key]
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT_CHARS:
        raise _bad(f"runtime.{key} must be a string of 1..{MAX_TEXT_CHARS} characters", value)
    return value


@dataclass(frozen=True)
class RuntimeFacts:
    """What a loaded stage runtime accepts and produces (``skippy.runtime.stage``'s
    ``AdmissionDescriptor``, reduced to what a peer must agree on)."""

    model_id: str
    width: int  # activation width crossing the links
    activation_dtype: str  # "f32"
    runtime_version: str  # e.g. "skippy-stage/1 ggml/0.25.3": the engines agree closely only
    engine: str
    n_ctx: int  # positions per session this stage holds
    vocab: int  # token ids (stage 0) / logits (final stage)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "width": self.width,
            "activation_dtype": self.activation_dtype,
            "runtime_version": self.runtime_version,
            "engine": self.engine,
            "n_ctx": self.n_ctx,
            "vocab": self.vocab,
        }

    @classmethod
    def from_dict(cls, data: object) -> RuntimeFacts:
        if not isinstance(data, Mapping) or set(data) != RUNTIME_KEYS:
            raise _bad(f"runtime has exactly the fields {sorted(RUNTIME_KEYS)}")
        return cls(
            model_id=_text(data, "model_id"),
            width=_int(data, "width"),
            activation_dtype=_text(data, "activation_dtype"),
            runtime_version=_text(data, "runtime_version"),
            engine=_text(data, "engine"),
            n_ctx=_int(data, "n_ctx"),
            vocab=_int(data, "vocab"),
        )


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
            **({} if self.runtime is None else {"runtime": self.runtime.to_dict()}),
        }

    @classmethod
    def from_dict(cls, data: object) -> StageDescriptor:
        """Strict parse of a peer's descriptor: exactly ``KEYS`` (plus ``runtime``), exact
        types."""
        if not isinstance(data, Mapping) or not KEYS <= set(data) <= KEYS | OPTIONAL_KEYS:
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


def runtime_problem(got: RuntimeFacts | None, expect: RuntimeFacts) -> tuple[str, str] | None:
    """Why a stage's runtime cannot join a route served with ``expect`` (
    same model, activation width and dtype, runtime version; at least the same context)."""
    if got is None:
        return "stage_not_loaded", "the stage is fetched but not loaded in a runtime"
    if got.model_id != expect.model_id:
        return "model_mismatch", f"model {got.model_id}, the route serves {expect.model_id}"
    if (got.width, got.activation_dtype) != (expect.width, expect.activation_dtype):
        return "activation_mismatch", (
            f"activations {got.width}x{got.activation_dtype}, the route carries "
            f"{expect.width}x{expect.activation_dtype}"
        )
    if got.runtime_version != expect.runtime_version:
        return "runtime_mismatch", (
            f"runtime {got.runtime_version}, the route runs {expect.runtime_version}"
        )
    if got.n_ctx < expect.n_ctx:
        return "context_too_small", (
            f"the stage holds {got.n_ctx} positions per session, the route needs {expect.n_ctx}"
        )
    return None
