"""The reference for skippy-quantize: llama.cpp's own quantizer, and tensor-by-tensor comparison.

``llama_quantize`` runs ``llama_model_quantize`` (llama.cpp's library entry point, the one
``llama-quantize`` calls) through llama-cpp-python on a source GGUF with the same knobs
``skippy-quantize`` exposes (preset, ``pure``, ``--tensor-type`` overrides, imatrix data).
``package_tensors`` / ``gguf_tensors`` read both sides as name -> (ggml type, shape, bytes)
so tests and the bench compare them directly. Used by tests/test_quantize*.py and
scripts/bench_quantize.py; nothing here is part of the product.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from skippy.gguf.reader import open_gguf
from skippy.produce.quant_rules import FILE_TYPES, T

Tensor = tuple[int, tuple[int, ...], bytes]
_keep: list[Any] = []  # ctypes objects that must outlive the call


def _llama() -> Any:
    import llama_cpp
    import llama_cpp.llama  # installs its own log callback; replaced by a silent one below

    if not _keep:
        cb = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))
        _keep.append(cb)
    return llama_cpp


def llama_quantize(
    source: Path,
    dest: Path,
    file_type: str,
    *,
    pure: bool = False,
    overrides: Sequence[tuple[str, str]] = (),
    imatrix: Mapping[str, np.ndarray] | None = None,
    nthread: int = 2,
    allow_requantize: bool = False,
) -> Path:
    """``llama_model_quantize(source, dest, params)``; raise if llama.cpp reports failure."""
    lib = _llama()
    params = lib.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type].ftype
    params.nthread = nthread
    params.pure = pure
    params.allow_requantize = allow_requantize
    keep: list[Any] = []
    if overrides:
        arr = (lib.llama_model_tensor_override * (len(overrides) + 1))()
        for i, (pattern, type_name) in enumerate(overrides):
            raw = pattern.encode()
            keep.append(raw)
            arr[i].pattern = raw
            arr[i].type = T[type_name.upper()]
        arr[len(overrides)].pattern = None
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(lib.llama_model_tensor_override))
        keep.append(arr)
    if imatrix is not None:
        items = sorted(imatrix.items())
        arr2 = (lib.llama_model_imatrix_data * (len(items) + 1))()
        for i, (name, values) in enumerate(items):
            v = np.ascontiguousarray(values, dtype=np.float32)
            keep += [v, name.encode()]
            arr2[i].name = keep[-1]
            arr2[i].data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr2[i].size = v.size
        arr2[len(items)].name = None
        params.imatrix = ctypes.cast(arr2, ctypes.POINTER(lib.llama_model_imatrix_data))
        keep.append(arr2)
    dest.parent.mkdir(parents=True, exist_ok=True)
    rc = lib.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({source}, {file_type}) failed with {rc}")
    return dest


def gguf_tensors(path: Path) -> dict[str, Tensor]:
    with open_gguf(path) as g:
        return {t.name: (t.ggml_type, t.shape, g.read_range(t.data_start, t.nbytes)) for t in g}


def gguf_kv(path: Path, key: str) -> Any:
    with open_gguf(path) as g:
        return g.get(key)


def package_files(pkg: Path) -> Iterator[Path]:
    manifest = json.loads((pkg / "model-package.json").read_text())
    shared = manifest["shared"]
    yield pkg / shared["metadata"]["path"]
    yield pkg / shared["embeddings"]["path"]
    for layer in sorted(manifest["layers"], key=lambda e: e["layer_index"]):
        yield pkg / layer["path"]
    yield pkg / shared["output"]["path"]


def package_tensors(pkg: Path) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for path in package_files(pkg):
        out.update(gguf_tensors(path))
    return out


def differences(ours: Mapping[str, Tensor], ref: Mapping[str, Tensor]) -> list[str]:
    """Every tensor whose type, shape or bytes differ (empty: identical tensor sets)."""
    out = [f"{n}: only in ours" for n in ours.keys() - ref.keys()]
    out += [f"{n}: only in llama.cpp's" for n in ref.keys() - ours.keys()]
    for name in sorted(ours.keys() & ref.keys()):
        (ta, sa, ba), (tb, sb, bb) = ours[name], ref[name]
        if (ta, sa) != (tb, sb):
            out.append(f"{name}: type/shape {ta}/{sa} vs llama.cpp {tb}/{sb}")
        elif ba != bb:
            out.append(f"{name}: bytes differ ({ta})")
    return out
