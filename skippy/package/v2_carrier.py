"""The package-v2 metadata carrier (``shared/metadata.gguf``) resolved into the tensor catalog.

Spec "v2 carrier": the carrier is a GGUF with no payload whose tensor directory lists every
source tensor and whose typed locator arrays say where each one's bytes live (payload part
index, absolute offset, stored length, alignment). ``resolve_carrier`` checks every rule and
fails closed with one coded ``ManifestError`` per violation (upstream's validation-code names
where they exist: ``storage_out_of_bounds``, ``overlapping_storage``, ``invalid_alignment``,
``misaligned_offset``, ``invalid_stored_length``, ``unknown_artifact``, ``duplicate_tensor``,
``layer_out_of_bounds``); the result is the same ``TensorCatalog`` a v1 package yields.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from skippy.constants import (
    KEY_V2_LOCATOR_SCHEMA,
    KEY_V2_METADATA_ONLY,
    KEY_V2_PART_COUNT,
    KEY_V2_TENSOR_ALIGNMENT,
    KEY_V2_TENSOR_OFFSET,
    KEY_V2_TENSOR_PART,
    KEY_V2_TENSOR_SIZE,
    V2_LAYER_PATH_RE,
    V2_LOCATOR_SCHEMA,
)
from skippy.errors import GGUFFormatError, ManifestError
from skippy.gguf.constants import ValueType
from skippy.gguf.reader import GGUFFile, open_gguf, tensor_nbytes
from skippy.package.catalog import CatalogTensor, TensorCatalog
from skippy.package.v2_root import CatalogArtifact, PackageRootV2

_UNSIGNED = frozenset({ValueType.UINT8, ValueType.UINT16, ValueType.UINT32, ValueType.UINT64})


def layer_ordinal(path: str) -> int | None:
    """``layers/layer-NNNNN.gguf`` or ``layers/layer-NNNNN-partMM.gguf`` -> N
    (spec "v2 carrier": the part form maps to its layer too)."""
    m = V2_LAYER_PATH_RE.match(path)
    return int(m.group(1)) if m else None


def _bad(message: str, code: str, path: str | None = None) -> ManifestError:
    return ManifestError(f"metadata carrier: {message}", code=code, path=path)


def _typed_array(g: GGUFFile, key: str, n: int) -> list[int]:
    f = g.fields.get(key)
    if f is None or f.value_type != ValueType.ARRAY:
        raise _bad(f"missing typed array {key}", "carrier_missing_array", key)
    if f.item_type not in _UNSIGNED:
        raise _bad(f"{key}[0] is not unsigned", "carrier_array_not_unsigned", key)
    if f.count != n:
        raise _bad(
            f"tensor locator arrays differ from its descriptor count ({key} has {f.count} "
            f"entries, the directory {n} tensors)",
            "carrier_locator_length_mismatch",
            key,
        )
    values = g.value(key)
    return [int(v) for v in values]


def resolve_carrier(root: PackageRootV2, carrier: GGUFFile) -> TensorCatalog:
    """The catalog the carrier describes, after every check of spec "v2 carrier"
    and "v2 catalog".
    ``carrier`` must be opened with ``header_only=True``."""
    meta = root.metadata_artifact
    where = meta.path if meta is not None else None
    if carrier.file_size != carrier.data_offset:
        raise _bad(
            f"contains tensor payload bytes (file is {carrier.file_size} bytes, its header ends "
            f"at {carrier.data_offset})",
            "carrier_has_payload",
            where,
        )
    f = carrier.fields.get(KEY_V2_METADATA_ONLY)
    if (
        f is None
        or f.value_type != ValueType.BOOL
        or carrier.value(KEY_V2_METADATA_ONLY) is not True
    ):
        raise _bad("is missing its typed metadata-only marker", "carrier_missing_marker", where)
    schema = carrier.fields.get(KEY_V2_LOCATOR_SCHEMA)
    if (
        schema is None
        or schema.value_type not in _UNSIGNED
        or carrier.value(KEY_V2_LOCATOR_SCHEMA) != V2_LOCATOR_SCHEMA
    ):
        raise _bad("has an unsupported locator schema", "unsupported_locator_schema", where)
    payload = root.payload_artifacts()
    if not payload:
        raise _bad("package root has no payload artifacts", "missing_value", where)
    pc = carrier.fields.get(KEY_V2_PART_COUNT)
    if (
        pc is None
        or pc.value_type not in _UNSIGNED
        or carrier.value(KEY_V2_PART_COUNT) != len(payload)
    ):
        raise _bad(
            "payload part count differs from the package root "
            f"({carrier.get(KEY_V2_PART_COUNT)!r} against {len(payload)} payload artifacts)",
            "carrier_part_count_mismatch",
            where,
        )
    n = len(carrier.tensors)
    parts = _typed_array(carrier, KEY_V2_TENSOR_PART, n)
    offsets = _typed_array(carrier, KEY_V2_TENSOR_OFFSET, n)
    sizes = _typed_array(carrier, KEY_V2_TENSOR_SIZE, n)
    aligns = _typed_array(carrier, KEY_V2_TENSOR_ALIGNMENT, n)
    out: list[CatalogTensor] = []
    for t, part, off, size, align in zip(
        carrier.tensors, parts, offsets, sizes, aligns, strict=True
    ):
        if part >= len(payload):
            raise _bad(
                f"tensor {t.name} references missing payload part {part}",
                "unknown_artifact",
                t.name,
            )
        art: CatalogArtifact = payload[part]
        if align == 0 or align & (align - 1):
            raise _bad(
                f"tensor {t.name} has an invalid payload alignment {align}",
                "invalid_alignment",
                t.name,
            )
        if off % align:
            raise _bad(
                f"tensor {t.name} offset {off} is not a multiple of its alignment {align}",
                "misaligned_offset",
                t.name,
            )
        try:
            want = tensor_nbytes(t.shape, t.ggml_type, name=t.name)
        except GGUFFormatError as exc:
            raise _bad(exc.message, "invalid_dimension", t.name) from None
        if size <= 0 or size != want:
            raise _bad(
                f"tensor {t.name} stored length {size} is not its type and dims' {want} bytes",
                "invalid_stored_length",
                t.name,
            )
        if off + size > art.byte_size:
            raise _bad(
                f"tensor {t.name} payload extent exceeds artifact {art.id} "
                f"([{off}, {off + size}) of {art.byte_size} bytes)",
                "storage_out_of_bounds",
                t.name,
            )
        layer = layer_ordinal(art.path)
        if layer is not None and layer >= root.layer_count:
            raise _bad(
                f"tensor {t.name} is in layer {layer} of {root.layer_count}",
                "layer_out_of_bounds",
                t.name,
            )
        out.append(
            CatalogTensor(
                name=t.name,
                artifact_id=art.id,
                path=art.path,
                offset=off,
                nbytes=size,
                ggml_type=t.ggml_type,
                shape=t.shape,
                layer=layer,
                alignment=align,
            )
        )
    by_artifact = sorted(out, key=lambda c: (c.path, c.offset))
    for prev, nxt in itertools.pairwise(by_artifact):
        if prev.path == nxt.path and nxt.offset < prev.offset + prev.nbytes:
            raise _bad(
                f"tensors {prev.name} and {nxt.name} overlap in {prev.path}",
                "overlapping_storage",
                nxt.name,
            )
    return TensorCatalog(tuple(sorted(out, key=lambda c: c.name)))


def open_carrier(path: Path) -> GGUFFile:
    return open_gguf(path, header_only=True)


def read_catalog(root: PackageRootV2, carrier_path: Path) -> TensorCatalog:
    with open_carrier(carrier_path) as g:
        return resolve_carrier(root, g)
