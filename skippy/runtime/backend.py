"""Where a stage's graphs run: weight placement, buffers and compute on ggml's CPU backend.

This is the seam a ggml device backend plugs into (``ggml_backend_sched`` across devices):
the engine asks it to place the checked weights, for the buffer type its graphs and KV caches
are allocated from, and to compute a graph; it never calls a backend function itself.

Today the weights are the package's own fragment bytes: every part with tensors is mapped
read-only (``skippy.runtime.weights``) and handed to ggml with
``ggml_backend_cpu_buffer_from_ptr``; each weight tensor (vectors, matrices and the rank-3
expert tensors of a MoE layer) is placed at its offset with ``ggml_backend_tensor_alloc``.
Nothing is copied or converted. The CPU-only tactic lives here too: the thread governor,
which runs a one-position step on the threads a busy machine allows now.
"""

from __future__ import annotations

from skippy.gguf import ggml
from skippy.gguf.ggml import GgmlInitParams
from skippy.runtime.boundary import RuntimeLoadError
from skippy.runtime.contention import ThreadGovernor, machine_cores
from skippy.runtime.weights import StageWeights

_ok = ggml.non_null


class CpuBackend:
    """ggml's CPU backend for one stage: its weights' context and buffers, the backend and
    its thread count. ``close()`` frees them."""

    def __init__(self, g: ggml.Ggml, n_threads: int, *, adaptive: bool) -> None:
        self.g = g
        self.n_threads = n_threads
        self._wctx: int | None = None
        self._buffers: list[int] = []
        self._backend = _ok(g.ggml_backend_cpu_init(), "ggml_backend_cpu_init")
        g.ggml_backend_cpu_set_n_threads(self._backend, n_threads)
        self.threads_now = n_threads
        self._governor = (
            ThreadGovernor(n_threads, machine_cores()) if adaptive and n_threads > 1 else None
        )

    def buffer_type(self) -> int:
        """The buffer type graphs and KV caches are allocated from."""
        return self.g.ggml_backend_cpu_buffer_type()

    def place_weights(self, w: StageWeights) -> dict[str, int]:
        """One no-alloc ggml tensor per checked weight, placed at its bytes in the mapping."""
        g = self.g
        refs = list(w)
        params = GgmlInitParams(
            mem_size=g.ggml_tensor_overhead() * (len(refs) + 1), mem_buffer=None, no_alloc=True
        )
        self._wctx = _ok(g.ggml_init(params), "ggml_init")
        for part in w.parts_with_tensors():
            base, size = w.part_span(part)
            if base % ggml.TENSOR_ALIGNMENT:  # a mapping starts on a page; keep it explicit
                raise RuntimeLoadError(f"part {part} is mapped at a misaligned address")
            self._buffers.append(
                _ok(g.ggml_backend_cpu_buffer_from_ptr(base, size), "buffer_from_ptr")
            )
        buffer_of = dict(zip(w.parts_with_tensors(), self._buffers, strict=True))
        tensors: dict[str, int] = {}
        for r in refs:
            shape = r.shape
            if len(shape) == 1:
                t = g.ggml_new_tensor_1d(self._wctx, r.ggml_type, shape[0])
            elif len(shape) == 2:
                t = g.ggml_new_tensor_2d(self._wctx, r.ggml_type, shape[0], shape[1])
            elif len(shape) == 3:  # a MoE layer's experts: [in, out, n_expert]
                t = g.ggml_new_tensor_3d(self._wctx, r.ggml_type, shape[0], shape[1], shape[2])
            else:  # the families' plans hold nothing of a higher rank
                raise RuntimeLoadError(f"{r.name}: unexpected rank {len(shape)}")
            t = _ok(t, "ggml_new_tensor")
            if g.ggml_nbytes(t) != r.nbytes:  # ggml and our reader must agree on the size
                raise RuntimeLoadError(
                    f"{r.name}: ggml sizes it {g.ggml_nbytes(t)} bytes, the file {r.nbytes}",
                    code="fragment_tensor_shape",
                )
            status = g.ggml_backend_tensor_alloc(buffer_of[r.part], t, w.address(r.name))
            if status != ggml.GGML_STATUS_SUCCESS:
                raise RuntimeLoadError(f"{r.name}: ggml_backend_tensor_alloc status {status}")
            tensors[r.name] = t
        return tensors

    def compute(self, graph: int, *, step: bool = False) -> None:
        """Run a graph. An adaptive stage runs a one-position ``step`` on the threads the
        governor allows now (a small graph is all barriers: one preempted thread stalls the
        rest at every op) and everything else on the cap (a prefill's big matmuls still gain
        from a second thread beside a busy neighbour: docs/performance.md)."""
        if self._governor is not None:
            n = self._governor.threads() if step else self.n_threads
            if n != self.threads_now:
                self.g.ggml_backend_cpu_set_n_threads(self._backend, n)
                self.threads_now = n
        status = self.g.ggml_backend_graph_compute(self._backend, graph)
        if status != ggml.GGML_STATUS_SUCCESS:
            raise ggml.GgmlCallFailed(f"ggml_backend_graph_compute returned status {status}")

    def close(self) -> None:
        g = self.g
        if self._backend:
            g.ggml_backend_free(self._backend)
            self._backend = 0
        for b in self._buffers:
            g.ggml_backend_buffer_free(b)
        self._buffers = []
        if self._wctx:
            g.ggml_free(self._wctx)
            self._wctx = None
