"""granitemoe (llama.cpp ``src/models/granite-moe.cpp``, built by granite's graph): granite's
layer and multipliers with a mixture-of-experts FFN in every layer (softmax router, the
``expert_used_count`` most probable experts per token, their weights normalised; each expert
``feed_forward_length`` wide). The shared-expert variant (``expert_shared_feed_forward_length``)
is refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gguf import Keys

from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.families.base import (
    Family,
    T,
    attention_tensors,
    qkv_bias_tensors,
    read_experts,
    tensor,
)
from skippy.runtime.families.granite import granite_layer, read_granite
from skippy.runtime.families.llama import model_tensors
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import ModelSpec, TensorSpec

ARCH = "granitemoe"


def read(kv: Mapping[str, Any]) -> ModelSpec:
    d = read_granite(kv, ARCH)
    shared = Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=ARCH)
    if kv.get(shared):
        raise StageUnsupported(
            f"{ARCH} with a shared expert ({shared}) is not implemented by the stage runtime",
            code="unsupported_hyperparameter",
            actual=shared,
            remediation="run this model with --engine llama",
        )
    # llama.cpp sizes granitemoe's experts by feed_forward_length
    return ModelSpec(**{**d, **read_experts(kv, ARCH, d["n_ff"], own_width=False)})


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    w, ff, e = spec.width, spec.n_ff_exp, spec.n_expert
    return [
        *attention_tensors(spec, il),
        *qkv_bias_tensors(spec, il, required=False),
        tensor(T.ATTN_OUT, il, (w,), "vector", False, "bias"),
        tensor(T.FFN_NORM, il, (w,), "vector"),
        tensor(T.FFN_GATE_INP, il, (w, e), "matrix"),
        tensor(T.FFN_GATE_EXP, il, (w, ff, e), "matrix"),
        tensor(T.FFN_UP_EXP, il, (w, ff, e), "matrix"),
        tensor(T.FFN_DOWN_EXP, il, (ff, w, e), "matrix"),
    ]


def _experts(b: GraphBuilder, w: LayerWeights, h: int) -> int:
    return b.moe_ffn(
        h,
        w[T.FFN_GATE_INP],
        w[T.FFN_UP_EXP],
        w[T.FFN_GATE_EXP],
        w[T.FFN_DOWN_EXP],
        n_expert_used=b.spec.n_expert_used,
        norm_weights=True,
    )


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    return granite_layer(b, w, il, x, _experts)


FAMILY = Family(ARCH, read, layer_tensors, build_layer, model_tensors, moe=True)
