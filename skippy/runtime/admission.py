"""The stage-admission vocabulary, once: what a loaded stage is, and whether stages fit together.

``AdmissionDescriptor`` is everything a loaded stage says about itself (its package and
manifest, its index and layer range, the activation contract, its engine and runtime version,
context and vocabulary): what ``run`` shows and what a chain checks before it sends anything.
``RuntimeFacts`` (``AdmissionDescriptor.facts``) is the part of it a peer must agree on: the
``runtime`` field of the stage descriptor a node sends with its ready report
(``skippy.stage.descriptor``), parsed strictly from a peer.

One rule decides whether two stages' runtimes fit (``runtime_mismatches``: the same model, the
same activation width and dtype, the same runtime version, since the engines agree closely but
not bit for bit), for both places that ask:

- in one process, a stage follows another (``AdmissionDescriptor.check_follows``: also the
  same manifest and adjacent layers), and
- on the mesh, a reported stage joins a serving coordinator's route (``runtime_problem``: also
  loaded, and holding at least the route's context).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from skippy.errors import TopologyError, UsageError
from skippy.package.ranges import LayerRange

ACTIVATION_DTYPE: Final = "f32"
RUNTIME_KEYS: Final = frozenset(
    {"model_id", "width", "activation_dtype", "runtime_version", "engine", "n_ctx", "vocab"}
)
MAX_TEXT_CHARS: Final = 256
SHA256_RE: Final = re.compile(r"\A[0-9a-f]{64}\Z")
_MAX_INT: Final = 1 << 62


# --- a peer's descriptor, parsed strictly ---------------------------------------------------------
def invalid_descriptor(message: str, actual: object = None) -> TopologyError:
    return TopologyError(message, code="invalid_stage_descriptor", actual=actual)


def descriptor_int(data: Mapping[str, Any], key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
        raise invalid_descriptor(f"{key} must be a non-negative integer", value)
    return value


def descriptor_text(data: Mapping[str, Any], key: str) -> str:
    value = data[key]
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT_CHARS:
        raise invalid_descriptor(
            f"runtime.{key} must be a string of 1..{MAX_TEXT_CHARS} characters", value
        )
    return value


@dataclass(frozen=True)
class RuntimeFacts:
    """What a loaded stage runtime accepts and produces, reduced to what a peer must agree on
    (``AdmissionDescriptor.facts``)."""

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
            raise invalid_descriptor(f"runtime has exactly the fields {sorted(RUNTIME_KEYS)}")
        return cls(
            model_id=descriptor_text(data, "model_id"),
            width=descriptor_int(data, "width"),
            activation_dtype=descriptor_text(data, "activation_dtype"),
            runtime_version=descriptor_text(data, "runtime_version"),
            engine=descriptor_text(data, "engine"),
            n_ctx=descriptor_int(data, "n_ctx"),
            vocab=descriptor_int(data, "vocab"),
        )


# --- the one rule ---------------------------------------------------------------------------------
def runtime_mismatches(got: RuntimeFacts, expect: RuntimeFacts) -> list[tuple[str, str]]:
    """Why a stage running ``got`` cannot exchange activations with stages running ``expect``
    (reason codes and sentences; empty when it can)."""
    problems = []
    if got.model_id != expect.model_id:
        problems.append(
            ("model_mismatch", f"model {got.model_id}, the route serves {expect.model_id}")
        )
    if (got.width, got.activation_dtype) != (expect.width, expect.activation_dtype):
        problems.append(
            (
                "activation_mismatch",
                f"activations {got.width}x{got.activation_dtype}, the route carries "
                f"{expect.width}x{expect.activation_dtype}",
            )
        )
    if got.runtime_version != expect.runtime_version:
        problems.append(
            (
                "runtime_mismatch",
                f"runtime {got.runtime_version}, the route runs {expect.runtime_version}",
            )
        )
    return problems


def runtime_problem(got: RuntimeFacts | None, expect: RuntimeFacts) -> tuple[str, str] | None:
    """Why a stage's runtime cannot join a route served with ``expect`` (loaded; the one rule;
    at least the same context), or None."""
    if got is None:
        return "stage_not_loaded", "the stage is fetched but not loaded in a runtime"
    problems = runtime_mismatches(got, expect)
    if problems:
        return problems[0]
    if got.n_ctx < expect.n_ctx:
        return "context_too_small", (
            f"the stage holds {got.n_ctx} positions per session, the route needs {expect.n_ctx}"
        )
    return None


# --- a loaded stage -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class AdmissionDescriptor:
    """What a stage is, for a peer deciding whether to connect to it (and for `run` output)."""

    package_ref: str
    model_id: str
    manifest_sha256: str | None
    stage_index: int
    stage_count: int
    layers: LayerRange
    width: int
    vocab: int | None  # logits width (final stage) / accepted token ids (stage 0)
    activation_dtype: str
    engine: str
    runtime_version: str
    n_ctx: int

    @property
    def input_kind(self) -> Literal["tokens", "activations"]:
        return "tokens" if self.layers.owns_input else "activations"

    @property
    def output_kind(self) -> Literal["logits", "activations"]:
        return "logits" if self.layers.owns_output else "activations"

    @property
    def facts(self) -> RuntimeFacts:
        return RuntimeFacts(
            model_id=self.model_id,
            width=self.width,
            activation_dtype=self.activation_dtype,
            runtime_version=self.runtime_version,
            engine=self.engine,
            n_ctx=self.n_ctx,
            vocab=self.vocab or 0,
        )

    def check_follows(self, upstream: AdmissionDescriptor) -> None:
        """Refuse to chain ``upstream -> self`` unless they are adjacent stages of the same
        package manifest whose runtimes fit (``runtime_mismatches``)."""
        problems = []
        if (upstream.model_id, upstream.manifest_sha256) != (self.model_id, self.manifest_sha256):
            problems.append("they come from different package manifests")
        if upstream.layers.stop != self.layers.start:
            problems.append(f"layers {upstream.layers} are not followed by {self.layers}")
        problems += [
            sentence
            for code, sentence in runtime_mismatches(self.facts, upstream.facts)
            if code != "model_mismatch"  # said above, with the manifest
        ]
        if problems:
            raise UsageError(
                f"stage {self.stage_index} cannot follow stage {upstream.stage_index}: "
                + "; ".join(problems),
                code="stage_mismatch",
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "package_ref": self.package_ref,
            "model_id": self.model_id,
            "manifest_sha256": self.manifest_sha256,
            "stage_index": self.stage_index,
            "stage_count": self.stage_count,
            "layer_start": self.layers.start,
            "layer_end": self.layers.stop,
            "layer_count": self.layers.layer_count,
            "input": self.input_kind,
            "output": self.output_kind,
            "width": self.width,
            "vocab": self.vocab,
            "activation_dtype": self.activation_dtype,
            "engine": self.engine,
            "runtime_version": self.runtime_version,
            "n_ctx": self.n_ctx,
        }
