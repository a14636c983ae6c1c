"""quantize-layer-package against a reference no one here wrote: llama.cpp's own quantizer.

Each case quantizes a synthetic high-precision model both ways, ours into a layer package and
``llama_model_quantize`` (through llama-cpp-python) into one GGUF, and compares every tensor:
same type, same shape, same bytes (tests/support/quant_reference.py). The real model is in
tests/real_models/test_quantize_gemma.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install 'skippy-mesh[llama]')"
)

from quant_reference import (
    differences,
    gguf_kv,
    gguf_tensors,
    llama_quantize,
    package_tensors,
)

from skippy.constants import MANIFEST_NAME
from skippy.produce.imatrix import load_imatrix
from skippy.produce.quant_rules import FILE_TYPES, QUANTIZE_TARGETS, T, parse_file_type
from skippy.produce.quantize_package import QuantizeOptions, quantize_layer_package
from skippy.produce.recipe import parse_recipe
from skippy.produce.validate import validate_package
from skippy.produce.write_package import local_provenance

pytestmark = pytest.mark.llama


def quantize(source: Path, out: Path, type_name: str, **kw: Any) -> Path:
    prov = local_provenance(
        model_id=f"acme/tiny:{type_name}",
        source_repo=None,
        source_revision="0123abc",
        source_file=source.name,
    )
    opts = QuantizeOptions(
        out_dir=out, provenance=prov, file_type=parse_file_type(type_name), **kw
    )
    quantize_layer_package(source, opts)
    return out


@pytest.mark.parametrize(
    ("dtype", "type_name", "pure"),
    [
        ("f32", "Q8_0", False),
        ("f16", "Q4_0", False),
        ("bf16", "Q4_K_M", False),
        ("f32", "Q6_K", False),
        ("f16", "Q4_K", True),  # every quantizable tensor Q4_K (llama-quantize --pure)
        ("tied", "Q4_K_M", False),  # tied embeddings take the output's type
        ("f16", "Q3_K_M", False),
        ("bf16", "IQ4_XS", False),
        ("moe", "Q3_K_M", False),  # 3-D expert tensors, the 8-expert rules
    ],
)
def test_tensors_are_byte_identical_to_llama_cpp(hp_models, tmp_path, dtype, type_name, pure):
    source = getattr(hp_models, dtype)
    pkg = quantize(source, tmp_path / "pkg", type_name, pure=pure)
    ref = llama_quantize(source, tmp_path / "ref.gguf", type_name, pure=pure)
    ours, theirs = package_tensors(pkg), gguf_tensors(ref)
    assert differences(ours, theirs) == []
    # the test means something: the target type is really there, norms stayed F32
    target = FILE_TYPES[type_name].default_type
    assert sum(t == target for t, _, _ in ours.values()) >= 8
    assert ours["blk.0.attn_norm.weight"][0] == T["F32"]
    meta = pkg / "shared" / "metadata.gguf"
    for key in ("general.file_type", "general.quantization_version"):
        assert gguf_kv(meta, key) == gguf_kv(ref, key)


def test_imatrix_values_reach_the_quantizer_as_llama_cpp_uses_them(hp_models, tmp_path):
    """Q4_0 with an imatrix: other bytes, and layer 0's ffn_down becomes Q4_1 (a rule that
    needs one); one tensor of IQ2_XS, which ggml cannot make without one (only one, by
    recipe on both sides: the IQ2 search is slow)."""
    imatrix = load_imatrix(hp_models.imatrix)
    recipe = parse_recipe(b"blk\\.0\\.attn_k=IQ2_XS\n", allowed_types=QUANTIZE_TARGETS)
    pkg = quantize(hp_models.f16, tmp_path / "pkg", "Q4_0", imatrix=imatrix, recipe=recipe)
    ref = llama_quantize(
        hp_models.f16,
        tmp_path / "ref.gguf",
        "Q4_0",
        imatrix=imatrix.entries,
        overrides=[("blk\\.0\\.attn_k", "IQ2_XS")],
    )
    ours = package_tensors(pkg)
    assert differences(ours, gguf_tensors(ref)) == []
    assert ours["blk.0.attn_k.weight"][0] == T["IQ2_XS"]
    assert ours["blk.0.ffn_down.weight"][0] == T["Q4_1"]
    plain = package_tensors(quantize(hp_models.f16, tmp_path / "plain", "Q4_0"))
    same_type = [
        n for n in imatrix.entries if n in ours and ours[n][0] == plain[n][0] == T["Q4_0"]
    ]
    assert len(same_type) > 40
    assert all(ours[n][2] != plain[n][2] for n in same_type)
    block = json.loads((pkg / MANIFEST_NAME).read_text())["quantization"]
    assert block["imatrix_sha256"] == imatrix.sha256


def test_moe_imatrix_is_applied_per_expert(hp_models, tmp_path):
    imatrix = load_imatrix(hp_models.moe_imatrix)
    """Each expert's rows are quantized with that expert's slice of the imatrix entry."""
    pkg = quantize(hp_models.moe, tmp_path / "pkg", "Q4_0", imatrix=imatrix)
    ref = llama_quantize(hp_models.moe, tmp_path / "ref.gguf", "Q4_0", imatrix=imatrix.entries)
    ours = package_tensors(pkg)
    assert differences(ours, gguf_tensors(ref)) == []
    assert ours["blk.1.ffn_up_exps.weight"][0] == T["Q4_0"]
    plain = package_tensors(quantize(hp_models.moe, tmp_path / "plain", "Q4_0"))
    assert ours["blk.1.ffn_up_exps.weight"][2] != plain["blk.1.ffn_up_exps.weight"][2]
    assert ours["blk.1.ffn_gate_inp.weight"][0] == T["F32"]  # the router stays


def test_recipe_matches_llama_cpps_tensor_type_overrides(hp_models, tmp_path):
    text = "# publish these\nattn_output=Q8_0\nffn_gate=q5_k   # trailing comment\n"
    recipe = parse_recipe(text.encode(), allowed_types=QUANTIZE_TARGETS)
    pkg = quantize(hp_models.f32, tmp_path / "pkg", "Q4_K_M", recipe=recipe)
    ref = llama_quantize(
        hp_models.f32,
        tmp_path / "ref.gguf",
        "Q4_K_M",
        overrides=[("attn_output", "Q8_0"), ("ffn_gate", "Q5_K")],
    )
    ours = package_tensors(pkg)
    assert differences(ours, gguf_tensors(ref)) == []
    assert ours["blk.5.ffn_gate.weight"][0] == T["Q5_K"]
    block = json.loads((pkg / MANIFEST_NAME).read_text())["quantization"]
    assert (block["type"], block["recipe"], block["recipe_sha256"]) == (
        "Q4_K_M",
        text,
        recipe.sha256,
    )


def test_recipe_changes_exactly_the_tensors_it_names(hp_models, tmp_path):
    """Where llama.cpp differs on purpose: its --tensor-type skips the position counters for
    overridden tensors, shifting later attn_v/ffn_down choices; ours does not."""
    recipe = parse_recipe(b"blk\\.[0-3]\\.attn_v=Q8_0\n", allowed_types=QUANTIZE_TARGETS)
    base = package_tensors(quantize(hp_models.f32, tmp_path / "base", "Q4_K_M"))
    ours = package_tensors(quantize(hp_models.f32, tmp_path / "rec", "Q4_K_M", recipe=recipe))
    named = {f"blk.{i}.attn_v.weight" for i in range(4)}
    assert {d.split(":")[0] for d in differences(ours, base)} == named
    assert all(ours[n][0] == T["Q8_0"] for n in named)
    ref = gguf_tensors(
        llama_quantize(
            hp_models.f32,
            tmp_path / "ref.gguf",
            "Q4_K_M",
            overrides=[("blk\\.[0-3]\\.attn_v", "Q8_0")],
        )
    )
    assert all(ours[n] == ref[n] for n in named)  # the named tensors: llama.cpp's bytes


def test_requantizing_equals_llama_cpp_with_allow_requantize(synth_dir, tmp_path):
    """synth llama_like mixes Q8_0/Q4_0/Q4_1/Q4_K/Q6_K/F16: ggml dequantizes, then quantizes."""
    pkg = quantize(synth_dir.llama, tmp_path / "pkg", "Q5_0", allow_requantize=True)
    ref = llama_quantize(synth_dir.llama, tmp_path / "ref.gguf", "Q5_0", allow_requantize=True)
    ours = package_tensors(pkg)
    assert differences(ours, gguf_tensors(ref)) == []
    assert ours["blk.0.ffn_down.weight"][0] == T["Q5_0"]  # was Q4_K


def test_quantized_package_validates_against_its_source_and_not_another(hp_models, tmp_path):
    pkg = quantize(hp_models.f32, tmp_path / "pkg", "Q4_K_M")
    report = validate_package(hp_models.f32, pkg)
    assert report.valid, [f.to_dict() for f in report.findings]
    assert report.tensors_checked == len(gguf_tensors(hp_models.f32))
    # the same tensors quantized from the F16 rounding of the source: bytes differ
    other = validate_package(hp_models.f16, pkg)
    codes = {f.code for f in other.findings}
    assert {"source_sha256_mismatch", "tensor_bytes_differ"} <= codes


def test_validation_catches_one_flipped_quantized_byte(hp_models, tmp_path):
    pkg = quantize(hp_models.f32, tmp_path / "pkg", "Q8_0")
    layer = pkg / "layers" / "layer-00003.gguf"
    from skippy.gguf.reader import open_gguf

    with open_gguf(layer) as g:
        t = g.tensor("blk.3.attn_q.weight")
        offset = t.data_start + t.nbytes // 2
    data = bytearray(layer.read_bytes())
    data[offset] ^= 0x01
    layer.write_bytes(bytes(data))
    report = validate_package(hp_models.f32, pkg)
    differ = [f for f in report.findings if f.code == "tensor_bytes_differ"]
    assert [f.message.split(" ")[0] for f in differ] == ["blk.3.attn_q.weight"]
