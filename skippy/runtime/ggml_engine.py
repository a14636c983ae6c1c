"""The ggml stage engine: a layer range's forward pass as ggml graphs.

Where the graphs run and where the weights live is the backend's business
(``skippy.runtime.backend``: today the CPU backend over the package's mapped fragment bytes,
no copy). What a layer computes is its family's (``skippy.runtime.families``: one
``build_layer`` per family over the helpers of ``skippy.runtime.graph``). This module owns the
sessions' graphs: each session's F16 KV cache, and one graph path, ``_build``, that serves
every graph the stage makes: a prefill chunk (fresh per call), a session's one-position decode
graph (built once over every cell, reused per token) and a batch of sessions' decode steps
(built once per set of sessions). The three differ only in their inputs and in how attention
writes and reads the caches (``_ChunkAttention``, ``_SlotAttention``, ``_BatchAttention``).

Per graph: embeddings (stage 0) or the incoming activations, then each layer, then for the
final stage the output norm and head over only the rows whose logits are wanted (kept after
the last layer's attention output projection, as llama.cpp's ``inp_out_ids``). The op
sequence mirrors llama.cpp's graph builders with the non-flash attention path and the V cache
stored transposed, as llama.cpp uses them through llama-cpp-python by default, and so do the
shapes (``skippy.runtime.graph_shapes``): the cache holds the context padded to 256 cells,
attention views it padded to a multiple of 256 (the empty cells masked), and a prefill chunk
computes at least 8 rows, so a position's logits do not depend on how its prompt was chunked.

Every value that reaches ggml has been checked in Python first (``StageBase.check_inputs``,
``StageWeights``): ggml aborts the process on a failed assertion.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from skippy.gguf import ggml
from skippy.gguf.ggml import GgmlInitParams, GgmlTensorStruct, GgmlType, tensor_struct
from skippy.runtime.backend import CpuBackend, GraphRunner
from skippy.runtime.boundary import StageNotLoaded
from skippy.runtime.device_backend import DeviceBackend
from skippy.runtime.devices import (
    CPU,
    DeviceChoice,
    check_rule_devices,
    choose_device,
    list_devices,
    place_tensors,
    placement_mode,
)
from skippy.runtime.families import family_of, layer_tensors
from skippy.runtime.families.base import T
from skippy.runtime.graph import Attention, GraphBuilder, LayerWeights
from skippy.runtime.graph_shapes import kv_length, prefill_rows
from skippy.runtime.model import ModelSpec, SwaType, attention_mask, first_visible, tensor_name
from skippy.runtime.nextn import NextnSession, NextnWeights, build_nextn, head_weights
from skippy.runtime.stage import (
    STAGE_API_VERSION,
    StageBase,
    check_token_ids,
    context_full,
    stage_usage,
)
from skippy.runtime.weights import StageWeights

log = logging.getLogger(__name__)
RUNTIME_VERSION: Final = f"skippy-stage/{STAGE_API_VERSION} ggml/{ggml.GGML_VERSION}"
# Tensors (ops and views) a layer adds to a graph, with room to spare; ggml aborts when a
# context runs out of room, so this errs large.
_TENSORS_PER_LAYER: Final = 64
_TENSORS_FIXED: Final = 64
_TENSORS_PER_MEMBER: Final = 32  # a batched decode graph's per-session attention, per layer
# Batched decode graphs kept per stage (one per recent set of sessions: sessions joining and
# leaving make new sets; a steady batch reuses its graph every step).
BATCH_GRAPHS_KEPT: Final = 4


_ok = ggml.non_null


def _ok_head(head: tuple[int, NextnWeights] | None) -> tuple[int, NextnWeights]:
    if head is None:
        raise StageNotLoaded("the stage has no NextN draft head")
    return head


@dataclass
class _KvCache:
    """One session's K and V for each of the stage's layers, in one backend buffer.
    K of a layer: [kv_dim, cells] F16 (one row per position); V: [cells, kv_dim] F16
    (transposed, so attention multiplies it without a copy). Under MLA (``ModelSpec.mla``)
    there is no V: K holds each position's latent and rope key, and V is a view of K, as
    llama.cpp's cache stores it. ``cells`` is the context padded as llama.cpp pads it
    (``kv_length(n_ctx)``)."""

    ctx: int
    buffer: int
    k: dict[int, int]
    v: dict[int, int]
    nbytes: int
    cells: int
    decode: _DecodeGraph | None = None  # built at the session's first decode
    nextn: NextnSession = field(default_factory=NextnSession)  # the draft head's state


@dataclass
class _KvSlots:
    """How a reused decode graph writes and reads the cache: K/V rows by index (inputs, so
    the position is data, not graph shape), attention views built over every cell, and the
    tensors whose KV length is set before each run (``_SessionInputs.resize``)."""

    k_rows: int  # I64 [1]: the position
    v_rows: int | None  # I64 [kv_dim]: d * cells + position (V stored transposed; None: MLA)
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
    swa_type: SwaType = "standard"  # how the sliding masks cut (ModelSpec.swa_type)

    @staticmethod
    def buffers(kv_dim: int, cells: int, swa_type: SwaType) -> dict[str, Any]:
        """Fresh host buffers for a session's inputs, and how its sliding masks cut (keyword
        arguments)."""
        v_base = np.arange(kv_dim, dtype=np.int64) * cells
        return {
            "swa_type": swa_type,
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
        if self.slots.v_rows is not None:
            g.ggml_backend_tensor_set(
                self.slots.v_rows, self.v_buf.ctypes.data, 0, self.v_buf.nbytes
            )
        for window, mask in self.masks.items():
            m = self.mask_buf[:n_kv]
            m[: position + 1] = 0.0
            m[position + 1 :] = -np.inf
            if window is not None:
                m[: max(0, first_visible(position, window, self.swa_type))] = -np.inf
            g.ggml_backend_tensor_set(mask, m.ctypes.data, 0, 4 * n_kv)


@dataclass(kw_only=True)
class _DecodeGraph(_SessionInputs):
    """One session's one-position graph, built once over every cell and run per token: only
    its inputs and the KV length of its attention tensors change between runs (the length
    moves in steps of 256, ``kv_length``), so each run computes exactly what a freshly built
    graph for that position computes (same ops, same shapes, same kernels: bit-identical)."""

    ctx: int
    runner: GraphRunner
    graph: int
    tokens: int  # I32 [1] ids (stage 0) or F32 [width, 1] activations
    pos: int  # I32 [1]
    result: int  # activations [width, 1] or logits [vocab, 1]
    # the result's bytes in the graph's own compute buffer (fixed while the graph lives), or
    # a host copy read after each run where the graph runs on a device
    result_view: npt.NDArray[np.float32]
    pos_buf: npt.NDArray[np.int32]
    temp: int | None = None  # F32 [1, 1, 1]: the position's attention temperature, if any
    hidden: int | None = None  # F32 [width, 1]: the trunk's normed output (a NextN stage)


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
    """One decode step of several sessions, built once for a set of
    sessions and reused while that set stays the same. The batch is ``[width, 1, B]``, one
    column per session. A weight whose type this ggml multiplies exactly as a ``[k, B]``
    matrix at this width (checked, ``skippy.runtime.batch_layout``) takes the columns as one:
    llamafile's GEMM then loads each weight block once for several columns. Any other weight
    is broadcast over dim 2, which keeps ggml's per-row vec-dot path (the GEMV of a
    one-session decode), reading each 16-row block once for the batch. Either way each
    session's column equals its own decode's bit for bit. Attention runs per session on its
    own KV views, as ``_DecodeGraph`` does."""

    ctx: int
    runner: GraphRunner
    graph: int
    members: list[_BatchMember]
    tokens: int  # I32 [B] ids (stage 0) or F32 [width, 1, B] activations
    pos: int  # I32 [B]
    result: int
    result_view: npt.NDArray[np.float32]  # [B, cols] in the graph's compute buffer (or a copy)
    pos_buf: npt.NDArray[np.int32]
    gemm_matmuls: int = 0  # weight matmuls taking the batch as one [k, B] matrix
    broadcast_matmuls: int = 0  # and those broadcast over it
    temp: int | None = None  # F32 [1, 1, B]: each position's attention temperature, if any


# --- attention over the sessions' caches: how each kind of graph writes and reads K/V ---------
def _attend(
    b: GraphBuilder,
    kv: _KvCache,
    il: int,
    q: int,
    mask: int,
    kq_scale: float,
    n_kv: int,
    rows: int,
    slots: _KvSlots | None,
    sinks: int | None = None,
    v_mla: int | None = None,
) -> int:
    """softmax(K^T Q * scale + mask) V (the scores soft-capped first where the model says)
    over the first ``n_kv`` cells of ``kv``'s layer
    ``il`` for Q ``[hd, n_head, rows]``: ``[q_dim, rows]``. With ``slots`` the attention
    tensors are registered to be resized to the position's KV length before each run;
    ``sinks`` join the softmax where the layer has them; under MLA V is a view of K made
    contiguous (transposed), and ``v_mla`` expands each head's output (``Attention``)."""
    g, ctx, spec = b.g, b.ctx, b.spec
    hd, cells = spec.head_dim, kv.cells
    f16_row = g.ggml_row_size(GgmlType.F16, spec.kv_dim)
    keys = g.ggml_view_3d(
        ctx, kv.k[il], hd, n_kv, spec.n_head_kv, f16_row, 2 * hd, 0
    )  # [hd, n_kv, n_head_kv]
    latent: list[tuple[int, int, bool]] = []  # MLA's V tensors to resize: (tensor, dim, cont)
    if spec.mla is None:
        values = g.ggml_view_3d(
            ctx, kv.v[il], n_kv, hd, spec.n_head_kv, 2 * cells, 2 * cells * hd, 0
        )  # [n_kv, hd, n_head_kv]
    else:  # llama.cpp's build_attn_mha with a V that is not transposed: cont(transpose(v))
        rank = spec.mla.kv_lora_rank
        v_view = g.ggml_view_3d(ctx, kv.k[il], rank, n_kv, 1, f16_row, f16_row * cells, 0)
        v_t = g.ggml_transpose(ctx, v_view)  # [n_kv, rank, 1]
        values = g.ggml_cont(ctx, v_t)
        latent = [(v_view, 1, False), (v_t, 0, False), (values, 0, True)]
    qp = g.ggml_permute(ctx, q, 0, 2, 1, 3)  # [hd, rows, n_head]
    scores = g.ggml_mul_mat(ctx, keys, qp)  # [n_kv, rows, n_head]
    # F32 accumulation, as llama.cpp asks: a device may otherwise sum the scores in F16
    g.ggml_prec_set_acc(scores, ggml.GGML_PREC_F32)
    capped = [scores]
    cap = spec.attn_softcap
    if cap:  # tanh(s / cap) * cap, before the softmax's scale and mask (llama.cpp's order)
        capped.append(g.ggml_scale(ctx, capped[-1], 1.0 / cap))
        capped.append(g.ggml_tanh(ctx, capped[-1]))
        capped.append(g.ggml_scale(ctx, capped[-1], cap))
    kq = g.ggml_soft_max_ext(ctx, capped[-1], mask, kq_scale, 0.0)
    if sinks is not None:
        g.ggml_soft_max_add_sinks(kq, sinks)
    if slots is not None:
        slots.add(keys, 1, False)
        slots.add(values, 0, False)
        for t in capped:
            slots.add(t, 0, True)
        slots.add(kq, 0, True)
        for t, dim, contiguous in latent:
            slots.add(t, dim, contiguous)
    kqv = g.ggml_mul_mat(ctx, values, kq)  # [hd, rows, n_head] (MLA: [rank, rows, n_head])
    if v_mla is not None:
        kqv = g.ggml_mul_mat(ctx, v_mla, kqv)  # [v_head_dim, rows, n_head]
    o = g.ggml_permute(ctx, kqv, 0, 2, 1, 3)  # [hd, n_head, rows]
    return g.ggml_cont_2d(ctx, o, spec.attn_out_dim, rows)


@dataclass
class _ChunkAttention:
    """A prefill chunk (or a decode step in a fresh graph): positions ``start..start+n`` at
    the last ``n`` of the graph's ``pad + n`` rows (the ``pad`` leading copies' K/V are not
    written), attention over ``n_kv`` cells."""

    kv: _KvCache
    masks: dict[int | None, int]
    start: int
    n: int
    pad: int
    n_kv: int

    def __call__(
        self,
        b: GraphBuilder,
        il: int,
        q: int,
        k: int,
        v: int,
        kq_scale: float,
        sinks: int | None = None,
        v_mla: int | None = None,
    ) -> int:
        g, ctx, spec, kv = b.g, b.ctx, b.spec, self.kv
        n, pad, kv_dim = self.n, self.pad, spec.kv_dim
        f16_row = g.ggml_row_size(GgmlType.F16, kv_dim)
        # write this chunk's K and V into the session cache (before the attention reads it:
        # nodes run in the order they were added)
        k_src = g.ggml_view_1d(ctx, k, n * kv_dim, 4 * kv_dim * pad)
        k_dst = g.ggml_view_1d(ctx, kv.k[il], n * kv_dim, f16_row * self.start)
        g.ggml_build_forward_expand(b.gf, g.ggml_cpy(ctx, k_src, k_dst))
        if spec.has_v_cache:
            v_src = g.ggml_view_2d(ctx, v, kv_dim, n, 4 * kv_dim, 4 * kv_dim * pad)
            v_t = g.ggml_transpose(ctx, v_src)  # [n, kv_dim]
            v_dst = g.ggml_view_2d(ctx, kv.v[il], n, kv_dim, 2 * kv.cells, 2 * self.start)
            g.ggml_build_forward_expand(b.gf, g.ggml_cpy(ctx, v_t, v_dst))
        mask = self.masks[_window(spec, il)]
        return _attend(b, kv, il, q, mask, kq_scale, self.n_kv, pad + n, None, sinks, v_mla)


def _write_rows(b: GraphBuilder, kv: _KvCache, il: int, k: int, v: int, slots: _KvSlots) -> None:
    """One position's K ``[kv_dim, 1]`` and V ``[1, kv_dim]`` written into the cache at the
    rows the slots' inputs name (the same f32 -> f16 conversion as a chunk's copy; no V under
    MLA)."""
    g, ctx = b.g, b.ctx
    g.ggml_build_forward_expand(b.gf, g.ggml_set_rows(ctx, kv.k[il], k, slots.k_rows))
    if slots.v_rows is None:
        return
    v_all = g.ggml_reshape_2d(ctx, kv.v[il], 1, kv.cells * b.spec.kv_dim)
    g.ggml_build_forward_expand(b.gf, g.ggml_set_rows(ctx, v_all, v, slots.v_rows))


@dataclass
class _SlotAttention:
    """A session's reused decode graph: one position, written at rows given as data, the
    attention built over every cell and resized before each run (``_SessionInputs``)."""

    kv: _KvCache
    slots: _KvSlots
    masks: dict[int | None, int]
    n_kv: int  # the cells the graph is built over (all, then resized; or the position's)

    def __call__(
        self,
        b: GraphBuilder,
        il: int,
        q: int,
        k: int,
        v: int,
        kq_scale: float,
        sinks: int | None = None,
        v_mla: int | None = None,
    ) -> int:
        g, ctx, kv_dim, slots = b.g, b.ctx, b.spec.kv_dim, self.slots
        k_row = g.ggml_reshape_2d(ctx, k, kv_dim, 1)
        v_row = g.ggml_reshape_2d(ctx, v, 1, kv_dim) if b.spec.has_v_cache else v
        _write_rows(b, self.kv, il, k_row, v_row, slots)
        mask = self.masks[_window(b.spec, il)]
        return _attend(b, self.kv, il, q, mask, kq_scale, self.n_kv, 1, slots, sinks, v_mla)


@dataclass
class _BatchAttention:
    """Several sessions' decode steps, one per column of ``[.., 1, B]``: each column's K/V
    written into its own session's cache and attended over it, as ``_SlotAttention`` does
    for one session; the columns' outputs joined back into ``[attn_out_dim, 1, B]``."""

    members: list[_BatchMember]

    def __call__(
        self,
        b: GraphBuilder,
        il: int,
        q: int,
        k: int,
        v: int,
        kq_scale: float,
        sinks: int | None = None,
        v_mla: int | None = None,
    ) -> int:
        g, ctx, spec = b.g, b.ctx, b.spec
        kv_dim, q_dim, hd = spec.kv_dim, spec.q_dim, spec.head_dim
        o: int | None = None
        for i, m in enumerate(self.members):
            k_row = g.ggml_view_2d(ctx, k, kv_dim, 1, 4 * kv_dim, 4 * kv_dim * i)
            v_col = g.ggml_view_2d(ctx, v, 1, kv_dim, 4, 4 * kv_dim * i) if spec.has_v_cache else v
            _write_rows(b, m.kv, il, k_row, v_col, m.slots)
            q_i = g.ggml_view_3d(ctx, q, hd, spec.n_head, 1, 4 * hd, 4 * q_dim, 4 * q_dim * i)
            mask = m.masks[_window(spec, il)]
            o_i = _attend(b, m.kv, il, q_i, mask, kq_scale, m.n_kv, 1, m.slots, sinks, v_mla)
            o = o_i if o is None else g.ggml_concat(ctx, o, o_i, 2)  # [q_dim, 1, i + 1]
        return _ok(o, "attention")


def _window(spec: ModelSpec, il: int) -> int | None:
    """The attention mask a layer uses: None = full causal, N = a sliding window of N."""
    return spec.sliding_window if spec.is_swa(il) else None


class GgmlStage(StageBase[_KvCache]):
    """A stage computed by ggml (see the module doc)."""

    engine = "ggml"
    runtime_version = RUNTIME_VERSION
    # Run a CPU stage through ggml's scheduler as a device stage runs (False: the CPU
    # backend directly, zero-copy and thread-governed; the tests compare the two).
    scheduled = False

    def _prepare(self) -> None:
        self.g = ggml.load()  # first: a missing or mismatched ggml is refused before any I/O
        self._backend: CpuBackend | DeviceBackend | None = None
        self._runner: GraphRunner | None = None
        self.device = CPU  # where the stage runs (``skippy.runtime.devices``)
        self.device_fallback: str | None = None  # why it runs on the CPU instead, if it does

    def _setup(self) -> None:
        g, spec = self.g, self.spec
        self._family = family_of(spec.arch)
        # the layers this stage's graphs run and cache: a final stage's NextN layers are
        # held for native MTP drafting, never run by the trunk (llama.cpp's builders)
        self._trunk = spec.trunk_layers(self.layers.start, self.layers.stop)
        w = self._loaded()
        head = tensor_name(T.OUTPUT) if self.layers.owns_output else None
        self._kv_cells = kv_length(self.config.n_ctx)  # a session's cache, as llama.cpp pads it
        choice, placement = self._placement(w)
        self.device, self.device_fallback = choice.device, choice.fallback_reason
        if choice.fallback_reason is not None:
            log.warning(
                "stage %s: device %s refused, running on the CPU: %s",
                self.layers,
                choice.requested,
                choice.fallback_reason,
            )
        if choice.device == CPU and not self.scheduled:
            cpu = CpuBackend(g, self.config.n_threads, adaptive=self.config.adaptive_threads)
            self._backend = cpu
            self._tensors = cpu.place_weights(w, repack=self.config.repack, tied_head=head)
        else:
            dev = DeviceBackend(g, choice.device, self.config.n_threads)
            self._backend = dev
            self._tensors = dev.place_weights(w, placement, tied_head=head)
        self.placement = placement
        self._layer_weights = {il: self._layer(il) for il in self.layers}
        self._nextn: tuple[int, NextnWeights] | None = self._nextn_head()
        # the last _build's normed output for the head, and its rows (NextN); whether the
        # graph being built is a drafting session's (its hidden rows kept); the sessions to
        # draft for (expect_drafts)
        self._built_hidden: tuple[int, int] | None = None
        self._drafting = False
        self._expecting: set[str] = set()
        # batched decode graphs by their sessions' caches (in batch order), newest last
        self._batch_graphs: dict[tuple[int, ...], _BatchGraph] = {}
        # per weight type, the batch widths multiplied as [k, B] (found at the first build)
        self._gemm_exact: dict[int, frozenset[int]] | None = None
        self._layouts = [0, 0]
        # a drafting stage's prefill graphs run their last layer twice (_build)
        n_built = len(self._trunk) + (1 if self._nextn is not None else 0)
        n_graph = self._tensors_per_layer() * n_built + _TENSORS_FIXED
        self._graph_size = max(ggml.GGML_DEFAULT_GRAPH_SIZE, n_graph)
        self._graph_mem = g.ggml_tensor_overhead() * 2 * self._graph_size + (
            g.ggml_graph_overhead_custom(self._graph_size, False)
        )
        # the prefill graphs' runner (each reused graph has its own)
        self._runner = self._backend.runner(2 * self._graph_size)

    def _placement(self, w: StageWeights) -> tuple[DeviceChoice, dict[str, str]]:
        """The stage's device (``choose_device`` over what it would hold there) and each
        weight's device."""
        cfg, names = self.config, [r.name for r in w]
        if cfg.device.upper() == CPU and not cfg.placement:
            return DeviceChoice(CPU, cfg.device), dict.fromkeys(names, CPU)
        devices = list_devices(self.g)
        check_rule_devices(cfg.placement, {d.name: d for d in devices})
        # A final stage holding a NextN layer embeds its drafts: it looks tokens up too.
        looks_up = self.layers.owns_input or any(il >= self.spec.n_trunk for il in self.layers)
        probe = place_tensors(
            names, "device", cfg.placement, cpu_moe=cfg.cpu_moe, looks_up=looks_up
        )
        on_device = sum(w.ref(n).nbytes for n, d in probe.items() if d != CPU)
        if self.layers.owns_output and w.tied and probe.get(tensor_name(T.TOKEN_EMBD)) == CPU:
            on_device += w.ref(tensor_name(T.TOKEN_EMBD)).nbytes  # the head's own copy
        need = on_device + cfg.max_sessions * self.kv_bytes_per_session()
        choice = choose_device(cfg.device, devices, need, fallback=cfg.device_fallback)
        placement = place_tensors(
            names,
            choice.device,
            cfg.placement,
            cpu_moe=cfg.cpu_moe,
            looks_up=looks_up,
        )
        return choice, placement

    def _nextn_head(self) -> tuple[int, NextnWeights] | None:
        """The draft head this stage runs: its first NextN block and weights, or None (no
        block here, or the block lacks what the head reads: ``nextn_unavailable`` says
        why)."""
        self.nextn_unavailable: str | None = None
        blocks = [il for il in self.layers if il >= self.spec.n_trunk]
        if not blocks:
            self.nextn_unavailable = "the stage holds no NextN layer"
            return None
        try:
            return blocks[0], head_weights(self._tensors, blocks[0], self._head_weight())
        except KeyError as missing:
            self.nextn_unavailable = (
                f"the NextN layer {blocks[0]} lacks {missing.args[0]} and the stage holds no "
                "model tensor to use instead"
            )
            return None

    def _cached(self) -> list[int]:
        """The layers a session caches K/V for: the trunk's, and the first NextN layer's on
        a final stage that holds one (the draft head's own cache)."""
        head = [il for il in self.layers if il >= self.spec.n_trunk][:1]
        return [*self._trunk, *head]

    def _take_hidden(self) -> tuple[int, int] | None:
        """The normed output tensor the last ``_build`` kept for the head, and its rows
        (once)."""
        hidden, self._built_hidden = self._built_hidden, None
        return hidden

    @property
    def drafts(self) -> bool:
        """This stage runs the NextN draft head (``draft``)."""
        return self._nextn is not None

    def _tensors_per_layer(self) -> int:
        # a MoE layer sums its experts' outputs through a view and an add per expert used
        return _TENSORS_PER_LAYER + 4 * self.spec.n_expert_used

    @property
    def threads_now(self) -> int:
        """The threads the last graph ran on (the thread governor may lower them)."""
        return self._backend.threads_now if self._backend is not None else self.config.n_threads

    def _layer(self, il: int) -> LayerWeights:
        names = [s.name for s in layer_tensors(self.spec, il, self.vocab)]
        return LayerWeights(il, {n: self._tensors[n] for n in names if n in self._tensors})

    # --- sessions --------------------------------------------------------------------------------
    def _new_session(self) -> _KvCache:
        g, spec, cells = self.g, self.spec, self._kv_cells
        params = GgmlInitParams(
            mem_size=g.ggml_tensor_overhead() * (2 * len(self._cached()) + 1),
            mem_buffer=None,
            no_alloc=True,
        )
        ctx = _ok(g.ggml_init(params), "ggml_init")
        try:
            k = {
                il: _ok(g.ggml_new_tensor_2d(ctx, GgmlType.F16, spec.kv_dim, cells), "k")
                for il in self._cached()
            }
            v = {
                il: _ok(g.ggml_new_tensor_2d(ctx, GgmlType.F16, cells, spec.kv_dim), "v")
                for il in (self._cached() if spec.has_v_cache else ())
            }
            buffer = _ok(
                g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, self._buffer_type()),
                "KV cache allocation",
            )
        except BaseException:
            g.ggml_free(ctx)
            raise
        g.ggml_backend_buffer_clear(buffer, 0)
        return _KvCache(ctx, buffer, k, v, g.ggml_backend_buffer_get_size(buffer), cells)

    def _release(self, state: _KvCache) -> None:
        for key in [k for k in self._batch_graphs if id(state) in k]:  # they view its cache
            self._free_batch_graph(self._batch_graphs.pop(key))
        if state.decode is not None:
            self._free_decode_graph(state.decode)
            state.decode = None
        self.g.ggml_backend_buffer_free(state.buffer)
        self.g.ggml_free(state.ctx)

    def _close_engine(self) -> None:
        for bg in getattr(self, "_batch_graphs", {}).values():
            self._free_batch_graph(bg)
        self._batch_graphs = {}
        if self._runner is not None:
            self._runner.free()
            self._runner = None
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    # --- the one graph path ----------------------------------------------------------------------
    def _live(self) -> CpuBackend | DeviceBackend:
        if self._backend is None:
            raise StageNotLoaded("the stage's backend is closed")
        return self._backend

    def _buffer_type(self) -> int:
        return self._live().buffer_type()

    def _compute(self, graph: int, *, step: bool = False) -> None:
        """Run a graph on the CPU backend (a one-position ``step`` on the governor's
        threads)."""
        self._live().compute(graph, step=step)

    def _prefill_runner(self) -> GraphRunner:
        if self._runner is None:
            raise StageNotLoaded("the stage's backend is closed")
        return self._runner

    def _new_graph(self, mem: int, size: int) -> tuple[int, int]:
        g = self.g
        ctx = _ok(g.ggml_init(GgmlInitParams(mem_size=mem, mem_buffer=None, no_alloc=True)), "init")
        try:
            return ctx, _ok(g.ggml_new_graph_custom(ctx, size, False), "ggml_new_graph")
        except BaseException:
            g.ggml_free(ctx)
            raise

    def _input(self, t: int | None) -> int:
        t = _ok(t, "ggml_new_tensor")
        self.g.ggml_set_input(t)
        return t

    def _embed(self, ctx: int, ids: int) -> int:
        """The token embeddings of ``ids`` (scaled where the model scales them)."""
        g, scale = self.g, self.spec.embed_scale
        x = g.ggml_get_rows(ctx, self._tensors[tensor_name(T.TOKEN_EMBD)], ids)
        return g.ggml_scale(ctx, x, scale) if scale is not None else x

    def _build(
        self,
        ctx: int,
        gf: int,
        x: int,
        pos: int,
        rows: int,
        attend: Attention,
        keep: int | None,
        attn_temp: int | None = None,
    ) -> int:
        """Every layer of the stage over ``x`` (its family's ``build_layer``), then for the
        final stage the output head: the graph's result (not yet expanded)."""
        b = GraphBuilder(
            g=self.g,
            ctx=ctx,
            gf=gf,
            spec=self.spec,
            pos=pos,
            rows=rows,
            mm=lambda weight, a: self._mm(ctx, weight, a),
            attend=attend,
            last_layer=self._trunk.stop - 1,
            keep=keep if self.layers.owns_output else None,
            freq_factors=self._tensors.get(tensor_name(T.ROPE_FREQS)),
            attn_temp=attn_temp,
        )
        last = self._trunk.stop - 1
        # a drafting stage's head reads every row's hidden state, not only the rows whose
        # logits are wanted: the last layer runs a second time over every row (the kept rows'
        # path, and so the logits, unchanged; the K/V it writes are the same values)
        self._built_hidden = None
        drafting, self._drafting = self._nextn is not None and self._drafting, False
        wide = drafting and b.keep is not None and b.keep < rows
        before_last = x
        for il in self._trunk:
            before_last = x
            x = self._family.build_layer(b, self._layer_weights[il], il, x)
        if not self.layers.owns_output:
            return x
        t = self._tensors
        norm, norm_bias = (
            t[tensor_name(T.OUTPUT_NORM)],
            t.get(tensor_name(T.OUTPUT_NORM, None, "bias")),
        )
        hidden = b.output_norm(x, norm, norm_bias)
        if drafting:  # the head pairs it with the next token (llama.cpp's h_nextn)
            every, n = hidden, b.keep if b.keep is not None else rows
            if wide:
                all_rows = replace(b, keep=None)
                x_all = self._family.build_layer(
                    all_rows, self._layer_weights[last], last, before_last
                )
                every, n = all_rows.output_norm(x_all, norm, norm_bias), rows
            self.g.ggml_set_output(every)
            self.g.ggml_build_forward_expand(gf, every)
            self._built_hidden = (every, n)
        return b.logits(
            hidden,
            _ok(self._head_weight(), "output head"),
            bias=t.get(tensor_name(T.OUTPUT, None, "bias")),
        )

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
        ctx, gf = self._new_graph(self._graph_mem, self._graph_size)
        try:
            feeds: list[tuple[int, npt.NDArray[Any]]] = []

            def fed(t: int | None, data: npt.NDArray[Any]) -> int:
                t = self._input(t)
                feeds.append((t, data))
                return t

            if self.layers.owns_input:
                x = self._embed(ctx, fed(g.ggml_new_tensor_1d(ctx, GgmlType.I32, rows), inputs))
            else:
                x = fed(g.ggml_new_tensor_2d(ctx, GgmlType.F32, spec.width, rows), inputs)
            positions = np.arange(start - pad, start + n, dtype=np.int32).clip(start)
            pos = fed(g.ggml_new_tensor_1d(ctx, GgmlType.I32, rows), positions)
            n_kv = kv_length(start + n)  # the cells in use, padded as llama.cpp views them
            masks = {}
            for window in self._windows():
                mask = attention_mask(start, n, window, n_kv=n_kv, swa_type=spec.swa_type)
                if pad:
                    mask = np.ascontiguousarray(np.concatenate([np.repeat(mask[:1], pad, 0), mask]))
                masks[window] = fed(g.ggml_new_tensor_2d(ctx, GgmlType.F32, n_kv, rows), mask)
            attend = _ChunkAttention(state, masks, start, n, pad, n_kv)
            temperature, temp = spec.attn_temperature, None
            if temperature is not None:
                t = g.ggml_new_tensor_3d(ctx, GgmlType.F32, 1, 1, rows)
                temp = fed(t, temperature.factors(positions))
            self._drafting = state.nextn.enabled
            result = self._build(ctx, gf, x, pos, rows, attend, out_rows, temp)
            built_hidden = self._take_hidden()
            final = self.layers.owns_output
            # a final stage that wants no logits only writes its K/V: the layers' cache
            # writes are in the graph, the rest is never expanded into it
            wanted = not (final and out_rows == 0)
            if wanted:
                g.ggml_set_output(result)
                g.ggml_build_forward_expand(gf, result)
            runner = self._prefill_runner()
            runner.alloc(gf)
            for t, data in feeds:
                if g.ggml_get_data(t) is not None:  # an input no node reads has no buffer
                    g.ggml_backend_tensor_set(t, data.ctypes.data, 0, data.nbytes)
            runner.compute(gf)
            if final and built_hidden is not None:
                self._keep_hidden(state, built_hidden, start, n, rows)
            if not wanted:
                return np.empty((0, self.vocab or 0), dtype=np.float32)
            cols = (self.vocab or 0) if final else spec.width
            rows_out = out_rows if final else n
            out = np.empty((rows_out, cols), dtype=np.float32)
            skip = 0 if final else pad  # a non-final stage returns its real rows only
            g.ggml_backend_tensor_get(result, out.ctypes.data, 4 * cols * skip, out.nbytes)
            return out
        finally:
            g.ggml_free(ctx)

    def _keep_hidden(
        self, state: _KvCache, built: tuple[int, int], start: int, n: int, rows: int
    ) -> None:
        """A chunk's hidden rows for the head: the last ``h_rows`` of its ``rows`` (the
        first ``rows - n`` are padding), at positions up to ``start + n - 1``."""
        tensor, h_rows = built
        real = min(h_rows, n)
        hidden = np.empty((real, self.spec.width), dtype=np.float32)
        offset = 4 * self.spec.width * (h_rows - real)
        self.g.ggml_backend_tensor_get(tensor, hidden.ctypes.data, offset, hidden.nbytes)
        state.nextn.keep_hidden(start + n - real, hidden)

    # --- the NextN draft head -------------------------------------------------------------------
    def expect_drafts(self, session: str) -> None:
        """``session`` will ask for drafts (``draft``): from its next pass on the trunk keeps
        every position's hidden state for the head (call it before the prompt, so the head
        covers it). A stage without a head ignores it; other sessions keep nothing."""
        if self._nextn is None:
            return
        self._check_session_id(session)
        self._expecting.add(session)
        s = self._sessions.get(session)
        if s is not None and not s.state.nextn.enabled:
            s.state.nextn.enabled = True
            if s.state.decode is not None:  # rebuilt with the hidden output
                self._free_decode_graph(s.state.decode)
                s.state.decode = None

    def _session_for(self, session: str, start: int, n: int) -> Any:
        s = super()._session_for(session, start, n)
        if session in self._expecting:
            s.state.nextn.enabled = True
        return s

    def free(self, session: str) -> None:
        """A freed session's expectation of drafts ends with it (one not yet alive keeps
        it: a loop frees its session before the prompt)."""
        if session in self._sessions:
            self._expecting.discard(session)
        super().free(session)

    def draft(self, session: str, start: int, tokens: Sequence[int]) -> npt.NDArray[np.float32]:
        """The NextN head's logits for the position after the pending token (``tokens[-1]``,
        at ``start + len(tokens) - 1``, the next position of ``session``'s trunk).
        ``tokens`` are committed tokens at positions ``start..``: the head's cache catches
        up on those it has not seen (each paired with the trunk's hidden state of the
        position before), so a caller may pass every token since any start it likes. Only a
        stage that ``drafts`` has a head (else ``UsageError`` ``native_mtp_unavailable``)."""
        if self._nextn is None:
            raise stage_usage(
                f"this stage runs no NextN draft head: {self.nextn_unavailable}",
                "native_mtp_unavailable",
            )
        self._loaded()
        self._check_session_id(session)
        s = self._sessions.get(session)
        pending = start + len(tokens) - 1
        if s is None or not tokens or s.length != pending:
            raise stage_usage(
                f"a draft pairs the pending token with the trunk's last position: session "
                f"{session!r} holds {s.length if s is not None else 0} positions, the pending "
                f"token is at {pending}",
                "bad_stage_input",
            )
        arr = np.asarray(list(tokens), dtype=np.int64)
        ids = check_token_ids(arr, self.vocab or 0, self.layers)
        state = s.state
        if not state.nextn.enabled:
            raise stage_usage(
                f"session {session!r} was not expecting drafts: call expect_drafts before its "
                "first pass",
                "bad_stage_input",
            )
        first, todo = state.nextn.plan(start, [int(t) for t in ids])
        if pending >= self.config.n_ctx:
            raise context_full(session, pending + 1, self.config.n_ctx)
        if not state.nextn.paired(pending):
            raise stage_usage(
                f"no trunk hidden state for position {pending - 1} of session {session!r}",
                "bad_stage_input",
            )
        zeros = np.zeros(self.spec.width, dtype=np.float32)
        hidden = np.stack(
            [state.nextn.hidden.get(p - 1, zeros) for p in range(first, pending + 1)]
        )
        ids32 = np.asarray(todo, dtype=np.int32)
        # as llama.cpp's drafter: the committed positions the cache lacks in one pass, then
        # the pending token alone
        if pending > first:
            k = pending - first
            self._draft_graph(state, first, ids32[:k], hidden[:k])
            state.nextn.committed(first, k)
        logits = self._draft_graph(state, pending, ids32[-1:], hidden[-1:])
        state.nextn.committed(pending, 1)
        return logits

    def _draft_graph(
        self,
        state: _KvCache,
        first: int,
        ids: npt.NDArray[np.int32],
        hidden: npt.NDArray[np.float32],
    ) -> npt.NDArray[np.float32]:
        """One pass of the head over positions ``first..first+rows-1`` (``build_nextn``),
        writing its own layer's K/V there; the last row's logits."""
        g, spec = self.g, self.spec
        il, weights = _ok_head(self._nextn)
        rows = int(ids.shape[0])
        ctx, gf = self._new_graph(self._graph_mem, self._graph_size)
        try:
            feeds: list[tuple[int, npt.NDArray[Any]]] = []

            def fed(t: int | None, data: npt.NDArray[Any]) -> int:
                t = self._input(t)
                feeds.append((t, np.ascontiguousarray(data)))
                return t

            tokens = fed(g.ggml_new_tensor_1d(ctx, GgmlType.I32, rows), ids)
            h = fed(g.ggml_new_tensor_2d(ctx, GgmlType.F32, spec.width, rows), hidden)
            positions = np.arange(first, first + rows, dtype=np.int32)
            pos = fed(g.ggml_new_tensor_1d(ctx, GgmlType.I32, rows), positions)
            n_kv = kv_length(first + rows)
            window = _window(spec, il)
            mask = attention_mask(first, rows, window, n_kv=n_kv)
            mask[:, : state.nextn.start or 0] = -np.inf  # cells before the head's cache began
            masks = {window: fed(g.ggml_new_tensor_2d(ctx, GgmlType.F32, n_kv, rows), mask)}
            b = GraphBuilder(
                g=g,
                ctx=ctx,
                gf=gf,
                spec=spec,
                pos=pos,
                rows=rows,
                mm=lambda weight, a: self._mm(ctx, weight, a),
                attend=_ChunkAttention(state, masks, first, rows, 0, n_kv),
                last_layer=il,
                freq_factors=self._tensors.get(tensor_name(T.ROPE_FREQS)),
            )
            layer = self._layer_weights[il]
            result, _ = build_nextn(b, weights, layer, self._family.build_layer, tokens, h)
            g.ggml_set_output(result)
            g.ggml_build_forward_expand(gf, result)
            runner = self._prefill_runner()
            runner.alloc(gf)
            for t, data in feeds:
                if g.ggml_get_data(t) is not None:
                    g.ggml_backend_tensor_set(t, data.ctypes.data, 0, data.nbytes)
            runner.compute(gf)
            out = np.empty(self.vocab or 0, dtype=np.float32)
            g.ggml_backend_tensor_get(result, out.ctypes.data, 0, out.nbytes)
            return out
        finally:
            g.ggml_free(ctx)

    def truncate(self, session: str, length: int) -> None:
        super().truncate(session, length)
        s = self._sessions.get(session)
        if s is not None:
            s.state.nextn.truncate(length)

    # --- one position: the reused decode graph and the head on ggml ------------------------------
    def _decode_one(
        self, state: _KvCache, position: int, inputs: npt.NDArray[Any], *, greedy: bool
    ) -> tuple[npt.NDArray[np.float32] | None, int | None]:
        dg = state.decode
        n_kv = self._built_kv(position)
        if dg is not None and dg.n_kv != n_kv and not self._live().resizes_graphs:
            self._free_decode_graph(dg)  # a device's graph is rebuilt at each new KV length
            dg = state.decode = None
        if dg is None:
            dg = state.decode = self._build_decode_graph(state, n_kv)
        g = self.g
        dg.set_position(g, position)
        dg.pos_buf[0] = position
        g.ggml_backend_tensor_set(dg.tokens, inputs.ctypes.data, 0, inputs.nbytes)
        if g.ggml_get_data(dg.pos) is not None:  # a stage of NoPE layers alone reads none
            g.ggml_backend_tensor_set(dg.pos, dg.pos_buf.ctypes.data, 0, 4)
        self._set_temperature(dg.temp, dg.pos_buf)
        dg.runner.compute(dg.graph, step=True)
        self._fetch(dg.result, dg.result_view)
        if dg.hidden is not None:
            hidden = np.empty((1, self.spec.width), dtype=np.float32)
            g.ggml_backend_tensor_get(dg.hidden, hidden.ctypes.data, 0, hidden.nbytes)
            state.nextn.keep_hidden(position, hidden)
        if greedy and self.layers.owns_output:
            # The argmax over the logits where ggml left them: no copy, and numpy's first
            # maximum is the sampler's own rule (ggml_argmax takes the last one on ties).
            return None, int(np.argmax(dg.result_view))
        return dg.result_view.reshape(1, -1).copy(), None

    def _temperature_input(self, ctx: int, rows: int) -> int | None:
        """A reused graph's attention-temperature input ``[1, 1, rows]``, where the model has
        one (set per run from the positions: ``_set_temperature``)."""
        if self.spec.attn_temperature is None:
            return None
        return self._input(self.g.ggml_new_tensor_3d(ctx, GgmlType.F32, 1, 1, rows))

    def _set_temperature(self, t: int | None, positions: npt.NDArray[np.int32]) -> None:
        temperature = self.spec.attn_temperature
        if t is not None and temperature is not None and self.g.ggml_get_data(t) is not None:
            f = temperature.factors(positions)
            self.g.ggml_backend_tensor_set(t, f.ctypes.data, 0, f.nbytes)

    def _built_kv(self, position: int) -> int:
        """The KV length a reused graph for ``position`` is built over: every cell where the
        backend resizes graphs in place, else the position's own (``kv_length``)."""
        return self._kv_cells if self._live().resizes_graphs else kv_length(position + 1)

    def _fetch(self, result: int, view: npt.NDArray[np.float32]) -> None:
        """A device graph's result copied to its host view (a CPU graph's is in place)."""
        if not self._live().host_results:
            self.g.ggml_backend_tensor_get(result, view.ctypes.data, 0, view.nbytes)

    def _session_inputs(self, ctx: int, cells: int) -> tuple[_KvSlots, dict[int | None, int]]:
        """A session's inputs in a reused graph: the K/V rows to write and one mask per
        window, over ``cells`` (resized per run where the backend resizes graphs)."""
        g, spec = self.g, self.spec
        slots = _KvSlots(
            k_rows=self._input(g.ggml_new_tensor_1d(ctx, GgmlType.I64, 1)),
            v_rows=self._input(g.ggml_new_tensor_1d(ctx, GgmlType.I64, spec.kv_dim))
            if spec.has_v_cache
            else None,
        )
        masks = {}
        for window in self._windows():
            masks[window] = self._input(g.ggml_new_tensor_2d(ctx, GgmlType.F32, cells, 1))
            slots.add(masks[window], 0, True)
        return slots, masks

    def _finish_graph(
        self, ctx: int, gf: int, result: int, n: int, size: int
    ) -> tuple[GraphRunner, Any]:
        """Expand a reused graph's result and give it its own runner (the shared one
        re-plans for every prefill graph, which would move this graph's tensors): the
        runner and a view of the result's ``n`` rows in its compute buffer (on a device: a
        host array ``_fetch`` fills after each run)."""
        g = self.g
        g.ggml_set_output(result)
        g.ggml_build_forward_expand(gf, result)
        backend = self._live()
        runner = backend.runner(size)
        try:
            runner.alloc(gf)
            cols = (self.vocab or 0) if self.layers.owns_output else self.spec.width
            if backend.host_results:
                data = _ok(g.ggml_get_data(result), "graph output")
                view = np.ctypeslib.as_array((ctypes.c_float * (cols * n)).from_address(data))
            else:
                view = np.empty(cols * n, dtype=np.float32)
        except BaseException:
            runner.free()
            raise
        return runner, view if n == 1 else view.reshape(n, cols)

    def _build_decode_graph(self, kv: _KvCache, n_kv: int) -> _DecodeGraph:
        """The one-position graph of ``kv``'s session over ``n_kv`` cells (see
        _DecodeGraph)."""
        g, spec = self.g, self.spec
        ctx, gf = self._new_graph(self._graph_mem, self._graph_size)
        try:
            if self.layers.owns_input:
                tokens = self._input(g.ggml_new_tensor_1d(ctx, GgmlType.I32, 1))
                x = self._embed(ctx, tokens)
            else:
                tokens = x = self._input(g.ggml_new_tensor_2d(ctx, GgmlType.F32, spec.width, 1))
            pos = self._input(g.ggml_new_tensor_1d(ctx, GgmlType.I32, 1))
            temp = self._temperature_input(ctx, 1)
            slots, masks = self._session_inputs(ctx, n_kv)
            attend = _SlotAttention(kv, slots, masks, n_kv)
            self._drafting = kv.nextn.enabled
            result = self._build(ctx, gf, x, pos, 1, attend, 1, temp)
            built = self._take_hidden()
            hidden = built[0] if built is not None else None
            runner, view = self._finish_graph(ctx, gf, result, 1, self._graph_size)
        except BaseException:
            g.ggml_free(ctx)
            raise
        return _DecodeGraph(
            ctx=ctx,
            runner=runner,
            graph=gf,
            slots=slots,
            tokens=tokens,
            pos=pos,
            masks=masks,
            result=result,
            result_view=view,
            pos_buf=np.zeros(1, dtype=np.int32),
            temp=temp,
            n_kv=n_kv,
            hidden=hidden,
            **_SessionInputs.buffers(spec.kv_dim, self._kv_cells, spec.swa_type),
        )

    # --- several sessions' decode steps in one graph ---------------------------------------------
    def _decode_many(
        self,
        states: list[_KvCache],
        positions: list[int],
        inputs: list[npt.NDArray[Any]],
        greedy: list[bool],
    ) -> list[tuple[npt.NDArray[np.float32] | None, int | None]]:
        if len(states) < 2 or any(s.nextn.enabled for s in states):
            # a drafting session keeps its hidden rows: one decode graph each
            return super()._decode_many(states, positions, inputs, greedy)
        n_kvs = [self._built_kv(p) for p in positions]
        # a device's graphs are built for their members' KV lengths (see _built_kv)
        key = tuple(id(s) for s in states) + (() if self._live().resizes_graphs else tuple(n_kvs))
        bg = self._batch_graphs.pop(key, None)
        if bg is None:
            while len(self._batch_graphs) >= BATCH_GRAPHS_KEPT:
                self._free_batch_graph(self._batch_graphs.pop(next(iter(self._batch_graphs))))
            bg = self._build_batch_graph(states, n_kvs)
        self._batch_graphs[key] = bg  # newest last
        g = self.g
        bg.pos_buf[:] = positions
        if g.ggml_get_data(bg.pos) is not None:  # as _decode_one
            g.ggml_backend_tensor_set(bg.pos, bg.pos_buf.ctypes.data, 0, bg.pos_buf.nbytes)
        self._set_temperature(bg.temp, bg.pos_buf)
        x = np.ascontiguousarray(np.concatenate(inputs))
        g.ggml_backend_tensor_set(bg.tokens, x.ctypes.data, 0, x.nbytes)
        for m, position in zip(bg.members, positions, strict=True):
            m.set_position(g, position)
        bg.runner.compute(bg.graph, step=True)
        self._fetch(bg.result, bg.result_view)
        out: list[tuple[npt.NDArray[np.float32] | None, int | None]] = []
        for i, gr in enumerate(greedy):
            row = bg.result_view[i]
            # first maximum: the sampler's rule, as _decode_one
            out.append((None, int(np.argmax(row))) if gr else (row.reshape(1, -1).copy(), None))
        return out

    def _build_batch_graph(self, states: list[_KvCache], n_kvs: list[int]) -> _BatchGraph:
        g, spec, b = self.g, self.spec, len(states)
        self._exact_gemm_widths()  # before the graph's matmuls choose their layout (_mm)
        self._layouts = [0, 0]  # [k, B] / broadcast matmuls of this build (_mm counts them)
        size = max(
            ggml.GGML_DEFAULT_GRAPH_SIZE,
            (self._tensors_per_layer() + _TENSORS_PER_MEMBER * b) * len(self._trunk)
            + _TENSORS_FIXED,
        )
        mem = g.ggml_tensor_overhead() * 2 * size + g.ggml_graph_overhead_custom(size, False)
        ctx, gf = self._new_graph(mem, size)
        try:
            if self.layers.owns_input:
                tokens = self._input(g.ggml_new_tensor_1d(ctx, GgmlType.I32, b))
                x = g.ggml_reshape_3d(ctx, self._embed(ctx, tokens), spec.width, 1, b)
            else:
                tokens = x = self._input(g.ggml_new_tensor_3d(ctx, GgmlType.F32, spec.width, 1, b))
            pos = self._input(g.ggml_new_tensor_1d(ctx, GgmlType.I32, b))
            temp = self._temperature_input(ctx, b)
            members = []
            for kv, n_kv in zip(states, n_kvs, strict=True):
                slots, masks = self._session_inputs(ctx, n_kv)
                members.append(
                    _BatchMember(
                        kv=kv,
                        slots=slots,
                        masks=masks,
                        n_kv=n_kv,
                        **_SessionInputs.buffers(spec.kv_dim, self._kv_cells, spec.swa_type),
                    )
                )
            result = self._build(ctx, gf, x, pos, b, _BatchAttention(members), None, temp)
            runner, view = self._finish_graph(ctx, gf, result, b, size)
        except BaseException:
            g.ggml_free(ctx)
            raise
        return _BatchGraph(
            ctx=ctx,
            runner=runner,
            graph=gf,
            members=members,
            tokens=tokens,
            pos=pos,
            result=result,
            result_view=view,
            pos_buf=np.zeros(b, dtype=np.int32),
            gemm_matmuls=self._layouts[0],
            broadcast_matmuls=self._layouts[1],
            temp=temp,
        )

    def _exact_gemm_widths(self) -> dict[int, frozenset[int]]:
        """Per weight type, the batch widths whose ``[k, B]`` product this ggml computes
        exactly as B one-column products (``skippy.runtime.batch_layout``), checked once per
        stage on a slice of one of its own weights per type."""
        if self._gemm_exact is None and not isinstance(self._backend, CpuBackend):
            self._gemm_exact = {}  # measured on the CPU backend's kernels only: broadcast
        if self._gemm_exact is None:
            from skippy.runtime.batch_layout import exact_gemm_widths

            weights: dict[int, int] = {}
            for w in self._layer_weights.values():
                for t in w.matrices():
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
        t = self._tensors
        return t.get(tensor_name(T.OUTPUT), t.get(tensor_name(T.TOKEN_EMBD)))

    def _free_batch_graph(self, bg: _BatchGraph) -> None:
        bg.runner.free()
        self.g.ggml_free(bg.ctx)

    def _free_decode_graph(self, dg: _DecodeGraph) -> None:
        dg.runner.free()
        self.g.ggml_free(dg.ctx)

    def _windows(self, layers: Iterable[int] | None = None) -> list[int | None]:
        """The attention masks ``layers`` (default: this stage's) use: None = full causal,
        N = sliding."""
        windows: list[int | None] = []
        for il in self._trunk if layers is None else layers:
            w = _window(self.spec, il)
            if w not in windows:
                windows.append(w)
        return windows

    # --- introspection -----------------------------------------------------------------------
    def device_status(self) -> dict[str, Any]:
        """Where the stage runs, for the node's status: its device, its weights' placement
        (``placement_mode``), and what it holds in the device's memory now: the weights
        uploaded there and the open sessions' KV caches (0 on the CPU)."""
        backend = self._backend
        weights = backend.device_weight_bytes if isinstance(backend, DeviceBackend) else 0
        kv = 0
        if self.device != CPU:
            kv = sum(s.state.nbytes for s in list(self._sessions.values()))
        return {
            "device": self.device,
            "device_fallback": self.device_fallback,
            "placement": placement_mode(getattr(self, "placement", {}), self.device),
            "device_memory_bytes": weights + kv,
            "device_weight_bytes": weights,
            "device_kv_bytes": kv,
        }

    def kv_bytes_per_session(self) -> int:
        caches = 2 if self.spec.has_v_cache else 1  # MLA: K only
        return caches * 2 * len(self._cached()) * self.spec.kv_dim * self._kv_cells
