"""Differential test: our GGUF vocabulary (kept apart from gguf-py for import speed) must equal
gguf-py's, so the two can never drift apart silently."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import pytest
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS
from gguf.gguf_writer import SHARD_NAME_FORMAT, GGUFWriter

from skippy import constants as skc
from skippy.gguf import constants as c


def test_ggml_type_table_equals_gguf_py() -> None:
    reference = {int(t): (t.name, *gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}
    assert reference == c.GGML_TYPES


def test_every_gguf_py_type_has_a_size() -> None:
    # If gguf-py grows a type without a size, the comparison above would silently skip nothing,
    # but our table could not describe it either: catch that case explicitly.
    assert set(gguf.GGMLQuantizationType) == set(gguf.GGML_QUANT_SIZES)


@pytest.mark.parametrize("type_id", sorted(c.GGML_TYPES))
def test_ggml_type_name(type_id: int) -> None:
    assert c.ggml_type_name(type_id) == gguf.GGMLQuantizationType(type_id).name


def test_unknown_ggml_type_name() -> None:
    assert c.ggml_type_name(4) == "unknown(4)"  # Q4_2, removed from ggml
    assert 4 not in {int(t) for t in gguf.GGMLQuantizationType}


def test_value_types_equal_gguf_py() -> None:
    ours = {m.name: int(m) for m in c.ValueType}
    theirs = {m.name: int(m) for m in gguf.GGUFValueType}
    assert ours == theirs


def test_scalar_formats_equal_gguf_writer_packing() -> None:
    packing = GGUFWriter._simple_value_packing
    assert set(c.SCALAR_FORMATS) == {int(t) for t in packing}
    for vtype, fmt in packing.items():
        assert c.SCALAR_FORMATS[int(vtype)] == "<" + fmt, vtype.name
        assert c.SCALAR_SIZES[int(vtype)] == struct.calcsize("<" + fmt), vtype.name


def test_container_constants_equal_gguf_py() -> None:
    assert struct.unpack("<I", c.GGUF_MAGIC)[0] == gguf.GGUF_MAGIC
    assert c.WRITE_VERSION == gguf.GGUF_VERSION
    assert set(READER_SUPPORTED_VERSIONS) == c.SUPPORTED_VERSIONS
    assert c.DEFAULT_ALIGNMENT == gguf.GGUF_DEFAULT_ALIGNMENT


def test_key_names_equal_gguf_py() -> None:
    assert skc.KEY_SPLIT_NO == gguf.Keys.Split.LLM_KV_SPLIT_NO
    assert skc.KEY_SPLIT_COUNT == gguf.Keys.Split.LLM_KV_SPLIT_COUNT
    assert skc.KEY_SPLIT_TENSORS_COUNT == gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT
    assert skc.KEY_ALIGNMENT == gguf.Keys.General.ALIGNMENT
    assert skc.KEY_ARCHITECTURE == gguf.Keys.General.ARCHITECTURE


@pytest.mark.parametrize(("no", "count"), [(1, 2), (3, 12), (99999, 99999)])
def test_split_shard_pattern_matches_gguf_py_names(no: int, count: int) -> None:
    name = Path(SHARD_NAME_FORMAT.format("my-model.Q4_K_M", no, count)).name
    m = skc.SPLIT_SHARD_RE.match(name)
    assert m is not None, name
    assert (m["prefix"], int(m["no"]), int(m["count"])) == ("my-model.Q4_K_M", no, count)
