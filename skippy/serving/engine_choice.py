"""Which engine serves a package, and whether it may be split: the pure decisions.

The stage runtime (ggml; numpy its f32 reference) runs the families ``skippy.runtime.model``
covers, split into stages over nodes. Any other model llama.cpp runs is served whole, on the
coordinator alone, by the ``llama`` engine (``skippy.runtime.llama_stage``); so is every model
when ``[serving] engine = "llama"`` is chosen. Such a choice refuses split placement with a
code and a reason that the log, ``/health`` and the status document all show.

- ``stage_runtime_problem``: why the stage runtime cannot run a model (its metadata), or None.
- ``choose_engine``: the configured engine and that answer -> an ``EngineChoice``.
- ``check_split``: a stage count the choice cannot honour is a usage error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from skippy.constants import KEY_ARCHITECTURE
from skippy.errors import ModelError, UsageError
from skippy.package.experts import check_metadata
from skippy.runtime.boundary import StageUnsupported

LLAMA_ENGINE: Final = "llama"
# The codes of a refused split placement (status, /health, the topology refusal).
FAMILY_UNSUPPORTED: Final = "family_unsupported"
ENGINE_WHOLE_MODEL: Final = "engine_whole_model"
SPLIT_UNSUPPORTED: Final = "split_unsupported"


@dataclass(frozen=True)
class EngineChoice:
    """The engine of this node's stage, and (for the one-node llama.cpp path) why the model
    is not split: ``split_refused`` and its ``code``."""

    engine: str
    family: str
    split_refused: str | None = None
    code: str | None = None
    # The stage runtime's own refusal (its code, words and hint), when that is the reason.
    problem: StageUnsupported | None = field(default=None, compare=False, repr=False)

    @property
    def one_node(self) -> bool:
        return self.split_refused is not None

    @property
    def label(self) -> str:
        """One line for the log, ``/health`` and the status document."""
        if self.split_refused is None:
            return f"engine: {self.engine}"
        return f"engine: llama.cpp (one node; split placement refused: {self.split_refused})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "family": self.family,
            "label": self.label,
            "split_refused": self.split_refused,
            "code": self.code,
        }


def family_of(kv: Mapping[str, Any]) -> str:
    arch = kv.get(KEY_ARCHITECTURE)
    return arch if isinstance(arch, str) and arch else "unknown"


def stage_runtime_problem(kv: Mapping[str, Any]) -> StageUnsupported | None:
    """The stage runtime's own refusal of this model's metadata (its architecture, experts,
    RoPE scaling, a hyperparameter shape), or None when it runs it. Metadata that is wrong
    for a family it does cover raises, as loading would; so do malformed MoE keys
    (``skippy.package.experts.check_metadata``: a ``moe_*`` code), whatever the family."""
    from skippy.runtime.families import spec_from_metadata

    check_metadata(kv)
    try:
        spec_from_metadata(kv)
    except StageUnsupported as exc:
        return exc
    return None


def choose_engine(
    configured: str, family: str, problem: StageUnsupported | None
) -> EngineChoice:
    """``configured`` ([serving] engine) for a model of ``family`` that the stage runtime
    refuses with ``problem`` (None: it runs it)."""
    if configured == LLAMA_ENGINE:
        return EngineChoice(
            LLAMA_ENGINE,
            family,
            '[serving] engine = "llama" runs the whole model in llama.cpp',
            ENGINE_WHOLE_MODEL,
        )
    if problem is None:
        return EngineChoice(configured, family)
    what = problem.actual if isinstance(problem.actual, str) and problem.actual else family
    reason = f"{what} is not supported by the stage runtime"
    if problem.code != "unsupported_architecture":
        reason = f"{family} is not supported by the stage runtime ({problem.message})"
    return EngineChoice(LLAMA_ENGINE, family, reason, FAMILY_UNSUPPORTED, problem)


def check_split(choice: EngineChoice, stages: int | None) -> None:
    """More than one stage of a model the choice serves whole is refused at once: a family
    the stage runtime does not cover with the runtime's own code, words and hint (exit 1, as
    the model cannot be split: a lab fails its bring-up with it), ``engine = "llama"`` as a
    usage error (exit 2)."""
    if not (choice.one_node and stages is not None and stages > 1):
        return
    if choice.problem is not None:
        raise ModelError(
            f"cannot split this model over {stages} stages: {choice.problem.message}",
            code=choice.problem.code,
            expected=1,
            actual=stages,
            remediation="; ".join(
                hint
                for hint in (
                    choice.problem.remediation,
                    "mesh-node serve without --stages serves it whole on one node (llama.cpp)",
                )
                if hint
            ),
        )
    raise UsageError(
        f"cannot split this model over {stages} stages: {choice.split_refused}",
        code=SPLIT_UNSUPPORTED,
        expected=1,
        actual=stages,
        remediation='serve it without --stages (one node, llama.cpp), or set [serving] '
        'engine = "ggml"',
    )
