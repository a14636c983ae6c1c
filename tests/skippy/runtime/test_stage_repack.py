"""Weight repacking in the stage runtime (``StageConfig(repack=True)``, ``[serving] repack``).

With repacking on, the ggml stage places the weights the CPU backend's extra buffer type
takes (here Q4_K as interleaved row blocks) in that buffer type, as llama.cpp's default
does, and its logits then equal llama.cpp's default (repacking on) bit for bit, over one
stage and a three-stage split, prefill in chunks of 128. Repacking changes llama.cpp's own
logits (asserted too, so the equality is not the trivial one). gemma3's tied head gets its
own repacked copy of the embedding matrix, as in llama.cpp.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from skippy.errors import UsageError
from skippy.runtime.canary import check, synth
from skippy.runtime.stage import StageConfig

pytestmark = pytest.mark.llama

CASES = [("qwen3moe", "Q4_K"), ("llama", "Q4_K"), ("gemma3", "Q4_K")]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("repack")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_repacked_stage_equals_llama_cpp_default(root: Path, case: tuple[str, str]) -> None:
    name, dtype = case
    spec = synth.family(name)
    model, pkg = check.package_model(spec, dtype, root)
    ids = synth.long_prompt(check.LONG_PROMPT, vocab=spec.dims().vocab)
    repacked = check.oracle(model, ids, n_batch=128, repack=True)
    plain = check.oracle(model, ids, n_batch=128, repack=False)
    assert check.max_difference(repacked, plain) > 0.0  # repacking does change the bits
    for ranges in check.layouts(spec.dims().n_layers)[:2]:  # one stage, three stages
        got = check.stage_logits(pkg, ids, check.Case(ranges, 128), repack=True)
        assert got.shape == repacked.shape
        assert np.array_equal(got, repacked), (ranges, check.max_difference(got, repacked))


def test_repack_must_be_a_boolean() -> None:
    assert StageConfig(repack=True).repack is True
    with pytest.raises(UsageError) as e:
        StageConfig(repack="yes")  # type: ignore[arg-type]
    assert e.value.code == "invalid_runtime_config"


def test_serving_repack_key() -> None:
    from mesh_node.settings import serving_settings

    assert serving_settings({}).repack is False
    assert serving_settings({"repack": True}).repack is True
    with pytest.raises(UsageError) as e:
        serving_settings({"repack": "on"})
    assert "serving.repack" in str(e.value)


def test_repacking_logs_no_line_per_tensor(root: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """ggml logs every repacked tensor at debug level on stderr; a stage's load keeps
    stderr free of those lines."""
    spec = synth.family("llama")
    _, pkg = check.package_model(spec, "Q4_K", root)
    capfd.readouterr()
    with check.open_chain(pkg, check.Case((f"0..{spec.dims().n_layers}",), 128), repack=True):
        pass
    assert "repack" not in capfd.readouterr().err
