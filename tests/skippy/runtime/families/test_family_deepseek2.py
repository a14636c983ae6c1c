"""deepseek2's own behaviour beyond the certification matrix: the latent cache (latent + rope
key only) in the reused one-position decode graphs, resized past a KV length step,
bit-identical to llama.cpp decoding one token at a time; a batch of two sessions (the
per-head absorption one column per session) equal to llama.cpp's decoding of each; repacked
weights as llama.cpp repacks them; group-limited routing and Mistral Large 3's attention
temperature changing the result, as llama.cpp's do; the metadata's derived
values (the attention scale with DeepSeek's YaRN mscale, the lite variants without q_lora,
GLM-4.7-Lite's default sigmoid gating) and what the reader refuses, with its codes."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from stagetools import batched_decode_rows, chain, decode_rows, llama_decode_reference

from skippy.errors import ModelError
from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.canary import synth
from skippy.runtime.canary.check import Case, oracle, package_model, stage_logits
from skippy.runtime.families import spec_from_metadata
from skippy.runtime.graph_shapes import kv_length
from skippy.runtime.stage import StageConfig

pytestmark = pytest.mark.llama

V3 = synth.family("deepseek2")
LITE = synth.family("deepseek2-lite")
K = gguf.Keys
ARCH = "deepseek2"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepseek2")


def _kv(spec: synth.FamilySpec, **changes: Any) -> dict[str, Any]:
    """The synthetic model's metadata with ``general.architecture`` and ``changes`` (keys
    without the ``deepseek2.`` prefix; None removes a key)."""
    kv: dict[str, Any] = dict(synth.model_metadata(spec, spec.dims(), "F16"))
    kv[K.General.ARCHITECTURE] = ARCH
    for key, value in changes.items():
        full = f"{ARCH}.{key}"
        if value is None:
            kv.pop(full, None)
        else:
            kv[full] = value
    return kv


# --- decoding against llama.cpp -------------------------------------------------------------
def test_decode_steps_past_a_kv_length_step_equal_llama_cpp(root: Path) -> None:
    """The reused decode graph resizes the latent view, its transpose and the contiguous V
    with the KV length (steps of 256): positions past 256 still equal llama.cpp's."""
    model, pkg = package_model(LITE, "F16", root)
    ids = synth.long_prompt(270, vocab=LITE.dims().vocab)
    cfg = StageConfig(n_ctx=512, n_threads=1)
    got = decode_rows(pkg, ["0..2", "2..4"], ids, cfg)
    assert np.array_equal(got, llama_decode_reference(model, ids, cfg.n_ctx))


def test_a_batch_of_two_sessions_decodes_as_llama_cpp_does_each(root: Path) -> None:
    model, pkg = package_model(V3, "F16", root)
    cfg = StageConfig(n_ctx=256, n_threads=1, max_sessions=2)
    prompts = [synth.long_prompt(24, vocab=V3.dims().vocab, seed=s) for s in (1, 2)]
    batched = batched_decode_rows(pkg, f"0..{V3.layer_count()}", prompts, cfg)
    for i, (p, got) in enumerate(zip(prompts, batched, strict=True)):
        assert np.array_equal(got, llama_decode_reference(model, p, cfg.n_ctx)), i


@pytest.mark.parametrize(
    ("factor", "log_mul", "scaling_type"),
    [(40.0, 0.1, "yarn"), (40.0, 0.0707, "yarn"), (32.0, None, "yarn"), (4.0, None, None)],
    ids=["v3-yarn40", "v2-mscale-yarn40", "yarn-no-log-mul", "linear-without-a-type"],
)
def test_rope_scalings_equal_llama_cpp_past_the_original_context(
    root: Path, factor: float, log_mul: float | None, scaling_type: str | None
) -> None:
    """DeepSeek-V3's YaRN factor 40 with its mscale (0.1 x mscale_all_dim 1), V2's (0.0707),
    YaRN without a log multiplier, and a factor without a scaling type (linear, as llama.cpp
    defaults it, its ln(factor) still in deepseek2's attention scale): 200 positions over an
    original context of 64, bit-identical to llama.cpp."""
    kv = {**V3.kv, K.Rope.SCALING_FACTOR: factor, K.Rope.SCALING_ORIG_CTX_LEN: 64}
    for key, value in ((K.Rope.SCALING_YARN_LOG_MUL, log_mul), (K.Rope.SCALING_TYPE, scaling_type)):
        if value is None:
            kv.pop(key)
        else:
            kv[key] = value
    spec = replace(V3, name=f"deepseek2-rope-{factor}-{log_mul}-{scaling_type}", kv=kv)
    model, pkg = package_model(spec, "F16", root)
    ids = synth.long_prompt(200, vocab=V3.dims().vocab)
    got = stage_logits(pkg, ids, Case((f"0..{V3.layer_count()}",), 256))
    assert np.array_equal(got, oracle(model, ids))


def test_repacked_weights_equal_llama_cpp_repacking_by_default(root: Path) -> None:
    """With repacking on, the Q4_K matrices llama.cpp repacks are repacked, and the per-head
    stacks attn_k_b / attn_v_b (rank 3, multiplied per head) stay as they are, as llama.cpp
    finds (its repacked kernels multiply rank-2 weights only)."""
    model, pkg = package_model(V3, "Q4_K", root)
    ids = synth.long_prompt(64, vocab=V3.dims().vocab)
    case = Case((f"0..{V3.layer_count()}",), 64)
    got = stage_logits(pkg, ids, case, repack=True)
    assert np.array_equal(got, oracle(model, ids, repack=True))


def test_the_cache_holds_the_latent_and_rope_key_only(root: Path) -> None:
    _, pkg = package_model(LITE, "F16", root)
    d = LITE.dims()
    cfg = StageConfig(n_ctx=256, n_threads=1)
    cells = kv_length(cfg.n_ctx)
    with chain("ggml", pkg, ["0..4"], cfg) as ch:
        stage: Any = ch.stages[0]
        # one F16 row of kv_lora + rope per cell and layer, no V cache
        assert stage.kv_bytes_per_session() == 2 * d.n_layers * (d.kv_lora + d.rope_mla) * cells


def test_expert_groups_change_the_routing_as_llama_cpp_does(root: Path) -> None:
    """The V3-shaped model with and without its expert groups: each equals llama.cpp's
    logits, and they differ (the groups cut some tokens' choice of experts)."""
    ungrouped = replace(
        V3,
        name="deepseek2-nogroups",
        kv={
            k: v
            for k, v in V3.kv.items()
            if k not in (K.LLM.EXPERT_GROUP_COUNT, K.LLM.EXPERT_GROUP_USED_COUNT)
        },
    )
    ids = synth.long_prompt(64, vocab=V3.dims().vocab)
    case = Case((f"0..{V3.layer_count()}",), 64)
    out = {}
    for spec in (V3, ungrouped):
        model, pkg = package_model(spec, "F16", root)
        out[spec.name] = stage_logits(pkg, ids, case)
        assert np.array_equal(out[spec.name], oracle(model, ids)), spec.name
    assert not np.array_equal(out[V3.name], out[ungrouped.name])


def test_attention_temperature_equals_llama_cpp_across_its_steps(root: Path) -> None:
    """Mistral Large 3's temperature tuning (Q times log(floor(pos / length) + 1) * scale + 1):
    320 positions cross two steps of a length of 128; without the keys the logits differ."""
    tempered = replace(
        LITE,
        name="deepseek2-lite-temperature",
        kv={**LITE.kv, K.Attention.TEMPERATURE_SCALE: 0.1, K.Attention.TEMPERATURE_LENGTH: 128},
    )
    ids = synth.long_prompt(320, vocab=LITE.dims().vocab)
    case = Case(("0..2", "2..4"), 128)
    out = {}
    for spec in (tempered, LITE):
        model, pkg = package_model(spec, "F16", root)
        out[spec.name] = stage_logits(pkg, ids, case)
        assert np.array_equal(out[spec.name], oracle(model, ids)), spec.name
    assert not np.array_equal(out[tempered.name], out[LITE.name])
    model, pkg = package_model(tempered, "F16", root)
    cfg = StageConfig(n_ctx=512, n_threads=1)
    decoded = decode_rows(pkg, ["0..4"], ids[:140], cfg)  # past the first step (127)
    assert np.array_equal(decoded, llama_decode_reference(model, ids[:140], cfg.n_ctx))


# --- metadata ---------------------------------------------------------------------------------
def test_the_spec_reads_latent_attention_and_routing() -> None:
    d = V3.dims()
    spec = spec_from_metadata(_kv(V3))
    assert spec.mla is not None
    assert (spec.mla.q_lora_rank, spec.mla.kv_lora_rank) == (d.q_lora, d.kv_lora)
    assert (spec.mla.rope_dim, spec.mla.k_head_dim) == (d.rope_mla, d.k_mla)
    assert (spec.head_dim, spec.n_head_kv, spec.rope_dims) == (d.kv_a_mla, 1, d.rope_mla)
    assert spec.attn_out_dim == d.o_mla
    assert (spec.n_layer, spec.n_trunk, spec.n_layer_dense_lead) == (d.n_layers + 1, 4, 1)
    assert (spec.expert_gating, spec.expert_weights_norm) == ("sigmoid", True)
    assert (spec.expert_groups, spec.expert_groups_used, spec.expert_weights_scale) == (4, 1, 2.5)
    lite = spec_from_metadata(_kv(LITE))
    assert lite.mla is not None and lite.mla.q_lora_rank == 0
    assert (lite.expert_gating, lite.expert_groups) == ("softmax", 0)


def test_the_attention_scale_takes_deepseeks_yarn_mscale() -> None:
    """softmax scale = mscale^2 / sqrt(key width), mscale = 1 + 0.1 mscale_all_dim ln(factor)
    (DeepSeek's reference); without scaling 1 / sqrt(key width)."""
    k_mla = V3.dims().k_mla
    plain = spec_from_metadata(_kv(V3, **{"rope.scaling.type": "none"}))
    assert plain.attn_scale == float(np.float32(1.0) / np.sqrt(np.float32(k_mla)))
    for spec, mscale_all_dim in ((V3, 1.0), (LITE, 0.707)):
        got = spec_from_metadata(_kv(spec)).attn_scale
        mscale = 1.0 + 0.1 * mscale_all_dim * math.log(4.0)
        assert got == pytest.approx(mscale * mscale / math.sqrt(k_mla), rel=1e-6)
        assert got != pytest.approx(1.0 / math.sqrt(k_mla), rel=1e-3)


def test_lite_layer_counts_ignore_q_lora_rank() -> None:
    """llama.cpp's loader reads no q_lora_rank for 26- or 27-layer models (V2-Lite): Q is
    projected directly whatever the file says."""
    for layers, rank in ((27, 0), (26, 0), (28, V3.dims().q_lora)):
        spec = spec_from_metadata(_kv(V3, block_count=layers, nextn_predict_layers=None))
        assert spec.mla is not None and spec.mla.q_lora_rank == rank, layers


def test_glm_lite_without_a_gating_key_gates_with_a_sigmoid() -> None:
    kv = _kv(LITE, block_count=47, vocab_size=154880, expert_gating_func=None)
    assert spec_from_metadata(kv).expert_gating == "sigmoid"
    assert spec_from_metadata(_kv(LITE, block_count=47)).expert_gating == "softmax"


@pytest.mark.parametrize(
    ("changes", "error", "code"),
    [
        ({"attention.key_length_mla": None}, StageUnsupported, "unsupported_hyperparameter"),
        ({"attention.temperature_scale": 0.1}, ModelError, "missing_hyperparameter"),
        ({"expert_gating_func": 3}, StageUnsupported, "unsupported_hyperparameter"),
        ({"expert_group_count": 3}, ModelError, "invalid_hyperparameters"),
        ({"expert_group_used_count": 4}, ModelError, "invalid_hyperparameters"),
        ({"attention.head_count_kv": 2}, ModelError, "invalid_hyperparameters"),
        ({"rope.dimension_count": 320}, ModelError, "invalid_hyperparameters"),
        ({"attention.q_lora_rank": None}, ModelError, "missing_hyperparameter"),
    ],
    ids=[
        "legacy_kv_b",
        "temperature",
        "gating",
        "groups",
        "groups_used",
        "kv_heads",
        "rope",
        "q_lora",
    ],
)
def test_the_reader_refuses_with_a_code(
    changes: dict[str, Any], error: type[Exception], code: str
) -> None:
    with pytest.raises(error) as info:
        spec_from_metadata(_kv(V3, **changes))
    assert getattr(info.value, "code", None) == code


def test_the_numpy_engine_refuses_the_family_with_a_code(root: Path) -> None:
    """The numpy reference has no latent attention: it refuses the package rather than
    compute it wrongly."""
    _, pkg = package_model(LITE, "F16", root)
    with pytest.raises(StageUnsupported) as err:
        chain("numpy", pkg, ["0..4"], StageConfig(n_ctx=64, n_threads=1))
    assert err.value.code == "unsupported_architecture"
