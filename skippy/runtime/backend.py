"""Where a stage's graphs run: weight placement, buffers and compute on ggml's CPU backend.

This is the seam a ggml device backend plugs into (``ggml_backend_sched`` across devices):
the engine asks it to place the checked weights, for the buffer type its graphs and KV caches
are allocated from, and to compute a graph; it never calls a backend function itself.

Today the weights are the package's own fragment bytes: every part with tensors is mapped
read-only (``skippy.runtime.weights``) and handed to ggml with
``ggml_backend_cpu_buffer_from_ptr``; each weight tensor (vectors, matrices and the rank-3
expert tensors of a MoE layer) is placed at its offset with ``ggml_backend_tensor_alloc``.
Nothing is copied or converted. With ``repack`` (``StageConfig.repack``) the weights whose
matmul the CPU backend's extra buffer type supports (Q4_0, Q4_K, ... as interleaved row
blocks: ``CPU_REPACK``) are copied into a buffer of that type instead, as llama.cpp's default
does: faster kernels, bit-identical to llama.cpp's default, but those weights are no longer
zero-copy. The CPU-only tactic lives here too: the thread governor,
which runs a one-position step on the threads a busy machine allows now.
"""

from __future__ import annotations

from typing import Protocol

from skippy.gguf import ggml
from skippy.gguf.ggml import GgmlInitParams
from skippy.runtime.boundary import RuntimeLoadError
from skippy.runtime.contention import ThreadGovernor, machine_cores
from skippy.runtime.weights import StageWeights, WeightRef

_ok = ggml.non_null
# Read with ggml_get_rows (stage 0's embedding lookup), which no extra buffer type supports: a
# tied output head reads the same tensor, so llama.cpp leaves it unrepacked too.
_GATHERED = frozenset({"token_embd.weight"})
_PROBE_ROWS = 512  # llama.cpp's weight_buft_supported asks with a 512-token batch
# the stacked experts (ffn_gate_exps, ffn_up_exps, ffn_down_exps, ffn_gate_up_exps: gguf-py's
# names), multiplied through mul_mat_id; other rank-3 weights are multiplied per head
_EXPERTS = "_exps."


def new_weight_tensor(g: ggml.Ggml, ctx: int, r: WeightRef) -> int:
    """A no-alloc tensor of ``r``'s type and shape in ``ctx``, its size checked."""
    shape = r.shape
    if len(shape) == 1:
        t = g.ggml_new_tensor_1d(ctx, r.ggml_type, shape[0])
    elif len(shape) == 2:
        t = g.ggml_new_tensor_2d(ctx, r.ggml_type, shape[0], shape[1])
    elif len(shape) == 3:  # a MoE layer's experts: [in, out, n_expert]
        t = g.ggml_new_tensor_3d(ctx, r.ggml_type, shape[0], shape[1], shape[2])
    else:  # the families' plans hold nothing of a higher rank
        raise RuntimeLoadError(f"{r.name}: unexpected rank {len(shape)}")
    t = _ok(t, "ggml_new_tensor")
    if g.ggml_nbytes(t) != r.nbytes:  # ggml and our reader must agree on the size
        raise RuntimeLoadError(
            f"{r.name}: ggml sizes it {g.ggml_nbytes(t)} bytes, the file {r.nbytes}",
            code="fragment_tensor_shape",
        )
    return t


def map_weights(
    g: ggml.Ggml, w: StageWeights, tensors: dict[str, int], names: set[str] | None = None
) -> list[int]:
    """Place weights zero-copy at their bytes in the mapped parts (all, or ``names``): one
    CPU buffer over each part that holds one of them (``ggml_backend_cpu_buffer_from_ptr``),
    marked as weights; the buffers, for the caller to free."""
    refs = [r for r in w if names is None or r.name in names]
    buffers: dict[int, int] = {}
    try:
        for part in sorted({r.part for r in refs}):
            base, size = w.part_span(part)
            if base % ggml.TENSOR_ALIGNMENT:  # a mapping starts on a page; keep it explicit
                raise RuntimeLoadError(f"part {part} is mapped at a misaligned address")
            buffers[part] = _ok(g.ggml_backend_cpu_buffer_from_ptr(base, size), "buffer_from_ptr")
            g.ggml_backend_buffer_set_usage(buffers[part], ggml.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        for r in refs:
            at = w.address(r.name)
            status = g.ggml_backend_tensor_alloc(buffers[r.part], tensors[r.name], at)
            if status != ggml.GGML_STATUS_SUCCESS:
                raise RuntimeLoadError(f"{r.name}: ggml_backend_tensor_alloc status {status}")
    except BaseException:
        for b in buffers.values():
            g.ggml_backend_buffer_free(b)
        raise
    return list(buffers.values())


class CpuBackend:
    """ggml's CPU backend for one stage: its weights' context and buffers, the backend and
    its thread count. ``close()`` frees them."""

    def __init__(self, g: ggml.Ggml, n_threads: int, *, adaptive: bool) -> None:
        self.g = g
        self.n_threads = n_threads
        self._wctx: int | None = None
        self._buffers: list[int] = []
        self.repacked_bytes = 0  # weights copied into an extra buffer type (repack)
        self._backend = _ok(g.ggml_backend_cpu_init(), "ggml_backend_cpu_init")
        g.ggml_backend_cpu_set_n_threads(self._backend, n_threads)
        self.threads_now = n_threads
        self._governor = (
            ThreadGovernor(n_threads, machine_cores()) if adaptive and n_threads > 1 else None
        )

    def buffer_type(self) -> int:
        """The buffer type graphs and KV caches are allocated from."""
        return self.g.ggml_backend_cpu_buffer_type()

    def place_weights(
        self, w: StageWeights, *, repack: bool = False, tied_head: str | None = None
    ) -> dict[str, int]:
        """One no-alloc ggml tensor per checked weight, placed at its bytes in the mapping;
        with ``repack``, those an extra buffer type takes are copied (repacked) there.

        ``tied_head``: the name under which the engine looks for an output head that is
        the embedding matrix. With repacking, llama.cpp gives that head its own repacked
        copy (the lookup keeps the plain one), so the stage does too."""
        g = self.g
        refs = list(w)
        params = GgmlInitParams(
            mem_size=g.ggml_tensor_overhead() * (len(refs) + 2), mem_buffer=None, no_alloc=True
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
            tensors[r.name] = self._new_tensor(self._wctx, r)
        wanted = [(r.name, r) for r in refs if r.name not in _GATHERED and len(r.shape) in (2, 3)]
        embd = next((r for r in refs if r.name in _GATHERED), None)
        if repack and tied_head is not None and embd is not None and tied_head not in tensors:
            tensors[tied_head] = self._new_tensor(self._wctx, embd)
            wanted.append((tied_head, embd))
        repacked = self._repack(w, tensors, wanted) if repack else {}
        tensors = {k: v for k, v in tensors.items() if k in repacked or k in w}
        for r in refs:
            if r.name in repacked:
                continue
            status = g.ggml_backend_tensor_alloc(
                buffer_of[r.part], tensors[r.name], w.address(r.name)
            )
            if status != ggml.GGML_STATUS_SUCCESS:
                raise RuntimeLoadError(f"{r.name}: ggml_backend_tensor_alloc status {status}")
        self.repacked_bytes = sum(repacked.values())
        return tensors

    def _new_tensor(self, ctx: int, r: WeightRef) -> int:
        return new_weight_tensor(self.g, ctx, r)

    def _probe_op(self, ctx: int, w: int, r: WeightRef) -> int:
        """The op the engine runs on weight ``w``: a matmul (rank 2, or a rank-3 stack of
        per-head matrices such as MLA's ``attn_k_b``, which the repacking types refuse, as
        llama.cpp finds) or the experts' ``mul_mat_id``, over F32 activations, as llama.cpp
        asks the device."""
        g, f32 = self.g, ggml.GgmlType.F32
        if len(r.shape) == 2:
            b = g.ggml_new_tensor_2d(ctx, f32, r.shape[0], _PROBE_ROWS)
            return _ok(g.ggml_mul_mat(ctx, w, _ok(b, "ggml_new_tensor")), "ggml_mul_mat")
        if _EXPERTS not in r.name:
            b = g.ggml_new_tensor_3d(ctx, f32, r.shape[0], _PROBE_ROWS, r.shape[2])
            return _ok(g.ggml_mul_mat(ctx, w, _ok(b, "ggml_new_tensor")), "ggml_mul_mat")
        b = g.ggml_new_tensor_3d(ctx, f32, r.shape[0], 1, _PROBE_ROWS)
        ids = g.ggml_new_tensor_2d(ctx, ggml.GgmlType.I32, 1, _PROBE_ROWS)
        op = g.ggml_mul_mat_id(ctx, w, _ok(b, "ggml_new_tensor"), _ok(ids, "ggml_new_tensor"))
        return _ok(op, "ggml_mul_mat_id")

    def _repack(
        self, w: StageWeights, tensors: dict[str, int], wanted: list[tuple[str, WeightRef]]
    ) -> dict[str, int]:
        """Allocate the weights an extra buffer type supports in a buffer of that type and
        upload them (``ggml_backend_tensor_set`` repacks); their allocated bytes by name.
        ``wanted``: (name in ``tensors``, the weight whose bytes it holds), the candidates.

        llama.cpp's rule (``weight_buft_supported``): a weight goes to the first extra
        buffer type on which the device supports the op that reads it, asked with the
        weight placed in that type. The probe places it in an untouched buffer (virtual
        memory only), since a tensor once allocated cannot move."""
        g = self.g
        dev, bufts = ggml.cpu_extra_buffer_types(g)
        todo = wanted
        if not bufts or not todo:
            return {}
        params = GgmlInitParams(
            mem_size=g.ggml_tensor_overhead() * (4 * len(todo) * len(bufts) + 8),
            mem_buffer=None,
            no_alloc=True,
        )
        pctx = _ok(g.ggml_init(params), "ggml_init")
        chosen: dict[int, list[tuple[str, WeightRef]]] = {}
        try:
            for buft in bufts:
                size = max(g.ggml_backend_buft_get_alloc_size(buft, tensors[k]) for k, _ in todo)
                probe = _ok(g.ggml_backend_buft_alloc_buffer(buft, size), "alloc_buffer")
                try:
                    base = _ok(g.ggml_backend_buffer_get_base(probe), "buffer_get_base")
                    for k, r in todo:
                        t = self._new_tensor(pctx, r)
                        if g.ggml_backend_tensor_alloc(probe, t, base) != ggml.GGML_STATUS_SUCCESS:
                            continue
                        if g.ggml_backend_dev_supports_op(dev, self._probe_op(pctx, t, r)):
                            chosen.setdefault(buft, []).append((k, r))
                finally:
                    g.ggml_backend_buffer_free(probe)
                taken = {k for k, _ in chosen.get(buft, [])}
                todo = [(k, r) for k, r in todo if k not in taken]
                if not todo:
                    break
        finally:
            g.ggml_free(pctx)
        with ggml.without_debug_log(g):
            return self._upload(w, tensors, chosen)

    def _upload(
        self,
        w: StageWeights,
        tensors: dict[str, int],
        chosen: dict[int, list[tuple[str, WeightRef]]],
    ) -> dict[str, int]:
        """One buffer per extra buffer type, each chosen weight placed and repacked in it."""
        g = self.g
        placed: dict[str, int] = {}
        for buft, refs in chosen.items():
            align = max(g.ggml_backend_buft_get_alignment(buft), 1)
            sizes = [g.ggml_backend_buft_get_alloc_size(buft, tensors[k]) for k, _ in refs]
            offsets, end = [], 0
            for n in sizes:
                offsets.append(end)
                end += -(-n // align) * align
            buffer = _ok(g.ggml_backend_buft_alloc_buffer(buft, end), "alloc_buffer")
            self._buffers.append(buffer)
            g.ggml_backend_buffer_set_usage(buffer, ggml.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
            base = _ok(g.ggml_backend_buffer_get_base(buffer), "buffer_get_base")
            for (k, r), off, n in zip(refs, offsets, sizes, strict=True):
                t = tensors[k]
                status = g.ggml_backend_tensor_alloc(buffer, t, base + off)
                if status != ggml.GGML_STATUS_SUCCESS:
                    raise RuntimeLoadError(f"{r.name}: ggml_backend_tensor_alloc status {status}")
                # the repacking buffer takes a whole tensor at once (it asserts offset 0)
                g.ggml_backend_tensor_set(t, w.address(r.name), 0, r.nbytes)
                placed[k] = n
        return placed

    # The engine's graphs each get a runner: this backend's own allocator per graph.
    host_results = True  # a graph's tensors are in host memory: results are read in place
    resizes_graphs = True  # a reused graph's KV length is set in place before each run

    def runner(self, graph_size: int) -> GraphRunner:
        """An allocator for one graph at a time, computing on this backend."""
        return GallocRunner(self)

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


class GraphRunner(Protocol):
    """Allocates one graph at a time (a new ``alloc`` replaces the last) and computes it."""

    def alloc(self, graph: int) -> None: ...

    def compute(self, graph: int, *, step: bool = False) -> None: ...

    def buffer_bytes(self) -> int: ...

    def free(self) -> None: ...


class GallocRunner:
    """The CPU backend's graph allocator (``ggml_gallocr``) and compute."""

    def __init__(self, backend: CpuBackend) -> None:
        g = backend.g
        self.g, self._backend = g, backend
        self._galloc = _ok(g.ggml_gallocr_new(backend.buffer_type()), "gallocr")

    def alloc(self, graph: int) -> None:
        if not self.g.ggml_gallocr_alloc_graph(self._galloc, graph):
            raise ggml.GgmlCallFailed("ggml_gallocr_alloc_graph failed (out of memory?)")

    def compute(self, graph: int, *, step: bool = False) -> None:
        self._backend.compute(graph, step=step)

    def buffer_bytes(self) -> int:
        return int(self.g.ggml_gallocr_get_buffer_size(self._galloc, 0)) if self._galloc else 0

    def free(self) -> None:
        if self._galloc:
            self.g.ggml_gallocr_free(self._galloc)
            self._galloc = 0
