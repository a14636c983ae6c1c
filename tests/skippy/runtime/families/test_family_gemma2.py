"""gemma2's own behaviour beyond the certification matrix: the attention soft-cap in the
reused one-position decode graph (its capped scores are resized with the KV length), past the
sliding window, bit-identical to llama.cpp decoding one token at a time; and its metadata
defaults and refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from skippy.errors import ModelError
from skippy.runtime.canary import synth
from skippy.runtime.canary.check import package_model
from skippy.runtime.families import spec_from_metadata
from skippy.runtime.stage import StageConfig

pytestmark = pytest.mark.llama

SPEC = synth.family("gemma2")
N = synth.SLIDING_WINDOW + 12  # decoded positions reach past the window


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return package_model(SPEC, "F16", tmp_path_factory.mktemp("gemma2"))


def test_decode_steps_equal_llama_cpp_decoding_one_token_at_a_time(
    model: tuple[Path, Path],
) -> None:
    from stagetools import decode_rows, llama_decode_reference

    gguf, pkg = model
    ids = synth.long_prompt(N, vocab=SPEC.dims().vocab)
    ref = llama_decode_reference(gguf, ids, 512)
    got = decode_rows(pkg, ["0..2", "2..4"], ids, StageConfig(n_ctx=512, n_threads=1))
    assert got.shape == ref.shape
    assert np.array_equal(got, ref)


def _kv(**extra: object) -> dict[str, object]:
    a = "gemma2."
    return {
        "general.architecture": "gemma2",
        a + "block_count": 4,
        a + "embedding_length": 256,
        a + "attention.head_count": 4,
        a + "attention.head_count_kv": 2,
        a + "feed_forward_length": 512,
        a + "attention.layer_norm_rms_epsilon": 1e-6,
        **{a + k: v for k, v in extra.items()},
    }


def test_llama_cpp_defaults_apply_when_the_file_is_silent() -> None:
    spec = spec_from_metadata(_kv())
    assert spec.attn_softcap == 50.0 and spec.final_logit_softcap == 30.0
    assert spec.sliding_window == 4096
    assert spec.swa_layers == frozenset({0, 2})  # even layers slide, odd ones are global


@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_a_non_positive_soft_cap_is_refused_with_a_code(key: str) -> None:
    with pytest.raises(ModelError) as err:
        spec_from_metadata(_kv(**{key: -1.0}))
    assert err.value.code == "invalid_hyperparameters"
