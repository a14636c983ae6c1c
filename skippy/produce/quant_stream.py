"""Tensor conversion through ggml, streamed: source rows in, quantized rows out, bounded memory.

One tensor at a time, in slabs of rows (``SLAB_ELEMENTS`` values): each slab is split into
one piece per worker thread; a piece reads its rows (``pread``), turns them into float32
(numpy for F16/BF16, ggml's own ``to_float`` for a quantized source), quantizes them with
``ggml_quantize_chunk`` and checks them with ``ggml_validate_row_data``, exactly as
llama.cpp's ``llama_tensor_quantize_impl`` does. Every foreign call releases the GIL, so
the pieces run on all cores; while the caller writes (and hashes) slab k, slab k+1 is
already being computed. Rows are independent for every ggml type (an imatrix is per
column), so any split into pieces gives llama.cpp's bytes.

Memory: two slabs in flight per tensor being written, each at most source + float32 +
quantized bytes of ``SLAB_ELEMENTS`` values (~10 MiB for an F32 source), never a whole tensor.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

import numpy as np

from skippy.errors import InputUnreadable, ModelError
from skippy.gguf import ggml
from skippy.gguf.constants import GGML_TYPES
from skippy.gguf.reader import TensorInfo
from skippy.gguf.writer import TensorProducer

SLAB_ELEMENTS: Final = 1 << 20  # values per slab: 4 MiB of float32
ARENA_BYTES: Final = 4 * SLAB_ELEMENTS  # a slab of source, float32 or output (<= 4 B a value)
F32, F16, BF16 = 0, 1, 30


class QuantizedDataInvalid(ModelError):
    """ggml_validate_row_data refused the quantized rows."""

    code = "quantized_data_invalid"


class SourceDataInvalid(ModelError):
    """ggml_validate_row_data refused the source rows (NaN or inf): llama.cpp's loader
    (``check_tensors``) refuses such a source the same way, copied tensors included."""

    code = "invalid_source_data"




def row_bytes(type_id: int, n_per_row: int) -> int:
    """ggml_row_size from our one type table (the same numbers; no library call needed)."""
    _, block, type_size = GGML_TYPES[type_id]
    return n_per_row // block * type_size


def output_info(src: TensorInfo, target_type: int) -> TensorInfo:
    """The converted tensor's header facts (offsets are the fragment writer's business)."""
    rows = src.n_elements // src.shape[0]
    return TensorInfo(
        name=src.name,
        shape=src.shape,
        ggml_type=target_type,
        offset=0,
        data_start=0,
        nbytes=rows * row_bytes(target_type, src.shape[0]),
    )


@dataclass(frozen=True)
class Conversion:
    """One tensor to convert: where its source bytes are and what it becomes."""

    src: TensorInfo
    fd: int
    target_type: int
    imatrix: np.ndarray | None = None  # float32, ne0 * ne2 values (one row per expert)

    @property
    def n_per_row(self) -> int:
        return self.src.shape[0]

    @property
    def rows_per_expert(self) -> int:
        return self.src.shape[1] if len(self.src.shape) > 1 else 1

    @property
    def n_experts(self) -> int:
        return self.src.n_elements // (self.n_per_row * self.rows_per_expert)


@dataclass
class _Slab:
    """Buffers for one slab, reused: source bytes, float32 values, quantized bytes."""

    raw: np.ndarray
    f32: np.ndarray
    out: np.ndarray
    arenas: tuple[np.ndarray, ...]


class _Arenas:
    """Reused ``ARENA_BYTES`` buffers. A fresh numpy array of megabytes is a fresh mmap whose
    pages fault in on first touch, for every tensor; reusing them saves that (~0.5 s of CPU
    on gemma3-270m's layers). Thread-safe: several fragments are written at once."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        if nbytes > ARENA_BYTES:  # a row longer than a slab: a one-off buffer
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            if self._free:
                return self._free.pop()
        return np.empty(ARENA_BYTES, dtype=np.uint8)

    def give(self, *arrays: np.ndarray) -> None:
        with self._lock:
            self._free.extend(a for a in arrays if a.nbytes == ARENA_BYTES)


class Converter:
    """Converts tensors on a shared pool of ``workers`` threads (the caller owns the pool)."""

    def __init__(self, g: ggml.Ggml, pool: ThreadPoolExecutor, workers: int) -> None:
        self.g = g
        self.pool = pool
        self.workers = max(1, workers)
        self._to_float: dict[int, Callable[[int, int, int], None]] = {}
        self._arenas = _Arenas()

    def prepare_type(self, source_type: int, target_type: int) -> None:
        """ggml_quantize_init once per target type (it allocates tables; not on the hot
        path), and the dequantizer of a quantized source type."""
        self.g.ggml_quantize_init(target_type)
        if source_type not in (F32, F16, BF16) and source_type not in self._to_float:
            traits = ggml.type_traits(self.g, source_type)
            if not traits.to_float:
                raise ModelError(
                    f"ggml cannot dequantize {GGML_TYPES[source_type][0]} tensors",
                    code="unsupported_source_type",
                )
            self._to_float[source_type] = ggml.GGML_TO_FLOAT(traits.to_float)

    def copier(self, src: TensorInfo, fd: int) -> TensorProducer:
        """A tensor kept as it is: copied in whole rows, each slab validated on the way."""

        def produce(write: Callable[[memoryview], None]) -> None:
            row = row_bytes(src.ggml_type, src.shape[0])
            step = max(1, ARENA_BYTES // row) * row
            buf = self._arenas.take(step)
            try:
                done = 0
                while done < src.nbytes:
                    view = buf[: min(step, src.nbytes - done)]
                    self._read(fd, view, src.data_start + done, src.name)
                    self._check_source(src, view)
                    write(view.data)
                    done += view.nbytes
            finally:
                self._arenas.give(buf)

        return produce

    def _read(self, fd: int, into: np.ndarray, offset: int, name: str) -> None:
        got = os.preadv(fd, [into.data], offset)
        if got != into.nbytes:
            raise InputUnreadable(
                f"the source ended inside tensor {name} (read {got} of {into.nbytes} bytes): "
                "the file is truncated or was changed while being read",
                code="unexpected_eof",
            )

    def _check_source(self, src: TensorInfo, data: np.ndarray) -> None:
        if not self.g.ggml_validate_row_data(src.ggml_type, data.ctypes.data, data.nbytes):
            raise SourceDataInvalid(
                f"tensor {src.name} of the source holds invalid values (NaN or infinite)",
                remediation="fix the source model; llama.cpp refuses it the same way",
            )

    def producer(self, conv: Conversion) -> TensorProducer:
        def produce(write: Callable[[memoryview], None]) -> None:
            for view in self.slabs(conv):
                write(view)

        return produce

    def slabs(self, conv: Conversion) -> Iterator[memoryview]:
        """The converted tensor, slab by slab in row order. A view is valid until the next
        one is asked for; closing the iterator early waits for the pieces in flight."""
        slab_rows = max(1, SLAB_ELEMENTS // conv.n_per_row)
        spans = [
            (e, r, min(slab_rows, conv.rows_per_expert - r))
            for e in range(conv.n_experts)
            for r in range(0, conv.rows_per_expert, slab_rows)  # never across an expert
        ]
        buffers = [self._new_slab(conv, min(slab_rows, conv.rows_per_expert)) for _ in range(2)]
        dst_row = row_bytes(conv.target_type, conv.n_per_row)
        pending: list[tuple[int, list[Future[None]]]] = []
        try:
            for k in range(len(spans) + 1):
                if k < len(spans):  # slab k computes while the caller consumes slab k-1
                    pending.append((k, self._submit(conv, buffers[k % 2], *spans[k])))
                if k == 0:
                    continue
                done, futs = pending.pop(0)
                for f in futs:
                    f.result()
                yield buffers[done % 2].out.data[: spans[done][2] * dst_row]
        finally:
            for _, futs in pending:  # an error or an early close: let in-flight pieces
                for f in futs:  # finish before the buffers they write into go away
                    f.cancel()
                for f in futs:
                    if not f.cancelled():
                        f.exception()
            for slab in buffers:
                self._arenas.give(*slab.arenas)

    def _new_slab(self, conv: Conversion, rows: int) -> _Slab:
        n = rows * conv.n_per_row
        src_type = conv.src.ggml_type
        sizes = (
            rows * row_bytes(src_type, conv.n_per_row),
            0 if src_type == F32 else 4 * n,
            rows * row_bytes(conv.target_type, conv.n_per_row),
        )
        raw, f32, out = (self._arenas.take(size) for size in sizes)
        return _Slab(
            raw=raw[: sizes[0]],
            f32=f32[: sizes[1]].view(np.float32),
            out=out[: sizes[2]],
            arenas=(raw, f32, out),
        )

    def _submit(
        self, conv: Conversion, slab: _Slab, expert: int, first: int, rows: int
    ) -> list[Future[None]]:
        pieces = min(self.workers, rows)
        bounds = [rows * i // pieces for i in range(pieces + 1)]
        return [
            self.pool.submit(
                self._piece, conv, slab, expert, first, bounds[i], bounds[i + 1] - bounds[i]
            )
            for i in range(pieces)
        ]

    def _piece(
        self, conv: Conversion, slab: _Slab, expert: int, first: int, at: int, rows: int
    ) -> None:
        """Rows ``[at, at + rows)`` of the slab starting at row ``first`` of ``expert``."""
        n = conv.n_per_row
        src_type, dst_type = conv.src.ggml_type, conv.target_type
        src_row, dst_row = row_bytes(src_type, n), row_bytes(dst_type, n)
        row0 = expert * conv.rows_per_expert + first + at  # global row index
        raw = slab.raw[at * src_row : (at + rows) * src_row]
        self._read(conv.fd, raw, conv.src.data_start + row0 * src_row, conv.src.name)
        self._check_source(conv.src, raw)
        if src_type == F32:
            f32 = raw.view(np.float32)
        else:
            f32 = slab.f32[at * n : (at + rows) * n]
            if src_type == F16:
                np.copyto(f32, raw.view(np.float16))
            elif src_type == BF16:  # bf16 is the top half of an f32: exact, as ggml's row op
                u32 = f32.view(np.uint32)
                np.copyto(u32, raw.view(np.uint16))
                u32 <<= 16
            else:
                self._to_float[src_type](raw.ctypes.data, f32.ctypes.data, rows * n)
        out = slab.out[at * dst_row : (at + rows) * dst_row]
        imatrix = None
        if conv.imatrix is not None:
            imatrix = conv.imatrix.ctypes.data + expert * n * 4
        size = self.g.ggml_quantize_chunk(
            dst_type, f32.ctypes.data, out.ctypes.data, 0, rows, n, imatrix
        )
        if size != out.nbytes or not self.g.ggml_validate_row_data(
            dst_type, out.ctypes.data, size
        ):
            raise QuantizedDataInvalid(
                f"quantizing {conv.src.name} to {GGML_TYPES[dst_type][0]} gave invalid rows "
                f"(near row {row0})",
                remediation="llama.cpp refuses such rows the same way; try another type",
            )
