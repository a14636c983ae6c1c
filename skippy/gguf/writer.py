"""GGUF fragment writer: raw KV records and raw tensor bytes in, one hashed file out.

Nothing is decoded or re-encoded: KV records are copied byte-for-byte from the source header
(``GGUFFile.raw_field``), new keys are encoded here, and tensor payloads are streamed from
the source file descriptor. The file is hashed in the same pass that writes it and installed
through ``skippy.atomic`` so a reader never sees a partial fragment. Layout matches gguf-py's
``GGUFWriter``: header, KV, tensor infos, padding to the alignment, then each tensor's bytes
followed by padding to the alignment.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skippy.atomic import atomic_install
from skippy.gguf.constants import GGUF_MAGIC, SCALAR_FORMATS, WRITE_VERSION, ValueType
from skippy.gguf.reader import TensorInfo
from skippy.hashing import HashingSink, copy_range


def _encode_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _encode_value(value_type: int, value: Any, item_type: int | None) -> bytes:
    fmt = SCALAR_FORMATS.get(value_type)
    if fmt is not None:
        return struct.pack(fmt, value)
    if value_type == ValueType.STRING:
        return _encode_string(value)
    if value_type == ValueType.ARRAY and item_type is not None:
        head = struct.pack("<IQ", item_type, len(value))
        return head + b"".join(_encode_value(item_type, v, None) for v in value)
    raise ValueError(f"cannot encode GGUF value type {value_type}")


def encode_kv(key: str, value_type: int, value: Any, item_type: int | None = None) -> bytes:
    """One complete KV record (key, type, value) as it appears in a GGUF header."""
    return (
        _encode_string(key)
        + struct.pack("<I", value_type)
        + _encode_value(value_type, value, item_type)
    )


# Streams one tensor's payload into ``write`` (the fragment's hashing sink).
TensorProducer = Callable[[Callable[[memoryview], None]], None]


@dataclass(frozen=True)
class TensorSource:
    """A tensor to write: its header facts and the open source file holding its bytes.

    ``produce``, when set, replaces the raw copy: a producer that transforms the bytes on the
    way (skippy-quantize) writes exactly ``info.nbytes`` bytes of the tensor ``info`` describes.
    """

    info: TensorInfo
    fd: int
    produce: TensorProducer | None = None


@dataclass(frozen=True)
class WrittenFragment:
    artifact_bytes: int
    sha256: str
    tensor_count: int
    tensor_bytes: int


def _pad(n: int, alignment: int) -> int:
    return -n % alignment


def build_header(
    kv_records: Sequence[bytes], tensors: Sequence[TensorInfo], alignment: int
) -> tuple[bytes, list[int]]:
    """Header bytes (padded to the alignment) and each tensor's offset in the data section."""
    parts = [GGUF_MAGIC, struct.pack("<IQQ", WRITE_VERSION, len(tensors), len(kv_records))]
    parts.extend(kv_records)
    offsets: list[int] = []
    offset = 0
    for t in tensors:
        offsets.append(offset)
        parts.append(_encode_string(t.name))
        parts.append(struct.pack("<I", len(t.shape)))
        parts.append(struct.pack(f"<{len(t.shape)}Q", *t.shape))
        parts.append(struct.pack("<IQ", t.ggml_type, offset))
        offset += t.nbytes + _pad(t.nbytes, alignment)
    header = b"".join(parts)
    return header + b"\0" * _pad(len(header), alignment), offsets


def fragment_bytes(
    kv_records: Sequence[bytes], tensors: Sequence[TensorInfo], alignment: int
) -> int:
    """The exact size ``write_fragment`` gives these records and tensors (``plan`` of a GGUF
    counts each part's header and padding as the package will hold them)."""
    header, _ = build_header(kv_records, tensors, alignment)
    return len(header) + sum(t.nbytes + _pad(t.nbytes, alignment) for t in tensors)


def _emit(
    write: Callable[[bytes | memoryview], None],
    nbytes: Callable[[], int],
    header: bytes,
    tensors: Sequence[TensorSource],
    alignment: int,
    *,
    trailing_pad: bool,
    cancel: threading.Event | None,
) -> None:
    """The one byte stream of a fragment: header, then each tensor padded to the alignment
    (the last one too unless ``trailing_pad`` is False, as package-v2 parts are)."""
    write(header)
    for i, t in enumerate(tensors):
        if t.produce is None:
            copy_range(t.fd, t.info.data_start, t.info.nbytes, write, cancel=cancel)
        else:
            start = nbytes()
            t.produce(write)
            if nbytes() - start != t.info.nbytes:  # the header already promised nbytes
                raise ValueError(
                    f"tensor {t.info.name}: the producer wrote {nbytes() - start} bytes, "
                    f"the header declares {t.info.nbytes}"
                )
        pad = _pad(t.info.nbytes, alignment)
        if pad and (trailing_pad or i + 1 < len(tensors)):
            write(b"\0" * pad)


def write_fragment(
    dest: Path,
    kv_records: Sequence[bytes],
    tensors: Sequence[TensorSource],
    alignment: int,
    *,
    on_bytes: Callable[[int], None] | None = None,
    cancel: threading.Event | None = None,
    trailing_pad: bool = True,
) -> WrittenFragment:
    """Write one fragment atomically, hashing in the same pass; return its facts. ``on_bytes``
    hears the size of every chunk written (a progress bar); ``cancel`` stops the copy at its
    next chunk (the partial file is removed)."""
    header, _ = build_header(kv_records, [t.info for t in tensors], alignment)
    with atomic_install(dest) as f:
        sink = HashingSink(f)
        write: Callable[[bytes | memoryview], None] = sink.write
        if on_bytes is not None:
            counted = on_bytes

            def write(data: bytes | memoryview) -> None:
                sink.write(data)
                counted(len(data))

        _emit(
            write,
            lambda: sink.nbytes,
            header,
            tensors,
            alignment,
            trailing_pad=trailing_pad,
            cancel=cancel,
        )
    return WrittenFragment(
        artifact_bytes=sink.nbytes,
        sha256=sink.hexdigest(),
        tensor_count=len(tensors),
        tensor_bytes=sum(t.info.nbytes for t in tensors),
    )


def fragment_digest(
    kv_records: Sequence[bytes],
    tensors: Sequence[TensorSource],
    alignment: int,
    *,
    trailing_pad: bool = True,
    cancel: threading.Event | None = None,
) -> tuple[int, str]:
    """(size, SHA-256) of the file ``write_fragment`` would write, computed from the source
    without writing: what ``--resume-existing-artifacts`` compares an existing file with."""
    h = hashlib.sha256()
    count = [0]

    def write(data: bytes | memoryview) -> None:
        h.update(data)
        count[0] += len(data)

    header, _ = build_header(kv_records, [t.info for t in tensors], alignment)
    _emit(
        write,
        lambda: count[0],
        header,
        tensors,
        alignment,
        trailing_pad=trailing_pad,
        cancel=cancel,
    )
    return count[0], h.hexdigest()
