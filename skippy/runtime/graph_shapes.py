"""The shapes the ggml engine gives its graphs, so that they compute llama.cpp's bits.

ggml's CPU matmul picks its kernel by shape, and the kernels sum in different orders:

- llamafile's tinyBLAS (float types, Q8_0, Q4_0, Q5_0, IQ4_NL) runs only for a product of at
  least 2 columns (for float types also: an inner length that is a multiple of 8 and a row count
  that is a multiple of 4); anything else falls back to per-row dot products. The tiled K-quant
  and IQ kernels run from 8 columns on; fewer go through the dot products. Each kernel gives
  an output element the same sum whatever the other columns, so the bits depend only on which
  kernel ran.
- softmax sums a row 8 lanes at a time with a vector exp and the rest one by one with libm's.

So attention over an unpadded KV length (``start + n``) sums differently from llama.cpp, which
views its cache padded to a multiple of 256 cells (``llama_kv_cache::get_n_kv``; the context is
padded the same way, ``GGML_PAD(n_ctx, 256)``), masking the empty cells: a position's logits
then depended on how many rows its prefill chunk had (equal only at lengths <= 8 or multiples of
8). With the views padded as llama.cpp pads them, the remaining dependence is the column count
of the weight matmuls: a chunk of 1 row, or of 2-7 rows on K-quants, runs other kernels than a
long prompt's. A prefill therefore computes every chunk with at least ``PREFILL_MIN_ROWS``
rows (or the whole prompt so far, when that is shorter: what llama.cpp computes for a short
prompt in one batch), the engine adding copies of the chunk's first row whose K/V are never
written. Every position's logits are then the same for any chunking, and equal llama.cpp's for
the prompt in one batch. A decode step stays one row: llama.cpp decodes one row too.
"""

from __future__ import annotations

from typing import Final

# llama.cpp pads its context and the KV length its graphs view to this many cells.
KV_PAD: Final = 256
# The column count from which every ggml CPU matmul kernel is the one a long prompt runs
# (tinyBLAS from 2, the tiled K-quant kernels from 8).
PREFILL_MIN_ROWS: Final = 8


def kv_length(positions: int) -> int:
    """The KV cells llama.cpp's graphs view once ``positions`` cells are in use (``get_n_kv``:
    at least ``KV_PAD``, rounded up to it); also the cells a context of ``positions``
    holds (``GGML_PAD(n_ctx, 256)``)."""
    if positions < 0:
        raise ValueError(f"positions must be >= 0, got {positions}")
    return max(KV_PAD, -(-positions // KV_PAD) * KV_PAD)


def prefill_rows(n: int, end: int) -> int:
    """The rows a prefill graph computes for a chunk of ``n`` rows of a prefill call that
    ends at position ``end``: ``n``, padded up to ``PREFILL_MIN_ROWS`` unless the whole
    prompt so far (``end`` positions) is shorter."""
    if not 1 <= n <= end:
        raise ValueError(f"need 1 <= n <= end, got n={n}, end={end}")
    return max(n, min(PREFILL_MIN_ROWS, end))
