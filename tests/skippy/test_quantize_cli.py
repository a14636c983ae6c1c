"""skippy-quantize on the command line: JSON, exit codes, hostile inputs, package sources,
and what consumers check of the quantization block."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pkgtools import edit_manifest, make_package
from quant_reference import differences, package_tensors

from skippy.cli import main as package_main
from skippy.constants import MANIFEST_NAME
from skippy.gguf.reader import open_gguf
from skippy.quantize_cli import main

PROV = ["--model-id", "acme/tiny:Q8_0", "--source-revision", "0123abc", "--source-file", "m.gguf"]


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, dict[str, Any]]:
    code = main(["quantize-layer-package", *map(str, argv), "--json"])
    return code, json.loads(capsys.readouterr().out)


def left_behind(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []


def test_json_result_and_the_manifest_block(hp_models, tmp_path, capsys):
    out = tmp_path / "pkg"
    code, data = run(capsys, hp_models.f32, "--out-dir", out, "--type", "q4_k", *PROV)
    assert code == 0 and data["ok"] is True
    block = data["quantization"]
    assert (block["type"], block["ftype"], block["pure"], block["recipe"]) == (
        "Q4_K_M",
        15,
        False,
        None,
    )
    assert block["tool_version"].startswith("skippy-quantize ")
    assert data["tensor_types"]["Q6_K"] == 5 and data["tensor_types"]["F32"] == 17
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["quantization"] == block
    assert manifest["source_model"]["primary_file"] == "m.gguf"
    with open_gguf(out / "shared" / "metadata.gguf") as g:
        assert g.get("general.file_type") == 15
        assert g.get("general.quantization_version") == 2
    assert package_main(["preflight", str(out), "--verify-sha256"]) == 0
    assert ": ok (" in capsys.readouterr().out


def test_text_output_and_dry_run_write_nothing(hp_models, tmp_path, capsys):
    out = tmp_path / "pkg"
    argv = ["quantize-layer-package", str(hp_models.f16), "--out-dir", str(out), "--type", "Q8_0"]
    assert main([*argv, *PROV, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "Q8_0: 58 Q8_0, 17 F32 (dry run: nothing written)" in text
    assert "blk.7.ffn_down.weight" in text and not out.exists()
    assert main([*argv, *PROV]) == 0
    assert "quantized to Q8_0 and wrote 11 artifacts" in capsys.readouterr().out


RECIPES = [
    ("attn_(q=Q8_0\n", "recipe_bad_regex"),
    ("attn_q=Q7_0\n", "recipe_unknown_type"),
    ("attn_q=" + "x" * 900 + "\n", "recipe_unknown_type"),  # a long type name
    ("a" * 5000 + "=Q8_0\n", "recipe_line_too_long"),
    ("attn_q=Q8_0\nnot_a_tensor=Q8_0\n", "recipe_rule_unused"),
    ("attn_norm=Q8_0\n", "recipe_rule_unused"),  # norms are never quantized
    ("attn=Q8_0\nattn_q=Q4_0\n", "recipe_rule_unused"),  # line 1 already decides them
    ("ffn_down=Q6_K\n", "recipe_type_shape"),  # rows of 640 take no 256-blocks
]


@pytest.mark.parametrize(("recipe", "code"), RECIPES)
def test_hostile_recipes_fail_before_anything_is_written(hp_models, tmp_path, capsys, recipe, code):
    path = tmp_path / "recipe.txt"
    path.write_text(recipe)
    out = tmp_path / "pkg"
    rc, data = run(
        capsys, hp_models.f32, "--out-dir", out, "--type", "Q8_0", "--tensor-types", path, *PROV
    )
    assert (rc, data["ok"], data["error"]["code"]) == (2, False, code)
    assert left_behind(out) == []


def _truncated(src: Path, dst: Path) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) - 4096])
    return dst


def _with_nan(src: Path, dst: Path, tensor: str) -> Path:
    data = bytearray(src.read_bytes())
    with open_gguf(src) as g:
        t = g.tensor(tensor)
    data[t.data_start + 64 : t.data_start + 68] = struct.pack("<f", float("nan"))
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize(
    ("make_source", "extra", "rc", "code"),
    [
        (lambda hp, sd, tmp: hp.f32, ["--type", "Q9_0"], 2, "unknown_quant_type"),
        (lambda hp, sd, tmp: sd.llama, ["--type", "Q8_0"], 1, "source_already_quantized"),
        (lambda hp, sd, tmp: _truncated(hp.f32, tmp / "t.gguf"), ["--type", "Q8_0"], 1, None),
        (lambda hp, sd, tmp: hp.f32, ["--type", "IQ2_XXS"], 2, "imatrix_required"),
        (lambda hp, sd, tmp: tmp / "absent.gguf", ["--type", "Q8_0"], 2, "unreadable_input"),
    ],
    ids=["unknown-type", "already-quantized", "truncated", "needs-imatrix", "missing"],
)
def test_hostile_sources_and_types(
    hp_models, synth_dir, tmp_path, capsys, make_source, extra, rc, code
):
    out = tmp_path / "pkg"
    source = make_source(hp_models, synth_dir, tmp_path)
    got, data = run(capsys, source, "--out-dir", out, *extra, *PROV)
    assert got == rc and data["ok"] is False
    if code is None:  # truncation is caught by the GGUF reader's bounds checks
        assert data["error"]["code"].startswith("gguf_")
    else:
        assert data["error"]["code"] == code
    assert left_behind(out) == []


def test_a_failure_mid_write_leaves_no_manifest_and_the_old_package_is_withdrawn(
    hp_models, tmp_path, capsys
):
    """NaN in the source is only found while reading it (ggml_validate_row_data, as
    llama.cpp's loader does)."""
    out = tmp_path / "pkg"
    assert run(capsys, hp_models.f32, "--out-dir", out, "--type", "Q8_0", *PROV)[0] == 0
    bad = _with_nan(hp_models.f32, tmp_path / "nan.gguf", "blk.5.attn_q.weight")
    rc, data = run(capsys, bad, "--out-dir", out, "--type", "Q8_0", "--overwrite", *PROV)
    assert (rc, data["error"]["code"]) == (1, "invalid_source_data")
    assert "blk.5.attn_q.weight" in data["error"]["message"]
    leftovers = left_behind(out)
    assert MANIFEST_NAME not in leftovers
    assert not [p for p in leftovers if p.endswith(".partial")]


def test_refused_overwrite_keeps_the_previous_package(hp_models, tmp_path, capsys):
    out = tmp_path / "pkg"
    assert run(capsys, hp_models.f32, "--out-dir", out, "--type", "Q8_0", *PROV)[0] == 0
    before = (out / MANIFEST_NAME).read_bytes()
    recipe = tmp_path / "r.txt"
    recipe.write_text("nothing_matches=Q4_0\n")
    rc, _ = run(
        capsys, hp_models.f32, "--out-dir", out, "--type", "Q8_0", "--tensor-types", recipe,
        "--overwrite", *PROV,
    )  # fmt: skip
    assert rc == 2 and (out / MANIFEST_NAME).read_bytes() == before
    rc, data = run(capsys, hp_models.f32, "--out-dir", out, "--type", "Q8_0", *PROV)
    assert (rc, data["error"]["code"]) == (2, "output_exists")


def test_a_layer_package_as_source_keeps_the_original_provenance(hp_models, tmp_path, capsys):
    src_pkg = tmp_path / "f16-pkg"
    written = make_package(hp_models.f16, src_pkg, model_id="acme/tiny:F16")
    out = tmp_path / "q8"
    rc, data = run(capsys, src_pkg, "--out-dir", out, "--type", "Q8_0")
    assert rc == 0, data
    direct = tmp_path / "direct"
    assert run(capsys, hp_models.f16, "--out-dir", direct, "--type", "Q8_0", *PROV)[0] == 0
    assert differences(package_tensors(out), package_tensors(direct)) == []
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert m["model_id"] == "acme/tiny:Q8_0"
    assert m["source_model"] == written.manifest.source_model.to_dict()
    # provenance stays the original's, so the package validates against the original GGUF
    assert package_main(["validate-package", str(hp_models.f16), str(out)]) == 0
    assert ": valid (" in capsys.readouterr().out
    rc, data = run(capsys, src_pkg, "--out-dir", src_pkg, "--type", "Q8_0", "--overwrite")
    assert (rc, data["error"]["code"]) == (2, "output_is_source")


def test_a_corrupt_package_source_is_refused(hp_models, tmp_path, capsys):
    src_pkg = tmp_path / "f16-pkg"
    make_package(hp_models.f16, src_pkg, model_id="acme/tiny:F16")
    layer = src_pkg / "layers" / "layer-00002.gguf"
    data = bytearray(layer.read_bytes())
    data[-100] ^= 0xFF
    layer.write_bytes(bytes(data))
    rc, out = run(capsys, src_pkg, "--out-dir", tmp_path / "q8", "--type", "Q8_0")
    assert (rc, out["error"]["code"]) == (1, "artifact_sha256_mismatch")
    assert left_behind(tmp_path / "q8") == []


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (lambda q: q.update(type="Q8_0", ftype=7), "quantization_file_type_mismatch"),
        (lambda q: q.update(recipe="attn_q=Q8_0\n"), "quantization_recipe_mismatch"),
        (lambda q: q.update(ftype="15"), "invalid_quantization_block"),
        (lambda q: q.update(pure=True), "quantization_type_mismatch"),
    ],
)
def test_preflight_checks_the_block_against_the_package(hp_models, tmp_path, capsys, edit, code):
    out = tmp_path / "pkg"
    recipe = tmp_path / "r.txt"
    recipe.write_text("attn_output=Q8_0\n")
    rc, _ = run(
        capsys, hp_models.f32, "--out-dir", out, "--type", "Q4_K_M", "--tensor-types", recipe, *PROV
    )
    assert rc == 0
    edit_manifest(out, lambda m: edit(m["quantization"]))
    assert package_main(["preflight", str(out), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert code in {f["code"] for f in report["findings"]}


def test_bf16_and_f16_sources_convert_exactly(hp_models, tmp_path, capsys):
    """bf16 -> f32 is a shift and f16 -> f32 exact in numpy, as in ggml's row converters:
    an F32 target (no rounding) gives back the source values."""
    for source in (hp_models.bf16, hp_models.f16):
        out = tmp_path / source.stem
        assert run(capsys, source, "--out-dir", out, "--type", "F32", *PROV)[0] == 0
        ours = package_tensors(out)
        with open_gguf(source) as g:
            t = g.tensor("blk.1.ffn_up.weight")
            raw = np.frombuffer(g.read_range(t.data_start, t.nbytes), dtype=np.uint16)
        want = (
            (raw.astype(np.uint32) << 16).view(np.float32)
            if source == hp_models.bf16
            else raw.view(np.float16).astype(np.float32)
        )
        assert ours["blk.1.ffn_up.weight"][2] == want.tobytes()


def test_requantizing_a_quantized_package_records_where_it_came_from(hp_models, tmp_path, capsys):
    q4 = tmp_path / "q4"
    assert run(capsys, hp_models.f16, "--out-dir", q4, "--type", "Q4_K_M", *PROV)[0] == 0
    rc, data = run(capsys, q4, "--out-dir", tmp_path / "q8", "--type", "Q8_0")
    assert (rc, data["error"]["code"]) == (1, "source_already_quantized")
    rc, data = run(
        capsys, q4, "--out-dir", tmp_path / "q8", "--type", "Q8_0", "--allow-requantize"
    )
    assert rc == 0
    earlier = json.loads((q4 / MANIFEST_NAME).read_text())["quantization"]
    assert data["quantization"]["requantized_from"] == earlier
    # the bytes cannot be redone from the original source: checked for types only, and said
    argv = ["validate-package", str(hp_models.f16), str(tmp_path / "q8"), "--json"]
    assert package_main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [f["code"] for f in report["findings"]] == ["quantized_bytes_not_checked"]
