"""``skippy.runtime.model.attention_mask``: which keys each query of a prefill chunk sees,
causal, in a sliding window (the last N positions) or in a chunk (its own aligned block of N
positions: llama.cpp's LLAMA_SWA_TYPE_CHUNKED, Llama 4), against llama.cpp's rule written out
position by position."""

from __future__ import annotations

import numpy as np
import pytest

from skippy.runtime.model import SwaType, attention_mask, first_visible


def _llama_cpp_masked(p0: int, p1: int, window: int | None, swa_type: SwaType) -> bool:
    """llama_hparams::is_masked_swa plus causality: key position p0, query position p1."""
    if p0 > p1:
        return True
    if window is None:
        return False
    if swa_type == "chunked":
        return p0 < (p1 // window) * window
    return p1 - p0 >= window


@pytest.mark.parametrize("swa_type", ["standard", "chunked"])
@pytest.mark.parametrize(("start", "n", "window"), [(0, 9, 4), (5, 6, 4), (7, 1, 4), (3, 5, None)])
def test_masks_follow_llama_cpps_rule(
    start: int, n: int, window: int | None, swa_type: SwaType
) -> None:
    n_kv = 16
    m = attention_mask(start, n, window, n_kv=n_kv, swa_type=swa_type)
    assert m.shape == (n, n_kv) and m.dtype == np.float32
    for i in range(n):
        for j in range(n_kv):
            masked = _llama_cpp_masked(j, start + i, window, swa_type)
            assert m[i, j] == (-np.inf if masked else 0.0), (i, j)


def test_a_chunk_starts_at_a_multiple_of_its_size() -> None:
    assert [first_visible(p, 4, "chunked") for p in (0, 3, 4, 7, 8)] == [0, 0, 4, 4, 8]
    assert [first_visible(p, 4, "standard") for p in (0, 3, 4, 7)] == [-3, 0, 1, 4]
    # right after a chunk boundary a chunked query sees itself alone, a sliding one 4 keys
    chunked = attention_mask(8, 1, 4, n_kv=9, swa_type="chunked")
    sliding = attention_mask(8, 1, 4, n_kv=9)
    assert int((chunked == 0).sum()) == 1 and int((sliding == 0).sum()) == 4
