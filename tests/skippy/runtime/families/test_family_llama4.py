"""llama4's own behaviour beyond the certification matrix (whose prompts stay inside the first
chunk: the pinned llama.cpp fixes the chunk at 8192): a prompt past the chunk boundary, where
the chunked layers stop seeing the previous chunk and the NoPE layer's attention temperature
steps up (position 8191), prefilled, decoded one token at a time and decoded in a batch,
bit-identical to llama.cpp; Scout's and Maverick's top-1 shapes (Maverick's 128 experts: no
Q/K norm); RoPE scaling read as llama.cpp reads it (a factor without a type is linear; YaRN
past the original context); the metadata's required keys, constants and refusals; and the
numpy engine refusing the family.

The long-prompt tests use a narrow model (width 64, F16 and Q8_0: no K-quant rows at that
width) so that 8,200 positions of attention stay cheap."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from stagetools import chain

from skippy.errors import ModelError
from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.canary import synth
from skippy.runtime.canary.check import Case, package_model, stage_logits
from skippy.runtime.canary.oracle import llama_logits
from skippy.runtime.families import llama4, spec_from_metadata
from skippy.runtime.stage import StageConfig

pytestmark = pytest.mark.llama

SPEC = synth.family("llama4")
NARROW = synth.Dims(
    embd=64, n_head=2, n_head_kv=1, head_dim=32, ff=128, ff_exp=64, vocab=64, n_ctx_train=16384
)
PAST = llama4.CHUNK + 8  # positions past the chunk boundary and the temperature's step
N_CTX = 8448  # PAST, padded as llama.cpp pads a context (256)
BATCH = 512
THREE = ("0..1", "1..3", "3..4")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llama4")


@pytest.fixture(scope="module")
def narrow(root: Path) -> tuple[Path, Path]:
    return package_model(SPEC, "F16", root, dims=NARROW)


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
def test_a_prompt_past_the_chunk_boundary_equals_llama_cpp(root: Path, dtype: str) -> None:
    model, pkg = package_model(SPEC, dtype, root, dims=NARROW)
    ids = synth.long_prompt(PAST, vocab=NARROW.vocab)
    got = stage_logits(pkg, ids, Case(THREE, BATCH), n_ctx=N_CTX)
    ref = llama_logits(model, ids, n_batch=BATCH, n_ctx=N_CTX)
    assert got.shape == ref.shape == (PAST, NARROW.vocab)
    assert np.array_equal(got, ref)


def test_decode_steps_across_the_chunk_boundary_equal_llama_cpp(
    narrow: tuple[Path, Path],
) -> None:
    """The reused one-position decode graph's masks cut at the chunk start and its
    temperature input steps up, as llama.cpp decoding one token at a time."""
    model, pkg = narrow
    ids = synth.long_prompt(PAST, vocab=NARROW.vocab, seed=1)
    start = llama4.CHUNK - 6  # decoded positions 8186..8199
    cfg = StageConfig(n_ctx=N_CTX, n_batch=BATCH, n_threads=1)
    rows = []
    with chain("ggml", pkg, THREE, cfg) as ch:
        first = ch.prefill("s", ids[:start]).logits
        assert first is not None
        rows.append(first[-1])
        for pos in range(start, PAST):
            step = ch.decode("s", pos, ids[pos]).logits
            assert step is not None
            rows.append(step[-1])
    ref = llama_logits(model, ids, n_batch=BATCH, n_ctx=N_CTX, prefill=start, steps=(1,))
    assert len(rows) == ref.shape[0] == PAST - start + 1
    assert np.array_equal(np.stack(rows), ref)


def test_a_batch_of_two_sessions_astride_the_boundary_decodes_as_llama_cpp_does_each(
    narrow: tuple[Path, Path],
) -> None:
    """Two sessions at different positions in one batched graph: each column's mask and
    temperature are its own position's."""
    from skippy.runtime.stage import DecodeStep

    model, pkg = narrow
    prompts = [synth.long_prompt(PAST, vocab=NARROW.vocab, seed=s) for s in (2, 3)]
    starts = (llama4.CHUNK - 7, llama4.CHUNK - 3)
    n_steps = PAST - starts[1]
    cfg = StageConfig(n_ctx=N_CTX, n_batch=BATCH, n_threads=1)
    rows: list[list[np.ndarray]] = [[], []]
    with chain("ggml", pkg, ["0..4"], cfg) as ch:
        stage = ch.stages[0]
        for i, (p, start) in enumerate(zip(prompts, starts, strict=True)):
            first = stage.prefill(f"s{i}", 0, np.asarray(p[:start])).logits
            assert first is not None
            rows[i].append(first[-1])
        for j in range(n_steps):
            steps = [
                DecodeStep(f"s{i}", start + j, np.asarray([p[start + j]]))
                for i, (p, start) in enumerate(zip(prompts, starts, strict=True))
            ]
            for i, out in enumerate(stage.decode_batch(steps)):
                assert out.logits is not None
                rows[i].append(out.logits[-1])
    for i, (p, start) in enumerate(zip(prompts, starts, strict=True)):
        ref = llama_logits(
            model, p[: start + n_steps], n_batch=BATCH, n_ctx=N_CTX, prefill=start, steps=(1,)
        )
        assert np.array_equal(np.stack(rows[i]), ref), i


def _variant_equals_llama_cpp(
    spec: synth.FamilySpec, root: Path, n: int, dims: synth.Dims = NARROW
) -> None:
    model, pkg = package_model(spec, "F16", root, dims=dims)
    ids = synth.long_prompt(n, vocab=dims.vocab)
    got = stage_logits(pkg, ids, Case(THREE, 128))
    assert np.array_equal(got, llama_logits(model, ids, n_batch=n, n_ctx=1024))


@pytest.mark.parametrize(
    ("n_expert", "qk_norm"), [(16, True), (128, False)], ids=["scout", "maverick"]
)
def test_the_checkpoints_top_1_routing_equals_llama_cpp(
    tmp_path: Path, n_expert: int, qk_norm: bool
) -> None:
    """Scout's and Maverick's shapes: 16 or 128 experts, each token routed to one (the
    canary's model routes to two); llama.cpp's loader turns the Q/K norm off for 128."""
    variant = replace(SPEC, moe=synth.MoE(n_expert, 1))
    kv = dict(synth.model_metadata(variant, variant.dims(NARROW), "F16"))
    kv["general.architecture"] = "llama4"
    assert spec_from_metadata(kv).qk_rms_norm == qk_norm
    _variant_equals_llama_cpp(variant, tmp_path, 64)


def test_a_scaling_factor_without_a_type_is_linear_on_every_rope_layer(tmp_path: Path) -> None:
    """llama.cpp defaults a missing rope.scaling.type to linear: with a pattern of 2, layer 1
    is a full-attention RoPE layer, which rotates at the context's scale (1/4 here, not 1)."""
    keys = gguf.Keys
    kv = {**SPEC.kv, keys.Rope.SCALING_FACTOR: 4.0, keys.Attention.SLIDING_WINDOW_PATTERN: 2}
    variant = replace(SPEC, kv=kv)
    meta = dict(synth.model_metadata(variant, variant.dims(NARROW), "F16"))
    meta["general.architecture"] = "llama4"
    spec = spec_from_metadata(meta)
    assert spec.swa_layers == frozenset({0, 2}) and spec.uses_rope(1)
    assert spec.rope_scale_for(1) == spec.rope_scale_for(0) == 0.25
    _variant_equals_llama_cpp(variant, tmp_path, 64)


def test_llama3_style_rope_factors_equal_llama_cpp(tmp_path: Path) -> None:
    """The checkpoints carry ``rope_freqs`` (llama3-style frequency factors, one per pair of
    the head), read by every RoPE layer of every stage."""
    factors = synth.TensorSpec(gguf.MODEL_TENSOR.ROPE_FREQS, ("half_head",), "norm")
    variant = replace(SPEC, model=(*SPEC.model, factors))
    _variant_equals_llama_cpp(variant, tmp_path, 64)


def test_yarn_past_the_original_context_equals_llama_cpp_ignoring_the_beta_keys(
    tmp_path: Path,
) -> None:
    """The loader reads no YaRN beta key (llama.cpp's defaults apply): the file's beta_fast
    of 8 changes nothing."""
    r = gguf.Keys.Rope
    kv = {
        **SPEC.kv,
        r.SCALING_TYPE: "yarn",
        r.SCALING_FACTOR: 8.0,
        r.SCALING_ORIG_CTX_LEN: 128,
        r.SCALING_YARN_BETA_FAST: 8.0,
    }
    _variant_equals_llama_cpp(replace(SPEC, kv=kv), tmp_path, 320)


# --- metadata -----------------------------------------------------------------------------------
def _kv(**extra: object) -> dict[str, object]:
    a = "llama4."
    kv: dict[str, object] = {
        "general.architecture": "llama4",
        a + "block_count": 8,
        a + "embedding_length": 256,
        a + "feed_forward_length": 512,
        a + "attention.head_count": 4,
        a + "attention.head_count_kv": 2,
        a + "attention.layer_norm_rms_epsilon": 1e-5,
        a + "expert_count": 16,
        a + "expert_used_count": 1,
        a + "expert_feed_forward_length": 256,
        a + "interleave_moe_layer_step": 2,
        a + "rope.freq_base": 500000.0,
    }
    kv.update({a + k: v for k, v in extra.items()})
    return {k: v for k, v in kv.items() if v is not None}


def test_the_loaders_fixed_chunk_pattern_nope_layers_and_temperature() -> None:
    spec = spec_from_metadata(_kv())
    assert spec.swa_type == "chunked" and spec.sliding_window == 8192
    assert spec.swa_layers == frozenset({0, 1, 2, 4, 5, 6})
    assert spec.nope_layers == frozenset({3, 7})
    assert spec.dense_layers == frozenset({0, 2, 4, 6})
    assert spec.qk_rms_norm and spec.n_ff_shexp == spec.n_ff_exp == 256
    assert spec.rope_style == "normal" and spec.expert_gating == "sigmoid"
    temp = spec.attn_temperature
    assert temp is not None
    f = temp.factors(np.array([0, 8190, 8191, 16382], dtype=np.int32))
    stepped = np.float32(np.log(2.0) * float(np.float32(0.1)) + 1.0)  # log(1 + 1) * 0.1 + 1
    assert f[0] == f[1] == 1.0 and f[2] == f[3] == stepped


def test_every_layer_is_moe_with_a_step_of_one_and_needs_no_dense_width() -> None:
    spec = spec_from_metadata(_kv(interleave_moe_layer_step=1, feed_forward_length=None))
    assert spec.dense_layers == frozenset()


@pytest.mark.parametrize("key", ["interleave_moe_layer_step", "expert_feed_forward_length"])
def test_the_loaders_required_keys_are_required(key: str) -> None:
    with pytest.raises(ModelError) as e:
        spec_from_metadata(_kv(**{key: None}))
    assert e.value.code == "missing_hyperparameter"


def test_dense_layers_without_a_dense_width_are_refused() -> None:
    with pytest.raises(ModelError) as e:
        spec_from_metadata(_kv(feed_forward_length=None))
    assert e.value.code == "invalid_hyperparameters"


def test_a_file_without_chunked_attention_is_refused_with_a_code() -> None:
    with pytest.raises(StageUnsupported) as e:
        spec_from_metadata(_kv(**{"attention.sliding_window": 0}))
    assert e.value.code == "unsupported_hyperparameter"
    # any other value keeps llama.cpp's fixed chunk
    assert spec_from_metadata(_kv(**{"attention.sliding_window": 128})).sliding_window == 8192


def test_scaling_type_none_leaves_full_layers_unscaled_but_scales_chunked_ones() -> None:
    """llama.cpp's context never scales under "none", but the chunked layers rotate at the
    training scale (rope_freq_scale_train_swa) whatever the type says."""
    spec = spec_from_metadata(
        _kv(**{"rope.scaling.type": "none", "rope.scaling.factor": 4.0}),
    )
    assert spec.rope_scale == 1.0 and spec.rope_scale_swa == 0.25


def test_a_fused_qkv_is_refused_with_a_code(tmp_path: Path) -> None:
    """llama.cpp's loader takes a fused ``attn_qkv`` for llama4 (no checkpoint has one): the
    stage runtime refuses the fragment rather than running it unchecked."""
    t = gguf.MODEL_TENSOR
    separate = (t.ATTN_Q, t.ATTN_K, t.ATTN_V)
    fused = synth.TensorSpec(t.ATTN_QKV, ("embd", "qkv"))

    def swap(layer: tuple[synth.TensorSpec, ...]) -> tuple[synth.TensorSpec, ...]:
        return (*(x for x in layer if x.tensor not in separate), fused)

    variant = replace(SPEC, layer=swap(SPEC.layer), dense_layer=swap(SPEC.dense_layer))
    _, pkg = package_model(variant, "F16", tmp_path, dims=NARROW)
    with pytest.raises(ModelError) as e:
        stage_logits(pkg, [1, 2, 3], Case(("0..4",), 128))
    assert e.value.code == "fragment_unexpected_tensor"
    assert "attn_qkv" in str(e.value)


def test_the_numpy_engine_refuses_the_family(narrow: tuple[Path, Path]) -> None:
    _, pkg = narrow
    with pytest.raises(StageUnsupported) as e, chain("numpy", pkg, ["0..4"], StageConfig()):
        pass
    assert e.value.code == "unsupported_architecture"
