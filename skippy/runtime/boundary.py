"""The runtime boundary: how a node hands a verified stage to an inference runtime.

Spec "Layer Selection" and "Consumer Validation". A ``StageLoad`` is everything a runtime
needs and nothing it must re-derive: the package identity, the half-open layer range with
its boundary flags, and the selected part files in split (load) order, already checked
against the manifest. ``StageRuntime`` is the protocol every runtime implements (the
llama.cpp one lives in ``skippy.runtime.llama_cpp``; nothing here imports a runtime library).

Consumer validation happens before a ``StageLoad`` exists
(``skippy.consume.resolve.resolve_stage``):
manifest rules, selection, path gate, presence, sizes, SHA-256. Integrity never falls back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from skippy.constants import ROLE_METADATA
from skippy.errors import EXIT_USAGE, ArtifactMissing, SkippyError, UsageError
from skippy.generation import SpeculativePlan
from skippy.package.ranges import LayerRange
from skippy.package.select import StageSelection
from skippy.paths import resolve_under

# Why a generation stopped, for every loop that makes one (``skippy.runtime.token_loop``):
# the token budget, an end-of-generation token, the context, or (serving) a stop string.
StopReason = Literal["length", "eos", "stop", "context"]


# --- errors every runtime may raise ---------------------------------------------------------------
class RuntimeUnavailable(SkippyError, ImportError):
    """The runtime library is not installed (e.g. ``llama_cpp`` for the llama.cpp runtime)."""

    code = "runtime_unavailable"
    exit_code = EXIT_USAGE


class StageUnsupported(UsageError):
    """The runtime cannot run this stage shape (e.g. a partial layer range)."""

    code = "stage_unsupported"


class RuntimeLoadError(SkippyError, RuntimeError):
    """The runtime library refused to load the selected parts."""

    code = "runtime_load_failed"


class StageNotLoaded(SkippyError, RuntimeError):
    """A runtime call that needs a loaded stage was made before ``load`` or after ``close``."""

    code = "stage_not_loaded"


# --- the boundary value ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StageLoad:
    """One verified stage, ready for a runtime.

    ``part_paths`` are local files in split order (metadata first, then embeddings when
    selected, the layers ascending, then output when selected); ``part_roles`` names the role
    of each. The boundary flags follow from ``layers`` so they can never disagree with it.
    """

    model_id: str
    source_sha256: str
    layers: LayerRange
    part_paths: tuple[Path, ...]
    part_roles: tuple[str, ...]
    manifest_sha256: str | None = None
    projector_path: Path | None = None
    sha256_verified: bool = False
    # The one resolved speculation plan (spec "Speculative Decoding"); runtimes execute it or
    # log a correctness-preserving fallback, and never re-resolve it.
    speculative: SpeculativePlan | None = None
    # 2: the first part is a package-v2 metadata carrier (no payload; its tensor directory
    # describes the payload parts) and the others are payload parts.
    schema_version: int = 1

    def __post_init__(self) -> None:
        if not self.model_id.strip():
            raise UsageError("a stage load needs a non-empty model_id", code="invalid_stage_load")
        if not self.part_paths:
            raise UsageError("a stage load needs at least one part", code="invalid_stage_load")
        if len(self.part_roles) != len(self.part_paths):
            raise UsageError(
                f"{len(self.part_paths)} part paths but {len(self.part_roles)} part roles",
                code="invalid_stage_load",
            )
        if self.part_roles[0] != ROLE_METADATA:
            raise UsageError(
                f"the first part must be the {ROLE_METADATA} split (split 0), got "
                f"{self.part_roles[0]!r}",
                code="invalid_stage_load",
            )
        if len(set(self.part_paths)) != len(self.part_paths):
            raise UsageError("a stage load names the same part twice", code="invalid_stage_load")

    @property
    def owns_input(self) -> bool:
        return self.layers.owns_input

    @property
    def owns_output(self) -> bool:
        return self.layers.owns_output

    @property
    def is_full(self) -> bool:
        return self.layers.is_full

    @classmethod
    def from_selection(
        cls,
        selection: StageSelection,
        files: Path | Mapping[str, Path],
        *,
        manifest_sha256: str | None = None,
        sha256_verified: bool = False,
        speculative: SpeculativePlan | None = None,
    ) -> StageLoad:
        """Build the load from a selection and where its files are.

        ``files`` is either a package root (each manifest path passes the path gate under it)
        or a mapping from manifest path to an already resolved local file (e.g. a hub cache
        snapshot). The caller is responsible for having verified those files.
        """

        def where(rel: str) -> Path:
            if isinstance(files, Path):
                return resolve_under(files, rel)
            try:
                return files[rel]
            except KeyError:
                raise ArtifactMissing(
                    f"{rel} is selected for the stage but was not resolved to a local file",
                    path=rel,
                ) from None

        m = selection.manifest
        return cls(
            model_id=m.model_id,
            source_sha256=m.source_model.sha256,
            manifest_sha256=manifest_sha256,
            speculative=speculative,
            layers=selection.layers,
            part_paths=tuple(where(r.path) for r in selection.parts),
            part_roles=tuple(r.role for r in selection.parts),
            projector_path=where(selection.projector.path) if selection.projector else None,
            sha256_verified=sha256_verified,
            schema_version=m.schema_version,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "source_sha256": self.source_sha256,
            "manifest_sha256": self.manifest_sha256,
            "layer_start": self.layers.start,
            "layer_end": self.layers.stop,
            "layer_count": self.layers.layer_count,
            "owns_input": self.owns_input,
            "owns_output": self.owns_output,
            "parts": [
                {"role": role, "path": str(path)}
                for role, path in zip(self.part_roles, self.part_paths, strict=True)
            ],
            "projector_path": str(self.projector_path) if self.projector_path else None,
            "sha256_verified": self.sha256_verified,
            "schema_version": self.schema_version,
            "speculative": self.speculative.to_dict() if self.speculative else None,
        }


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One greedy completion: token ids, text, why it stopped, and timings."""

    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    text: str
    stop_reason: StopReason
    prefill_s: float  # until the first generated token is known
    decode_s: float  # the remaining tokens

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens over the whole generation time (prefill included)."""
        return len(self.tokens) / self.total_s if self.tokens and self.total_s > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode speed: tokens after the first over the time after the first."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": list(self.prompt_tokens),
            "tokens": list(self.tokens),
            "completion": self.text,
            "stop_reason": self.stop_reason,
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }


def log_speculation_fallback(
    stage: StageLoad,
    logger: logging.Logger,
    runtime: str,
    *,
    executable: Collection[str] = (),
) -> None:
    """Spec "Generation Defaults": a speculation path a runtime cannot execute gets a
    correctness-preserving fallback (plain decoding: the same greedy tokens) and a stated
    reason, in one structured line. ``executable`` are the plan modes the runtime runs."""
    plan = stage.speculative
    if plan is None or not plan.enabled or plan.mode in executable:
        return
    record = {
        "requested": plan.requested,
        "mode": plan.mode,
        "selected": "disabled",
        "fallback_reason": f"{runtime} has no speculative decoding; plain greedy decoding "
        "gives the same tokens",
    }
    logger.warning("speculative decoding fallback %s", json.dumps(record, sort_keys=True))


# --- the protocol ---------------------------------------------------------------------------------
@runtime_checkable
class StageRuntime(Protocol):
    """What a node calls on a runtime. One runtime object holds at most one loaded stage."""

    def require_supported(self, layers: LayerRange) -> None:
        """Raise ``StageUnsupported`` if this runtime cannot run ``layers``. Cheap: callers
        use it to refuse before spending time on verification."""
        ...

    def load(self, stage: StageLoad) -> None:
        """Load the stage's parts as they are (no materialized copy); replaces a loaded one."""
        ...

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids for ``text``; ``add_special`` adds the model's BOS when it uses one."""
        ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...

    def logits_for_prompt(self, tokens: Sequence[int]) -> npt.NDArray[np.float32]:
        """Next-token logits after a fresh evaluation of ``tokens`` (shape ``(n_vocab,)``)."""
        ...

    def generate(self, tokens: Sequence[int], *, max_tokens: int) -> Generation:
        """Deterministic greedy (temperature 0) completion from a fresh state."""
        ...

    def close(self) -> None:
        """Release the model; idempotent."""
        ...
