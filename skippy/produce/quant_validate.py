"""What validate-package expects of a quantized package: the recorded quantization, redone.

For a package whose manifest carries a ``quantization`` block, "recompute from the source"
(spec "Publishing Rules") means: plan every tensor's type again from the source and the
block (preset, ``pure``, recipe), expect those types, and expect the bytes ggml makes of the
source rows, produced slab by slab while the artifact is read (bounded memory, both cores).
The metadata fragment must hold the source's KV records with llama.cpp's ``general.file_type``
and ``general.quantization_version``. When the block names an imatrix, the file is not
available here: types and shapes are checked, the quantized bytes are not (one warning).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from skippy.errors import ManifestError, SkippyError
from skippy.findings import Finding
from skippy.gguf import ggml
from skippy.gguf.reader import TensorInfo
from skippy.hashing import DEFAULT_WORKERS
from skippy.package.manifest import Manifest
from skippy.package.quantization import (
    QUANTIZATION_KEY,
    parse_quantization,
    quantized_kv_records,
)
from skippy.produce.quant_rules import (
    FILE_TYPES,
    QUANTIZE_TARGETS,
    TensorFacts,
    model_facts,
    plan_types,
)
from skippy.produce.quant_stream import Conversion, Converter, output_info
from skippy.produce.recipe import parse_recipe
from skippy.produce.source import SourceModelFiles


class TensorReader(Protocol):
    """Sequential reader of a tensor's expected bytes (what validate-package compares)."""

    def read(self, into: memoryview) -> int: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class ExpectedTensor:
    """A tensor as the package must hold it. ``open_reader`` None: the raw source bytes at
    ``info.data_start``; otherwise the quantized bytes it streams. ``compare_bytes`` False:
    check type and shape only."""

    info: TensorInfo
    fd: int
    open_reader: Callable[[], TensorReader] | None = None
    compare_bytes: bool = True


class _SlabReader:
    """A pull reader over ``Converter.slabs``: fills the caller's buffer in order."""

    def __init__(self, slabs: Iterator[memoryview]) -> None:
        self._slabs = slabs
        self._view = memoryview(b"")

    def read(self, into: memoryview) -> int:
        done = 0
        while done < len(into):
            if not self._view:
                nxt = next(self._slabs, None)
                if nxt is None:
                    break
                self._view = nxt
            n = min(len(into) - done, len(self._view))
            into[done : done + n] = self._view[:n]
            self._view = self._view[n:]
            done += n
        return done

    def close(self) -> None:
        self._view = memoryview(b"")
        close = getattr(self._slabs, "close", None)
        if close is not None:
            close()


@dataclass
class QuantizedExpectation:
    """Expected tensors and metadata records; a context manager owning the ggml workers."""

    tensors: dict[str, ExpectedTensor] = field(default_factory=dict)
    kv: dict[str, bytes] | None = None
    findings: list[Finding] = field(default_factory=list)
    _pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> QuantizedExpectation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _not_reproducible(why: str) -> Finding:
    return Finding(
        "quantization_not_reproducible",
        f"the package's {QUANTIZATION_KEY} block cannot be redone from this source: {why}",
        remediation="validate against the source the package was quantized from",
    )


def quantized_expectation(
    m: Manifest, src: SourceModelFiles, *, workers: int = DEFAULT_WORKERS
) -> QuantizedExpectation:
    """Expectations for every source tensor, or findings saying why there are none."""
    out = QuantizedExpectation()
    try:
        block = parse_quantization(m.extra[QUANTIZATION_KEY])
    except ManifestError:
        return out  # check_manifest already reports the malformed block
    file_type = FILE_TYPES.get(block.type)
    if file_type is None or file_type.ftype != block.ftype:
        out.findings.append(_not_reproducible(f"type {block.type!r} / ftype {block.ftype}"))
        return out
    records = [(f.key, src.head.raw_field(f.key)) for f in src.kv_fields()]
    out.kv = dict(quantized_kv_records(records, file_type.ftype))
    try:
        recipe = (
            parse_recipe(block.recipe.encode("utf-8"), allowed_types=QUANTIZE_TARGETS)
            if block.recipe is not None
            else None
        )
        facts = [TensorFacts(t.info.name, t.info.shape, t.info.ggml_type) for t in src.tensors]
        plan = plan_types(
            facts,
            model_facts(src.metadata()),
            file_type,
            pure=block.pure,
            recipe=recipe,
            has_imatrix=block.imatrix_sha256 is not None,
        )
    except SkippyError as exc:
        out.findings.append(_not_reproducible(exc.message))
        return out
    why = (
        "with an importance matrix, which is not available here"
        if block.imatrix_sha256 is not None
        else "from a package that was itself quantized from this source"
        if block.requantized_from is not None
        else None
    )
    with_imatrix = why is not None  # quantized bytes cannot be redone from this source
    if why is not None:
        out.findings.append(
            Finding(
                "quantized_bytes_not_checked",
                f"the package was quantized {why}: tensor types and shapes are checked, "
                "quantized bytes are not",
                severity="warning",
            )
        )
    g = ggml.load()
    out._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="requantize")
    converter = Converter(g, out._pool, workers)
    choices = plan.by_name()
    for t in src.tensors:
        fd = src.shards[t.shard].fileno()
        c = choices[t.info.name]
        if not c.converts:
            out.tensors[t.info.name] = ExpectedTensor(t.info, fd)
            continue
        converter.prepare_type(c.source_type, c.target_type)
        conv = Conversion(src=t.info, fd=fd, target_type=c.target_type)
        out.tensors[t.info.name] = ExpectedTensor(
            output_info(t.info, c.target_type),
            fd,
            open_reader=None if with_imatrix else _opener(converter, conv),
            compare_bytes=not with_imatrix,
        )
    return out


def _opener(converter: Converter, conv: Conversion) -> Callable[[], TensorReader]:
    return lambda: _SlabReader(converter.slabs(conv))
