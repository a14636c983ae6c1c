"""Which weight types a batched decode graph may multiply as one ``[k, B]`` matrix, found by
asking this process's ggml.

A batch of B sessions' one-position steps can meet a weight two ways:

- ``[k, 1, B]`` (the batch in dim 2, the weight broadcast): ggml's CPU matmul runs its per-row
  vec-dot for every column, the very kernel of a one-session decode (``[k, 1]``). Exact for
  every type, but it shares only the weight reads: on these cores a step is mostly the
  vec-dots' arithmetic, so 4 sessions cost ~3x one (docs/performance.md, "Batched decode").
- ``[k, B]`` (the batch in dim 1): for ``B >= 2`` ggml hands some types to llamafile's
  register-tiled GEMM (tinyBLAS), which loads each weight block once for several columns:
  ~2.2x one column's time for 4 columns of the gemma3 head, against ~3.2x.

Whether the GEMM's sums equal the GEMV's bit for bit depends on the type and on the kernels
this ggml was built with (F16/F32 GEMMs sum in another order; the Q8_0 and Q5_0 kernels here
do the same per-block products in the same order). So it is measured, not assumed: for each
weight type of a stage, a slice of one of its real weights is multiplied by random columns in
both forms, for every batch width up to the stage's session cap, and a width is ``[k, B]``-
safe for that type only if every column equals its own one-column product bit for bit (the
kernel can change with the width: Q4_K and Q6_K here are exact up to 7 columns, not at 8).
The same operations in the same order give the same bits for every input; a different order
shows on random data (a rounding difference in some of ~10^4 sums), so random inputs are a
sound test of the kernel's order, which is what exactness depends on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

import numpy as np

from skippy.gguf import ggml
from skippy.gguf.ggml import GgmlInitParams, GgmlType, non_null, tensor_struct

# Rows of a weight the check multiplies: enough for the GEMM's whole tiles and, with the
# weight's own remainder modulo 64 added, its edge tiles too.
CHECK_ROWS: Final = 64


def check_rows(rows: int) -> int:
    """How many of a weight's ``rows`` the check uses: all of a small weight, else
    ``CHECK_ROWS`` plus the weight's remainder (the GEMM's edge tiles follow it)."""
    if rows <= 2 * CHECK_ROWS:
        return rows
    return CHECK_ROWS + rows % CHECK_ROWS


def exact_gemm_widths(
    g: ggml.Ggml,
    weights: Mapping[int, int],
    max_batch: int,
    compute: Callable[[int], None],
    *,
    seed: int = 0,
) -> dict[int, frozenset[int]]:
    """Per ggml type (keys of ``weights``: type -> one weight tensor of it), the batch widths
    B in ``2..max_batch`` whose ``[k, B]`` product equals B one-column products bit for bit.
    ``compute`` runs a graph on the caller's backend (its threads)."""
    return {
        type_: exact_widths(g, weight, max(max_batch, 2), compute, seed)
        for type_, weight in weights.items()
    }


def exact_widths(
    g: ggml.Ggml, weight: int, max_batch: int, compute: Callable[[int], None], seed: int = 0
) -> frozenset[int]:
    """The widths B in ``2..max_batch`` at which ``weight`` (a slice of its rows) times B
    random columns equals each column's own product bit for bit."""
    ws = tensor_struct(weight)
    k, rows = int(ws.ne[0]), check_rows(int(ws.ne[1]))
    n_ops = 2 * max_batch + 2
    mem = g.ggml_tensor_overhead() * 4 * n_ops + g.ggml_graph_overhead_custom(4 * n_ops, False)
    params = GgmlInitParams(mem_size=mem, mem_buffer=None, no_alloc=True)
    ctx = non_null(g.ggml_init(params), "ggml_init")
    galloc = 0
    try:
        gf = non_null(g.ggml_new_graph_custom(ctx, 4 * n_ops, False), "ggml_new_graph")
        w = g.ggml_view_2d(ctx, weight, k, rows, int(ws.nb[1]), 0)
        x = non_null(g.ggml_new_tensor_2d(ctx, GgmlType.F32, k, max_batch), "ggml_new_tensor")
        g.ggml_set_input(x)
        nb1 = 4 * k

        def product(cols: int, first: int) -> int:
            y = g.ggml_mul_mat(ctx, w, g.ggml_view_2d(ctx, x, k, cols, nb1, nb1 * first))
            g.ggml_set_output(y)
            g.ggml_build_forward_expand(gf, y)
            return y

        singles = [product(1, j) for j in range(max_batch)]
        batches = {b: product(b, 0) for b in range(2, max_batch + 1)}
        galloc = non_null(g.ggml_gallocr_new(g.ggml_backend_cpu_buffer_type()), "gallocr")
        if not g.ggml_gallocr_alloc_graph(galloc, gf):
            raise ggml.GgmlCallFailed("ggml_gallocr_alloc_graph failed (out of memory?)")
        data = np.random.default_rng(seed).standard_normal((max_batch, k)).astype(np.float32)
        g.ggml_backend_tensor_set(x, data.ctypes.data, 0, data.nbytes)
        compute(gf)
        alone = np.stack([_read(g, y, 1, rows)[0] for y in singles])
        return frozenset(
            b for b, y in batches.items() if np.array_equal(_read(g, y, b, rows), alone[:b])
        )
    finally:
        if galloc:
            g.ggml_gallocr_free(galloc)
        g.ggml_free(ctx)


def _read(g: ggml.Ggml, tensor: int, cols: int, rows: int) -> np.ndarray:
    out = np.empty((cols, rows), dtype=np.float32)
    g.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
    return out
