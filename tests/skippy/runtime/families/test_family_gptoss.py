"""gpt-oss's own behaviour beyond the certification matrix: attention sinks in the reused
one-position decode graphs (the sink joins a softmax resized with the KV length) past the
sliding window, for one session and a batch of two, bit-identical to llama.cpp decoding one
token at a time; the project's quantizer writing MXFP4 experts the runtime runs exactly; a
prefill that wants only its last row dropping the other rows after the last layer, as
llama.cpp's builder does; the file's YaRN tuning keys ignored, as llama.cpp's loader ignores
them; its metadata's required keys and derived values; and the numpy engine refusing the
family."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from stagetools import batched_decode_rows, chain, decode_rows, llama_decode_reference

from skippy.errors import ModelError
from skippy.quantize_cli import main as quantize_main
from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.canary import synth
from skippy.runtime.canary.check import Case, oracle, package_model, stage_logits
from skippy.runtime.canary.oracle import llama_logits
from skippy.runtime.families import spec_from_metadata
from skippy.runtime.stage import StageConfig

pytestmark = pytest.mark.llama

SPEC = synth.family("gpt-oss")
N = synth.SLIDING_WINDOW + 12  # decoded positions reach past the window
CFG = StageConfig(n_ctx=256, n_threads=1)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpt-oss")


@pytest.fixture(scope="module")
def model(root: Path) -> tuple[Path, Path]:
    return package_model(SPEC, "MXFP4", root)


def test_decode_steps_equal_llama_cpp_decoding_one_token_at_a_time(
    model: tuple[Path, Path],
) -> None:
    gguf, pkg = model
    ids = synth.long_prompt(N, vocab=SPEC.dims().vocab)
    got = decode_rows(pkg, ["0..1", "1..4"], ids, CFG)
    assert np.array_equal(got, llama_decode_reference(gguf, ids, CFG.n_ctx))


def test_a_batch_of_two_sessions_decodes_as_llama_cpp_does_each(
    model: tuple[Path, Path],
) -> None:
    gguf, pkg = model
    prompts = [synth.long_prompt(N, vocab=SPEC.dims().vocab, seed=s) for s in (1, 2)]
    batched = batched_decode_rows(pkg, "0..4", prompts, CFG)
    for i, (p, got) in enumerate(zip(prompts, batched, strict=True)):
        assert np.array_equal(got, llama_decode_reference(gguf, p, CFG.n_ctx)), i


def test_a_prefill_wanting_its_last_row_equals_llama_cpp_asked_for_that_row(root: Path) -> None:
    """The final layer's experts run over every row and the others are dropped before the
    output norm: on F32 weights (whose kernels depend on the row count) dropping them inside
    the last layer, as other families do, differs from llama.cpp by ~8e-7."""
    gguf, pkg = package_model(SPEC, "F32", root)
    n = 320  # past the window, a multiple of 8 (the engine's kernels match llama.cpp's there)
    ids = synth.long_prompt(n, vocab=SPEC.dims().vocab)
    cfg = StageConfig(n_ctx=512, n_batch=512, n_threads=1)
    with chain("ggml", pkg, ["0..2", "2..4"], cfg) as ch:
        out = ch.prefill("s", ids).logits
    assert out is not None and out.shape[0] == 1
    ref = llama_logits(gguf, ids, n_batch=n, n_ctx=512, prefill=n)
    assert ref.shape[0] == 1
    assert np.array_equal(out[-1], ref[0])


def test_the_quantizers_mxfp4_moe_package_runs_as_llama_cpp_runs_the_mxfp4_model(
    root: Path, model: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """skippy-quantize's MXFP4_MOE of the F32 model (experts MXFP4, every other matrix Q8_0,
    as llama.cpp's quantizer) is the synthetic MXFP4 model: the stage runtime runs the
    package and equals llama.cpp on that file bit for bit."""
    f32, _ = package_model(SPEC, "F32", root)
    out = root / "quantized"
    argv = ["quantize-layer-package", str(f32), "--out-dir", str(out), "--type", "MXFP4_MOE"]
    prov = ["--model-id", "canary/gpt-oss:MXFP4", "--source-revision", "0123abc"]
    code = quantize_main([*argv, *prov, "--source-file", f32.name, "--threads", "1", "--json"])
    assert code == 0
    counts = json.loads(capsys.readouterr().out)["tensor_types"]
    assert counts["MXFP4"] == 3 * SPEC.dims().n_layers  # gate, up and down experts per layer
    ids = synth.long_prompt(N, vocab=SPEC.dims().vocab)
    got = stage_logits(out, ids, Case(("0..2", "2..4"), 128))
    assert np.array_equal(got, oracle(model[0], ids))


def test_the_files_yarn_beta_keys_are_ignored_as_llama_cpp_ignores_them(
    tmp_path: Path,
) -> None:
    """llama.cpp's gpt-oss loader reads no YaRN beta or log-multiplier key (its defaults, 32
    and 1, apply): a file that has them gives llama.cpp's logits all the same."""
    keys = gguf.Keys.Rope
    tuned = {
        keys.SCALING_YARN_BETA_FAST: 8.0,
        keys.SCALING_YARN_BETA_SLOW: 2.0,
        keys.SCALING_YARN_LOG_MUL: 1.0,
    }
    variant = replace(SPEC, kv={**SPEC.kv, **tuned})
    gguf_path, pkg = package_model(variant, "F16", tmp_path)
    ids = synth.long_prompt(synth.SLIDING_WINDOW + 12, vocab=SPEC.dims().vocab)
    got = stage_logits(pkg, ids, Case(("0..4",), 512))
    assert np.array_equal(got, oracle(gguf_path, ids))


def _kv(**extra: object) -> dict[str, object]:
    a = "gpt-oss."
    kv: dict[str, object] = {
        "general.architecture": "gpt-oss",
        a + "block_count": 4,
        a + "embedding_length": 256,
        a + "attention.head_count": 4,
        a + "attention.head_count_kv": 2,
        a + "attention.key_length": 64,
        a + "attention.value_length": 64,
        a + "attention.layer_norm_rms_epsilon": 1e-5,
        a + "attention.sliding_window": 128,
        a + "expert_count": 8,
        a + "expert_used_count": 4,
        a + "expert_feed_forward_length": 256,
        a + "rope.scaling.type": "yarn",
        a + "rope.scaling.factor": 32.0,
        a + "rope.scaling.original_context_length": 4096,
    }
    kv.update({a + k: v for k, v in extra.items()})
    return {k: v for k, v in kv.items() if v is not None}


def test_even_layers_slide_and_every_layer_is_yarn_scaled() -> None:
    spec = spec_from_metadata(_kv())
    assert spec.swa_layers == frozenset({0, 2}) and spec.sliding_window == 128
    assert spec.yarn is not None and spec.yarn.n_ctx_orig == 4096
    assert spec.rope_scale_for(0) == spec.rope_scale_for(1) == 1.0 / 32.0
    assert spec.n_ff_exp == 256 and not spec.expert_weights_norm


@pytest.mark.parametrize("key", ["expert_feed_forward_length", "attention.sliding_window"])
def test_a_key_llama_cpp_requires_is_refused_with_a_code_when_missing(key: str) -> None:
    with pytest.raises(ModelError) as err:
        spec_from_metadata(_kv(**{key: None}))
    assert err.value.code == "missing_hyperparameter"
    assert key in str(err.value)


def test_the_numpy_engine_refuses_the_family_with_a_code(model: tuple[Path, Path]) -> None:
    """The ggml engine runs the package; the numpy engine, which has no sinks, biased experts
    or clamped SwiGLU, refuses it rather than compute it wrongly."""
    with chain("ggml", model[1], ["0..4"], CFG) as ch:
        assert ch.prefill("s", [5, 6, 7]).logits is not None
    with pytest.raises(StageUnsupported) as err:
        chain("numpy", model[1], ["0..4"], CFG)
    assert err.value.code == "unsupported_architecture"
    assert "numpy engine" in str(err.value)
