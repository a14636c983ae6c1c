"""olmo2's own behaviour beyond the certification matrix: OLMo 3's sliding-window layers (the
same architecture with ``attention.sliding_window``), the numpy reference on olmo2's
post-norm-only layers with whole-projection Q/K norms, and its head-dimension check.

The oracle is llama.cpp (llama-cpp-python 0.3.36) on synthetic models of the canary
(``skippy.runtime.canary.synth``), one batch, weight repacking off.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

from stagetools import chain

from skippy.errors import ModelError
from skippy.gguf.reader import open_gguf
from skippy.runtime.canary import synth
from skippy.runtime.canary.check import Case, max_difference, oracle, package_model, stage_logits
from skippy.runtime.families import spec_from_metadata
from skippy.runtime.stage import StageConfig
from skippy.runtime.weights import read_model_kv

pytestmark = pytest.mark.llama

K = gguf.Keys
OLMO2 = synth.family("olmo2")
# OLMo 3: five layers, so the default pattern (three of four slide) makes layer 3 global and
# layers 0-2 and 4 sliding, with a window the prompts go past
OLMO3 = replace(
    OLMO2,
    name="olmo3",
    kv={**OLMO2.kv, K.Attention.SLIDING_WINDOW: synth.SLIDING_WINDOW},
    n_layers=5,
)
# |numpy f32 - llama.cpp| here, measured: ~0.003 (F16 weights)
NUMPY_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("family_olmo2")


def test_olmo3_sliding_layers_equal_llama_cpp_bit_for_bit(root: Path) -> None:
    model, pkg = package_model(OLMO3, "Q8_0", root)
    spec = spec_from_metadata(gguf_kv(model))
    assert spec.sliding_window == synth.SLIDING_WINDOW and spec.swa_layers == {0, 1, 2, 4}
    ids = synth.long_prompt(synth.SLIDING_WINDOW + 64, vocab=OLMO3.dims().vocab)
    ref = oracle(model, ids)
    for case in (Case(("0..5",), 512), Case(("0..2", "2..5"), 7)):
        assert max_difference(stage_logits(pkg, ids, case), ref) == 0.0, case.name


@pytest.mark.parametrize("family", [OLMO2, OLMO3], ids=lambda f: f.name)
def test_numpy_oracle_is_close_to_llama_cpp(family: synth.FamilySpec, root: Path) -> None:
    model, pkg = package_model(family, "F16", root)
    ids = synth.long_prompt(synth.SLIDING_WINDOW + 32, vocab=family.dims().vocab)
    ref = oracle(model, ids)
    cfg = StageConfig(n_ctx=256, n_threads=1)
    with chain("numpy", pkg, [f"0..{family.dims().n_layers}"], cfg) as ch:
        got = ch.logits(ids, all_positions=True)
    err = float(np.abs(got - ref).max())
    assert 0 < err <= NUMPY_TOLERANCE  # an independent computation, yet the same model
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.95


def test_heads_that_do_not_tile_the_width_are_refused() -> None:
    # llama.cpp shapes olmo2's attn_output and K norm from embedding_length / head_count
    kv = {
        "general.architecture": "olmo2",
        "olmo2.block_count": 2,
        "olmo2.embedding_length": 256,
        "olmo2.attention.head_count": 4,
        "olmo2.attention.key_length": 32,
        "olmo2.feed_forward_length": 512,
        "olmo2.attention.layer_norm_rms_epsilon": 1e-6,
    }
    with pytest.raises(ModelError) as err:
        spec_from_metadata(kv)
    assert err.value.code == "invalid_hyperparameters"
    assert "4 x 32 != 256" in str(err.value)


def gguf_kv(path: Path) -> dict[str, Any]:
    with open_gguf(path) as g:
        return read_model_kv(g)
