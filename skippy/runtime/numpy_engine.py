"""The numpy reference engine: the same stage math in plain f32 numpy, as an oracle.

Independent of ggml on purpose: weights are dequantized with gguf-py (``gguf.quants``, the
reference llama.cpp's own Python tools use), activations stay f32 (no Q8 rounding before
matmuls), the KV cache is f32, RoPE angles are computed in float64, and every sublayer is a
few lines of numpy. It shares with the ggml engine only what defines the model
(``ModelSpec``, read by the model's family, and the checked weights: a layer's optional
tensors, such as biases and extra norms, apply where the family's plan put them) and the stage
API (``StageBase``). A MoE layer (``ModelSpec.n_expert``) runs its experts token by token.
Slow (every weight dequantized at load: gemma3-270m needs ~1.75 GB) and meant for tests and
``run --engine numpy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from gguf import MODEL_TENSOR

from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.families import family_of
from skippy.runtime.families.base import T
from skippy.runtime.model import attention_mask, tensor_name
from skippy.runtime.stage import STAGE_API_VERSION, StageBase
from skippy.runtime.weights import StageWeights, WeightRef

RUNTIME_VERSION: Final = f"skippy-stage/{STAGE_API_VERSION} numpy-reference"
F32 = np.float32
Array = npt.NDArray[np.float32]


def dequantize(weights: StageWeights, ref: WeightRef) -> Array:
    """One tensor as f32 in numpy order (``(ne1, ne0)`` for a matrix)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    raw = weights.raw(ref.name)
    rows = int(np.prod(ref.np_shape[:-1], dtype=np.int64)) if len(ref.shape) > 1 else 1
    values = gguf_dequantize(raw.reshape(rows, -1), GGMLQuantizationType(ref.ggml_type))
    return np.ascontiguousarray(values, dtype=F32).reshape(ref.np_shape)


# --- the sublayers (shapes in comments: n tokens, h heads, d head dim) --------------------------
def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """Normalize over the last axis, then scale (weights already hold gemma's +1)."""
    ms = np.mean(np.square(x, dtype=F32), axis=-1, keepdims=True, dtype=F32)
    return (x / np.sqrt(ms + F32(eps))).astype(F32) * weight


def rope(
    x: Array,  # (n, h, d)
    positions: npt.NDArray[np.int64],  # (n,)
    *,
    base: float,
    scale: float,
    style: str,
    freq_factors: Array | None,
) -> Array:
    """Rotate pairs by position * base^(-2i/d) * scale (/ factor_i): pairs (2i, 2i+1) for the
    "normal" style (llama's converted weights), (i, i + d/2) for "neox"."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # (d/2,)
    if freq_factors is not None:
        inv = inv / freq_factors.astype(np.float64)
    theta = positions.astype(np.float64)[:, None] * inv[None, :] * scale  # (n, d/2)
    cos = np.cos(theta).astype(F32)[:, None, :]
    sin = np.sin(theta).astype(F32)[:, None, :]
    if style == "normal":
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out
    half = d // 2
    x0, x1 = x[..., :half], x[..., half:]
    return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)


def _plus(x: Array, bias: Array | None) -> Array:
    return x + bias if bias is not None else x


def softmax(z: Array) -> Array:
    z = z - np.max(z, axis=-1, keepdims=True)
    e = np.exp(z)
    out: Array = e / np.sum(e, axis=-1, keepdims=True)
    return out


def gelu_tanh(x: Array) -> Array:
    c = F32(np.sqrt(2.0 / np.pi))
    inner = c * (x + F32(0.044715) * x * x * x)
    return (F32(0.5) * x * (F32(1.0) + np.tanh(inner))).astype(F32)


def silu(x: Array) -> Array:
    return (x / (F32(1.0) + np.exp(-x))).astype(F32)


def attention(
    q: Array,  # (n, h, d), already scaled if the model scales q
    keys: Array,  # (n_kv, h_kv, d)
    values: Array,  # (n_kv, h_kv, d)
    mask: Array,  # (n, n_kv) additive
    scale: float,
    softcap: float | None = None,
) -> Array:
    """Grouped-query attention: query head i reads KV head i // (h / h_kv); with
    ``softcap`` the raw scores become tanh(s / cap) * cap first."""
    group = q.shape[1] // keys.shape[1]
    k = np.repeat(keys, group, axis=1)  # (n_kv, h, d)
    v = np.repeat(values, group, axis=1)
    raw = np.einsum("qhd,khd->hqk", q, k, dtype=F32)
    if softcap:
        raw = np.tanh(raw / F32(softcap)) * F32(softcap)
    scores = raw * F32(scale) + mask[None]
    probs = softmax(scores.astype(F32))  # (h, n, n_kv)
    out: Array = np.einsum("hqk,khd->qhd", probs, v, dtype=F32)  # (n, h, d)
    return out


def moe_ffn(
    h: Array,  # (n, width)
    router: Array,  # (n_expert, width)
    gate: Array,  # (n_expert, ff, width)
    up: Array,  # (n_expert, ff, width)
    down: Array,  # (n_expert, width, ff)
    n_used: int,
    normalise: bool = True,
) -> Array:
    """Softmax gating, each token's ``n_used`` most probable experts, their probabilities
    (normalised to sum 1 when ``normalise``: qwen3moe, Mixtral) the weights of the sum of
    their SiLU-gated FFNs."""
    probs = softmax((h @ router.T).astype(F32))  # (n, n_expert)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        picked = np.argsort(-probs[t], kind="stable")[:n_used]
        weights = probs[t, picked]
        if normalise:
            weights = weights / max(weights.sum(), F32(6.103515625e-5))
        for e, wt in zip(picked, weights, strict=True):
            a = silu(gate[e] @ h[t]) * (up[e] @ h[t])  # (ff,)
            out[t] += F32(wt) * (down[e] @ a)
    return out


@dataclass
class _NpKv:
    k: dict[int, Array]  # layer -> (n_ctx, h_kv, d)
    v: dict[int, Array]


class NumpyStage(StageBase[_NpKv]):
    """A stage computed in f32 numpy (see the module doc)."""

    engine = "numpy"
    runtime_version = RUNTIME_VERSION

    def _setup(self) -> None:
        spec = self.spec
        if not family_of(spec.arch).numpy_reference:
            raise StageUnsupported(
                f"{spec.arch} is not implemented by the numpy engine (its layers use ops the "
                "numpy blocks do not have)",
                code="unsupported_architecture",
                actual=spec.arch,
                remediation="run it with the ggml engine (the default)",
            )
        if spec.yarn is not None or spec.attn_temperature is not None:
            # the numpy rope has no YaRN ramp and the blocks no per-position Q scale
            raise StageUnsupported(
                f"{spec.arch} with YaRN RoPE scaling or an attention temperature is not "
                "implemented by the numpy engine",
                code="unsupported_hyperparameter",
                actual=spec.arch,
                remediation="run it with the ggml engine (the default)",
            )
        w = self._loaded()
        self._w = {r.name: dequantize(w, r) for r in w}

    def _new_session(self) -> _NpKv:
        shape = (self.config.n_ctx, self.spec.n_head_kv, self.spec.head_dim)
        return _NpKv(
            k={il: np.zeros(shape, F32) for il in self.layers},
            v={il: np.zeros(shape, F32) for il in self.layers},
        )

    def _release(self, state: _NpKv) -> None:
        state.k.clear()
        state.v.clear()

    def _close_engine(self) -> None:
        self._w = {}

    def _forward(
        self,
        state: _NpKv,
        start: int,
        inputs: npt.NDArray[Any],
        out_rows: int,
        *,
        rows: int | None = None,
    ) -> Array:
        # rows is always n here (the default _chunk_rows): numpy's f32 sums do not depend on
        # how many rows a chunk has, so it never pads
        spec = self.spec
        x: Array
        if self.layers.owns_input:
            x = self._w[tensor_name(T.TOKEN_EMBD)][inputs].astype(F32)  # (n, width)
            if spec.embed_scale is not None:
                x = x * F32(spec.embed_scale)
        else:
            x = np.asarray(inputs, dtype=F32)
        n = x.shape[0]
        positions = np.arange(start, start + n, dtype=np.int64)
        for il in self.layers:
            if il < spec.n_trunk:  # NextN blocks are a draft head's (ggml engine)
                x = self._block(il, x, positions, state, start)
        if not self.layers.owns_output:
            return x
        if out_rows == 0:
            return np.empty((0, self.vocab or 0), dtype=F32)
        h = rms_norm(x[n - out_rows :], self._w[tensor_name(T.OUTPUT_NORM)], spec.rms_eps)
        h = _plus(h, self._w.get(tensor_name(T.OUTPUT_NORM, None, "bias")))
        untied = tensor_name(T.OUTPUT)
        head = self._w[untied if untied in self._w else tensor_name(T.TOKEN_EMBD)]
        logits: Array = _plus(h @ head.T, self._w.get(tensor_name(T.OUTPUT, None, "bias")))
        logits = logits.astype(F32)  # (rows, vocab)
        if spec.logit_scale is not None:
            logits = logits * F32(spec.logit_scale)
        if spec.final_logit_softcap:
            cap = F32(spec.final_logit_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits

    def _block(
        self, il: int, x: Array, positions: npt.NDArray[np.int64], kv: _NpKv, start: int
    ) -> Array:
        spec, w = self.spec, self._w
        n, hd = x.shape[0], spec.head_dim

        def name(t: MODEL_TENSOR, suffix: str = "weight") -> str:
            return tensor_name(t, il, suffix)

        def linear(t: MODEL_TENSOR, h: Array) -> Array:
            y: Array = h @ w[name(t)].T
            bias = w.get(name(t, "bias"))
            return y + bias if bias is not None else y

        def norm_if_any(t: MODEL_TENSOR, h: Array) -> Array:
            weight = w.get(name(t))
            return h if weight is None else rms_norm(h, weight, spec.rms_eps)

        def residual(branch: Array) -> Array:  # granite scales each branch before its add
            rs = spec.residual_scale
            return branch * F32(rs) if rs is not None else branch

        def heads(t: MODEL_TENSOR, proj: Array, n_heads: int) -> Array:
            # a Q/K norm over one head (gemma3, qwen3) or over the whole projection (olmo2)
            weight = w.get(name(t))
            if weight is not None and weight.shape[-1] != hd:
                proj = rms_norm(proj, weight, spec.rms_eps)
                return proj.reshape(n, n_heads, hd)
            return norm_if_any(t, proj.reshape(n, n_heads, hd))

        # attention: (n, width) -> (n, width); olmo2 has no norm before it, phimoe's has a bias
        h = _plus(norm_if_any(T.ATTN_NORM, x), w.get(name(T.ATTN_NORM, "bias")))
        if name(T.ATTN_QKV) in w:  # one fused projection: Q, K, V side by side
            qp, kp, vp = np.split(linear(T.ATTN_QKV, h), [spec.q_dim, spec.q_dim + spec.kv_dim], 1)
        else:
            qp, kp, vp = linear(T.ATTN_Q, h), linear(T.ATTN_K, h), linear(T.ATTN_V, h)
        q = heads(T.ATTN_Q_NORM, qp, spec.n_head)
        k = heads(T.ATTN_K_NORM, kp, spec.n_head_kv)
        v = vp.reshape(n, spec.n_head_kv, hd)
        rope_args: dict[str, Any] = {
            "base": spec.rope_base_for(il),
            "scale": spec.rope_scale_for(il),
            "style": spec.rope_style,
            "freq_factors": w.get(tensor_name(T.ROPE_FREQS)),
        }
        if spec.uses_rope(il):
            q = rope(q, positions, **rope_args)
            k = rope(k, positions, **rope_args)
        scale = spec.attn_scale
        if spec.scale_q_before_attention:
            q, scale = q * F32(spec.attn_scale), 1.0
        kv.k[il][start : start + n] = k
        kv.v[il][start : start + n] = v
        n_kv = start + n
        window = spec.sliding_window if spec.is_swa(il) else None
        mask = attention_mask(start, n, window, swa_type=spec.swa_type)
        o = attention(q, kv.k[il][:n_kv], kv.v[il][:n_kv], mask, scale, spec.attn_softcap)
        o = norm_if_any(T.ATTN_POST_NORM, linear(T.ATTN_OUT, o.reshape(n, spec.q_dim)))
        x = x + residual(o)
        # feed-forward: (n, width) -> (n, width)
        h = _plus(norm_if_any(T.FFN_NORM, x), w.get(name(T.FFN_NORM, "bias")))
        if spec.n_expert:
            exps = (w[name(T.FFN_GATE_EXP)], w[name(T.FFN_UP_EXP)], w[name(T.FFN_DOWN_EXP)])
            router = w[name(T.FFN_GATE_INP)]
            f = moe_ffn(h, router, *exps, spec.n_expert_used, spec.expert_weights_norm)
            if spec.n_ff_shexp:  # the shared expert, behind its own sigmoid gate (qwen2moe)
                z = h @ w[name(T.FFN_GATE_INP_SHEXP)]  # (n,)
                a = silu(h @ w[name(T.FFN_GATE_SHEXP)].T) * (h @ w[name(T.FFN_UP_SHEXP)].T)
                shared = (a @ w[name(T.FFN_DOWN_SHEXP)].T) / (1 + np.exp(-z))[:, None]
                f = f + shared.astype(F32)
        else:
            up = h @ w[name(T.FFN_UP)].T
            if name(T.FFN_GATE) in w:
                gate = h @ w[name(T.FFN_GATE)].T
            else:  # one fused projection: the gate's rows, then the up's
                gate, up = np.split(up, 2, axis=1)
            act = gelu_tanh(gate) if spec.activation == "gelu_tanh" else silu(gate)
            f = norm_if_any(T.FFN_POST_NORM, (act * up) @ w[name(T.FFN_DOWN)].T)
        out: Array = (x + residual(f)).astype(F32)
        return out


__all__ = ["NumpyStage", "attention", "dequantize", "moe_ffn", "rope"]
