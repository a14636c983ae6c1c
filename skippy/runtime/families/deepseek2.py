"""deepseek2 (llama.cpp ``src/models/deepseek2.cpp``): DeepSeek-V2/V2-Lite, V3/R1 and Kimi
K2. Multi-head latent attention in llama.cpp's absorbed form (the file's ``attn_k_b`` and
``attn_v_b``): Q low-rank through ``attn_q_a``, its norm and ``attn_q_b`` (V3) or straight
from ``attn_q`` (V2-Lite); one compressed KV latent per token (``attn_kv_a_mqa``'s first
``kv_lora_rank`` rows, RMS-normed) plus a rotated key part every head shares; each head's
non-rotated query absorbed into the latent through ``attn_k_b``, so attention runs as one
KV head of ``kv_lora_rank + rope_dim`` (the cache holds latent + rope key, V is its latent
part), each head's output expanded through ``attn_v_b``. Normal-style RoPE over the rotated
part only, YaRN with DeepSeek's mscale folded into the attention scale as llama.cpp does.
The first ``leading_dense_block_count`` layers run a dense SiLU FFN, the others a mixture
of experts (softmax gating, V2; sigmoid with a selection bias, V3; group-limited routing;
normalised and scaled weights) beside shared experts. Only the residual stream crosses a
stage boundary.

With ``attention.temperature_scale`` (Mistral Large 3) Q is scaled per position by
log(floor(pos / ``attention.temperature_length``) + 1) * scale + 1 before attention.

Refused with a code: files from before the split ``attn_k_b``/``attn_v_b`` (no
``key_length_mla``: the non-absorbed ``attn_kv_b`` path), per-layer expert widths and a
fused ``ffn_gate_up_exps``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.families.base import (
    Family,
    T,
    bad,
    nextn_head_tensors,
    read_decoder,
    read_float,
    read_int,
    routed_experts,
    tensor,
)
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_FF,
    MAX_HEAD_DIM,
    MAX_WIDTH,
    AttnTemperature,
    ExpertGating,
    Mla,
    ModelSpec,
    TensorSpec,
)

ARCH = "deepseek2"
# llama.cpp's lite variants (DeepSeek-V2-Lite, GigaChat3-10B-A1.8B, Kanana-2-30B-A3B): their
# loader reads no q_lora_rank (Q is projected directly), whatever the file says
_LITE_LAYERS = (27, 26)
_LITE_48_VOCAB = 128256
# GLM 4.7 Lite ships as deepseek2 without a gating key: llama.cpp gates it with a sigmoid
_GLM_LITE_LAYERS, _GLM_LITE_VOCAB = (47, 48), 154880
# llama_expert_gating_func_type (llama-hparams.h): the ones this builder runs
_GATING: dict[int, ExpertGating] = {1: "softmax", 2: "sigmoid"}
_REMEDIATION = "run this model with --engine llama"


def _vocab_size(kv: Mapping[str, Any]) -> int:
    """llama.cpp's n_vocab as this loader finds it: ``vocab_size``, else the token list's."""
    n = kv.get(f"{ARCH}.vocab_size")
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    tokens = kv.get("tokenizer.ggml.tokens")
    return len(tokens) if isinstance(tokens, list | tuple) else 0


def _unsupported(message: str, key: str) -> StageUnsupported:
    return StageUnsupported(
        message, code="unsupported_hyperparameter", actual=key, remediation=_REMEDIATION
    )


def _f32_log(x: np.float32) -> np.float32:
    return np.float32(math.log(float(x)))


def kq_scale(attn_factor: float, freq_scale: float, log_mul: float, k_dim: int) -> float:
    """llama.cpp's deepseek2 attention scale, in its f32 arithmetic: the context's
    attn_factor with YaRN's cancelling factor undone, times DeepSeek's mscale
    (1 + 0.1 * yarn_log_multiplier * ln(1 / freq_scale)), squared, over sqrt(key width)."""
    f32 = np.float32
    ln = _f32_log(f32(1.0) / f32(freq_scale))
    org = f32(f32(attn_factor) * f32(f32(1.0) + f32(0.1) * ln))
    mscale = f32(org * f32(f32(1.0) + f32(f32(0.1) * f32(log_mul)) * ln))
    return float(f32(f32(f32(1.0) * mscale) * mscale) / np.sqrt(f32(k_dim)))


def read(kv: Mapping[str, Any]) -> ModelSpec:
    """The decoder's hyperparameters with latent attention's own head dimensions, YaRN as
    llama.cpp's deepseek2 reads it, the NextN layers, the lite variants' direct Q, the MLA
    ranks (checked against the cache's one-head shape the converter writes), the optional
    attention temperature, the leading dense layers and the experts' routing keys."""
    a = f"{ARCH}."
    # llama.cpp's deepseek2 loader reads the log multiplier without the converter's 0.1, and
    # no other YaRN tuning key
    log_mul = float(np.float32(read_float(kv, a + "rope.scaling.yarn_log_multiplier", 0.0)))
    log_mul = float(np.float32(log_mul) / np.float32(0.1))
    d = read_decoder(
        kv,
        ARCH,
        dense_ffn=False,
        yarn=True,
        yarn_tuning_keys=False,
        yarn_mscale_all_dims=log_mul,
        latent_attention=True,
    )
    # NextN (MTP) layers after the trunk: counted in n_layer (the package's), never run by
    # the trunk's graph (ModelSpec.n_layer_nextn); llama.cpp's checks below count the trunk
    nextn = d.pop("n_layer_nextn")  # read_decoder reads nextn_predict_layers for every family
    n_layer = d["n_layer"] - nextn
    if a + "attention.key_length_mla" not in kv or a + "attention.value_length_mla" not in kv:
        raise _unsupported(
            "this deepseek2 file predates llama.cpp's absorbed MLA (no "
            "attention.key_length_mla / value_length_mla: one attn_kv_b per layer); the stage "
            "runtime runs files with attn_k_b and attn_v_b (re-convert with a current "
            "convert_hf_to_gguf.py)",
            a + "attention.key_length_mla",
        )
    temp_scale = read_float(kv, a + "attention.temperature_scale", 0.0)
    if temp_scale != 0.0:  # Mistral Large 3's temperature tuning: llama.cpp needs both keys
        floor = read_int(kv, a + "attention.temperature_length", 1, MAX_CONTEXT)
        d["attn_temperature"] = AttnTemperature(float(np.float32(temp_scale)), floor)
    vocab = _vocab_size(kv)
    lite = n_layer in _LITE_LAYERS or (n_layer == 48 and vocab == _LITE_48_VOCAB)
    q_lora = 0 if lite else read_int(kv, a + "attention.q_lora_rank", 0, MAX_WIDTH)
    kv_lora = read_int(kv, a + "attention.kv_lora_rank", 1, MAX_WIDTH)
    k_mla = read_int(kv, a + "attention.key_length_mla", 2, MAX_HEAD_DIM)
    v_mla = read_int(kv, a + "attention.value_length_mla", 1, MAX_HEAD_DIM)
    rope_dim = read_int(kv, a + "rope.dimension_count", 2, MAX_HEAD_DIM)
    if rope_dim % 2 or rope_dim >= k_mla:
        raise bad(
            f"rope.dimension_count {rope_dim} must be even and less than key_length_mla "
            f"{k_mla} (the key's non-rotated part is at least 1 wide)",
            a + "rope.dimension_count",
        )
    # the cache's one "head": latent + rope key (K), latent (V), as the converter writes them
    if (d["head_dim"], d["n_head_kv"]) != (kv_lora + rope_dim, 1) or read_int(
        kv, a + "attention.value_length", 1, MAX_HEAD_DIM
    ) != kv_lora:
        raise bad(
            f"MLA needs head_count_kv 1, key_length kv_lora_rank + rope ({kv_lora + rope_dim})"
            f" and value_length kv_lora_rank ({kv_lora})",
            a + "attention.key_length",
        )
    n_dense = read_int(kv, a + "leading_dense_block_count", 0, n_layer, default=0)
    if n_dense and not d["n_ff"]:
        raise bad(f"{a}feed_forward_length is needed by the leading dense layers", a)
    experts: dict[str, Any] = {}
    if n_dense < n_layer:
        experts = _read_experts(kv, n_layer, vocab)
    freq_scale = d["rope_scale"]
    yarn = d.get("yarn")
    attn_factor = (
        yarn.attn_factor
        if yarn is not None
        else read_float(kv, a + "rope.scaling.attn_factor", 1.0)
    )
    if yarn is None and attn_factor != 1.0:  # llama.cpp would pass it to RoPE too
        raise _unsupported(
            "rope.scaling.attn_factor without YaRN is not implemented by the stage runtime",
            a + "rope.scaling.attn_factor",
        )
    d["attn_scale"] = kq_scale(attn_factor, freq_scale, log_mul, k_mla)
    d["rope_style"] = "normal"
    mla = Mla(q_lora, kv_lora, rope_dim, k_mla, v_mla)
    return ModelSpec(
        **d, **experts, mla=mla, dense_layers=frozenset(range(n_dense)), n_layer_nextn=nextn
    )


def _read_experts(kv: Mapping[str, Any], n_layer: int, vocab: int) -> dict[str, Any]:
    a = f"{ARCH}."
    n_expert = read_int(kv, a + "expert_count", 1, MAX_EXPERTS)
    n_used = read_int(kv, a + "expert_used_count", 1, n_expert)
    n_ff_exp = read_int(kv, a + "expert_feed_forward_length", 1, MAX_FF)
    n_shared = read_int(kv, a + "expert_shared_count", 0, MAX_EXPERTS)
    gating_id = read_int(kv, a + "expert_gating_func", 0, 16, default=0)
    if gating_id == 0:  # files from before the key: V2's softmax (GLM 4.7 Lite: sigmoid)
        glm_lite = n_layer in _GLM_LITE_LAYERS and vocab == _GLM_LITE_VOCAB
        gating_id = 2 if glm_lite else 1
    if gating_id not in _GATING:
        raise _unsupported(
            f"expert gating function {gating_id} is not one the stage runtime runs for "
            f"deepseek2 (1 softmax, 2 sigmoid)",
            a + "expert_gating_func",
        )
    groups = read_int(kv, a + "expert_group_count", 0, n_expert, default=0)
    group_used = read_int(kv, a + "expert_group_used_count", 0, n_expert, default=0)
    if groups > 1:
        # llama.cpp asserts these (and picks each group's best two experts to score it)
        if groups >= n_expert or n_expert % groups or n_expert // groups < 2:
            raise bad(
                f"expert_group_count {groups} must divide expert_count {n_expert} into groups "
                "of at least 2",
                a + "expert_group_count",
            )
        if not 0 < group_used < groups:
            raise bad(
                f"expert_group_used_count {group_used} must be 1..{groups - 1}",
                a + "expert_group_used_count",
            )
        if group_used * (n_expert // groups) < n_used:
            raise bad(
                f"the {group_used} groups used hold fewer experts than expert_used_count {n_used}",
                a + "expert_group_used_count",
            )
    norm = kv.get(a + "expert_weights_norm", False)
    if not isinstance(norm, bool):
        raise bad(f"{a}expert_weights_norm must be a bool", a + "expert_weights_norm")
    return {
        "n_expert": n_expert,
        "n_expert_used": n_used,
        "n_ff_exp": n_ff_exp,
        "n_ff_shexp": n_ff_exp * n_shared,
        "expert_gating": _GATING[gating_id],
        "expert_weights_norm": norm,
        "expert_weights_scale": read_float(kv, a + "expert_weights_scale", 0.0),
        "expert_groups": groups if groups > 1 else 0,
        "expert_groups_used": group_used if groups > 1 else 0,
    }


def _mla(spec: ModelSpec) -> Mla:
    if spec.mla is None:
        raise ValueError("a deepseek2 spec without MLA")
    return spec.mla


def nextn_tensors(spec: ModelSpec, il: int, vocab: int | None = None) -> list[TensorSpec]:
    """A NextN/MTP layer's tensors (``il`` >= ``spec.n_trunk``, llama.cpp's loader): a block
    like the trunk's, the projection of [normed embedding, normed hidden state] back to the
    width and its two norms; optionally its own head norm, embeddings and head (sized by
    ``vocab`` where known; llama.cpp falls back on the model's)."""
    return [*_block_tensors(spec, il), *nextn_head_tensors(spec, il, vocab)]


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    if il >= spec.n_trunk:
        return nextn_tensors(spec, il)
    return _block_tensors(spec, il)


def _block_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    """A layer's block, trunk or NextN: MLA, the FFN's norm, its dense FFN or its experts."""
    m, w, h = _mla(spec), spec.width, spec.n_head
    out = [tensor(T.ATTN_NORM, il, (w,), "vector")]
    if m.q_lora_rank:
        out += [
            tensor(T.ATTN_Q_A_NORM, il, (m.q_lora_rank,), "vector"),
            tensor(T.ATTN_Q_A, il, (w, m.q_lora_rank), "matrix"),
            tensor(T.ATTN_Q_B, il, (m.q_lora_rank, h * m.k_head_dim), "matrix"),
        ]
    else:
        out.append(tensor(T.ATTN_Q, il, (w, h * m.k_head_dim), "matrix"))
    out += [
        tensor(T.ATTN_KV_A_NORM, il, (m.kv_lora_rank,), "vector"),
        tensor(T.ATTN_KV_A_MQA, il, (w, m.kv_lora_rank + m.rope_dim), "matrix"),
        tensor(T.ATTN_K_B, il, (m.nope_dim, m.kv_lora_rank, h), "matrix"),
        tensor(T.ATTN_V_B, il, (m.kv_lora_rank, m.v_head_dim, h), "matrix"),
        tensor(T.ATTN_OUT, il, (h * m.v_head_dim, w), "matrix"),
        tensor(T.FFN_NORM, il, (w,), "vector"),
    ]
    if il in spec.dense_layers:
        ff = spec.n_ff
        return [
            *out,
            tensor(T.FFN_GATE, il, (w, ff), "matrix"),
            tensor(T.FFN_UP, il, (w, ff), "matrix"),
            tensor(T.FFN_DOWN, il, (ff, w), "matrix"),
        ]
    ff, e, sh = spec.n_ff_exp, spec.n_expert, spec.n_ff_shexp
    out += [
        tensor(T.FFN_GATE_INP, il, (w, e), "matrix"),
        tensor(T.FFN_EXP_PROBS_B, il, (e,), "vector", required=False, suffix="bias"),
        tensor(T.FFN_GATE_EXP, il, (w, ff, e), "matrix"),
        tensor(T.FFN_UP_EXP, il, (w, ff, e), "matrix"),
        tensor(T.FFN_DOWN_EXP, il, (ff, w, e), "matrix"),
    ]
    if sh:
        out += [
            tensor(T.FFN_GATE_SHEXP, il, (w, sh), "matrix"),
            tensor(T.FFN_UP_SHEXP, il, (w, sh), "matrix"),
            tensor(T.FFN_DOWN_SHEXP, il, (sh, w), "matrix"),
        ]
    return out


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    spec = b.spec
    m = _mla(spec)
    q_proj = (w[T.ATTN_Q_A], w[T.ATTN_Q_A_NORM], w[T.ATTN_Q_B]) if m.q_lora_rank else w[T.ATTN_Q]
    a = b.mla_attention(
        il,
        b.norm(x, w[T.ATTN_NORM]),
        q_proj,
        w[T.ATTN_KV_A_MQA],
        w[T.ATTN_KV_A_NORM],
        w[T.ATTN_K_B],
        w[T.ATTN_V_B],
    )
    o = b.linear(w[T.ATTN_OUT], a)
    o, x = b.last_rows(il, o, x)
    x = b.add(o, x)
    h = b.norm(x, w[T.FFN_NORM])
    if il in spec.dense_layers:
        return b.add(b.ffn(h, w[T.FFN_GATE], w[T.FFN_UP], w[T.FFN_DOWN], "silu"), x)
    f = routed_experts(b, w, h)
    if spec.n_ff_shexp:
        f = b.add(f, b.ffn(h, w[T.FFN_GATE_SHEXP], w[T.FFN_UP_SHEXP], w[T.FFN_DOWN_SHEXP], "silu"))
    return b.add(f, x)


FAMILY = Family(
    ARCH,
    read,
    layer_tensors,
    build_layer,
    moe=True,
    numpy_reference=False,
    nextn_tensors=nextn_tensors,
)
