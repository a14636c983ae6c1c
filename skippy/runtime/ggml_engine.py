"""The ggml stage engine: a layer range's forward pass as ggml graphs on the CPU backend.

Weights are the package's own fragment bytes: every part with tensors is mapped read-only
(``skippy.runtime.weights``) and handed to ggml with ``ggml_backend_cpu_buffer_from_ptr``;
each weight tensor is placed at its offset with ``ggml_backend_tensor_alloc``. Nothing is
copied or converted (quantized matmuls run on the quantized bytes; ggml quantizes the
activations to Q8 for them, as llama.cpp does).

Per call, one graph: embeddings (stage 0) or the incoming activations, then each layer
(RMS norm, q/k/v, optional q/k norms, RoPE, the session's F16 KV cache, masked softmax
attention, output projection, gated FFN), then for the final stage the output norm and
head over only the rows whose logits are wanted (kept after the last layer's attention
output projection, as llama.cpp's ``inp_out_ids``). The op sequence mirrors llama.cpp's graph
builders for these architectures (``src/models/{llama,qwen2,qwen3,gemma3}.cpp``) with the
non-flash attention path and the V cache stored transposed, as llama.cpp uses them through
llama-cpp-python by default, and so do the shapes (``skippy.runtime.graph_shapes``): the
cache holds the context padded to 256 cells, attention views it padded to a multiple of 256
(the empty cells masked), and a prefill chunk computes at least 8 rows, so a position's
logits do not depend on how its prompt was chunked. Graphs are allocated by one
``ggml_gallocr`` per stage.

Every value that reaches ggml has been checked in Python first (``StageBase.check_inputs``,
``StageWeights``): ggml aborts the process on a failed assertion.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from skippy.gguf import ggml
from skippy.gguf.ggml import (
    GGML_ROPE_TYPE_NEOX,
    GGML_ROPE_TYPE_NORMAL,
    GgmlInitParams,
    GgmlTensorStruct,
    GgmlType,
    tensor_struct,
)
from skippy.runtime.boundary import RuntimeLoadError
from skippy.runtime.contention import ThreadGovernor, machine_cores
from skippy.runtime.graph_shapes import kv_length, prefill_rows
from skippy.runtime.model import OUTPUT_NORM_TENSOR, ROPE_FREQS_TENSOR, attention_mask
from skippy.runtime.stage import STAGE_API_VERSION, StageBase

RUNTIME_VERSION: Final = f"skippy-stage/{STAGE_API_VERSION} ggml/{ggml.GGML_VERSION}"
# Tensors (ops and views) a layer adds to a graph, with room to spare; ggml aborts when a
# context runs out of room, so this errs large.
_TENSORS_PER_LAYER: Final = 64
_TENSORS_FIXED: Final = 64
_TENSORS_PER_MEMBER: Final = 32  # a batched decode graph's per-session attention, per layer
# Batched decode graphs kept per stage (one per recent set of sessions: sessions joining and
# leaving make new sets; a steady batch reuses its graph every step).
BATCH_GRAPHS_KEPT: Final = 4
# YaRN parameters that disable YaRN (ggml.h, ggml_rope_ext); llama.cpp passes these values
# when the model has no YaRN scaling.
_EXT_FACTOR, _ATTN_FACTOR, _BETA_FAST, _BETA_SLOW = 0.0, 1.0, 32.0, 1.0


_ok = ggml.non_null


@dataclass
class _KvCache:
    """One session's K and V for each of the stage's layers, in one backend buffer.
    K of a layer: [kv_dim, cells] F16 (one row per position); V: [cells, kv_dim] F16
    (transposed, so attention multiplies it without a copy). ``cells`` is the context padded
    as llama.cpp pads it (``kv_length(n_ctx)``)."""

    ctx: int
    buffer: int
    k: dict[int, int]
    v: dict[int, int]
    nbytes: int
    decode: _DecodeGraph | None = None  # built at the session's first decode


@dataclass
class _KvSlots:
    """How a reused decode graph writes and reads the cache: K/V rows by index (inputs, so
    the position is data, not graph shape), attention views built over every cell, and the
    tensors whose KV length is set before each run (``_SessionInputs.resize``)."""

    k_rows: int  # I64 [1]: the position
    v_rows: int  # I64 [kv_dim]: d * cells + position (V is stored transposed)
    resizable: list[tuple[GgmlTensorStruct, int, bool]] = field(default_factory=list)

    def add(self, tensor: int, dim: int, contiguous: bool) -> None:
        self.resizable.append((tensor_struct(tensor), dim, contiguous))


@dataclass(kw_only=True)
class _SessionInputs:
    """One session's part of a decode graph, alone (``_DecodeGraph``) or batched
    (``_BatchMember``): the inputs naming the cache rows its K and V are written at and its
    attention masks, the host buffers behind them, and the KV length its attention tensors
    are sized to."""

    slots: _KvSlots
    masks: dict[int | None, int]  # F32 [cells, 1] each, resized to [n_kv, 1]
    k_buf: npt.NDArray[np.int64]
    v_base: npt.NDArray[np.int64]
    v_buf: npt.NDArray[np.int64]
    mask_buf: npt.NDArray[np.float32]
    n_kv: int = 0

    @staticmethod
    def buffers(kv_dim: int, cells: int) -> dict[str, Any]:
        """Fresh host buffers for a session's inputs (keyword arguments)."""
        v_base = np.arange(kv_dim, dtype=np.int64) * cells
        return {
            "k_buf": np.zeros(1, dtype=np.int64),
            "v_base": v_base,
            "v_buf": v_base.copy(),
            "mask_buf": np.zeros(cells, dtype=np.float32),
        }

    def resize(self, n_kv: int) -> None:
        """Set the KV length of every attention tensor (``_resize_slots``)."""
        if n_kv != self.n_kv:
            _resize_slots(self.slots, n_kv)
            self.n_kv = n_kv

    def set_position(self, g: ggml.Ggml, position: int) -> None:
        """Point the graph at ``position``: the KV length (padded as llama.cpp pads it), the
        cache rows K and V are written at, and each mask (query ``position`` sees every key
        up to it, minus those outside its window; the cells after it are empty)."""
        n_kv = kv_length(position + 1)
        self.resize(n_kv)
        self.k_buf[0] = position
        np.add(self.v_base, position, out=self.v_buf)
        g.ggml_backend_tensor_set(self.slots.k_rows, self.k_buf.ctypes.data, 0, 8)
        g.ggml_backend_tensor_set(self.slots.v_rows, self.v_buf.ctypes.data, 0, self.v_buf.nbytes)
        for window, mask in self.masks.items():
            m = self.mask_buf[:n_kv]
            m[: position + 1] = 0.0
            m[position + 1 :] = -np.inf
            if window is not None and position + 1 > window:
                m[: position + 1 - window] = -np.inf
            g.ggml_backend_tensor_set(mask, m.ctypes.data, 0, 4 * n_kv)


@dataclass(kw_only=True)
class _DecodeGraph(_SessionInputs):
    """One session's one-position graph, built once over every cell and run per token: only
    its inputs and the KV length of its attention tensors change between runs (the length
    moves in steps of 256, ``kv_length``), so each run computes exactly what a freshly built
    graph for that position computes (same ops, same shapes, same kernels: bit-identical)."""

    ctx: int
    galloc: int
    graph: int
    tokens: int  # I32 [1] ids (stage 0) or F32 [width, 1] activations
    pos: int  # I32 [1]
    result: int  # activations [width, 1] or logits [vocab, 1]
    # the result's bytes in the graph's own compute buffer (fixed while the graph lives)
    result_view: npt.NDArray[np.float32]
    pos_buf: npt.NDArray[np.int32]


def _resize_slots(slots: _KvSlots, n_kv: int) -> None:
    """Set the KV length of every attention tensor of ``slots`` (views keep their strides;
    contiguous results get the strides of their new shape)."""
    for t, dim, contiguous in slots.resizable:
        t.ne[dim] = n_kv
        if contiguous:
            nb = t.nb
            nb[1] = nb[0] * t.ne[0]
            nb[2] = nb[1] * t.ne[1]
            nb[3] = nb[2] * t.ne[2]


@dataclass(kw_only=True)
class _BatchMember(_SessionInputs):
    """One session's part of a batched decode graph: its cache, slots, masks and KV length."""

    kv: _KvCache


@dataclass
class _BatchGraph:
    """One decode step of several sessions (issue #22 item 6), built once for a set of
    sessions and reused while that set stays the same. The batch is ``[width, 1, B]``, one
    column per session. A weight whose type this ggml multiplies exactly as a ``[k, B]``
    matrix at this width (checked, ``skippy.runtime.batch_layout``) takes the columns as one:
    llamafile's GEMM then loads each weight block once for several columns. Any other weight
    is broadcast over dim 2, which keeps ggml's per-row vec-dot path (the GEMV of a
    one-session decode), reading each 16-row block once for the batch. Either way each
    session's column equals its own decode's bit for bit. Attention runs per session on its
    own KV views, as ``_DecodeGraph`` does."""

    ctx: int
    galloc: int
    graph: int
    members: list[_BatchMember]
    tokens: int  # I32 [B] ids (stage 0) or F32 [width, 1, B] activations
    pos: int  # I32 [B]
    result_view: npt.NDArray[np.float32]  # [B, cols] in the graph's compute buffer
    pos_buf: npt.NDArray[np.int32]
    gemm_matmuls: int = 0  # weight matmuls taking the batch as one [k, B] matrix
    broadcast_matmuls: int = 0  # and those broadcast over it


@dataclass(frozen=True)
class _LayerWeights:
    attn_norm: int
    q: int
    k: int
    v: int
    o: int
    ffn_norm: int
    gate: int
    up: int
    down: int
    q_bias: int | None
    k_bias: int | None
    v_bias: int | None
    o_bias: int | None
    q_norm: int | None
    k_norm: int | None
    post_attn_norm: int | None
    post_ffw_norm: int | None


class GgmlStage(StageBase[_KvCache]):
    """A stage computed by ggml on the CPU backend (see the module doc)."""

    engine = "ggml"
    runtime_version = RUNTIME_VERSION
    # Decode through one graph per session, reused per token (False: a fresh graph per token,
    # the general path; the bench and the tests compare the two).
    reuse_decode_graph = True

    def _prepare(self) -> None:
        self.g = ggml.load()  # first: a missing or mismatched ggml is refused before any I/O
        self._wctx: int | None = None
        self._buffers: list[int] = []
        self._backend = 0  # 0: none (a NULL pointer)
        self._galloc = 0

    def _setup(self) -> None:
        g = self.g
        self._tensors = self._place_weights()
        self._layer_weights = {il: self._layer(il) for il in self.layers}
        self._backend = _ok(g.ggml_backend_cpu_init(), "ggml_backend_cpu_init")
        g.ggml_backend_cpu_set_n_threads(self._backend, self.config.n_threads)
        self.threads_now = self.config.n_threads
        self._governor = (
            ThreadGovernor(self.config.n_threads, machine_cores())
            if self.config.adaptive_threads and self.config.n_threads > 1
            else None
        )
        self._galloc = _ok(g.ggml_gallocr_new(g.ggml_backend_cpu_buffer_type()), "gallocr")
        # batched decode graphs by their sessions' caches (in batch order), newest last
        self._batch_graphs: dict[tuple[int, ...], _BatchGraph] = {}
        # per weight type, the batch widths multiplied as [k, B] (found at the first build)
        self._gemm_exact: dict[int, frozenset[int]] | None = None
        self._layouts = [0, 0]
        n_graph = _TENSORS_PER_LAYER * len(self.layers) + _TENSORS_FIXED
        self._graph_size = max(ggml.GGML_DEFAULT_GRAPH_SIZE, n_graph)
        self._kv_cells = kv_length(self.config.n_ctx)  # a session's cache, as llama.cpp pads it
        self._graph_mem = g.ggml_tensor_overhead() * 2 * self._graph_size + (
            g.ggml_graph_overhead_custom(self._graph_size, False)
        )
        self._rope_mode = (
            GGML_ROPE_TYPE_NORMAL if self.spec.rope_style == "normal" else GGML_ROPE_TYPE_NEOX
        )

    # --- loading ---------------------------------------------------------------------------------
    def _place_weights(self) -> dict[str, int]:
        """One no-alloc ggml tensor per checked weight, placed at its bytes in the mapping."""
        g, w = self.g, self._loaded()
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
            else:  # the model plan only has vectors and matrices
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

    def _layer(self, il: int) -> _LayerWeights:
        t, p = self._tensors, f"blk.{il}."

        def opt(name: str) -> int | None:
            return t.get(p + name)

        return _LayerWeights(
            attn_norm=t[p + "attn_norm.weight"],
            q=t[p + "attn_q.weight"],
            k=t[p + "attn_k.weight"],
            v=t[p + "attn_v.weight"],
            o=t[p + "attn_output.weight"],
            ffn_norm=t[p + "ffn_norm.weight"],
            gate=t[p + "ffn_gate.weight"],
            up=t[p + "ffn_up.weight"],
            down=t[p + "ffn_down.weight"],
            q_bias=opt("attn_q.bias"),
            k_bias=opt("attn_k.bias"),
            v_bias=opt("attn_v.bias"),
            o_bias=opt("attn_output.bias"),
            q_norm=opt("attn_q_norm.weight"),
            k_norm=opt("attn_k_norm.weight"),
            post_attn_norm=opt("post_attention_norm.weight"),
            post_ffw_norm=opt("post_ffw_norm.weight"),
        )

    # --- sessions --------------------------------------------------------------------------------
    def _new_session(self) -> _KvCache:
        g, spec, cells = self.g, self.spec, self._kv_cells
        params = GgmlInitParams(
            mem_size=g.ggml_tensor_overhead() * (2 * len(self.layers) + 1),
            mem_buffer=None,
            no_alloc=True,
        )
        ctx = _ok(g.ggml_init(params), "ggml_init")
        try:
            k = {
                il: _ok(g.ggml_new_tensor_2d(ctx, GgmlType.F16, spec.kv_dim, cells), "k")
                for il in self.layers
            }
            v = {
                il: _ok(g.ggml_new_tensor_2d(ctx, GgmlType.F16, cells, spec.kv_dim), "v")
                for il in self.layers
            }
            buffer = _ok(
                g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, g.ggml_backend_cpu_buffer_type()),
                "KV cache allocation",
            )
        except BaseException:
            g.ggml_free(ctx)
            raise
        g.ggml_backend_buffer_clear(buffer, 0)
        return _KvCache(ctx, buffer, k, v, g.ggml_backend_buffer_get_size(buffer))

    def _release(self, state: _KvCache) -> None:
        for key in [k for k in self._batch_graphs if id(state) in k]:  # they view its cache
            self._free_batch_graph(self._batch_graphs.pop(key))
        if state.decode is not None:
            self._free_decode_graph(state.decode)
            state.decode = None
        self.g.ggml_backend_buffer_free(state.buffer)
        self.g.ggml_free(state.ctx)

    def _close_engine(self) -> None:
        g = self.g
        for bg in self._batch_graphs.values():
            self._free_batch_graph(bg)
        self._batch_graphs = {}
        if self._galloc:
            g.ggml_gallocr_free(self._galloc)
            self._galloc = 0
        if self._backend:
            g.ggml_backend_free(self._backend)
            self._backend = 0
        for b in self._buffers:
            g.ggml_backend_buffer_free(b)
        self._buffers = []
        if self._wctx:
            g.ggml_free(self._wctx)
            self._wctx = None

    # --- the forward pass ------------------------------------------------------------------------
    def _compute(self, graph: int, *, step: bool = False) -> None:
        """Run a graph. An adaptive stage runs a one-position ``step`` on the threads the
        governor allows now (a small graph is all barriers: one preempted thread stalls the
        rest at every op) and everything else on the cap (a prefill's big matmuls still gain
        from a second thread beside a busy neighbour: docs/performance.md, issue #25)."""
        if self._governor is not None:
            n = self._governor.threads() if step else self.config.n_threads
            if n != self.threads_now:
                self.g.ggml_backend_cpu_set_n_threads(self._backend, n)
                self.threads_now = n
        status = self.g.ggml_backend_graph_compute(self._backend, graph)
        if status != ggml.GGML_STATUS_SUCCESS:
            raise ggml.GgmlCallFailed(f"ggml_backend_graph_compute returned status {status}")

    def _chunk_rows(self, n: int, end: int) -> int:
        return prefill_rows(n, end)

    def _forward(
        self,
        state: _KvCache,
        start: int,
        inputs: npt.NDArray[Any],
        out_rows: int,
        *,
        rows: int | None = None,
    ) -> npt.NDArray[np.float32]:
        g, spec = self.g, self.spec
        n = int(inputs.shape[0])
        rows = n if rows is None else rows
        pad = rows - n  # leading copies of the first row: the graph's shape, not its result
        if pad:
            inputs = np.ascontiguousarray(np.concatenate([np.repeat(inputs[:1], pad, 0), inputs]))
        ctx = _ok(
            g.ggml_init(GgmlInitParams(mem_size=self._graph_mem, mem_buffer=None, no_alloc=True)),
            "ggml_init",
        )
        try:
            gf = _ok(g.ggml_new_graph_custom(ctx, self._graph_size, False), "ggml_new_graph")
            feeds: list[tuple[int, npt.NDArray[Any]]] = []

            def input_tensor(t: int | None, data: npt.NDArray[Any]) -> int:
                t = _ok(t, "ggml_new_tensor")
                g.ggml_set_input(t)
                feeds.append((t, data))
                return t

            if self.layers.owns_input:
                ids = input_tensor(g.ggml_new_tensor_1d(ctx, GgmlType.I32, rows), inputs)
                x = g.ggml_get_rows(ctx, self._tensors["token_embd.weight"], ids)
                if spec.embed_scale is not None:
                    x = g.ggml_scale(ctx, x, spec.embed_scale)
            else:
                x = input_tensor(g.ggml_new_tensor_2d(ctx, GgmlType.F32, spec.width, rows), inputs)
            positions = np.arange(start - pad, start + n, dtype=np.int32).clip(start)
            pos = input_tensor(g.ggml_new_tensor_1d(ctx, GgmlType.I32, rows), positions)
            n_kv = kv_length(start + n)  # the cells in use, padded as llama.cpp views them
            final = self.layers.owns_output
            last = self.layers.stop - 1
            # the layers that attend: a final stage that wants no logits only writes its last
            # layer's K/V (an input no node reads has no buffer to be set)
            attending = [il for il in self.layers if not (final and il == last and not out_rows)]
            masks = {}
            for window in self._windows(attending):
                mask = attention_mask(start, n, window, n_kv=n_kv)
                if pad:
                    mask = np.ascontiguousarray(np.concatenate([np.repeat(mask[:1], pad, 0), mask]))
                t = g.ggml_new_tensor_2d(ctx, GgmlType.F32, n_kv, rows)
                masks[window] = input_tensor(t, mask)
            result: int | None = x
            for il in self.layers:
                keep = out_rows if final and il == last else None
                result = self._layer_graph(
                    ctx, gf, il, x, pos, masks, state, start, n, keep, pad=pad, n_kv=n_kv
                )
                if result is None:  # final stage, no logits wanted: K/V written, done
                    break
                x = result
            if final and result is not None:
                result = self._head(ctx, result)
            if result is not None:
                g.ggml_set_output(result)
                g.ggml_build_forward_expand(gf, result)
            if not g.ggml_gallocr_alloc_graph(self._galloc, gf):
                raise ggml.GgmlCallFailed("ggml_gallocr_alloc_graph failed (out of memory?)")
            for t, data in feeds:
                g.ggml_backend_tensor_set(t, data.ctypes.data, 0, data.nbytes)
            self._compute(gf)
            if result is None:
                return np.empty((0, self.vocab or 0), dtype=np.float32)
            cols = (self.vocab or 0) if final else spec.width
            rows_out = out_rows if final else n
            out = np.empty((rows_out, cols), dtype=np.float32)
            skip = 0 if final else pad  # a non-final stage returns its real rows only
            g.ggml_backend_tensor_get(result, out.ctypes.data, 4 * cols * skip, out.nbytes)
            return out
        finally:
            g.ggml_free(ctx)

    # --- one position: the reused decode graph and the head on ggml (issue #25 item 2) -------
    def _decode_one(
        self, state: _KvCache, position: int, inputs: npt.NDArray[Any], *, greedy: bool
    ) -> tuple[npt.NDArray[np.float32] | None, int | None]:
        if not self.reuse_decode_graph:
            return super()._decode_one(state, position, inputs, greedy=greedy)
        dg = state.decode
        if dg is None:
            dg = state.decode = self._build_decode_graph(state)
        g = self.g
        dg.set_position(g, position)
        dg.pos_buf[0] = position
        g.ggml_backend_tensor_set(dg.tokens, inputs.ctypes.data, 0, inputs.nbytes)
        g.ggml_backend_tensor_set(dg.pos, dg.pos_buf.ctypes.data, 0, 4)
        self._compute(dg.graph, step=True)
        if greedy and self.layers.owns_output:
            # The argmax over the logits where ggml left them: no copy, and numpy's first
            # maximum is the sampler's own rule (ggml_argmax takes the last one on ties).
            return None, int(np.argmax(dg.result_view))
        return dg.result_view.reshape(1, -1).copy(), None

    def _build_decode_graph(self, kv: _KvCache) -> _DecodeGraph:
        """The one-position graph of ``kv``'s session over every cell (see _DecodeGraph),
        with its own allocator: the shared one re-plans for every prefill graph, which would
        move this graph's intermediate tensors."""
        g, spec, cells = self.g, self.spec, self._kv_cells
        ctx = _ok(
            g.ggml_init(GgmlInitParams(mem_size=self._graph_mem, mem_buffer=None, no_alloc=True)),
            "ggml_init",
        )
        galloc = 0
        try:
            gf = _ok(g.ggml_new_graph_custom(ctx, self._graph_size, False), "ggml_new_graph")

            def input_tensor(t: int | None) -> int:
                t = _ok(t, "ggml_new_tensor")
                g.ggml_set_input(t)
                return t

            if self.layers.owns_input:
                tokens = input_tensor(g.ggml_new_tensor_1d(ctx, GgmlType.I32, 1))
                x = g.ggml_get_rows(ctx, self._tensors["token_embd.weight"], tokens)
                if spec.embed_scale is not None:
                    x = g.ggml_scale(ctx, x, spec.embed_scale)
            else:
                tokens = x = input_tensor(g.ggml_new_tensor_2d(ctx, GgmlType.F32, spec.width, 1))
            pos = input_tensor(g.ggml_new_tensor_1d(ctx, GgmlType.I32, 1))
            slots = _KvSlots(
                k_rows=input_tensor(g.ggml_new_tensor_1d(ctx, GgmlType.I64, 1)),
                v_rows=input_tensor(g.ggml_new_tensor_1d(ctx, GgmlType.I64, spec.kv_dim)),
            )
            masks = {}
            for window in self._windows():
                masks[window] = input_tensor(g.ggml_new_tensor_2d(ctx, GgmlType.F32, cells, 1))
                slots.add(masks[window], 0, True)
            final = self.layers.owns_output
            last = self.layers.stop - 1
            for il in self.layers:
                rows = 1 if final and il == last else None
                y = self._layer_graph(ctx, gf, il, x, pos, masks, kv, 0, 1, rows, slots, n_kv=cells)
                x = _ok(y, "decode layer")
            result = self._head(ctx, x) if final else x
            g.ggml_set_output(result)
            g.ggml_build_forward_expand(gf, result)
            galloc = _ok(g.ggml_gallocr_new(g.ggml_backend_cpu_buffer_type()), "gallocr")
            if not g.ggml_gallocr_alloc_graph(galloc, gf):
                raise ggml.GgmlCallFailed("ggml_gallocr_alloc_graph failed (out of memory?)")
            cols = (self.vocab or 0) if final else spec.width
            data = _ok(g.ggml_get_data(result), "decode graph output")
            view = np.ctypeslib.as_array((ctypes.c_float * cols).from_address(data))
        except BaseException:
            if galloc:
                g.ggml_gallocr_free(galloc)
            g.ggml_free(ctx)
            raise
        return _DecodeGraph(
            ctx=ctx,
            galloc=galloc,
            graph=gf,
            slots=slots,
            tokens=tokens,
            pos=pos,
            masks=masks,
            result=result,
            result_view=view,
            pos_buf=np.zeros(1, dtype=np.int32),
            **_SessionInputs.buffers(spec.kv_dim, cells),
        )

    # --- several sessions' decode steps in one graph (issue #22 item 6) ----------------------
    def _decode_many(
        self,
        states: list[_KvCache],
        positions: list[int],
        inputs: list[npt.NDArray[Any]],
        greedy: list[bool],
    ) -> list[tuple[npt.NDArray[np.float32] | None, int | None]]:
        if not self.reuse_decode_graph or len(states) < 2:
            return super()._decode_many(states, positions, inputs, greedy)
        key = tuple(id(s) for s in states)
        bg = self._batch_graphs.pop(key, None)
        if bg is None:
            while len(self._batch_graphs) >= BATCH_GRAPHS_KEPT:
                self._free_batch_graph(self._batch_graphs.pop(next(iter(self._batch_graphs))))
            bg = self._build_batch_graph(states)
        self._batch_graphs[key] = bg  # newest last
        g = self.g
        bg.pos_buf[:] = positions
        g.ggml_backend_tensor_set(bg.pos, bg.pos_buf.ctypes.data, 0, bg.pos_buf.nbytes)
        x = np.ascontiguousarray(np.concatenate(inputs))
        g.ggml_backend_tensor_set(bg.tokens, x.ctypes.data, 0, x.nbytes)
        for m, position in zip(bg.members, positions, strict=True):
            m.set_position(g, position)
        self._compute(bg.graph, step=True)
        out: list[tuple[npt.NDArray[np.float32] | None, int | None]] = []
        for i, gr in enumerate(greedy):
            row = bg.result_view[i]
            # first maximum: the sampler's rule, as _decode_one
            out.append((None, int(np.argmax(row))) if gr else (row.reshape(1, -1).copy(), None))
        return out

    def _build_batch_graph(self, states: list[_KvCache]) -> _BatchGraph:
        g, spec, cells, b = self.g, self.spec, self._kv_cells, len(states)
        self._exact_gemm_widths()  # before the graph's matmuls choose their layout (_mm)
        self._layouts = [0, 0]  # [k, B] / broadcast matmuls of this build (_mm counts them)
        size = max(
            ggml.GGML_DEFAULT_GRAPH_SIZE,
            (_TENSORS_PER_LAYER + _TENSORS_PER_MEMBER * b) * len(self.layers) + _TENSORS_FIXED,
        )
        mem = g.ggml_tensor_overhead() * 2 * size + g.ggml_graph_overhead_custom(size, False)
        ctx = _ok(g.ggml_init(GgmlInitParams(mem_size=mem, mem_buffer=None, no_alloc=True)), "init")
        galloc = 0
        try:
            gf = _ok(g.ggml_new_graph_custom(ctx, size, False), "ggml_new_graph")

            def input_tensor(t: int | None) -> int:
                t = _ok(t, "ggml_new_tensor")
                g.ggml_set_input(t)
                return t

            if self.layers.owns_input:
                tokens = input_tensor(g.ggml_new_tensor_1d(ctx, GgmlType.I32, b))
                x = g.ggml_get_rows(ctx, self._tensors["token_embd.weight"], tokens)
                if spec.embed_scale is not None:
                    x = g.ggml_scale(ctx, x, spec.embed_scale)
                x = g.ggml_reshape_3d(ctx, x, spec.width, 1, b)
            else:
                tokens = x = input_tensor(g.ggml_new_tensor_3d(ctx, GgmlType.F32, spec.width, 1, b))
            pos = input_tensor(g.ggml_new_tensor_1d(ctx, GgmlType.I32, b))
            members = []
            for kv in states:
                slots = _KvSlots(
                    k_rows=input_tensor(g.ggml_new_tensor_1d(ctx, GgmlType.I64, 1)),
                    v_rows=input_tensor(g.ggml_new_tensor_1d(ctx, GgmlType.I64, spec.kv_dim)),
                )
                masks = {}
                for window in self._windows():
                    masks[window] = input_tensor(g.ggml_new_tensor_2d(ctx, GgmlType.F32, cells, 1))
                    slots.add(masks[window], 0, True)
                members.append(
                    _BatchMember(
                        kv=kv,
                        slots=slots,
                        masks=masks,
                        **_SessionInputs.buffers(spec.kv_dim, cells),
                    )
                )
            for il in self.layers:
                x = self._batch_layer_graph(ctx, gf, il, x, pos, members)
            final = self.layers.owns_output
            result = self._head(ctx, x) if final else x
            g.ggml_set_output(result)
            g.ggml_build_forward_expand(gf, result)
            galloc = _ok(g.ggml_gallocr_new(g.ggml_backend_cpu_buffer_type()), "gallocr")
            if not g.ggml_gallocr_alloc_graph(galloc, gf):
                raise ggml.GgmlCallFailed("ggml_gallocr_alloc_graph failed (out of memory?)")
            cols = (self.vocab or 0) if final else spec.width
            data = _ok(g.ggml_get_data(result), "batch graph output")
            view = np.ctypeslib.as_array((ctypes.c_float * (cols * b)).from_address(data))
        except BaseException:
            if galloc:
                g.ggml_gallocr_free(galloc)
            g.ggml_free(ctx)
            raise
        return _BatchGraph(
            ctx=ctx,
            galloc=galloc,
            graph=gf,
            members=members,
            tokens=tokens,
            pos=pos,
            result_view=view.reshape(b, cols),
            pos_buf=np.zeros(b, dtype=np.int32),
            gemm_matmuls=self._layouts[0],
            broadcast_matmuls=self._layouts[1],
        )

    def _batch_layer_graph(
        self, ctx: int, gf: int, il: int, x: int, pos: int, members: list[_BatchMember]
    ) -> int:
        """One block over x ``[width, 1, B]``: the ops of ``_layer_graph`` for one position,
        the linear layers over the whole batch, attention per session (its own KV)."""
        g, spec = self.g, self.spec
        hd, cells = spec.head_dim, self._kv_cells
        f16_row = g.ggml_row_size(GgmlType.F16, spec.kv_dim)
        # [hd, n_head, B] / [hd, n_head_kv, B] / [kv_dim, 1, B]: position i per column
        q, k, v, kq_scale = self._qkv(ctx, il, x, pos, len(members))
        window = spec.sliding_window if spec.is_swa(il) else None
        o: int | None = None
        for i, m in enumerate(members):
            kv, slots = m.kv, m.slots
            k_row = g.ggml_view_2d(ctx, k, spec.kv_dim, 1, 4 * spec.kv_dim, 4 * spec.kv_dim * i)
            g.ggml_build_forward_expand(gf, g.ggml_set_rows(ctx, kv.k[il], k_row, slots.k_rows))
            v_all = g.ggml_reshape_2d(ctx, kv.v[il], 1, cells * spec.kv_dim)
            v_col = g.ggml_view_2d(ctx, v, 1, spec.kv_dim, 4, 4 * spec.kv_dim * i)
            g.ggml_build_forward_expand(gf, g.ggml_set_rows(ctx, v_all, v_col, slots.v_rows))
            keys = g.ggml_view_3d(ctx, kv.k[il], hd, cells, spec.n_head_kv, f16_row, 2 * hd, 0)
            values = g.ggml_view_3d(
                ctx, kv.v[il], cells, hd, spec.n_head_kv, 2 * cells, 2 * cells * hd, 0
            )
            q_i = g.ggml_view_3d(
                ctx, q, hd, spec.n_head, 1, 4 * hd, 4 * spec.q_dim, 4 * spec.q_dim * i
            )
            qp = g.ggml_permute(ctx, q_i, 0, 2, 1, 3)  # [hd, 1, n_head]
            scores = g.ggml_mul_mat(ctx, keys, qp)  # [n_kv, 1, n_head]
            kq = g.ggml_soft_max_ext(ctx, scores, m.masks[window], kq_scale, 0.0)
            slots.add(keys, 1, False)
            slots.add(values, 0, False)
            slots.add(scores, 0, True)
            slots.add(kq, 0, True)
            kqv = g.ggml_mul_mat(ctx, values, kq)  # [hd, 1, n_head]
            o_i = g.ggml_cont_2d(ctx, g.ggml_permute(ctx, kqv, 0, 2, 1, 3), spec.q_dim, 1)
            o = o_i if o is None else g.ggml_concat(ctx, o, o_i, 2)  # [q_dim, 1, i + 1]
        return self._attn_out_and_ffn(ctx, il, _ok(o, "attention"), x)

    def _exact_gemm_widths(self) -> dict[int, frozenset[int]]:
        """Per weight type, the batch widths whose ``[k, B]`` product this ggml computes
        exactly as B one-column products (``skippy.runtime.batch_layout``), checked once per
        stage on a slice of one of its own weights per type."""
        if self._gemm_exact is None:
            from skippy.runtime.batch_layout import exact_gemm_widths

            weights: dict[int, int] = {}
            for w in self._layer_weights.values():
                for t in (w.q, w.k, w.v, w.o, w.gate, w.up, w.down):
                    weights.setdefault(tensor_struct(t).type, t)
            head = self._head_weight()
            if self.layers.owns_output and head is not None:
                weights.setdefault(tensor_struct(head).type, head)
            self._gemm_exact = exact_gemm_widths(
                self.g, weights, self.config.max_sessions, self._compute
            )
        return self._gemm_exact

    def _mm(self, ctx: int, weight: int, x: int) -> int:
        """``weight @ x``; over a batch's ``[k, 1, B]`` activations, as one ``[k, B]`` matrix
        when the weight's type multiplies that way exactly at this width
        (``_exact_gemm_widths``: ggml's GEMM then loads each weight block once for several
        sessions' columns), else broadcast (the one-session GEMV per column). Anything else
        (a one-session step, a prefill chunk) is multiplied as it is."""
        g, xs = self.g, tensor_struct(x)
        k, b = int(xs.ne[0]), int(xs.ne[2])
        if b < 2 or xs.ne[1] != 1 or xs.ne[3] != 1 or self._gemm_exact is None:
            return g.ggml_mul_mat(ctx, weight, x)
        if (
            b in self._gemm_exact.get(tensor_struct(weight).type, ())
            and xs.type == GgmlType.F32
            and xs.nb[1] == 4 * k  # contiguous, so the reshapes are views (ggml asserts it)
            and xs.nb[2] == 4 * k
        ):
            self._layouts[0] += 1
            y = g.ggml_mul_mat(ctx, weight, g.ggml_reshape_2d(ctx, x, k, b))
            return g.ggml_reshape_3d(ctx, y, int(tensor_struct(y).ne[0]), 1, b)
        self._layouts[1] += 1
        return g.ggml_mul_mat(ctx, weight, x)

    def _head_weight(self) -> int | None:
        return self._tensors.get("output.weight", self._tensors.get("token_embd.weight"))

    def _free_batch_graph(self, bg: _BatchGraph) -> None:
        self.g.ggml_gallocr_free(bg.galloc)
        self.g.ggml_free(bg.ctx)

    def _free_decode_graph(self, dg: _DecodeGraph) -> None:
        self.g.ggml_gallocr_free(dg.galloc)
        self.g.ggml_free(dg.ctx)

    def _windows(self, layers: Iterable[int] | None = None) -> list[int | None]:
        """The attention masks ``layers`` (default: this stage's) use: None = full causal,
        N = sliding."""
        spec = self.spec
        windows: list[int | None] = []
        for il in self.layers if layers is None else layers:
            w = spec.sliding_window if spec.is_swa(il) else None
            if w not in windows:
                windows.append(w)
        return windows

    def _norm(self, ctx: int, x: int, weight: int) -> int:
        g = self.g
        return g.ggml_mul(ctx, g.ggml_rms_norm(ctx, x, self.spec.rms_eps), weight)

    def _linear(self, ctx: int, weight: int, x: int, bias: int | None = None) -> int:
        y = self._mm(ctx, weight, x)
        return self.g.ggml_add(ctx, y, bias) if bias is not None else y

    def _layer_graph(
        self,
        ctx: int,
        gf: int,
        il: int,
        x: int,
        pos: int,
        masks: dict[int | None, int],
        kv: _KvCache,
        start: int,
        n: int,
        out_rows: int | None,
        slots: _KvSlots | None = None,
        *,
        pad: int = 0,
        n_kv: int,
    ) -> int | None:
        """One transformer block over x ``[width, rows]`` (``rows = pad + n``: ``pad`` leading
        copies of the first row, whose K/V are not written); returns ``[width, rows]``, or
        for the final layer ``[width, out_rows]`` (the last rows, kept after the attention
        output projection as llama.cpp keeps them) or None when no logits are wanted from
        this chunk. Attention views ``n_kv`` cells. With ``slots`` (the reused decode graph,
        n = 1, ``n_kv`` every cell) K and V are written at the rows the slots' inputs name and
        the attention tensors are resized to the position's KV length before each run."""
        g, spec = self.g, self.spec
        hd, cells, rows = spec.head_dim, self._kv_cells, pad + n
        f16_row = g.ggml_row_size(GgmlType.F16, spec.kv_dim)
        q, k, v, kq_scale = self._qkv(ctx, il, x, pos, rows)  # [hd, n_head, rows], ...
        # write this chunk's K and V into the session cache (before the attention reads it:
        # nodes run in the order they were added)
        if slots is None:
            k_src = g.ggml_view_1d(ctx, k, n * spec.kv_dim, 4 * spec.kv_dim * pad)
            k_dst = g.ggml_view_1d(ctx, kv.k[il], n * spec.kv_dim, f16_row * start)
            g.ggml_build_forward_expand(gf, g.ggml_cpy(ctx, k_src, k_dst))
            v_src = g.ggml_view_2d(ctx, v, spec.kv_dim, n, 4 * spec.kv_dim, 4 * spec.kv_dim * pad)
            v_t = g.ggml_transpose(ctx, v_src)  # [n, kv_dim]
            v_dst = g.ggml_view_2d(ctx, kv.v[il], n, spec.kv_dim, 2 * cells, 2 * start)
            g.ggml_build_forward_expand(gf, g.ggml_cpy(ctx, v_t, v_dst))
        else:  # the same f32 -> f16 conversion, at rows given as data
            k_row = g.ggml_reshape_2d(ctx, k, spec.kv_dim, 1)
            g.ggml_build_forward_expand(gf, g.ggml_set_rows(ctx, kv.k[il], k_row, slots.k_rows))
            v_all = g.ggml_reshape_2d(ctx, kv.v[il], 1, cells * spec.kv_dim)
            v_col = g.ggml_reshape_2d(ctx, v, 1, spec.kv_dim)
            g.ggml_build_forward_expand(gf, g.ggml_set_rows(ctx, v_all, v_col, slots.v_rows))
        if out_rows == 0:
            return None
        keys = g.ggml_view_3d(
            ctx, kv.k[il], hd, n_kv, spec.n_head_kv, f16_row, 2 * hd, 0
        )  # [hd, n_kv, n_head_kv]
        values = g.ggml_view_3d(
            ctx, kv.v[il], n_kv, hd, spec.n_head_kv, 2 * cells, 2 * cells * hd, 0
        )  # [n_kv, hd, n_head_kv]
        qp = g.ggml_permute(ctx, q, 0, 2, 1, 3)  # [hd, rows, n_head]
        kq = g.ggml_mul_mat(ctx, keys, qp)  # [n_kv, rows, n_head]
        window = spec.sliding_window if spec.is_swa(il) else None
        scores = kq
        kq = g.ggml_soft_max_ext(ctx, kq, masks[window], kq_scale, 0.0)
        if slots is not None:
            slots.add(keys, 1, False)
            slots.add(values, 0, False)
            slots.add(scores, 0, True)
            slots.add(kq, 0, True)
        kqv = g.ggml_mul_mat(ctx, values, kq)  # [hd, rows, n_head]
        o = g.ggml_permute(ctx, kqv, 0, 2, 1, 3)  # [hd, n_head, rows]
        o = g.ggml_cont_2d(ctx, o, spec.q_dim, rows)
        return self._attn_out_and_ffn(ctx, il, o, x, keep=out_rows)

    def _qkv(self, ctx: int, il: int, x: int, pos: int, n: int) -> tuple[int, int, int, float]:
        """A block's start over x ``[width, n]`` (or ``[width, 1, n]``, a batch): the attention
        norm, Q/K/V (Q and K as ``[hd, heads, n]``, with their norms where the model has
        them), RoPE at ``pos``, and the attention scale (folded into Q where the model says)."""
        g, spec, w = self.g, self.spec, self._layer_weights[il]
        hd = spec.head_dim
        h = self._norm(ctx, x, w.attn_norm)
        q = self._linear(ctx, w.q, h, w.q_bias)
        k = self._linear(ctx, w.k, h, w.k_bias)
        v = self._linear(ctx, w.v, h, w.v_bias)
        q = g.ggml_reshape_3d(ctx, q, hd, spec.n_head, n)
        k = g.ggml_reshape_3d(ctx, k, hd, spec.n_head_kv, n)
        if w.q_norm is not None and w.k_norm is not None:
            q = self._norm(ctx, q, w.q_norm)
            k = self._norm(ctx, k, w.k_norm)
        freq_factors = self._tensors.get(ROPE_FREQS_TENSOR)
        base, scale = spec.rope_base_for(il), spec.rope_scale_for(il)
        rope = (hd, self._rope_mode, spec.context_length, base, scale)
        yarn = (_EXT_FACTOR, _ATTN_FACTOR, _BETA_FAST, _BETA_SLOW)
        q = g.ggml_rope_ext(ctx, q, pos, freq_factors, *rope, *yarn)
        k = g.ggml_rope_ext(ctx, k, pos, freq_factors, *rope, *yarn)
        kq_scale = spec.attn_scale
        if spec.scale_q_before_attention:
            q, kq_scale = g.ggml_scale(ctx, q, spec.attn_scale), 1.0
        return q, k, v, kq_scale

    def _attn_out_and_ffn(self, ctx: int, il: int, o: int, x: int, keep: int | None = None) -> int:
        """A block's end: the attention output ``o`` projected (and normed where the model
        has a post-attention norm) onto the residual ``x``, then the feed-forward block; with
        ``keep``, over only the last ``keep`` rows after the projection (llama.cpp's
        ``inp_out_ids`` on its last layer: the feed-forward's matmuls then have as many
        columns as in llama.cpp, which picks their kernel)."""
        g, spec, w = self.g, self.spec, self._layer_weights[il]
        o = self._linear(ctx, w.o, o, w.o_bias)
        skip = 0 if keep is None else int(tensor_struct(o).ne[1]) - keep
        if keep is not None and skip > 0:
            o = g.ggml_view_2d(ctx, o, spec.width, keep, 4 * spec.width, 4 * spec.width * skip)
            x = g.ggml_view_2d(ctx, x, spec.width, keep, 4 * spec.width, 4 * spec.width * skip)
        if w.post_attn_norm is not None:
            o = self._norm(ctx, o, w.post_attn_norm)
        x = g.ggml_add(ctx, o, x)
        h = self._norm(ctx, x, w.ffn_norm)
        gate = self._mm(ctx, w.gate, h)
        up = self._mm(ctx, w.up, h)
        if spec.activation == "gelu_tanh":
            a = g.ggml_geglu_split(ctx, gate, up)
        else:
            a = g.ggml_swiglu_split(ctx, gate, up)
        f = self._mm(ctx, w.down, a)
        if w.post_ffw_norm is not None:
            f = self._norm(ctx, f, w.post_ffw_norm)
        return g.ggml_add(ctx, f, x)

    def _head(self, ctx: int, x: int) -> int:
        g, spec = self.g, self.spec
        h = self._norm(ctx, x, self._tensors[OUTPUT_NORM_TENSOR])
        logits = self._mm(ctx, _ok(self._head_weight(), "output head"), h)  # [vocab, rows]
        cap = spec.final_logit_softcap
        if cap:
            logits = g.ggml_scale(ctx, g.ggml_tanh(ctx, g.ggml_scale(ctx, logits, 1.0 / cap)), cap)
        return logits

    # --- introspection -----------------------------------------------------------------------
    def kv_bytes_per_session(self) -> int:
        return 2 * 2 * len(self.layers) * self.spec.kv_dim * self._kv_cells

    def compute_buffer_bytes(self) -> int:
        """The shared graph allocator's buffer plus each session's decode graph's own and
        each kept batched decode graph's."""
        if not self._galloc:
            return 0
        size = int(self.g.ggml_gallocr_get_buffer_size(self._galloc, 0))
        for s in self._sessions.values():
            if s.state.decode is not None:
                size += int(self.g.ggml_gallocr_get_buffer_size(s.state.decode.galloc, 0))
        for bg in self._batch_graphs.values():
            size += int(self.g.ggml_gallocr_get_buffer_size(bg.galloc, 0))
        return size
