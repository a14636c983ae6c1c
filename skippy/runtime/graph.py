"""Shared graph helpers: the sublayers every family composes (llama.cpp's ``llama-graph``).

A family's ``build_layer(b, w, il, x)`` is a short composition of these: ``b.norm``,
``b.linear``, ``b.qkv``, ``b.rope``, ``b.attention`` (over the session's KV cache: the engine
plugs in how K/V are written and read for a prefill chunk, a reused decode graph or a batch
of sessions), ``b.last_rows`` (llama.cpp's ``inp_out_ids`` on the final layer), the dense
``b.ffn`` and the MoE ``b.moe_ffn``. One builder serves every graph the engine makes, so a
family is written once. The helpers only add ggml ops to the graph under construction; they
never compute, allocate or read host memory.

Shapes (ggml order, ne0 first): x ``[width, rows]`` for a prefill chunk or a decode step,
``[width, 1, B]`` for a batch of B sessions' decode steps; Q/K ``[head_dim, heads, rows]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from gguf import MODEL_TENSOR

from skippy.gguf import ggml
from skippy.gguf.ggml import (
    GGML_PREC_F32,
    GGML_ROPE_TYPE_NEOX,
    GGML_ROPE_TYPE_NORMAL,
    tensor_struct,
)
from skippy.runtime.model import ExpertGating, ModelSpec, tensor_name

# YaRN parameters that disable YaRN (ggml.h, ggml_rope_ext); llama.cpp passes these values
# when the model has no YaRN scaling.
_EXT_FACTOR, _ATTN_FACTOR, _BETA_FAST, _BETA_SLOW = 0.0, 1.0, 32.0, 1.0
GatedActivation = Literal["silu", "gelu"]
# The experts' gated activation: SiLU, or gpt-oss's clamped SwiGLU (``ggml_swiglu_oai``).
ExpertActivation = Literal["silu", "swiglu_oai"]
# gpt-oss's clamped SwiGLU (gate clamped above and up to [-limit, limit], then
# gate * sigmoid(alpha * gate) * (up + 1)): llama.cpp fixes both in build_moe_ffn
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0
# the least sum of a token's expert weights divided by (F16's smallest normal: llama.cpp)
_MIN_WEIGHT_SUM = 6.103515625e-5


class LayerWeights:
    """One layer's weight tensors (ggml pointers, by name: only the layer's own), looked up
    by gguf-py's tensor kind."""

    def __init__(self, il: int, tensors: Mapping[str, int]) -> None:
        self.il = il
        self._tensors = tensors
        # (kind, suffix) -> tensor or None: a graph build looks each up without formatting
        self._by_kind: dict[tuple[MODEL_TENSOR, str], int | None] = {}

    def __getitem__(self, t: MODEL_TENSOR) -> int:
        found = self.get(t)
        if found is None:
            raise KeyError(tensor_name(t, self.il))
        return found

    def get(self, t: MODEL_TENSOR, suffix: str = "weight") -> int | None:
        key = (t, suffix)
        if key not in self._by_kind:
            self._by_kind[key] = self._tensors.get(tensor_name(t, self.il, suffix))
        return self._by_kind[key]

    def matrices(self) -> list[int]:
        """The layer's weight matrices (rank 2: what a batch's matmuls multiply; not the
        rank-2 expert biases of gpt-oss, which are added, never multiplied)."""
        out = []
        for name, t in self._tensors.items():
            ne = tensor_struct(t).ne
            if ne[1] > 1 and ne[2] == 1 and not name.endswith(".bias"):
                out.append(t)
        return out


@dataclass(frozen=True)
class ExpertBiases:
    """Biases of a MoE block where the model has them: the router's ``[n_expert]``, and each
    expert's gate/up ``[n_ff_exp, n_expert]`` and down ``[n_embd, n_expert]`` (gpt-oss);
    ``selection`` (``exp_probs_b``, deepseek-v3, glm4moe) ``[n_expert]`` is added to the
    gate's probabilities only to choose the experts: the weights stay unbiased."""

    router: int | None = None
    selection: int | None = None
    up: int | None = None
    gate: int | None = None
    down: int | None = None


class Attention(Protocol):
    """Attention of one layer over the session's KV cache: writes this graph's K and V into
    the cache, then returns softmax(K^T Q * scale + mask) V as ``[q_dim, rows]`` (or
    ``[q_dim, 1, B]``), before the output projection. ``sinks`` (F32 ``[n_head]``): one
    extra logit per head in each softmax's denominator that attends to nothing (gpt-oss).
    ``v_mla`` (``[kv_lora_rank, v_head_dim, n_head]``, MLA): the cache holds K only, V is
    its first ``kv_lora_rank`` values (``v`` is not written), and each head's output is
    expanded from the latent by this matrix (``ModelSpec.attn_out_dim`` wide)."""

    def __call__(
        self,
        b: GraphBuilder,
        il: int,
        q: int,
        k: int,
        v: int,
        kq_scale: float,
        sinks: int | None = None,
        v_mla: int | None = None,
    ) -> int: ...


@dataclass
class GraphBuilder:
    """One graph under construction: the context its ops live in, the model, the positions
    input, the engine's matmul (its batch layout) and attention, and how many rows the final
    layer keeps (None: all; the helpers never see the engine's sessions or buffers)."""

    g: ggml.Ggml
    ctx: int
    gf: int
    spec: ModelSpec
    pos: int  # I32 [rows]
    rows: int  # the columns of x (B for a batch)
    mm: Callable[[int, int], int]  # weight @ x
    attend: Attention
    last_layer: int
    keep: int | None = None
    freq_factors: int | None = None
    attn_temp: int | None = None  # F32 [1, 1, rows]: ModelSpec.attn_temperature's factors

    # --- basic ops ----------------------------------------------------------------------------
    def add(self, a: int, b: int) -> int:
        return self.g.ggml_add(self.ctx, a, b)

    def scale(self, a: int, s: float) -> int:
        return self.g.ggml_scale(self.ctx, a, s)

    def norm(self, x: int, weight: int, bias: int | None = None) -> int:
        """RMS norm over ne0, times ``weight``, plus ``bias`` where the model has one
        (llama.cpp's ``build_norm``, LLM_NORM_RMS)."""
        g = self.g
        y = g.ggml_mul(self.ctx, g.ggml_rms_norm(self.ctx, x, self.spec.rms_eps), weight)
        return g.ggml_add(self.ctx, y, bias) if bias is not None else y

    def rms(self, x: int) -> int:
        """RMS norm over ne0 without a weight (llama.cpp's bare ``ggml_rms_norm``: Llama 4's
        "L2 norm" of Q and K)."""
        return self.g.ggml_rms_norm(self.ctx, x, self.spec.rms_eps)

    def linear(self, weight: int, x: int, bias: int | None = None) -> int:
        y = self.mm(weight, x)
        return self.g.ggml_add(self.ctx, y, bias) if bias is not None else y

    def f32_accumulate(self, y: int) -> int:
        """``y``, a matmul's result (or the engine's reshape of one), with the matmul asked
        to accumulate in F32 as llama.cpp asks for GLM's attention output and FFN down (a
        device may otherwise sum in F16; the CPU backend always sums in F32)."""
        if not self.g.ggml_prec_set_acc(y, GGML_PREC_F32):
            src = tensor_struct(y).src[0]
            if src:
                self.g.ggml_prec_set_acc(src, GGML_PREC_F32)
        return y

    # --- attention ----------------------------------------------------------------------------
    def qkv(
        self,
        w: LayerWeights,
        h: int,
        *,
        split_heads: bool = True,
        proj_norms: tuple[int, int] | None = None,
    ) -> tuple[int, int, int]:
        """Q, K ``[head_dim, heads, rows]`` and V ``[kv_dim, rows]`` from the normed input,
        with the biases the layer has; ``proj_norms`` (Q's, K's): RMS norms over the whole
        Q and K projections, before they are split into heads (olmoe). Without
        ``split_heads`` Q and K stay whole projections ``[q_dim, rows]`` / ``[kv_dim, rows]``
        (for a norm over all heads; ``heads`` then splits them)."""
        T = MODEL_TENSOR
        qkv = w.get(T.ATTN_QKV)
        if qkv is not None:
            return self._split_qkv(self.linear(qkv, h, w.get(T.ATTN_QKV, "bias")))
        q = self.linear(w[T.ATTN_Q], h, w.get(T.ATTN_Q, "bias"))
        k = self.linear(w[T.ATTN_K], h, w.get(T.ATTN_K, "bias"))
        v = self.linear(w[T.ATTN_V], h, w.get(T.ATTN_V, "bias"))
        if proj_norms is not None:
            q, k = self.norm(q, proj_norms[0]), self.norm(k, proj_norms[1])
        if split_heads:
            q, k = self.heads(q, self.spec.n_head), self.heads(k, self.spec.n_head_kv)
        return q, k, v

    def heads(self, x: int, n_heads: int) -> int:
        """A whole projection ``[n_heads * head_dim, rows]`` as ``[head_dim, n_heads, rows]``."""
        return self.g.ggml_reshape_3d(self.ctx, x, self.spec.head_dim, n_heads, self.rows)

    def _split_qkv(self, qkv: int) -> tuple[int, int, int]:
        """Q, K and V as views of a fused projection's rows ``[q_dim + 2 kv_dim, rows]``
        (llama.cpp's ``build_qkv`` with ``wqkv``); V made contiguous for the cache writes
        (a copy: the same values)."""
        g, ctx, spec = self.g, self.ctx, self.spec
        hd, q_dim, kv_dim = spec.head_dim, spec.q_dim, spec.kv_dim
        row = 4 * (q_dim + 2 * kv_dim)  # F32 activations
        q = g.ggml_view_3d(ctx, qkv, hd, spec.n_head, self.rows, 4 * hd, row, 0)
        k = g.ggml_view_3d(ctx, qkv, hd, spec.n_head_kv, self.rows, 4 * hd, row, 4 * q_dim)
        v = g.ggml_view_2d(ctx, qkv, kv_dim, self.rows, row, 4 * (q_dim + kv_dim))
        return q, k, g.ggml_cont(ctx, v)

    def rope(self, x: int, il: int) -> int:
        """RoPE at the graph's positions, with the layer's base and scale (sliding layers have
        their own) and the model's frequency factors, in the model's pair style, over the
        first ``ModelSpec.rope_dims`` of each head."""
        spec, yarn = self.spec, self.spec.yarn
        mode = GGML_ROPE_TYPE_NORMAL if spec.rope_style == "normal" else GGML_ROPE_TYPE_NEOX
        return self.g.ggml_rope_ext(
            self.ctx,
            x,
            self.pos,
            self.freq_factors,
            spec.rope_dims,  # the first dims only where the model rotates part of the head
            mode,
            spec.context_length if yarn is None else yarn.n_ctx_orig,
            spec.rope_base_for(il),
            spec.rope_scale_for(il),
            _EXT_FACTOR if yarn is None else yarn.ext_factor,
            _ATTN_FACTOR if yarn is None else yarn.attn_factor,
            _BETA_FAST if yarn is None else yarn.beta_fast,
            _BETA_SLOW if yarn is None else yarn.beta_slow,
        )

    def temperature(self, q: int) -> int:
        """Q ``[head_dim, heads, rows]`` times its position's attention temperature where the
        model has one (the engine's ``attn_temp`` input, ``[1, 1, rows]``)."""
        if self.attn_temp is None:
            return q
        return self.g.ggml_mul(self.ctx, q, self.attn_temp)

    def attention(
        self,
        il: int,
        q: int,
        k: int,
        v: int,
        kq_scale: float,
        *,
        sinks: int | None = None,
        v_mla: int | None = None,
    ) -> int:
        """Attention over the session's cache (the layer's mask: causal, or its sliding
        window), ``[attn_out_dim, rows]``; with the layer's attention ``sinks`` where it has
        them (``ggml_soft_max_add_sinks``, as llama.cpp's ``build_attn_mha``) and MLA's
        ``v_mla`` (``Attention``)."""
        return self.attend(self, il, q, k, v, kq_scale, sinks, v_mla)

    def last_rows(self, il: int, o: int, x: int) -> tuple[int, int]:
        """On the final layer, only the rows whose logits are wanted, taken after the
        attention output projection (llama.cpp's ``inp_out_ids``: the feed-forward's matmuls
        then have as many columns as llama.cpp's, which picks their kernel)."""
        if il != self.last_layer or self.keep is None:
            return o, x
        skip = int(tensor_struct(o).ne[1]) - self.keep
        if skip <= 0:
            return o, x
        g, w, keep = self.g, self.spec.width, self.keep
        o = g.ggml_view_2d(self.ctx, o, w, keep, 4 * w, 4 * w * skip)
        x = g.ggml_view_2d(self.ctx, x, w, keep, 4 * w, 4 * w * skip)
        return o, x

    def final_rows(self, il: int, x: int) -> int:
        """After the final layer, only the rows whose logits are wanted: for builders that
        run the whole last layer over every row and drop the others just before the output
        norm (llama.cpp's gpt-oss), where ``last_rows`` drops them after attention."""
        if il != self.last_layer or self.keep is None:
            return x
        return self.last_rows(il, x, x)[1]

    # --- feed-forward -------------------------------------------------------------------------
    def ffn(
        self,
        x: int,
        gate: int | None,
        up: int,
        down: int,
        act: GatedActivation,
        *,
        f32_down: bool = False,
    ) -> int:
        """A gated feed-forward: down(act(gate x) * up x) (llama.cpp's ``build_ffn`` with
        LLM_FFN_PAR and SILU or GELU); without ``gate``, ``up`` holds the gate's rows then
        the up's, and ``act`` must be SiLU (LLM_FFN_SWIGLU over one fused projection).
        ``f32_down``: the down projection accumulates in F32 (``f32_accumulate``: GLM)."""
        g = self.g
        if gate is None:
            if act != "silu":
                raise ValueError("a fused gate and up projection is SiLU-gated here")
            a = g.ggml_swiglu(self.ctx, self.mm(up, x))
        else:
            a_gate, a_up = self.mm(gate, x), self.mm(up, x)
            if act == "gelu":
                a = g.ggml_geglu_split(self.ctx, a_gate, a_up)
            else:
                a = g.ggml_swiglu_split(self.ctx, a_gate, a_up)
        y = self.mm(down, a)
        return self.f32_accumulate(y) if f32_down else y

    def moe_ffn(
        self,
        x: int,
        gate_inp: int,
        up_exps: int,
        gate_exps: int,
        down_exps: int,
        *,
        n_expert_used: int,
        norm_weights: bool,
        gating: ExpertGating = "softmax",
        biases: ExpertBiases | None = None,
        act: ExpertActivation = "silu",
        weight_scale: float = 1.0,
        groups: tuple[int, int] = (0, 0),
        weight_before_ffn: bool = False,
    ) -> int:
        """A mixture of experts with softmax gating (llama.cpp's ``build_moe_ffn`` as qwen3moe
        calls it: LLM_FFN_SILU, LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX). Each token's router
        probabilities pick its ``n_expert_used`` experts (``ggml_argsort_top_k``: ordered,
        unlike ``ggml_top_k``), their probabilities are the weights (normalised to sum 1 when
        ``norm_weights``), each picked expert's SiLU-gated FFN runs through
        ``ggml_mul_mat_id`` and the weighted outputs are summed in the experts' order. Every
        step is per token, so a token's output does not depend on the others in the batch
        (the router goes through the engine's matmul: per column in a batch). ``gating``,
        ``biases`` (each added where llama.cpp adds it: ``ggml_add_id`` for the experts') and
        ``act`` give gpt-oss's variant (LLM_FFN_SWIGLU_OAI_MOE,
        LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT). ``gating="sigmoid"`` with
        ``biases.selection`` and ``weight_scale`` (``expert_weights_scale``: the weights
        times it after any normalisation, unless it is 0 or 1, as llama.cpp skips it) give
        deepseek-v3's and glm4moe's routing (LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID).
        ``groups`` (n_groups, n_used; deepseek-v3's group-limited routing, when n_groups > 1):
        the experts split into equal groups, each scored by the sum of its two best
        selection probabilities; a token picks its experts only from its ``n_used``
        best-scoring groups (the others masked to -inf before the top-k).
        ``weight_before_ffn`` is Llama 4's routing (llama.cpp ties both to the architecture):
        the experts are picked by the raw router logits, and each picked expert's weight
        multiplies its copy of the input before the expert runs instead of its output
        after."""
        g, ctx = self.g, self.ctx
        ne = tensor_struct(x).ne
        n_embd, n_tokens, batched = int(ne[0]), int(ne[1]) * int(ne[2]), int(ne[2]) > 1
        logits = self.mm(gate_inp, x)  # [n_expert, n_tokens] ([n_expert, 1, B] in a batch)
        n_expert = int(tensor_struct(logits).ne[0])
        if batched:
            logits = g.ggml_reshape_2d(ctx, logits, n_expert, n_tokens)
        bias = biases or ExpertBiases()
        if bias.router is not None:
            logits = g.ggml_add(ctx, logits, bias.router)
        # [n_expert, n_tokens]
        if gating == "softmax":
            probs = g.ggml_soft_max(ctx, logits)
        elif gating == "sigmoid":
            probs = g.ggml_sigmoid(ctx, logits)
        else:
            probs = logits
        # the selection bias chooses the experts; their weights come from the unbiased probs
        choose = probs if bias.selection is None else g.ggml_add(ctx, probs, bias.selection)
        if weight_before_ffn:
            choose = logits  # sigmoid is monotonic, but saturates: ties where logits differ
        if groups[0] > 1 and n_tokens > 0:  # no rows (a final stage wanting no logits)
            choose = self._group_mask(choose, n_expert, n_tokens, *groups)
        selected = g.ggml_argsort_top_k(ctx, choose, n_expert_used)  # [n_used, n_tokens] I32
        probs = g.ggml_reshape_3d(ctx, probs, 1, n_expert, n_tokens)
        weights = g.ggml_get_rows(ctx, probs, selected)  # [1, n_used, n_tokens]
        if gating == "softmax_weight":
            weights = g.ggml_reshape_2d(ctx, weights, n_expert_used, n_tokens)
            weights = g.ggml_soft_max(ctx, weights)  # [n_used, n_tokens]
            weights = g.ggml_reshape_3d(ctx, weights, 1, n_expert_used, n_tokens)
        if norm_weights:
            weights = g.ggml_reshape_2d(ctx, weights, n_expert_used, n_tokens)
            total = g.ggml_sum_rows(ctx, weights)  # [1, n_tokens]
            # no division by zero: at least F16's smallest normal, as llama.cpp clamps it
            total = g.ggml_clamp(ctx, total, _MIN_WEIGHT_SUM, float("inf"))
            weights = g.ggml_div(ctx, weights, total)  # [n_used, n_tokens]
            weights = g.ggml_reshape_3d(ctx, weights, 1, n_expert_used, n_tokens)
        if weight_scale not in (0.0, 1.0):
            weights = g.ggml_scale(ctx, weights, weight_scale)
        g.ggml_build_forward_expand(self.gf, weights)
        cur = g.ggml_reshape_3d(ctx, x, n_embd, 1, n_tokens)
        if weight_before_ffn:  # each picked expert's copy of the input, times its weight
            cur = g.ggml_repeat_4d(ctx, cur, n_embd, n_expert_used, n_tokens, 1)
            cur = g.ggml_mul(ctx, cur, weights)  # [n_embd, n_used, n_tokens]
        up = g.ggml_mul_mat_id(ctx, up_exps, cur, selected)  # [n_ff_exp, n_used, n_tokens]
        if bias.up is not None:
            up = g.ggml_add_id(ctx, up, bias.up, selected)
        gate = g.ggml_mul_mat_id(ctx, gate_exps, cur, selected)
        if bias.gate is not None:
            gate = g.ggml_add_id(ctx, gate, bias.gate, selected)
        if act == "swiglu_oai":
            a = g.ggml_swiglu_oai(ctx, gate, up, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)
        else:
            a = g.ggml_swiglu_split(ctx, gate, up)
        experts = g.ggml_mul_mat_id(ctx, down_exps, a, selected)  # [n_embd, n_used, n_tok]
        if bias.down is not None:
            experts = g.ggml_add_id(ctx, experts, bias.down, selected)
        if not weight_before_ffn:
            experts = g.ggml_mul(ctx, experts, weights)
        g.ggml_build_forward_expand(self.gf, experts)
        es = tensor_struct(experts)
        nb1, nb2 = int(es.nb[1]), int(es.nb[2])
        views = []
        for i in range(n_expert_used):  # the views ordered before the adds, as llama.cpp
            views.append(g.ggml_view_2d(ctx, experts, n_embd, n_tokens, nb2, i * nb1))
            g.ggml_build_forward_expand(self.gf, views[-1])
        out = views[0]
        for view in views[1:]:
            out = g.ggml_add(ctx, out, view)
            g.ggml_build_forward_expand(self.gf, out)
        if n_expert_used == 1:
            out = g.ggml_cont(ctx, out)  # not a strided view
        if batched:
            out = g.ggml_reshape_3d(ctx, out, n_embd, 1, n_tokens)
        return out

    def _group_mask(
        self, choose: int, n_expert: int, n_tokens: int, n_groups: int, n_used: int
    ) -> int:
        """``choose`` ``[n_expert, n_tokens]`` with the experts outside each token's ``n_used``
        best groups set to -inf (llama.cpp's build_moe_ffn with n_expert_groups)."""
        g, ctx = self.g, self.ctx
        per_group = n_expert // n_groups
        grouped = g.ggml_reshape_3d(ctx, choose, per_group, n_groups, n_tokens)
        best2 = g.ggml_argsort_top_k(ctx, grouped, 2)  # [2, n_groups, n_tokens]
        as_rows = g.ggml_reshape_4d(ctx, grouped, 1, per_group, n_groups, n_tokens)
        scores = g.ggml_get_rows(ctx, as_rows, best2)  # [1, 2, n_groups, n_tokens]
        scores = g.ggml_sum_rows(ctx, g.ggml_reshape_3d(ctx, scores, 2, n_groups, n_tokens))
        scores = g.ggml_reshape_2d(ctx, scores, n_groups, n_tokens)  # [n_groups, n_tokens]
        kept = g.ggml_argsort_top_k(ctx, scores, n_used)  # [n_used, n_tokens]
        picked = g.ggml_get_rows(ctx, grouped, kept)  # [per_group, n_used, n_tokens]
        masked = g.ggml_set_rows(ctx, g.ggml_fill(ctx, grouped, float("-inf")), picked, kept)
        return g.ggml_reshape_2d(ctx, masked, n_expert, n_tokens)

    def mla_attention(
        self,
        il: int,
        h: int,
        q_proj: tuple[int, int, int] | int,
        kv_a: int,
        kv_a_norm: int,
        k_b: int,
        v_b: int,
    ) -> int:
        """Multi-head latent attention (``ModelSpec.mla``) over the normed input ``h`` in
        llama.cpp's absorbed form (deepseek2's builder with ``attn_k_b``/``attn_v_b``), before
        the output projection: ``[n_head * v_head_dim, rows]``. ``q_proj``: ``attn_q``, or
        (``attn_q_a``, its norm, ``attn_q_b``). Q's non-rotated part is absorbed into the
        latent per head (``k_b``), its rotated part and the shared rope key take RoPE over
        ``rope_dim``; K = latent + rope key (one KV head), V = the latent, the output
        expanded per head by ``v_b``; Q times its position's temperature where the model
        has one. In a batch of sessions (``[.., 1, B]``) the absorption
        multiplies one column per session, as each session's own decode does."""
        g, ctx, spec = self.g, self.ctx, self.spec
        m = spec.mla
        if m is None:
            raise ValueError("mla_attention needs a model with latent attention")
        n_head, rows, f = spec.n_head, self.rows, 4  # F32 activations
        per_seq, seqs = (1, rows) if tensor_struct(h).ne[2] > 1 else (rows, 1)
        if isinstance(q_proj, tuple):
            q_a, q_a_norm, q_b = q_proj
            q = self.linear(q_b, self.norm(self.linear(q_a, h), q_a_norm))
        else:
            q = self.linear(q_proj, h)
        kd, rank, rope, nope = m.k_head_dim, m.kv_lora_rank, m.rope_dim, m.nope_dim
        q = g.ggml_reshape_4d(ctx, q, kd, n_head, per_seq, seqs)
        kv_pe = self.linear(kv_a, h)  # [rank + rope, rows] ([.., 1, B])
        row = f * (rank + rope)
        kv_cmpr = g.ggml_view_2d(ctx, kv_pe, rank, rows, row, 0)
        k_pe = g.ggml_view_3d(ctx, kv_pe, rope, 1, rows, row, row, f * rank)
        k_pe = self.rope(k_pe, il)  # [rope, 1, rows]
        kv_cmpr = self.norm(kv_cmpr, kv_a_norm)
        qs = (f * kd, f * kd * n_head, f * kd * n_head * per_seq)
        q_nope = g.ggml_view_4d(ctx, q, nope, n_head, per_seq, seqs, *qs, 0)
        q_pe = g.ggml_view_3d(ctx, q, rope, n_head, rows, qs[0], qs[1], f * nope)
        q_pe = g.ggml_reshape_4d(ctx, self.rope(q_pe, il), rope, n_head, per_seq, seqs)
        q_nope = g.ggml_permute(ctx, q_nope, 0, 2, 1, 3)  # [nope, T, n_head, S]
        absorbed = g.ggml_mul_mat(ctx, k_b, q_nope)  # [rank, T, n_head, S]
        absorbed = g.ggml_permute(ctx, absorbed, 0, 2, 1, 3)  # [rank, n_head, T, S]
        q_cur = g.ggml_concat(ctx, absorbed, q_pe, 0)  # the rope part last, as llama.cpp
        q_cur = self.temperature(g.ggml_reshape_3d(ctx, q_cur, rank + rope, n_head, rows))
        kv_cmpr = g.ggml_reshape_3d(ctx, kv_cmpr, rank, 1, rows)
        k_cur = g.ggml_concat(ctx, kv_cmpr, k_pe, 0)  # [rank + rope, 1, rows]
        return self.attention(il, q_cur, k_cur, kv_cmpr, spec.attn_scale, v_mla=v_b)

    def shared_expert(self, x: int, gate_inp: int, gate: int, up: int, down: int) -> int:
        """A shared expert every token runs, scaled by its own sigmoid gate: ffn(x) *
        sigmoid(gate_inp . x) (llama.cpp's qwen2moe, which computes the sigmoid as
        silu(z) / z: the same bits only that way)."""
        g, ctx = self.g, self.ctx
        z = self.mm(gate_inp, x)  # [1, rows] ([1, 1, B] in a batch)
        s = g.ggml_div(ctx, g.ggml_silu(ctx, z), z)
        return g.ggml_mul(ctx, self.ffn(x, gate, up, down, "silu"), s)

    # --- the output head ----------------------------------------------------------------------
    def head(
        self,
        x: int,
        norm: int,
        weight: int,
        *,
        norm_bias: int | None = None,
        bias: int | None = None,
    ) -> int:
        """The output norm and head: logits ``[vocab, rows]``, with the biases the model has,
        times its logit scale (granite) and soft-capped (tanh(z / cap) * cap) where the model
        says."""
        return self.logits(self.output_norm(x, norm, norm_bias), weight, bias=bias)

    def output_norm(self, x: int, norm: int, bias: int | None = None) -> int:
        """The output norm: the hidden state the head projects (llama.cpp's ``h_nextn``,
        which a NextN draft head reads)."""
        return self.norm(x, norm, bias)

    def logits(self, hidden: int, weight: int, *, bias: int | None = None) -> int:
        """The head over the output-normed ``hidden`` (``head``'s second half)."""
        logits = self.linear(weight, hidden, bias)
        if self.spec.logit_scale is not None:
            logits = self.scale(logits, self.spec.logit_scale)
        cap = self.spec.final_logit_softcap
        if cap:
            g = self.g
            logits = self.scale(g.ggml_tanh(self.ctx, self.scale(logits, 1.0 / cap)), cap)
        return logits
