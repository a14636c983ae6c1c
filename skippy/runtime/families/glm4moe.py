"""GLM-4.5/4.6/4.7 (llama.cpp ``src/models/glm4-moe.cpp``, architecture ``glm4moe``): RMS
pre-norms (the FFN's is the file's ``post_attention_norm``), Q/K/V with optional biases,
optional per-head Q/K RMS norms, NEOX RoPE over the first ``rope.dimension_count`` dims of
the head (half of it in the checkpoints), a dense SiLU FFN in the first
``leading_dense_block_count`` layers and in the others a mixture of experts: a sigmoid
router whose selection-only bias (``exp_probs_b``) picks the experts, their weights the
unbiased sigmoids (normalised where ``expert_weights_norm``, times ``expert_weights_scale``),
plus a shared expert every token runs, unscaled.

The ``nextn_predict_layers`` NextN/MTP layers after the trunk are counted in ``block_count``
(the package's layers) but never run by the trunk's graph: llama.cpp loads them (only when
asked for MTP) and drafts with them in a graph of their own. Here they live with the final
stage (``skippy.runtime.families.check_stage_layers``), their tensors planned by
``nextn_tensors`` for native MTP drafting."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.families.base import (
    Family,
    T,
    attention_tensors,
    bad,
    expert_tensors,
    nextn_head_tensors,
    qkv_bias_tensors,
    read_decoder,
    read_experts,
    read_float,
    read_int,
    routed_experts,
    tensor,
)
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import (
    MAX_EXPERTS,
    MAX_FF,
    ExpertGating,
    ModelSpec,
    TensorSpec,
)

ARCH = "glm4moe"
# llama_expert_gating_func_type (llama-hparams.h) -> moe_ffn's gating; 0 (none) is sigmoid
# for this family, as its loader defaults it
_GATING: dict[int, ExpertGating] = {0: "sigmoid", 1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


def _gating(kv: Mapping[str, Any]) -> ExpertGating:
    key = f"{ARCH}.expert_gating_func"
    value = read_int(kv, key, 0, 1 << 16, default=0)
    if value not in _GATING:
        raise StageUnsupported(
            f"{key} = {value}: the stage runtime runs softmax (1), sigmoid (2) and "
            "softmax-weight (3) expert gating",
            code="unsupported_hyperparameter",
            actual=key,
            remediation="run this model with --engine llama",
        )
    return _GATING[value]


def read(kv: Mapping[str, Any]) -> ModelSpec:
    """The decoder's hyperparameters (partial RoPE allowed, YaRN read where the file has
    it), the experts' (``expert_feed_forward_length`` required, as llama.cpp), the shared
    experts' count (their width is ``n_ff_exp`` times it), the routing keys, the leading
    dense layers and the NextN layers."""
    a = f"{ARCH}."
    sections = kv.get(a + "rope.dimension_sections")
    if isinstance(sections, list) and any(sections):
        raise StageUnsupported(
            f"{a}rope.dimension_sections {sections}: multi-section RoPE (a multimodal GLM) is "
            "not implemented by the stage runtime",
            code="unsupported_hyperparameter",
            actual=a + "rope.dimension_sections",
            remediation="run this model with --engine llama",
        )
    d = read_decoder(kv, ARCH, dense_ffn=False, yarn=True, partial_rope=True)
    n_all = d["n_layer"]
    nextn = d["n_layer_nextn"]
    dense = read_int(kv, a + "leading_dense_block_count", 0, n_all - nextn, default=0)
    if dense and not d["n_ff"]:
        raise bad(f"{a}feed_forward_length is needed by the leading dense layers", ARCH)
    read_int(kv, a + "expert_feed_forward_length", 1, MAX_FF)
    experts = read_experts(kv, ARCH, d["n_ff"], own_width=True)
    # llama.cpp requires the key and builds the shared expert unconditionally
    shared = read_int(kv, a + "expert_shared_count", 1, MAX_EXPERTS)
    n_ff_shexp = experts["n_ff_exp"] * shared
    if n_ff_shexp > MAX_FF:
        raise bad(f"the shared experts' width {n_ff_shexp} is more than {MAX_FF}", ARCH)
    scale = read_float(kv, a + "expert_weights_scale", 0.0)
    norm = kv.get(a + "expert_weights_norm", False)
    if not isinstance(norm, bool):
        raise bad(f"{a}expert_weights_norm = {norm!r} is not a bool", a + "expert_weights_norm")
    # 1.0f / sqrtf(float(n_embd_head)), in single precision
    d["attn_scale"] = float(np.float32(1.0) / np.sqrt(np.float32(d["head_dim"])))
    return ModelSpec(
        **{
            **d,
            **experts,
            "n_ff_shexp": n_ff_shexp,
            "expert_gating": _gating(kv),
            "expert_weights_norm": norm,
            "expert_weights_scale": float(np.float32(scale)),
            "dense_layers": frozenset(range(dense)),
            "n_layer_nextn": nextn,
        }
    )


def _block_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    """What a layer's block holds, trunk or NextN: attention (biases and per-head Q/K
    norms where the file has them), the FFN's norm, and its dense FFN or its experts."""
    w, hd = spec.width, spec.head_dim
    out = [
        *attention_tensors(spec, il),
        *qkv_bias_tensors(spec, il, required=False),
        tensor(T.ATTN_Q_NORM, il, (hd,), "vector", required=False),
        tensor(T.ATTN_K_NORM, il, (hd,), "vector", required=False),
        tensor(T.ATTN_POST_NORM, il, (w,), "vector"),
    ]
    if il in spec.dense_layers:
        ff = spec.n_ff
        return [
            *out,
            tensor(T.FFN_GATE, il, (w, ff), "matrix"),
            tensor(T.FFN_UP, il, (w, ff), "matrix"),
            tensor(T.FFN_DOWN, il, (ff, w), "matrix"),
        ]
    sh = spec.n_ff_shexp
    return [
        *out,
        *expert_tensors(spec, il),
        tensor(T.FFN_EXP_PROBS_B, il, (spec.n_expert,), "vector", suffix="bias"),
        tensor(T.FFN_GATE_SHEXP, il, (w, sh), "matrix"),
        tensor(T.FFN_UP_SHEXP, il, (w, sh), "matrix"),
        tensor(T.FFN_DOWN_SHEXP, il, (sh, w), "matrix"),
    ]


def nextn_tensors(spec: ModelSpec, il: int, vocab: int | None = None) -> list[TensorSpec]:
    """A NextN/MTP layer's tensors (``il`` >= ``spec.n_trunk``): a block like the trunk's,
    the projection of [normed embedding, normed hidden state] back to the width and its two
    norms; optionally its own head norm, and (sized by ``vocab``, where known) its own
    embeddings and head (llama.cpp falls back on the model's)."""
    return [*_block_tensors(spec, il), *nextn_head_tensors(spec, il, vocab)]


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    if il >= spec.n_trunk:
        return nextn_tensors(spec, il)
    return _block_tensors(spec, il)


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    spec = b.spec
    q, k, v = b.qkv(w, b.norm(x, w[T.ATTN_NORM]))
    q_norm, k_norm = w.get(T.ATTN_Q_NORM), w.get(T.ATTN_K_NORM)
    if q_norm is not None:
        q = b.norm(q, q_norm)
    if k_norm is not None:
        k = b.norm(k, k_norm)
    q, k = b.rope(q, il), b.rope(k, il)
    # llama.cpp sums GLM's attention output and FFN down projections in F32
    o = b.f32_accumulate(b.mm(w[T.ATTN_OUT], b.attention(il, q, k, v, spec.attn_scale)))
    o, x = b.last_rows(il, o, x)
    x = b.add(o, x)
    h = b.norm(x, w[T.ATTN_POST_NORM])
    if il in spec.dense_layers:
        f = b.ffn(h, w[T.FFN_GATE], w[T.FFN_UP], w[T.FFN_DOWN], "silu", f32_down=True)
        return b.add(f, x)
    routed = routed_experts(b, w, h)  # no expert groups: (0, 0), as llama.cpp reads them
    shared = b.ffn(
        h, w[T.FFN_GATE_SHEXP], w[T.FFN_UP_SHEXP], w[T.FFN_DOWN_SHEXP], "silu", f32_down=True
    )
    return b.add(b.add(routed, shared), x)


FAMILY = Family(
    ARCH,
    read,
    layer_tensors,
    build_layer,
    moe=True,
    numpy_reference=False,
    nextn_tensors=nextn_tensors,
)
