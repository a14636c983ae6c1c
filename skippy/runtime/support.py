"""Which model families the stage runtime runs, answered without loading it: what ``inspect``
shows (the runtime's own modules import numpy, which ``inspect`` must not pay for).

``skippy.runtime.families`` stays the authority: ``spec_from_metadata`` decides when a stage
loads, hyperparameters included. This table answers for the family and its experts only; the
registry refuses to import when its families and this table disagree, and
tests/skippy/package/test_experts.py checks the verdicts against ``spec_from_metadata`` on real
files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from skippy.package.experts import check_metadata

STAGE_FAMILIES: Final = (  # == the registry's
    "llama",
    "qwen2",
    "qwen3",
    "gemma3",
    "qwen3moe",
    "olmo2",
    "smollm3",
    "granite",
    "granitemoe",
    "phimoe",
    "qwen2moe",
    "olmoe",
    "gemma2",
    "phi3",
    "mistral3",
    "gpt-oss",
    "glm4moe",
    "deepseek2",
)
# The families whose files may hold experts (llama: Mixtral; a file with experts of any
# other family is refused).
STAGE_MOE_FAMILIES: Final[tuple[str, ...]] = (
    "llama",
    "qwen3moe",
    "qwen2moe",
    "olmoe",
    "granitemoe",
    "phimoe",
    "gpt-oss",
    "glm4moe",
    "deepseek2",
)
UNSUPPORTED: Final = "unsupported_architecture"  # the runtime's own code for both refusals


def support_verdict(kv: Mapping[str, Any]) -> dict[str, Any]:
    """``runs`` (the family, and its experts, are among the stage runtime's), else the
    refusal's ``code`` and ``reason``; the supported families. Malformed MoE keys raise their
    coded ``ModelError`` (``skippy.package.experts.check_metadata``)."""
    config = check_metadata(kv)
    arch = config.arch
    reason = None
    if arch not in STAGE_FAMILIES:
        reason = (
            f"architecture {arch!r} is not supported by the stage runtime "
            f"(supported: {', '.join(STAGE_FAMILIES)})"
        )
    elif config.moe and arch not in STAGE_MOE_FAMILIES:
        moe = ", ".join(STAGE_MOE_FAMILIES) or "none"
        reason = (
            f"{arch} with experts (MoE) is not supported by the stage runtime (it runs dense "
            f"{', '.join(STAGE_FAMILIES)} models; with experts: {moe})"
        )
    return {
        "runs": reason is None,
        "code": None if reason is None else UNSUPPORTED,
        "reason": reason,
        "supported": list(STAGE_FAMILIES),
        "supported_moe": list(STAGE_MOE_FAMILIES),
    }


__all__ = ["STAGE_FAMILIES", "STAGE_MOE_FAMILIES", "support_verdict"]
