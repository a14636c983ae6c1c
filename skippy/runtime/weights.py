"""A stage's weights: its parts opened, every tensor checked, the bytes mapped (no copy).

``StageWeights.open(stage)`` reads each selected part with the bounded GGUF reader
(``skippy.gguf.reader``: offsets, sizes, overlaps, alignment), then checks every tensor
against its family's plan for this layer range (``skippy.runtime.families``): the part that
holds it owns it (spec "Repository Layout"), the name is expected, the shape is exact, the
type is one the engines run, and its data is 32-byte aligned in the file (ggml aborts the
process on a misaligned buffer: runtime-facts.md). Only then are the files mapped read-only.
Nothing here calls
ggml; the engines receive addresses and byte views of tensors that passed every check, so a
hostile or corrupt fragment becomes a coded error, never a native abort.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from skippy.constants import (
    KEY_ARCHITECTURE,
    KEY_V2_METADATA_ONLY,
    OUTPUT_WEIGHT_TENSOR,
    ROLE_COMMON,
    ROLE_EMBEDDINGS,
    ROLE_LAYER,
    ROLE_METADATA,
    ROLE_OUTPUT,
    TOKEN_EMBEDDING_TENSOR,
    V2_CARRIER_KEYS,
)
from skippy.errors import ModelError
from skippy.gguf.constants import GGML_TYPES
from skippy.gguf.reader import GGUFFile, TensorInfo, open_gguf
from skippy.package.experts import summarize
from skippy.package.ownership import owner_of
from skippy.package.ranges import LayerRange
from skippy.runtime.boundary import StageLoad, StageUnsupported
from skippy.runtime.families import check_stage_layers, spec_from_metadata, stage_tensors
from skippy.runtime.model import MAX_VOCAB, ModelSpec, TensorSpec, describe_allowed, type_name

# ggml's CPU backend needs every tensor it reads 32-byte aligned (TENSOR_ALIGNMENT).
DATA_ALIGNMENT = 32
# Metadata keys not needed for the forward pass; the tokenizer arrays alone are ~786k values
# for gemma3 and are read by the tokenizer, not here.
_SKIPPED_KEY_PREFIXES = ("tokenizer.",)


def _fragment_error(message: str, code: str, path: Path, **kw: Any) -> ModelError:
    return ModelError(message, code=code, path=str(path), **kw)


@dataclass(frozen=True)
class WeightRef:
    """One checked tensor: where its bytes are (part index, absolute offset)."""

    name: str
    shape: tuple[int, ...]  # GGUF order, ne0 first
    ggml_type: int
    part: int
    offset: int
    nbytes: int

    @property
    def np_shape(self) -> tuple[int, ...]:
        """numpy order (rows last-dim-first): ``(ne1, ne0)`` for a matrix."""
        return tuple(reversed(self.shape))


def read_model_kv(g: GGUFFile) -> dict[str, Any]:
    """The metadata part's KV pairs the forward pass reads (tokenizer arrays and a v2
    carrier's locator arrays skipped)."""
    return {
        k: g.value(k)
        for k in g.fields
        if not k.startswith(_SKIPPED_KEY_PREFIXES) and k not in V2_CARRIER_KEYS
    }


class StageWeights:
    """The checked, mapped tensors of one stage. Use as a context manager or ``close()``."""

    def __init__(
        self,
        stage: StageLoad,
        spec: ModelSpec,
        kv: Mapping[str, Any],
        tensors: dict[str, WeightRef],
        maps: list[mmap.mmap | None],
        vocab: int | None,
        tied: bool,
    ) -> None:
        self.stage = stage
        self.spec = spec
        self.kv = kv
        self.tensors = tensors
        self._maps = maps
        self._views: list[npt.NDArray[np.uint8] | None] = [
            np.frombuffer(m, dtype=np.uint8) if m is not None else None for m in maps
        ]
        self.vocab = vocab
        self.tied = tied

    @property
    def layers(self) -> LayerRange:
        return self.stage.layers

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[WeightRef]:
        return iter(self.tensors.values())

    def ref(self, name: str) -> WeightRef:
        return self.tensors[name]

    def raw(self, name: str) -> npt.NDArray[np.uint8]:
        """The tensor's bytes in the mapped file (read-only, no copy)."""
        r = self.tensors[name]
        view = self._views[r.part]
        if view is None:  # every part holding a checked tensor is mapped
            raise ModelError(f"{name} is not mapped", code="stage_not_loaded")
        return view[r.offset : r.offset + r.nbytes]

    def address(self, name: str) -> int:
        """Absolute address of the tensor's first byte (for ggml)."""
        return int(self.raw(name).ctypes.data)

    def release_pages(self, name: str) -> None:
        """Drop the tensor's pages from this process's memory (they were copied elsewhere,
        e.g. uploaded to a device); a later read faults them in again from the file."""
        r = self.tensors[name]
        m = self._maps[r.part]
        if m is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = r.offset - r.offset % mmap.PAGESIZE
        m.madvise(mmap.MADV_DONTNEED, start, r.offset + r.nbytes - start)

    def part_span(self, part: int) -> tuple[int, int]:
        """(address, size) of a whole mapped part."""
        view = self._views[part]
        if view is None:
            raise ModelError(f"part {part} is not mapped", code="stage_not_loaded")
        return int(view.ctypes.data), int(view.nbytes)

    def parts_with_tensors(self) -> list[int]:
        return sorted({r.part for r in self.tensors.values()})

    def close(self) -> None:
        self._views = [None] * len(self._views)
        for m in self._maps:
            if m is not None:
                # BufferError: a caller still holds a view; the mapping goes with the last view
                with contextlib.suppress(BufferError):
                    m.close()
        self._maps = [None] * len(self._maps)

    def __enter__(self) -> StageWeights:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @classmethod
    def open(cls, stage: StageLoad) -> StageWeights:
        return _open_stage(stage)


# --- opening and checking ------------------------------------------------------------------------
def _collect(
    stage: StageLoad, files: list[GGUFFile], arch: str
) -> dict[str, tuple[int, TensorInfo]]:
    found: dict[str, tuple[int, TensorInfo]] = {}
    for index, (g, role) in enumerate(zip(files, stage.part_roles, strict=True)):
        if index == 0 and stage.schema_version == 2:
            continue  # the carrier's directory describes the payload parts, it holds none
        part_arch = g.get(KEY_ARCHITECTURE)
        if part_arch != arch:
            raise _fragment_error(
                f"{g.path} is a {part_arch!r} fragment; the metadata part says {arch!r}",
                "fragment_architecture_mismatch",
                g.path,
                expected=arch,
                actual=str(part_arch),
            )
        for t in g.tensors:
            owner = owner_of(t.name)
            owner_role, layer = owner.role, owner.layer_index
            # A v2 common part holds every non-layer tensor (spec "v2 parts").
            common_ok = role == ROLE_COMMON and layer is None
            if not common_ok and (
                owner_role != role or (role == ROLE_LAYER and layer not in stage.layers)
            ):
                raise _fragment_error(
                    f"{g.path} ({role} part) holds tensor {t.name!r}, which belongs to the "
                    f"{owner_role} part" + (f" of layer {layer}" if layer is not None else ""),
                    "fragment_tensor_misplaced",
                    g.path,
                    actual=t.name,
                )
            if t.name in found:
                raise _fragment_error(
                    f"tensor {t.name!r} appears in two parts of the stage",
                    "fragment_duplicate_tensor",
                    g.path,
                    actual=t.name,
                )
            found[t.name] = (index, t)
    return found


def _vocab_rows(found: Mapping[str, tuple[int, TensorInfo]], files: list[GGUFFile]) -> int | None:
    rows = None
    for name in (TOKEN_EMBEDDING_TENSOR, OUTPUT_WEIGHT_TENSOR):
        if name in found:
            part, t = found[name]
            if len(t.shape) != 2 or not 1 <= t.shape[1] <= MAX_VOCAB:
                raise _fragment_error(
                    f"{name} has shape {t.shape}; expected (width, vocab) with vocab in "
                    f"1..{MAX_VOCAB}",
                    "fragment_tensor_shape",
                    files[part].path,
                    actual=list(t.shape),
                )
            if rows is not None and t.shape[1] != rows:
                raise _fragment_error(
                    f"{name} has {t.shape[1]} rows, {TOKEN_EMBEDDING_TENSOR} has {rows}",
                    "fragment_tensor_shape",
                    files[part].path,
                )
            rows = t.shape[1]
    return rows


def _check(
    plan: list[TensorSpec], found: Mapping[str, tuple[int, TensorInfo]], files: list[GGUFFile]
) -> dict[str, WeightRef]:
    by_name = {s.name: s for s in plan}
    for name, (part, _) in found.items():
        if name not in by_name:
            raise _fragment_error(
                f"{files[part].path} holds tensor {name!r}, which the stage runtime does not "
                "know for this architecture; refusing rather than computing without it",
                "fragment_unexpected_tensor",
                files[part].path,
                actual=name,
            )
    refs: dict[str, WeightRef] = {}
    for s in plan:
        if s.name not in found:
            if s.required:
                raise ModelError(
                    f"tensor {s.name!r} is missing from the stage's parts",
                    code="fragment_missing_tensor",
                    actual=s.name,
                )
            continue
        part, t = found[s.name]
        path = files[part].path
        if t.shape != s.shape:
            raise _fragment_error(
                f"tensor {s.name!r} has shape {t.shape}, the model's hyperparameters need "
                f"{s.shape}",
                "fragment_tensor_shape",
                path,
                expected=list(s.shape),
                actual=list(t.shape),
            )
        if t.ggml_type not in s.allowed_types:
            raise StageUnsupported(
                f"tensor {s.name!r} has type {type_name(t.ggml_type)}; the stage runtime runs "
                f"{describe_allowed(s.allowed_types)} for it",
                code="unsupported_tensor_type",
                path=str(path),
                actual=type_name(t.ggml_type),
                remediation="run a whole-range stage of this model with --engine llama",
            )
        if t.data_start % DATA_ALIGNMENT:
            raise _fragment_error(
                f"tensor {s.name!r} starts at byte {t.data_start}, not a multiple of "
                f"{DATA_ALIGNMENT}: ggml would abort on it",
                "fragment_tensor_misaligned",
                path,
                actual=t.data_start,
            )
        _, block, type_size = GGML_TYPES[t.ggml_type]
        rows = 1
        for d in t.shape[1:]:
            rows *= d
        if t.nbytes != t.shape[0] // block * type_size * rows:  # the reader derived it so
            raise _fragment_error(f"tensor {s.name!r} size is inconsistent", "gguf_invalid", path)
        refs[s.name] = WeightRef(s.name, t.shape, t.ggml_type, part, t.data_start, t.nbytes)
    return refs


def _map(path: Path, expected_size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != expected_size:
            raise _fragment_error(
                f"{path} changed size while the stage was loading ({expected_size} -> {size})",
                "fragment_changed",
                path,
            )
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def _open_stage(stage: StageLoad) -> StageWeights:
    files: list[GGUFFile] = []
    maps: list[mmap.mmap | None] = []
    try:
        for i, path in enumerate(stage.part_paths):
            files.append(open_gguf(path, header_only=i == 0 and stage.schema_version == 2))
        if stage.schema_version == 2 and files[0].get(KEY_V2_METADATA_ONLY) is not True:
            raise _fragment_error(
                f"{files[0].path} is not a package-v2 metadata carrier (no "
                f"{KEY_V2_METADATA_ONLY} marker)",
                "carrier_missing_marker",
                files[0].path,
            )
        if stage.part_roles[0] != ROLE_METADATA:  # StageLoad guarantees it; keep it explicit
            raise ModelError("the first part is not the metadata part", code="invalid_stage_load")
        kv = read_model_kv(files[0])
        # Malformed MoE metadata or expert tensors: a coded error here, before any family
        # check and long before ggml (which would abort on a wrong expert shape).
        skip = 1 if stage.schema_version == 2 else 0  # the carrier's directory holds no bytes
        summarize(kv, [t for g in files[skip:] for t in g.tensors], whole_model=False)
        spec = spec_from_metadata(kv)
        if spec.n_layer != stage.layers.layer_count:
            raise _fragment_error(
                f"the metadata says {spec.n_layer} layers; the stage is {stage.layers} of "
                f"{stage.layers.layer_count}",
                "layer_count_mismatch",
                files[0].path,
                expected=stage.layers.layer_count,
                actual=spec.n_layer,
            )
        check_stage_layers(spec, stage.layers)
        found = _collect(stage, files, spec.arch)
        vocab = _vocab_rows(found, files)
        owns_output = stage.layers.owns_output
        tied = owns_output and OUTPUT_WEIGHT_TENSOR not in found
        needs_vocab = stage.layers.owns_input or owns_output
        if needs_vocab and vocab is None:
            role = ROLE_EMBEDDINGS if stage.layers.owns_input or tied else ROLE_OUTPUT
            raise ModelError(
                f"the stage {stage.layers} needs {TOKEN_EMBEDDING_TENSOR} or "
                f"{OUTPUT_WEIGHT_TENSOR}, and its parts hold neither (is the {role} part "
                "selected?)",
                code="fragment_missing_tensor",
                actual=TOKEN_EMBEDDING_TENSOR,
            )
        plan = stage_tensors(spec, stage.layers, vocab=vocab, tied=tied)
        if stage.schema_version == 2:  # a common part also holds other stages' boundary tensors
            wanted = {s.name for s in plan}
            found = {
                n: v
                for n, v in found.items()
                if n in wanted or stage.part_roles[v[0]] != ROLE_COMMON
            }
        refs = _check(plan, found, files)
        used = {r.part for r in refs.values()}
        for i, g in enumerate(files):
            maps.append(_map(g.path, g.file_size) if i in used else None)
        return StageWeights(stage, spec, kv, refs, maps, vocab, tied)
    except BaseException:
        for m in maps:
            if m is not None:
                m.close()
        raise
    finally:
        for g in files:
            g.close()
