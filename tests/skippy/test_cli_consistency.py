"""Consistent answers across commands: a split set is read whole, plan
counts bytes as the package holds them, one exit code per kind of mistake, one JSON shape,
readable human output (no ``None``, sizes in units, findings summarised)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from pkgtools import make_package

from skippy.cli import main
from skippy.constants import layer_path
from skippy.progress import human_bytes


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def run_text(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def pkg(synth_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("consistency") / "pkg"
    make_package(synth_dir.llama, out)
    return out


# --- a split set is one model ----------------------------------------------------------------
def test_inspect_of_the_first_shard_describes_the_whole_set(synth_dir, capsys):
    _, whole = run_json(capsys, "inspect", str(synth_dir.llama))
    _, split = run_json(capsys, "inspect", str(synth_dir.split[0]))
    for key in ("tensor_count", "tensor_bytes", "layer_count", "tied_embeddings"):
        assert split[key] == whole[key], key
    assert split["files"] == [str(p) for p in synth_dir.split]
    assert {t["name"] for t in split["tensors"]} == {t["name"] for t in whole["tensors"]}


def test_plan_of_the_first_shard_equals_the_whole_model(synth_dir, capsys):
    _, whole = run_json(capsys, "plan", str(synth_dir.llama), "--stages", "2")
    _, split = run_json(capsys, "plan", str(synth_dir.split[0]), "--stages", "2")
    assert split["stages"] == whole["stages"]


@pytest.mark.parametrize("model", ["llama", "gemma", "nextn"])
@pytest.mark.parametrize("balance", ["layers", "bytes"])
def test_plan_of_a_gguf_counts_bytes_exactly_as_the_package_holds_them(
    synth_dir, tmp_path, capsys, model, balance
):
    source = getattr(synth_dir, model)
    out = tmp_path / "pkg"
    make_package(source, out)
    for stages in ("1", "2", "3"):
        _, raw = run_json(capsys, "plan", str(source), "--stages", stages, "--balance", balance)
        _, packaged = run_json(capsys, "plan", str(out), "--stages", stages, "--balance", balance)
        assert raw["stages"] == packaged["stages"]


# --- exit codes and wrong types ----------------------------------------------------------------
@pytest.mark.parametrize("stages", ["0", "-1", "99"])
def test_a_bad_stage_count_is_a_usage_error_everywhere(pkg, capsys, stages):
    for command in ("plan", "preflight"):
        code, doc = run_json(capsys, command, str(pkg), "--stages", stages)
        assert code == 2, (command, doc)
        assert doc["ok"] is False


def test_preflight_of_a_file_says_it_is_not_a_directory(synth_dir, capsys):
    code, _, err = run_text(capsys, "preflight", str(synth_dir.llama))
    assert code == 2 and "is not a directory" in err and "does not exist" not in err


def test_validate_package_with_a_folder_as_source_says_it_is_not_a_file(pkg, capsys):
    code, _, err = run_text(capsys, "validate-package", str(pkg), str(pkg))
    assert code == 2 and "is not a file" in err and "does not exist" not in err


def test_inspect_of_a_missing_path_fails_with_findings(tmp_path, capsys):
    code, doc = run_json(capsys, "inspect", str(tmp_path / "nope.gguf"))
    assert code == 2 and doc["ok"] is False
    assert doc["findings"][0]["code"] == doc["error"]["code"]


# --- human output ------------------------------------------------------------------------------
def test_no_python_none_in_any_human_output(pkg, tmp_path, capsys):
    out = tmp_path / "stage.gguf"
    commands = [
        ["inspect", str(pkg / layer_path(0))],
        ["inspect", str(pkg / "shared" / "metadata.gguf")],
        ["inspect", str(pkg / "shared" / "output.gguf")],
        ["inspect", str(pkg)],
        ["plan", str(pkg), "--stages", "2"],
        ["preflight", str(pkg), "--stages", "2"],
        ["select", str(pkg), "--layers", "1..3"],
        ["materialize", str(pkg), "--layers", "1..3", "--out", str(out)],
        ["materialize", str(pkg), "--layers", "1..3", "--out", str(out)],
        ["inspect", str(out)],
    ]
    for argv in commands:
        code, text, err = run_text(capsys, *argv)
        assert code == 0, (argv, err)
        assert "None" not in text and "None" not in err, (argv, text)


def test_a_materialized_partial_stage_reports_its_real_layer_count(pkg, tmp_path, capsys):
    out = tmp_path / "stage.gguf"
    assert main(["materialize", str(pkg), "--layers", "1..3", "--out", str(out)]) == 0
    capsys.readouterr()
    _, doc = run_json(capsys, "inspect", str(out))
    assert doc["layers_held"] == {"start": 1, "stop": 3, "count": 2}
    _, text, _ = run_text(capsys, "inspect", str(out))
    assert "2 layers" in text.splitlines()[0] and "4 layers" not in text.splitlines()[0]


def test_plan_says_one_stage_and_aligns_its_columns(pkg, capsys):
    _, text, _ = run_text(capsys, "plan", str(pkg), "--stages", "1")
    assert text.startswith("1 stage over")
    _, text, _ = run_text(capsys, "plan", str(pkg), "--stages", "3")
    rows = [line for line in text.splitlines() if re.match(r"\s+\d+\s", line)]
    assert len(rows) == 3
    ends = {line.rfind("iB") for line in rows}
    assert len(ends) == 1, text  # the byte column is right-aligned


def test_human_sizes_have_units_up_to_pib():
    assert human_bytes(512) == "512 B"
    assert human_bytes(3 * 1024**4) == "3.0 TiB"
    assert human_bytes(5 * 1024**5) == "5.0 PiB"


def test_validate_against_the_wrong_source_summarises_first(synth_dir, pkg, capsys):
    code, text, _ = run_text(capsys, "validate-package", str(synth_dir.gemma), str(pkg))
    assert code == 1
    lines = text.splitlines()
    assert "INVALID" in lines[0]
    assert re.match(r"\s+\d+ errors?", lines[1]), lines[1]  # the summary, by code
    per_code: dict[str, int] = {}
    for line in lines[2:]:
        m = re.match(r"\s+error: \[(\w+)\]", line)
        if m:
            per_code[m.group(1)] = per_code.get(m.group(1), 0) + 1
    assert per_code and max(per_code.values()) <= 5
    assert "--all" in text
    code, full, _ = run_text(capsys, "validate-package", str(synth_dir.gemma), str(pkg), "--all")
    _, doc = run_json(capsys, "validate-package", str(synth_dir.gemma), str(pkg))
    errors = [f for f in doc["findings"] if f["severity"] == "error"]
    assert full.count("  error: [") == len(errors) > sum(per_code.values())
    assert doc["summary"]["errors"] == len(errors)


# --- one JSON shape ----------------------------------------------------------------------------
def test_every_document_has_ok_and_names_its_input_the_same_way(synth_dir, pkg, tmp_path, capsys):
    out = tmp_path / "s.gguf"
    cases = [
        (["inspect", str(synth_dir.llama)], {"source": str(synth_dir.llama)}),
        (["inspect", str(pkg)], {"package": str(pkg)}),
        (["plan", str(synth_dir.llama), "--stages", "2"], {"source": str(synth_dir.llama)}),
        (["plan", str(pkg), "--stages", "2"], {"package": str(pkg)}),
        (
            ["validate-package", str(synth_dir.llama), str(pkg)],
            {"source": str(synth_dir.llama), "package": str(pkg)},
        ),
        (["preflight", str(pkg)], {"package": str(pkg)}),
        (["select", str(pkg), "--layers", "0..2"], {"package": str(pkg)}),
        (["materialize", str(pkg), "--layers", "0..2", "--out", str(out)], {"package": str(pkg)}),
        (
            ["policy", str(pkg), "--phase", "decode", "--n-tokens", "1", "--n-kv", "8"],
            {"package": str(pkg)},
        ),
    ]
    for argv, names in cases:
        code, doc = run_json(capsys, *argv)
        assert code == 0 and doc["ok"] is True, argv
        for key, value in names.items():
            assert doc[key] == value, (argv, key)
        assert "path" not in doc and "out_dir" not in doc, argv


def test_write_package_json_names_source_and_package(synth_dir, tmp_path, capsys):
    out = tmp_path / "pkg"
    argv = ["write-package", str(synth_dir.llama), "--out-dir", str(out), "--model-id"]
    argv += ["acme/tiny-GGUF:Q8_0", "--source-revision", "r", "--source-file", "m.gguf"]
    code, doc = run_json(capsys, *argv)
    assert code == 0 and doc["ok"] is True
    assert doc["source"] == str(synth_dir.llama) and doc["package"] == str(out)


def test_inspect_package_uses_the_manifests_field_names(pkg, capsys):
    _, doc = run_json(capsys, "inspect", str(pkg))
    manifest = json.loads((pkg / "model-package.json").read_text())
    assert doc["source_model"] == manifest["source_model"]
    assert set(doc["layers"][0]) == {
        "layer_index",
        "path",
        "tensor_count",
        "tensor_bytes",
        "artifact_bytes",
        "sha256",
    }


def test_materialize_reports_the_outputs_sha256_built_or_kept(pkg, tmp_path, capsys):
    out = tmp_path / "s.gguf"
    argv = ["materialize", str(pkg), "--layers", "0..2", "--out", str(out)]
    _, built = run_json(capsys, *argv)
    _, kept = run_json(capsys, *argv)
    import hashlib

    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert built["built"] is True and kept["built"] is False
    assert built["sha256"] == kept["sha256"] == digest
    assert built["out"] == str(out)


def test_preflight_json_summarises_findings(pkg, tmp_path, capsys):
    broken = tmp_path / "pkg"
    shutil.copytree(pkg, broken)
    (broken / layer_path(1)).unlink()
    code, doc = run_json(capsys, "preflight", str(broken))
    assert code == 1 and doc["ok"] is False
    assert doc["summary"]["by_code"]["missing_artifact"] == 1


@pytest.mark.parametrize(
    ("tool", "argv"),
    [
        ("skippy", ["plan", "--no-such-flag"]),
        ("quantize", ["quantize-layer-package", "--no-such-flag"]),
        ("mesh", ["topology", "--no-such-flag"]),
        ("mesh", ["lab", "--nodes", "0", "--package", "x"]),
    ],
)
def test_every_tool_names_a_usage_error_the_same_way(tool, argv, capsys):
    """One code for "you called it wrong" across the three command-line tools."""
    from mesh_node.cli import main as mesh_main
    from skippy.quantize_cli import main as quantize_main

    entry = {"skippy": main, "quantize": quantize_main, "mesh": mesh_main}[tool]
    try:
        code = entry([*argv, "--json"])
    except SystemExit as exit_:
        code = exit_.code
    doc = json.loads(capsys.readouterr().out)
    assert code == 2, doc
    assert doc["ok"] is False and doc["error"]["code"] == "usage", doc
