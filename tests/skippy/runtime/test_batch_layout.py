"""Which weight types a batched decode graph multiplies as one ``[k, B]`` matrix
(``skippy.runtime.batch_layout``): the check runs this process's real ggml on a slice of
each type's real weight, and its verdict must be the whole weight's."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

from pkgtools import make_package
from stagetools import chain

from skippy.gguf.ggml import GgmlType, tensor_struct
from skippy.runtime import batch_layout
from skippy.runtime.batch_layout import check_rows, exact_widths
from skippy.runtime.ggml_engine import GgmlStage
from skippy.runtime.stage import StageConfig

pytestmark = pytest.mark.llama

CFG = StageConfig(n_ctx=32, n_threads=2, max_sessions=8)


def test_check_rows_keeps_small_weights_whole_and_the_remainder_of_large_ones() -> None:
    assert check_rows(1) == 1
    assert check_rows(128) == 128
    assert check_rows(129) == 64 + 1
    assert check_rows(262144) == 64
    assert check_rows(1000) == 64 + 1000 % 64


@pytest.fixture(scope="module")
def llama_pkg(synth_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("batch_layout") / "llama"
    make_package(synth_dir.llama, root, model_id="acme/llama-GGUF:Q8_0")
    return root


def _weights_by_type(st: GgmlStage) -> dict[int, int]:
    out: dict[int, int] = {}
    for w in st._layer_weights.values():
        for t in w.matrices():
            out.setdefault(tensor_struct(t).type, t)
    return out


def test_the_slice_verdict_is_the_whole_weights_and_tells_types_apart(
    llama_pkg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For every weight type of the synthetic llama, the widths the check admits from a
    slice of the weight are those at which the whole weight's [k, B] product equals its
    one-column products; F16 (a GEMM that sums in another order) is admitted at no width and
    Q8_0 at every width, so the graph really mixes both layouts."""
    with chain("ggml", llama_pkg, ["0..4"], CFG) as ch:
        st = ch.stages[0]
        assert isinstance(st, GgmlStage)
        by_type = _weights_by_type(st)
        sliced = {t: exact_widths(st.g, w, 8, st._compute) for t, w in by_type.items()}
        monkeypatch.setattr(batch_layout, "check_rows", lambda rows: rows)
        whole = {t: exact_widths(st.g, w, 8, st._compute, seed=1) for t, w in by_type.items()}
        assert st._exact_gemm_widths() == sliced  # what the stage's graphs use
    assert sliced == whole
    assert sliced[GgmlType.F16] == frozenset()
    assert sliced[GgmlType.Q8_0] == frozenset(range(2, 9))
