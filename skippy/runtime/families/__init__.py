"""The model families the stage runtime runs: llama.cpp's architecture name -> its module.

This table is the only place an architecture name maps to code. Adding a family is one module
beside these (a metadata reader into ``ModelSpec``, a tensor plan named from gguf-py, a
``build_layer`` over ``skippy.runtime.graph``'s helpers, exported as ``FAMILY``), one row
here, and its canary entry (docs/architecture.md, "Adding a model family").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from skippy.constants import KEY_ARCHITECTURE
from skippy.package.ranges import LayerRange
from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.families import (
    deepseek2,
    gemma2,
    gemma3,
    glm4moe,
    gptoss,
    granite,
    granitemoe,
    llama,
    llama4,
    mistral3,
    olmo2,
    olmoe,
    phi3,
    phimoe,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    smollm3,
)
from skippy.runtime.families.base import Family, T, nextn_head_tensors, tensor
from skippy.runtime.model import LLAMA_HINT, ModelSpec, TensorSpec
from skippy.runtime.support import STAGE_FAMILIES, STAGE_MOE_FAMILIES

FAMILIES: Final[Mapping[str, Family]] = {
    f.arch: f
    for f in (
        llama.FAMILY,
        qwen2.FAMILY,
        qwen3.FAMILY,
        gemma3.FAMILY,
        qwen3moe.FAMILY,
        olmo2.FAMILY,
        smollm3.FAMILY,
        granite.FAMILY,
        granitemoe.FAMILY,
        phimoe.FAMILY,
        qwen2moe.FAMILY,
        olmoe.FAMILY,
        gemma2.FAMILY,
        phi3.FAMILY,
        mistral3.FAMILY,
        gptoss.FAMILY,
        glm4moe.FAMILY,
        deepseek2.FAMILY,
        llama4.FAMILY,
    )
}
# ``inspect`` answers from skippy.runtime.support's table without importing the runtime: the
# two must name the same families (a new family is added to both, or nothing imports).
if set(FAMILIES) != set(STAGE_FAMILIES) or {
    a for a, f in FAMILIES.items() if f.may_have_experts
} != set(STAGE_MOE_FAMILIES):
    raise RuntimeError("skippy.runtime.support's family table disagrees with the registry")


def supported() -> tuple[str, ...]:
    """The architecture names the stage runtime runs, for messages and docs."""
    return tuple(FAMILIES)


def family_of(arch: object) -> Family:
    family = FAMILIES.get(arch) if isinstance(arch, str) else None
    if family is None:
        raise StageUnsupported(
            f"architecture {arch!r} is not supported by the stage runtime "
            f"(supported: {', '.join(supported())})",
            code="unsupported_architecture",
            actual=str(arch),
            remediation=LLAMA_HINT,
        )
    return family


def spec_from_metadata(kv: Mapping[str, Any]) -> ModelSpec:
    """The model's hyperparameters, read by its family (``unsupported_architecture`` for a
    family the runtime does not have, and for experts in the file of a family whose builder
    has no MoE block; llama's takes them: Mixtral)."""
    family = family_of(kv.get(KEY_ARCHITECTURE))
    if not family.may_have_experts and kv.get(f"{family.arch}.expert_count", 0):
        dense = ", ".join(a for a, f in FAMILIES.items() if not f.moe)
        moe = ", ".join(a for a, f in FAMILIES.items() if f.may_have_experts)
        raise StageUnsupported(
            f"{family.arch} with experts (MoE) is not supported by the stage runtime (it runs "
            f"dense {dense} models, and MoE {moe} models)",
            code="unsupported_architecture",
            actual=f"{family.arch} (MoE)",
            remediation=LLAMA_HINT + "; a split needs a model of a family the runtime runs",
        )
    return family.read(kv)


def check_stage_layers(spec: ModelSpec, layers: LayerRange) -> None:
    """A stage's layers where the model has NextN/MTP layers after its trunk: they go with
    the final stage, which holds the last trunk layer and the output head too (a cut between
    the trunk and them, or among them, would leave the trunk's end without its head, or a
    stage that computes nothing). ``nextn_stage_cut`` otherwise."""
    trunk = spec.n_trunk
    if not spec.n_layer_nextn or not (layers.start >= trunk or trunk <= layers.stop < spec.n_layer):
        return
    raise StageUnsupported(
        f"the stage {layers} cuts the model where its NextN/MTP layers "
        f"{trunk}..{spec.n_layer} would leave the trunk's last layer ({trunk - 1}): they go "
        "with the final stage",
        code="nextn_stage_cut",
        actual=str(layers),
        remediation=f"end the last stage at layer {spec.n_layer} and start it at or before "
        f"layer {trunk - 1}",
    )


def layer_tensors(spec: ModelSpec, il: int, vocab: int | None = None) -> list[TensorSpec]:
    """Every tensor layer ``il`` may hold: a trunk layer's, or a NextN layer's (with the
    vocabulary-sized ones where ``vocab`` is known)."""
    family = family_of(spec.arch)
    if il < spec.n_trunk:
        return family.layer_tensors(spec, il)
    if family.nextn_tensors is not None:
        return family.nextn_tensors(spec, il, vocab)
    # a NextN block of a family with no plan of its own: its layer plus the head's tensors
    return [*family.layer_tensors(spec, il), *nextn_head_tensors(spec, il, vocab)]


def stage_tensors(
    spec: ModelSpec, layers: LayerRange, *, vocab: int | None, tied: bool
) -> list[TensorSpec]:
    """Every tensor a stage over ``layers`` may hold. ``vocab`` is the embedding row count
    (known once the embeddings or output part is open); ``tied``: logits through the token
    embeddings."""
    family = family_of(spec.arch)
    out = family.model_tensors(spec)
    if vocab is not None and (layers.owns_input or (layers.owns_output and tied)):
        out.append(tensor(T.TOKEN_EMBD, None, (spec.width, vocab), "matrix"))
    elif vocab is not None and layers.stop > spec.n_trunk:
        # the NextN head embeds the next token (its block's own embed_tokens, else these)
        out.append(tensor(T.TOKEN_EMBD, None, (spec.width, vocab), "matrix", required=False))
    for il in layers:
        out += layer_tensors(spec, il, vocab)
    if layers.owns_output:
        out.append(tensor(T.OUTPUT_NORM, None, (spec.width,), "vector"))
        if family.output_biases:
            out.append(tensor(T.OUTPUT_NORM, None, (spec.width,), "vector", suffix="bias"))
        if vocab is not None and not tied:
            out.append(tensor(T.OUTPUT, None, (spec.width, vocab), "matrix"))
            if family.output_biases:
                out.append(tensor(T.OUTPUT, None, (vocab,), "vector", suffix="bias"))
    return out
