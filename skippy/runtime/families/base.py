"""What every family module is made of: tensor plan entries named from gguf-py, the metadata
readers, and the ``Family`` value the registry hands out (pure: no ggml, no files).

A family module (``llama.py``, ``gemma3.py``...) reads its hyperparameters once from the GGUF
KV into the family-independent ``ModelSpec`` (bounds-checked, coded errors), says which
tensors a layer holds (names from gguf-py's ``MODEL_TENSOR``/``TENSOR_NAMES``, never spelled
by hand), and composes one layer's graph from the helpers of ``skippy.runtime.graph``. The
readers below are the keys most families share (llama.cpp's ``load_hparams`` reads the same
``{arch}.*`` keys for all of them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import MODEL_TENSOR

from skippy.errors import ModelError
from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.graph import ExpertBiases, GraphBuilder, LayerWeights
from skippy.runtime.model import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_FF,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_WIDTH,
    Kind,
    ModelSpec,
    TensorSpec,
    Yarn,
    tensor_name,
)

T = MODEL_TENSOR
ATTN_SOFTCAP = 50.0  # llama.cpp's default attention logit soft-cap (f_attn_logit_softcapping)


def tensor(
    t: MODEL_TENSOR,
    layer: int | None,
    shape: tuple[int, ...],
    kind: Kind,
    required: bool = True,
    suffix: str = "weight",
) -> TensorSpec:
    return TensorSpec(tensor_name(t, layer, suffix), shape, kind, required)


def attention_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    """The attention block every family here has: its norm, Q/K/V and the output projection."""
    w, q, kv = spec.width, spec.q_dim, spec.kv_dim
    return [
        tensor(T.ATTN_NORM, il, (w,), "vector"),
        tensor(T.ATTN_Q, il, (w, q), "matrix"),
        tensor(T.ATTN_K, il, (w, kv), "matrix"),
        tensor(T.ATTN_V, il, (w, kv), "matrix"),
        tensor(T.ATTN_OUT, il, (q, w), "matrix"),
    ]


def qkv_bias_tensors(spec: ModelSpec, il: int, *, required: bool) -> list[TensorSpec]:
    q, kv = spec.q_dim, spec.kv_dim
    return [
        tensor(T.ATTN_Q, il, (q,), "vector", required, "bias"),
        tensor(T.ATTN_K, il, (kv,), "vector", required, "bias"),
        tensor(T.ATTN_V, il, (kv,), "vector", required, "bias"),
    ]


def qk_norm_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    hd = spec.head_dim
    return [tensor(T.ATTN_Q_NORM, il, (hd,), "vector"), tensor(T.ATTN_K_NORM, il, (hd,), "vector")]


def dense_ffn_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    """The gated feed-forward block: its norm, gate, up and down."""
    w, ff = spec.width, spec.n_ff
    return [
        tensor(T.FFN_NORM, il, (w,), "vector"),
        tensor(T.FFN_GATE, il, (w, ff), "matrix"),
        tensor(T.FFN_UP, il, (w, ff), "matrix"),
        tensor(T.FFN_DOWN, il, (ff, w), "matrix"),
    ]


def expert_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    """A mixture-of-experts layer's router and its stacked experts' gate, up and down."""
    w, ff, e = spec.width, spec.n_ff_exp, spec.n_expert
    return [
        tensor(T.FFN_GATE_INP, il, (w, e), "matrix"),
        tensor(T.FFN_GATE_EXP, il, (w, ff, e), "matrix"),
        tensor(T.FFN_UP_EXP, il, (w, ff, e), "matrix"),
        tensor(T.FFN_DOWN_EXP, il, (ff, w, e), "matrix"),
    ]


def nextn_head_tensors(spec: ModelSpec, il: int, vocab: int | None) -> list[TensorSpec]:
    """The NextN tensors of block ``il`` besides its layer's: the three llama.cpp requires
    (``eh_proj``, ``enorm``, ``hnorm``), and the optional head norm and (sized by ``vocab``,
    where known) own embeddings and head (else the model's are used)."""
    w = spec.width
    out = [
        tensor(T.NEXTN_EH_PROJ, il, (2 * w, w), "matrix"),
        tensor(T.NEXTN_ENORM, il, (w,), "vector"),
        tensor(T.NEXTN_HNORM, il, (w,), "vector"),
        tensor(T.NEXTN_SHARED_HEAD_NORM, il, (w,), "vector", required=False),
    ]
    if vocab is not None:
        out += [
            tensor(T.NEXTN_EMBED_TOKENS, il, (w, vocab), "matrix", required=False),
            tensor(T.NEXTN_SHARED_HEAD_HEAD, il, (w, vocab), "matrix", required=False),
        ]
    return out


def routed_experts(b: GraphBuilder, w: LayerWeights, h: int) -> int:
    """The routed experts over ``h`` as the spec's routing says (deepseek2's and glm4moe's:
    the gating function, the selection bias ``exp_probs_b`` where the layer has one, the
    weights' normalisation and scale, the expert groups), before any shared expert."""
    spec = b.spec
    return b.moe_ffn(
        h,
        w[T.FFN_GATE_INP],
        w[T.FFN_UP_EXP],
        w[T.FFN_GATE_EXP],
        w[T.FFN_DOWN_EXP],
        n_expert_used=spec.n_expert_used,
        norm_weights=spec.expert_weights_norm,
        gating=spec.expert_gating,
        biases=ExpertBiases(selection=w.get(T.FFN_EXP_PROBS_B, "bias")),
        weight_scale=spec.expert_weights_scale,
        groups=(spec.expert_groups, spec.expert_groups_used),
    )


LayerTensors = Callable[[ModelSpec, int], list[TensorSpec]]
# (spec, il, vocab) -> a NextN/MTP layer's tensors (vocab-sized ones where vocab is known)
NextnTensors = Callable[[ModelSpec, int, int | None], list[TensorSpec]]
ModelTensors = Callable[[ModelSpec], list[TensorSpec]]
BuildLayer = Callable[[GraphBuilder, LayerWeights, int, int], int]  # (b, w, il, x) -> x


def no_model_tensors(spec: ModelSpec) -> list[TensorSpec]:
    return []


@dataclass(frozen=True)
class Family:
    """One model family: llama.cpp's architecture name, its metadata reader, its tensor plan
    (per layer, plus model-wide tensors besides embeddings, output norm and head) and its
    layer builder."""

    arch: str
    read: Callable[[Mapping[str, Any]], ModelSpec]
    layer_tensors: LayerTensors
    build_layer: BuildLayer
    model_tensors: ModelTensors = no_model_tensors
    moe: bool = False  # its layers route tokens to experts
    output_biases: bool = False  # output_norm.bias and output.bias (phimoe)
    # its layers route tokens to experts when the file has them (expert_count > 0), else run
    # the dense FFN: llama, whose builder takes Mixtral's experts
    moe_optional: bool = False
    # the numpy reference engine computes its layers (False: it refuses the family, with a
    # code, rather than compute it wrongly)
    numpy_reference: bool = True
    # the tensors of its NextN/MTP layers after the trunk (None: the family has none); the
    # trunk never runs them, the final stage holds them for native MTP drafting
    nextn_tensors: NextnTensors | None = None

    @property
    def may_have_experts(self) -> bool:
        return self.moe or self.moe_optional


# --- reading the metadata ---------------------------------------------------------------------
def bad(message: str, key: str | None = None) -> ModelError:
    return ModelError(message, code="invalid_hyperparameters", actual=key)


def read_int(kv: Mapping[str, Any], key: str, lo: int, hi: int, default: int | None = None) -> int:
    value = kv.get(key, default)
    if value is None:
        raise ModelError(
            f"the model metadata has no {key}", code="missing_hyperparameter", actual=key
        )
    if isinstance(value, bool) or not isinstance(value, int):
        # e.g. a per-layer array of head counts: a shape this runtime does not run
        raise StageUnsupported(
            f"{key} is {type(value).__name__} {str(value)[:40]}; the stage runtime needs one "
            "integer",
            code="unsupported_hyperparameter",
            actual=key,
        )
    if not lo <= value <= hi:
        raise bad(f"{key} = {value} is outside {lo}..{hi}", key)
    return value


def read_float(kv: Mapping[str, Any], key: str, default: float | None = None) -> float:
    value = kv.get(key, default)
    if value is None:
        raise ModelError(
            f"the model metadata has no {key}", code="missing_hyperparameter", actual=key
        )
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(f"{key} = {value!r} is not a finite number", key)
    return float(value)


def read_yarn(
    kv: Mapping[str, Any],
    arch: str,
    n_ctx_train: int,
    *,
    tuning_keys: bool = True,
    mscale_all_dims: float | None = None,
) -> tuple[float, Yarn]:
    """YaRN scaling from the file: ``freq_scale`` and ggml's parameters, ``attn_factor``
    computed in f32 as llama.cpp's context does (its mscale, then the cancelling factor).
    Without ``tuning_keys`` the file's ``yarn_beta_fast``, ``yarn_beta_slow`` and
    ``yarn_log_multiplier`` are ignored for llama.cpp's defaults, as the loaders of families
    that do not read them (gpt-oss) do. ``mscale_all_dims``: the log multiplier a family's
    loader read itself (deepseek2's), which llama.cpp's context also takes as YaRN's mscale
    for deepseek2: the two cancel wherever it is not 0."""
    a, f32 = f"{arch}.", np.float32

    def tuned(key: str, default: float) -> float:
        return read_float(kv, a + key, default) if tuning_keys else default

    for key in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor"):
        if a + key in kv:
            raise StageUnsupported(
                f"{a}{key} is not implemented by the stage runtime",
                code="unsupported_rope_scaling",
                actual=a + key,
                remediation="run this model with --engine llama",
            )
    ropescale = read_float(kv, a + "rope.scaling.factor")
    if ropescale <= 0:
        raise bad(f"{a}rope.scaling.factor must be positive", a + "rope.scaling.factor")
    freq_scale = f32(1.0) / f32(ropescale)
    factor = f32(1.0) / freq_scale

    def mscale(m: float) -> np.float32:
        if factor <= 1:
            return f32(1.0)
        return f32(f32(0.1) * f32(m) * np.log(factor) + f32(1.0))

    if mscale_all_dims is not None:
        log_mul = mscale_all_dims
        attn = mscale(log_mul) / mscale(log_mul) if log_mul != 0.0 else mscale(1.0)
    else:
        log_mul = tuned("rope.scaling.yarn_log_multiplier", 0.0)
        attn = mscale(1.0) / mscale(log_mul) if log_mul != 0.0 else mscale(1.0)
    attn = f32(attn * (f32(1.0) / (f32(1.0) + f32(0.1) * np.log(factor))))
    attn = f32(attn * f32(read_float(kv, a + "rope.scaling.attn_factor", 1.0)))
    yarn = Yarn(
        ext_factor=1.0,
        attn_factor=float(attn),
        beta_fast=tuned("rope.scaling.yarn_beta_fast", 32.0),
        beta_slow=tuned("rope.scaling.yarn_beta_slow", 1.0),
        n_ctx_orig=read_int(
            kv, a + "rope.scaling.original_context_length", 1, MAX_CONTEXT, default=n_ctx_train
        ),
    )
    return float(freq_scale), yarn


def rope_scale_train(kv: Mapping[str, Any], arch: str) -> float:
    """llama.cpp's ``rope_freq_scale_train``: 1 / ``rope.scaling.factor`` (or, when the file
    has no such key, its older spelling ``rope.scale_linear``; absent or 0: unscaled),
    computed in f32, whatever the scaling type says. The sliding layers of gpt-oss and Llama 4
    rotate with it; the other layers with the context's (``_rope_scale``)."""
    key = f"{arch}.rope.scaling.factor"
    if key not in kv:
        key = f"{arch}.rope.scale_linear"
    factor = read_float(kv, key, 0.0)
    if factor == 0.0:
        return 1.0
    if factor < 0:
        raise bad(f"{key} must be positive", key)
    return float(np.float32(1.0) / np.float32(factor))


def _rope_scale(kv: Mapping[str, Any], arch: str, *, yarn: bool = False) -> float:
    """The RoPE frequency scale as llama.cpp's loader and context derive it: a file without
    ``rope.scaling.type`` is linear, scaled by the training scale (``rope_scale_train``);
    ``none`` never scales, whatever factor the file has."""
    kind = kv.get(f"{arch}.rope.scaling.type", "linear")  # llama.cpp's default
    if kind == "yarn" and yarn:
        return 1.0  # read_decoder reads YaRN's own scale
    if kind == "none":
        return 1.0
    if kind == "linear":
        return rope_scale_train(kv, arch)
    raise StageUnsupported(
        f"RoPE scaling {kind!r} is not implemented by the stage runtime for {arch} (only "
        f"none and linear{', and yarn' if yarn else ''})",
        code="unsupported_rope_scaling",
        actual=str(kind),
        remediation="run this model with --engine llama",
    )


def read_swa_layers(kv: Mapping[str, Any], arch: str, n_layer: int, period: int) -> frozenset[int]:
    """The sliding-window layers: the file's pattern key when present (an int period N:
    layer i slides unless i % N == N - 1; or one bool per layer), else the family's default
    ``period`` (llama.cpp's ``load_swa_pattern``)."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = kv.get(key, period)
    if isinstance(pattern, list):
        if len(pattern) != n_layer or not all(isinstance(p, bool) for p in pattern):
            raise bad(f"{key} must hold one bool per layer ({n_layer})", key)
        return frozenset(i for i, p in enumerate(pattern) if p)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or not 1 <= pattern <= MAX_LAYERS:
        raise bad(f"{key} = {pattern!r} is not a period in 1..{MAX_LAYERS}", key)
    return frozenset(i for i in range(n_layer) if i % pattern < pattern - 1)


def read_decoder(
    kv: Mapping[str, Any],
    arch: str,
    *,
    dense_ffn: bool = True,
    attn_softcap: bool = False,
    yarn: bool = False,
    yarn_tuning_keys: bool = True,
    partial_rope: bool = False,
    yarn_mscale_all_dims: float | None = None,
    latent_attention: bool = False,
) -> dict[str, Any]:
    """The hyperparameters of a decoder-only transformer every family here shares, as
    ``ModelSpec`` keyword arguments (a family adds or overrides its own). Without
    ``dense_ffn`` (a MoE family) the dense FFN width may be absent (0). A family whose
    attention soft-caps its scores (``attn_softcap``) gets the file's cap, and one that
    implements YaRN (``yarn``) its parameters (else both are refused; ``yarn_tuning_keys``:
    ``read_yarn``'s, as ``yarn_mscale_all_dims``). A family whose RoPE may rotate only the
    first ``rope.dimension_count`` dims of the head (``partial_rope``) gets them as ``n_rot``;
    one with latent attention (``latent_attention``, deepseek2's MLA) checks its own head
    dimensions (its RoPE dims are ``n_rot`` too)."""
    a = f"{arch}."
    n_layer = read_int(kv, a + "block_count", 1, MAX_LAYERS)
    width = read_int(kv, a + "embedding_length", 1, MAX_WIDTH)
    n_head = read_int(kv, a + "attention.head_count", 1, MAX_HEADS)
    n_head_kv = read_int(kv, a + "attention.head_count_kv", 1, n_head, default=n_head)
    if n_head % n_head_kv:
        raise bad(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}", arch)
    default_hd = width // n_head if width % n_head == 0 else None
    head_dim = read_int(kv, a + "attention.key_length", 2, MAX_HEAD_DIM, default=default_hd)
    v_dim = read_int(kv, a + "attention.value_length", 2, MAX_HEAD_DIM, default=head_dim)
    rope_dims = read_int(kv, a + "rope.dimension_count", 2, MAX_HEAD_DIM, default=head_dim)
    extra: dict[str, Any] = {}
    rope_ok = rope_dims == head_dim or (partial_rope and rope_dims < head_dim)
    bad_dims = v_dim != head_dim or not rope_ok or head_dim % 2 or rope_dims % 2
    if bad_dims and not latent_attention:
        whole = "rotated whole" if not partial_rope else "rotated over an even part"
        raise StageUnsupported(
            f"head dims k={head_dim} v={v_dim} rope={rope_dims}: the stage runtime needs one "
            f"even head dimension, {whole}",
            code="unsupported_hyperparameter",
            actual=arch,
        )
    if rope_dims != head_dim:
        extra["n_rot"] = rope_dims
    eps = read_float(kv, a + "attention.layer_norm_rms_epsilon")
    if not 0 < eps < 1:
        raise bad(f"rms epsilon {eps} is outside (0, 1)", arch)
    context_length = read_int(kv, a + "context_length", 1, MAX_CONTEXT, default=MAX_CONTEXT)
    rope_base = read_float(kv, a + "rope.freq_base", 10000.0)
    if rope_base <= 0:
        raise bad("rope.freq_base must be positive", arch)
    rope_scale = _rope_scale(kv, arch, yarn=yarn)
    if yarn and kv.get(a + "rope.scaling.type") == "yarn":
        rope_scale, extra["yarn"] = read_yarn(
            kv,
            arch,
            context_length,
            tuning_keys=yarn_tuning_keys,
            mscale_all_dims=yarn_mscale_all_dims,
        )
    softcap = kv.get(a + "final_logit_softcapping")
    softcap_value = read_float(kv, a + "final_logit_softcapping") if softcap else None
    if attn_softcap:
        extra["attn_softcap"] = read_float(kv, a + "attn_logit_softcapping", ATTN_SOFTCAP)
        if extra["attn_softcap"] <= 0:
            raise bad(f"{a}attn_logit_softcapping must be positive", arch)
    elif kv.get(a + "attn_logit_softcapping"):
        raise StageUnsupported(
            "attention logit soft-capping is not implemented by the stage runtime",
            code="unsupported_hyperparameter",
            actual=arch,
        )
    return {
        "arch": arch,
        "n_layer": n_layer,
        "width": width,
        "n_head": n_head,
        "n_head_kv": n_head_kv,
        "head_dim": head_dim,
        "n_ff": read_int(kv, a + "feed_forward_length", 1, MAX_FF)
        if dense_ffn
        else read_int(kv, a + "feed_forward_length", 0, MAX_FF, default=0),
        "rms_eps": eps,
        "context_length": context_length,
        "rope_style": "neox",
        "rope_base": rope_base,
        "rope_base_swa": rope_base,
        "rope_scale": rope_scale,
        "sliding_window": None,
        "swa_layers": frozenset(),
        "attn_scale": 1.0 / math.sqrt(head_dim),  # llama.cpp's default kq_scale
        "scale_q_before_attention": False,
        "embed_scale": None,
        "activation": "silu",
        "final_logit_softcap": softcap_value,
        # llama.cpp reads the key for every architecture: its trunk is n_layer - n_layer_nextn
        "n_layer_nextn": read_nextn(kv, arch, n_layer),
        **extra,
    }


def read_nextn(kv: Mapping[str, Any], arch: str, n_layer: int) -> int:
    """How many of the ``n_layer`` layers are NextN (multi-token prediction) blocks, the
    last ones (``{arch}.nextn_predict_layers``, llama.cpp's ``n_layer_nextn``; 0 without the
    key). The draft head runs the first (``skippy.runtime.nextn``)."""
    return read_int(kv, f"{arch}.nextn_predict_layers", 0, n_layer - 1, default=0)


def read_experts(
    kv: Mapping[str, Any], arch: str, n_ff: int, *, own_width: bool
) -> dict[str, int]:
    """The experts' hyperparameters as ``ModelSpec`` keyword arguments, checked before
    anything reaches ggml (llama.cpp asserts on a file without experts, without experts used
    or using more than it has). Each expert is ``expert_feed_forward_length`` wide when
    ``own_width`` (default ``n_ff / expert_used_count``, as llama.cpp), else ``n_ff`` (the
    dense FFN width is the experts': llama's Mixtral, olmoe)."""
    a = f"{arch}."
    n_expert = read_int(kv, a + "expert_count", 1, MAX_EXPERTS)
    n_used = kv.get(a + "expert_used_count")
    if isinstance(n_used, int) and not isinstance(n_used, bool) and n_used > n_expert:
        raise bad(
            f"{a}expert_used_count = {n_used} is more than {a}expert_count = {n_expert}: a "
            "token cannot use more experts than the layer has (is the metadata corrupt?)",
            a + "expert_used_count",
        )
    n_used = read_int(kv, a + "expert_used_count", 1, n_expert)
    if own_width:
        default_ff = n_ff // n_used if n_ff >= n_used else None
        n_ff_exp = read_int(kv, a + "expert_feed_forward_length", 1, MAX_FF, default=default_ff)
    else:
        n_ff_exp = n_ff
    return {"n_expert": n_expert, "n_expert_used": n_used, "n_ff_exp": n_ff_exp}
