"""GGUF container vocabulary: magic, versions, value types, ggml type sizes and our bounds.

Kept here (not imported from gguf-py) because ``import gguf`` alone costs ~0.23 s and the
fast paths (``inspect``) must not pay it. tests/skippy/gguf/test_gguf_constants.py checks the tables
against gguf-py's own so they cannot drift.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Final

GGUF_MAGIC: Final = b"GGUF"
SUPPORTED_VERSIONS: Final = frozenset({2, 3})
WRITE_VERSION: Final = 3
DEFAULT_ALIGNMENT: Final = 32

# --- bounds: a hostile header must not make us allocate or loop without limit -----------------
MAX_TENSOR_COUNT: Final = 1 << 20
MAX_KV_COUNT: Final = 1 << 16
MAX_STRING_BYTES: Final = 64 * 1024 * 1024
MAX_ARRAY_LEN: Final = 1 << 28
MAX_NESTING_DEPTH: Final = 2  # an array of arrays at most; llama.cpp never writes deeper
MAX_DIMS: Final = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT: Final = 1 << 16


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct format per fixed-size scalar type (little-endian).
SCALAR_FORMATS: Final[dict[int, str]] = {
    ValueType.UINT8: "<B",
    ValueType.INT8: "<b",
    ValueType.UINT16: "<H",
    ValueType.INT16: "<h",
    ValueType.UINT32: "<I",
    ValueType.INT32: "<i",
    ValueType.FLOAT32: "<f",
    ValueType.BOOL: "<?",
    ValueType.UINT64: "<Q",
    ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
}
SCALAR_SIZES: Final[dict[int, int]] = {t: struct.calcsize(f) for t, f in SCALAR_FORMATS.items()}

# ggml tensor types: id -> (name, elements per block, bytes per block).
GGML_TYPES: Final[dict[int, tuple[str, int, int]]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}


def ggml_type_name(type_id: int) -> str:
    entry = GGML_TYPES.get(type_id)
    return entry[0] if entry else f"unknown({type_id})"
