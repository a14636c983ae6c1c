"""``GraphBuilder.moe_ffn``'s routing variants against a numpy transcription of llama.cpp's
``build_moe_ffn``: sigmoid gating, the selection-only bias (``exp_probs_b``: it changes which
experts a token picks, never their weights), the weights' normalisation and the routed
scale (``expert_weights_scale``, skipped at 0 and 1 as llama.cpp skips it). F32 weights
throughout, so ggml and numpy differ only by rounding; the family parity tests check the
bits against llama.cpp."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

from skippy.gguf import ggml
from skippy.gguf.ggml import GgmlInitParams, GgmlType
from skippy.runtime.graph import ExpertBiases, GraphBuilder
from skippy.runtime.model import ExpertGating, ModelSpec

N_EMBD, N_FF, N_EXPERT, N_USED, N_TOKENS = 16, 8, 8, 2, 5
F32 = npt.NDArray[np.float32]


@dataclass
class Weights:
    x: F32  # [tokens, embd]
    router: F32  # [expert, embd]
    gate: F32  # [expert, ff, embd]
    up: F32
    down: F32  # [expert, embd, ff]
    selection: F32  # [expert]


def _weights(seed: int = 7) -> Weights:
    rng = np.random.default_rng(seed)

    def r(*shape: int) -> F32:
        return rng.standard_normal(shape).astype(np.float32)

    # large selection biases: they must move some token's choice of experts
    selection = (rng.standard_normal(N_EXPERT) * 2.0).astype(np.float32)
    return Weights(
        r(N_TOKENS, N_EMBD),
        r(N_EXPERT, N_EMBD) * np.float32(0.5),
        r(N_EXPERT, N_FF, N_EMBD) * np.float32(0.3),
        r(N_EXPERT, N_FF, N_EMBD) * np.float32(0.3),
        r(N_EXPERT, N_EMBD, N_FF) * np.float32(0.3),
        selection,
    )


def _spec() -> ModelSpec:
    return ModelSpec(
        arch="test",
        n_layer=1,
        width=N_EMBD,
        n_head=1,
        n_head_kv=1,
        head_dim=N_EMBD,
        n_ff=N_FF,
        rms_eps=1e-6,
        context_length=16,
        rope_style="normal",
        rope_base=10000.0,
        rope_base_swa=10000.0,
        rope_scale=1.0,
        sliding_window=None,
        swa_layers=frozenset(),
        attn_scale=1.0,
        scale_q_before_attention=False,
        embed_scale=None,
        activation="silu",
        final_logit_softcap=None,
        n_expert=N_EXPERT,
        n_expert_used=N_USED,
        n_ff_exp=N_FF,
    )


def _no_attention(*args: object, **kwargs: object) -> int:
    raise AssertionError("moe_ffn attends to nothing")


def ggml_moe(
    w: Weights,
    *,
    gating: ExpertGating,
    norm: bool,
    scale: float,
    selection: bool,
) -> F32:
    """``moe_ffn`` over ``w`` on ggml's CPU backend: ``[tokens, embd]``."""
    g = ggml.load()
    params = GgmlInitParams(
        mem_size=g.ggml_tensor_overhead() * 128 + g.ggml_graph_overhead_custom(128, False),
        mem_buffer=None,
        no_alloc=True,
    )
    ctx = ggml.non_null(g.ggml_init(params), "ggml_init")
    buffer = backend = None
    try:

        def new(arr: F32) -> int:
            ne = arr.shape[::-1]
            if len(ne) == 1:
                t = g.ggml_new_tensor_1d(ctx, GgmlType.F32, ne[0])
            elif len(ne) == 2:
                t = g.ggml_new_tensor_2d(ctx, GgmlType.F32, ne[0], ne[1])
            else:
                t = g.ggml_new_tensor_3d(ctx, GgmlType.F32, ne[0], ne[1], ne[2])
            return ggml.non_null(t, "ggml_new_tensor")

        arrays = [w.x, w.router, w.up, w.gate, w.down, w.selection]
        tx, trouter, tup, tgate, tdown, tsel = (new(a) for a in arrays)
        gf = ggml.non_null(g.ggml_new_graph_custom(ctx, 128, False), "ggml_new_graph_custom")
        b = GraphBuilder(
            g=g,
            ctx=ctx,
            gf=gf,
            spec=_spec(),
            pos=tx,  # unused by moe_ffn
            rows=N_TOKENS,
            mm=lambda weight, x: g.ggml_mul_mat(ctx, weight, x),
            attend=_no_attention,
            last_layer=0,
        )
        out = b.moe_ffn(
            tx,
            trouter,
            tup,
            tgate,
            tdown,
            n_expert_used=N_USED,
            norm_weights=norm,
            gating=gating,
            biases=ExpertBiases(selection=tsel if selection else None),
            weight_scale=scale,
        )
        g.ggml_build_forward_expand(gf, out)
        buffer = ggml.non_null(
            g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, g.ggml_backend_cpu_buffer_type()),
            "ggml_backend_alloc_ctx_tensors_from_buft",
        )
        for t, arr in zip((tx, trouter, tup, tgate, tdown, tsel), arrays, strict=True):
            a = np.ascontiguousarray(arr)
            g.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.nbytes)
        backend = ggml.non_null(g.ggml_backend_cpu_init(), "ggml_backend_cpu_init")
        g.ggml_backend_cpu_set_n_threads(backend, 1)
        assert g.ggml_backend_graph_compute(backend, gf) == 0
        got = np.empty((N_TOKENS, N_EMBD), dtype=np.float32)
        g.ggml_backend_tensor_get(out, got.ctypes.data, 0, got.nbytes)
        return got
    finally:
        if backend:
            g.ggml_backend_free(backend)
        if buffer:
            g.ggml_backend_buffer_free(buffer)
        g.ggml_free(ctx)


def _sigmoid(z: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return 1.0 / (1.0 + np.exp(-z))


def picked(w: Weights, *, selection: bool) -> list[list[int]]:
    """Each token's experts, best first, as llama.cpp picks them under sigmoid gating."""
    probs = _sigmoid(w.x.astype(np.float64) @ w.router.T.astype(np.float64))
    if selection:
        probs = probs + w.selection
    return [list(np.argsort(-row, kind="stable")[:N_USED]) for row in probs]


def numpy_moe(
    w: Weights, *, gating: ExpertGating, norm: bool, scale: float, selection: bool
) -> npt.NDArray[np.float64]:
    """llama.cpp's ``build_moe_ffn`` in float64 (SiLU experts, no expert biases)."""
    x = w.x.astype(np.float64)
    logits = x @ w.router.T.astype(np.float64)
    if gating == "sigmoid":
        probs = _sigmoid(logits)
    else:
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = e / e.sum(axis=1, keepdims=True)
    choose = probs + w.selection if selection else probs
    out = np.zeros_like(x)
    for t in range(N_TOKENS):
        experts = np.argsort(-choose[t], kind="stable")[:N_USED]
        weights = probs[t, experts]  # the unbiased probabilities
        if norm:
            weights = weights / max(weights.sum(), 6.103515625e-5)
        if scale not in (0.0, 1.0):
            weights = weights * scale
        for e_id, wt in zip(experts, weights, strict=True):
            gate = w.gate[e_id].astype(np.float64) @ x[t]
            up = w.up[e_id].astype(np.float64) @ x[t]
            act = gate / (1.0 + np.exp(-gate)) * up
            out[t] += wt * (w.down[e_id].astype(np.float64) @ act)
    return out


def test_the_selection_bias_changes_which_experts_tokens_pick() -> None:
    # the premise of the routing tests below: without it they could not tell the bias apart
    w = _weights()
    assert picked(w, selection=True) != picked(w, selection=False)


@pytest.mark.parametrize(("norm", "scale"), [(True, 2.5), (False, 1.0), (True, 0.0), (False, 1.75)])
def test_sigmoid_gating_with_a_selection_bias_matches_llama_cpps_routing(
    norm: bool, scale: float
) -> None:
    w = _weights()
    got = ggml_moe(w, gating="sigmoid", norm=norm, scale=scale, selection=True)
    want = numpy_moe(w, gating="sigmoid", norm=norm, scale=scale, selection=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # the bias only chose: weighting by the biased scores would give another output
    wrong = numpy_moe(w, gating="sigmoid", norm=norm, scale=scale, selection=False)
    assert not np.allclose(got, wrong, rtol=1e-4, atol=1e-5)


def test_the_routed_scale_multiplies_the_experts_sum() -> None:
    w = _weights()
    plain = ggml_moe(w, gating="sigmoid", norm=True, scale=1.0, selection=True)
    scaled = ggml_moe(w, gating="sigmoid", norm=True, scale=2.5, selection=True)
    np.testing.assert_allclose(scaled, plain * np.float32(2.5), rtol=1e-5, atol=1e-6)


def test_softmax_gating_takes_a_selection_bias_too() -> None:
    w = _weights()
    got = ggml_moe(w, gating="softmax", norm=False, scale=1.0, selection=True)
    want = numpy_moe(w, gating="softmax", norm=False, scale=1.0, selection=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
