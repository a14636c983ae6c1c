"""Importance matrices for ``--imatrix``: llama.cpp's GGUF format and its legacy ``.dat``.

Ported from llama.cpp (llama-cpp-python 0.3.36) ``common/imatrix-loader.cpp``
(``common_imatrix_load``, ``common_imatrix_load_legacy``) and ``tools/quantize/quantize.cpp``
(``load_imatrix``): the values handed to the quantizer are the per-expert sums divided by
the rounded per-expert counts (GGUF), or the sums divided by the call count (legacy), in
float32 as the C++ does, so the quantized bytes match llama.cpp's for the same file.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from skippy.errors import GGUFFormatError, InputUnreadable, UsageError
from skippy.gguf.constants import GGUF_MAGIC
from skippy.gguf.reader import open_gguf

IN_SUM2_SUFFIX: Final = ".in_sum2"
COUNTS_SUFFIX: Final = ".counts"
# llama-quantize refuses a GGUF imatrix without these (load_imatrix: "missing imatrix metadata").
METADATA_KEYS: Final = ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")
MAX_IMATRIX_BYTES: Final = 4 * 1024**3
F32_TYPE: Final = 0


class ImatrixError(UsageError):
    code = "invalid_imatrix"


@dataclass(frozen=True)
class Imatrix:
    """Normalised importance values per tensor name (float32, ``ne0 * n_expert`` each)."""

    path: Path
    sha256: str
    entries: dict[str, np.ndarray]

    def for_tensor(self, name: str) -> np.ndarray | None:
        return self.entries.get(name)


def load_imatrix(path: Path) -> Imatrix:
    try:
        size = path.stat().st_size
        if size > MAX_IMATRIX_BYTES:
            raise ImatrixError(
                f"{path} is {size} bytes, over the {MAX_IMATRIX_BYTES}-byte limit", path=str(path)
            )
        data = path.read_bytes()
    except OSError as exc:
        raise InputUnreadable(
            f"cannot read --imatrix {path}: {exc.strerror or exc}", path=str(path)
        ) from exc
    digest = hashlib.sha256(data).hexdigest()
    entries = _load_gguf(path) if data[:4] == GGUF_MAGIC else _load_legacy(path, data)
    if not entries:
        raise ImatrixError(f"{path} holds no importance data", path=str(path))
    for name, values in entries.items():
        if not np.all(np.isfinite(values)):
            raise ImatrixError(
                f"{path}: the values for {name} are not all finite", path=str(path)
            )
    return Imatrix(path=path, sha256=digest, entries=entries)


def _load_gguf(path: Path) -> dict[str, np.ndarray]:
    try:
        g = open_gguf(path)
    except GGUFFormatError as exc:
        raise ImatrixError(f"--imatrix {exc.message}", path=str(path)) from exc
    with g:
        missing = [k for k in METADATA_KEYS if k not in g.fields]
        if missing:
            raise ImatrixError(
                f"{path} lacks the imatrix metadata {', '.join(missing)} (llama-quantize "
                "refuses such a file too)",
                path=str(path),
            )
        pairs: dict[str, dict[str, np.ndarray]] = {}
        for t in g.tensors:
            for suffix in (IN_SUM2_SUFFIX, COUNTS_SUFFIX):
                if t.name.endswith(suffix) and len(t.name) > len(suffix):
                    if t.ggml_type != F32_TYPE:
                        raise ImatrixError(
                            f"{path}: {t.name} must be F32", path=str(path)
                        )
                    values = np.frombuffer(g.read_range(t.data_start, t.nbytes), dtype="<f4")
                    pairs.setdefault(t.name[: -len(suffix)], {})[suffix] = values
    out: dict[str, np.ndarray] = {}
    for name, pair in sorted(pairs.items()):
        sums, counts = pair.get(IN_SUM2_SUFFIX), pair.get(COUNTS_SUFFIX)
        if sums is None or counts is None:
            raise ImatrixError(f"{path}: mismatched sums and counts for {name}", path=str(path))
        if len(counts) == 0 or len(sums) % len(counts):
            raise ImatrixError(
                f"{path}: {name} has {len(sums)} sums for {len(counts)} experts", path=str(path)
            )
        # std::lround then back to float, as the C++ does
        rounded = np.floor(np.abs(counts.astype(np.float64)) + 0.5) * np.sign(counts)
        per_expert = sums.astype(np.float32).reshape(len(counts), -1)
        values = np.ones_like(per_expert)
        for j, count in enumerate(rounded.astype(np.float32)):
            if count > 0:
                values[j] = per_expert[j] / count
        out[name] = values.reshape(-1)
    return out


def _load_legacy(path: Path, data: bytes) -> dict[str, np.ndarray]:
    """The pre-GGUF ``imatrix.dat``: n_entries, then (name, ncall, nval, values) records."""

    def bad(what: str) -> ImatrixError:
        return ImatrixError(
            f"{path} is neither a GGUF imatrix nor a legacy imatrix.dat ({what})", path=str(path)
        )

    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise bad(f"truncated at {what}")
        chunk = data[pos : pos + n]
        pos += n
        return chunk

    (n_entries,) = struct.unpack("<i", take(4, "the entry count"))
    if n_entries < 1:
        raise bad("no entries")
    out: dict[str, np.ndarray] = {}
    for i in range(n_entries):
        (name_len,) = struct.unpack("<i", take(4, f"entry {i}"))
        try:
            name = take(name_len, f"entry {i}'s name").split(b"\0", 1)[0].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise bad(f"entry {i}'s name is not UTF-8") from exc
        ncall, nval = struct.unpack("<ii", take(8, f"entry {i}'s counts"))
        if nval < 1:
            raise bad(f"entry {i} has {nval} values")
        sums = np.frombuffer(take(4 * nval, f"entry {i}'s values"), dtype="<f4")
        out[name] = (sums / np.float32(ncall)).astype(np.float32) if ncall > 0 else sums.copy()
    return out
