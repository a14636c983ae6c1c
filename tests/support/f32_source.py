"""A high-precision source from a quantized GGUF: every tensor dequantized to F32 by gguf-py.

The real models we can install (gemma3-270m Q4_K_M, SmolLM2 Q4_1) are quantized; skippy-
quantize needs an F32/F16/BF16 source. ``dequantize_gguf`` writes the same model with every
tensor as F32 (``gguf.quants.dequantize``, the reference dequantizers of gguf-py) and
``general.file_type`` = 0 (ALL_F32); every other KV record is copied byte for byte. It
streams one tensor at a time and installs the file atomically. ``gemma_f32`` caches the
gemma3-270m one (~1.1 GB) under ``.work/models/`` once per machine, for tests and the bench.

    python tests/support/f32_source.py SRC.gguf OUT.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

from skippy.atomic import atomic_install
from skippy.gguf.constants import ValueType
from skippy.gguf.reader import TensorInfo, open_gguf
from skippy.gguf.writer import build_header, encode_kv

F32_NAME = "gemma-3-270m-f32.gguf"
KEY_FILE_TYPE = "general.file_type"


def dequantize_gguf(src: Path, dst: Path) -> Path:
    with open_gguf(src) as g:
        records = [
            g.raw_field(k) if k != KEY_FILE_TYPE else encode_kv(k, ValueType.UINT32, 0)
            for k in g.fields
        ]
        if KEY_FILE_TYPE not in g.fields:
            records.append(encode_kv(KEY_FILE_TYPE, ValueType.UINT32, 0))
        infos = [
            TensorInfo(t.name, t.shape, 0, 0, 0, 4 * t.n_elements) for t in g.tensors
        ]
        header, _ = build_header(records, infos, g.alignment)
        with atomic_install(dst) as f:
            f.write(header)
            for t in g.tensors:
                raw = np.frombuffer(g.read_range(t.data_start, t.nbytes), dtype=np.uint8)
                if t.ggml_type == 0:
                    values = raw.view(np.float32)
                else:
                    rows = raw.reshape(t.n_elements // t.shape[0], -1)
                    values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(t.ggml_type))
                data = np.ascontiguousarray(values, dtype=np.float32).tobytes()
                f.write(data + b"\0" * (-len(data) % g.alignment))
    return dst


def gemma_f32(gemma_q4: Path, cache_dir: Path) -> Path:
    """The F32 gemma3-270m, built from the Q4_K_M file once and cached."""
    dst = cache_dir / F32_NAME
    if not dst.is_file():
        dequantize_gguf(gemma_q4, dst)
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: f32_source.py SRC.gguf OUT.gguf")
    print(dequantize_gguf(Path(sys.argv[1]), Path(sys.argv[2])))
