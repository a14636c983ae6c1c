"""smollm3's own behaviour beyond the certification matrix: no RoPE on every 4th layer (3, 7,
...: llama.cpp's fixed interval, no metadata key) in a model deep enough to have two such
layers, one of them inside a stage, and the numpy reference skipping RoPE there too.

The oracle is llama.cpp (llama-cpp-python 0.3.36) on synthetic models of the canary
(``skippy.runtime.canary.synth``), one batch, weight repacking off.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

from stagetools import chain

from skippy.gguf.reader import open_gguf
from skippy.runtime.canary import synth
from skippy.runtime.canary.check import Case, max_difference, oracle, package_model, stage_logits
from skippy.runtime.families import spec_from_metadata
from skippy.runtime.stage import StageConfig
from skippy.runtime.weights import read_model_kv

pytestmark = pytest.mark.llama

SMOLLM3 = synth.family("smollm3")
DEEP = replace(SMOLLM3, name="smollm3-8", n_layers=8)
NUMPY_TOLERANCE = 0.05  # |numpy f32 - llama.cpp| here, measured: ~0.003 (F16 weights)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("family_smollm3")


def test_layers_without_rope_equal_llama_cpp_bit_for_bit(root: Path) -> None:
    model, pkg = package_model(DEEP, "Q8_0", root)
    with open_gguf(model) as g:
        assert spec_from_metadata(read_model_kv(g)).nope_layers == {3, 7}
    ids = synth.long_prompt(96, vocab=DEEP.dims().vocab)
    ref = oracle(model, ids)
    for case in (Case(("0..8",), 512), Case(("0..2", "2..5", "5..8"), 7)):
        assert max_difference(stage_logits(pkg, ids, case), ref) == 0.0, case.name


@pytest.mark.parametrize("family", [SMOLLM3, DEEP], ids=lambda f: f.name)
def test_numpy_oracle_is_close_to_llama_cpp(family: synth.FamilySpec, root: Path) -> None:
    model, pkg = package_model(family, "F16", root)
    ids = synth.long_prompt(96, vocab=family.dims().vocab)
    ref = oracle(model, ids)
    cfg = StageConfig(n_ctx=256, n_threads=1)
    with chain("numpy", pkg, [f"0..{family.dims().n_layers}"], cfg) as ch:
        got = ch.logits(ids, all_positions=True)
    err = float(np.abs(got - ref).max())
    assert 0 < err <= NUMPY_TOLERANCE  # an independent computation, yet the same model
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.95
