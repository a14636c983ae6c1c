"""Inputs that were accepted but must not be: provenance text and source
paths at write time and the same rule for manifests, escaping of everything printed from a
manifest, integer bounds, layer ranges, references, projectors and hub distributions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pkgtools import edit_manifest, make_package

from mesh_node.lab.hub_server import running_hub
from skippy.cli import main
from skippy.constants import MANIFEST_NAME
from skippy.errors import ManifestError, UsageError
from skippy.package.manifest import check_manifest, parse_manifest, read_manifest_bytes
from skippy.package.ranges import parse_layer_range
from skippy.package.refs import InvalidPackageRef, parse_package_ref
from skippy.produce.hub_source import choose_distribution_files
from skippy.produce.write_package import Provenance

MODEL_ID = "acme/tiny-GGUF:Q8_0"
HOSTILE_TEXT = ["two\nlines", "esc\x1b[2Jape", "tab\there", "rtl\u202egguf.exe", "nul\x00"]


@pytest.fixture(scope="module")
def pkg(synth_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "pkg"
    make_package(synth_dir.llama, out)
    return out


def _copy(pkg: Path, tmp_path: Path) -> Path:
    out = tmp_path / "pkg"
    shutil.copytree(pkg, out)
    return out


# --- provenance at write time ------------------------------------------------------------------
GOOD = {"model_id": MODEL_ID, "repo": "acme/tiny-GGUF", "revision": "r", "source_file": "m.gguf"}


@pytest.mark.parametrize("field", ["model_id", "repo", "revision", "source_file"])
@pytest.mark.parametrize("text", HOSTILE_TEXT, ids=["newline", "escape", "tab", "bidi", "nul"])
def test_provenance_refuses_control_and_bidi_characters(field, text):
    with pytest.raises(UsageError) as exc:
        Provenance(**{**GOOD, field: text})
    assert exc.value.code in ("invalid_provenance", "invalid_model_id")


@pytest.mark.parametrize("source_file", ["../../etc/passwd", "/etc/passwd", "a//b.gguf", "a\\b"])
def test_provenance_refuses_unsafe_source_paths(source_file):
    with pytest.raises(UsageError) as exc:
        Provenance(**{**GOOD, "source_file": source_file})
    assert exc.value.code == "unsafe_source_path"


def test_cli_newline_in_revision_writes_nothing(synth_dir, tmp_path, capsys):
    out = tmp_path / "pkg"
    argv = [
        "write-package",
        str(synth_dir.llama),
        "--out-dir",
        str(out),
        "--model-id",
        MODEL_ID,
        "--source-revision",
        "main\n# injected heading",
        "--source-file",
        "m.gguf",
    ]
    assert main(argv) == 2
    assert "invalid_provenance" in capsys.readouterr().err
    assert not out.exists()


# --- the same rule for manifests ---------------------------------------------------------------
@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(model_id="acme/tiny\u202e-GGUF:Q8_0"),
        lambda d: d["source_model"].update(revision="r\x1b]0;pwned\x07"),
        lambda d: d["source_model"].update(repo="acme/x\ny"),
        lambda d: d["source_model"].update(canonical_ref="a\u2066b"),
    ],
    ids=["model_id-bidi", "revision-osc", "repo-newline", "canonical-isolate"],
)
def test_preflight_refuses_what_write_package_would_refuse(pkg, tmp_path, capsys, edit):
    out = _copy(pkg, tmp_path)
    edit_manifest(out, edit)
    assert main(["preflight", str(out), "--json"]) == 1
    codes = {f["code"] for f in json.loads(capsys.readouterr().out)["findings"]}
    assert "unsafe_manifest_text" in codes


@pytest.mark.parametrize("bad", ["../../etc/passwd", "/etc/passwd"])
def test_manifest_source_paths_must_be_safe(pkg, bad):
    data = json.loads((pkg / MANIFEST_NAME).read_text())
    data["source_model"]["primary_file"] = bad
    codes = {f.code for f in check_manifest(parse_manifest(json.dumps(data).encode()))}
    assert "unsafe_source_path" in codes


def test_artifact_paths_with_control_characters_are_unsafe(pkg):
    data = json.loads((pkg / MANIFEST_NAME).read_text())
    data["layers"][0]["path"] = "layers/\x1b[31mred.gguf"
    codes = {f.code for f in check_manifest(parse_manifest(json.dumps(data).encode()))}
    assert "unsafe_artifact_path" in codes


def test_no_escape_sequence_from_a_manifest_reaches_the_terminal(pkg, tmp_path, capsys):
    out = _copy(pkg, tmp_path)
    edit_manifest(out, lambda d: d.update(model_id="evil\x1b[2J\u202e\nFAKE LINE:Q"))
    main(["inspect", str(out)])
    main(["preflight", str(out)])
    main(["select", str(out), "--layers", "0..1"])
    captured = capsys.readouterr()
    for stream in (captured.out, captured.err):
        assert "\x1b" not in stream and "\u202e" not in stream
        assert "\nFAKE LINE" not in stream
    assert "\\x1b[2J" in captured.out


# --- integer bounds ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda d: d["shared"]["metadata"].update(artifact_bytes=2**60), "artifact_bytes"),
        (lambda d: d.update(activation_width=-640), "activation_width"),
        (lambda d: d.update(activation_width=0), "activation_width"),
        (lambda d: d.update(created_at_unix_secs=-1), "created_at_unix_secs"),
        (lambda d: d.update(created_at_unix_secs=10**13), "created_at_unix_secs"),
        (lambda d: d["layers"][0].update(tensor_count=2**40), "tensor_count"),
        (lambda d: d["source_model"]["files"][0].update(size_bytes=-5), "size_bytes"),
    ],
)
def test_integer_fields_are_bounded(pkg, edit, where):
    data = json.loads((pkg / MANIFEST_NAME).read_text())
    edit(data)
    with pytest.raises(ManifestError) as exc:
        parse_manifest(json.dumps(data).encode())
    assert where in str(exc.value.path) and exc.value.code == "invalid_manifest"


def test_an_out_of_range_size_is_an_error_not_a_31_digit_figure(pkg, tmp_path, capsys):
    out = _copy(pkg, tmp_path)
    edit_manifest(out, lambda d: d["shared"]["metadata"].update(artifact_bytes=10**40))
    assert main(["inspect", str(out)]) == 1
    err = capsys.readouterr().err
    assert "error [invalid_manifest" in err and "GiB" not in err


def test_a_huge_integer_does_not_leak_pythons_digit_limit(pkg, tmp_path, capsys):
    out = _copy(pkg, tmp_path)
    text = (out / MANIFEST_NAME).read_text()
    (out / MANIFEST_NAME).write_text(
        text.replace('"layer_count": ', '"layer_count": ' + "9" * 100_000 + ', "x": ')
    )
    assert main(["preflight", str(out)]) == 1
    captured = capsys.readouterr()
    said = captured.out + captured.err
    assert "int_max_str_digits" not in said and "100000 digits" in said


def test_an_oversized_manifest_reports_its_real_size(pkg, tmp_path):
    out = _copy(pkg, tmp_path)
    with open(out / MANIFEST_NAME, "ab") as f:
        f.write(b" " * (52 * 1024 * 1024))
    with pytest.raises(ManifestError) as exc:
        read_manifest_bytes(out)
    assert exc.value.code == "manifest_too_large"
    assert "16777217" not in exc.value.message and "52.0 MiB" in exc.value.message


# --- layer ranges --------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["１..２", "٠..٢", "0..²"])
def test_layer_ranges_take_ascii_digits_only(text):
    with pytest.raises(UsageError) as exc:
        parse_layer_range(text, 4)
    assert exc.value.code == "invalid_layer_range"


def test_a_negative_layer_range_is_our_error_not_argparses(pkg, capsys):
    assert main(["select", str(pkg), "--layers", "-1..2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error [invalid_layer_range]") and "negative" in err


# --- references ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["hf://a/b@rev@rev2", "hf://a/b@main@{u}"])
def test_a_reference_has_one_revision(text):
    with pytest.raises(InvalidPackageRef):
        parse_package_ref(text)


@pytest.mark.parametrize("text", ["s3://a/b", "https://huggingface.co/a/b", "file:///tmp/x"])
def test_other_schemes_are_unsupported_references(text, capsys):
    with pytest.raises(InvalidPackageRef) as exc:
        parse_package_ref(text)
    assert "unsupported" in exc.value.message
    assert main(["select", text, "--layers", "0..1"]) == 2
    assert "error [invalid_package_ref]" in capsys.readouterr().err


def test_a_dot_slash_source_is_a_local_path_not_a_hub_coordinate(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # any hub call would fail loudly
    argv = ["write-package", "./google/x:Q", "--out-dir", "out", "--model-id", MODEL_ID]
    assert main([*argv, "--source-revision", "r", "--source-file", "x.gguf"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "hub" not in err.lower()


# --- projectors ----------------------------------------------------------------------------------
def test_a_language_model_is_not_a_projector(synth_dir, tmp_path):
    with pytest.raises(UsageError) as exc:
        make_package(synth_dir.llama, tmp_path / "pkg", projectors=(synth_dir.gemma,))
    assert exc.value.code == "not_a_projector"
    assert not (tmp_path / "pkg").exists()


def test_a_projector_as_the_source_says_use_projector(synth_dir, tmp_path):
    with pytest.raises(UsageError) as exc:
        make_package(synth_dir.projector, tmp_path / "pkg")
    assert exc.value.code == "source_is_projector" and "--projector" in exc.value.message


# --- hub distributions -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("files", "dist", "chosen"),
    [
        (["m-Q4_K_XL.gguf", "m-UD-Q4_K_XL.gguf"], "Q4_K_XL", ["m-Q4_K_XL.gguf"]),
        (["m-Q4_K_XL.gguf", "m-UD-Q4_K_XL.gguf"], "UD-Q4_K_XL", ["m-UD-Q4_K_XL.gguf"]),
        (["Qwen3-8B-Q4_K_M.gguf"], "Q4_K_M", ["Qwen3-8B-Q4_K_M.gguf"]),
        (["llama-2-7b.Q4_K_M.gguf"], "Q4_K_M", ["llama-2-7b.Q4_K_M.gguf"]),
        (["DeepSeek-V3.2-UD-Q2_K_XL.gguf"], "UD-Q2_K_XL", ["DeepSeek-V3.2-UD-Q2_K_XL.gguf"]),
        (["gemma-3-270m-it-BF16.gguf"], "BF16", ["gemma-3-270m-it-BF16.gguf"]),
    ],
)
def test_distributions_match_exactly(files, dist, chosen):
    assert choose_distribution_files(files, dist) == chosen


def test_a_different_recipe_is_not_the_distribution():
    with pytest.raises(UsageError) as exc:
        choose_distribution_files(["m-UD-Q4_K_XL.gguf", "m-Q8_0.gguf"], "Q4_K_XL")
    assert exc.value.code == "distribution_not_found"
    assert "UD-Q4_K_XL" in exc.value.message  # it lists what the repository holds


def test_source_file_picks_a_hub_file_explicitly(synth_dir, tmp_path, monkeypatch, capsys):
    repo_dir = tmp_path / "repo"
    repo_dir.mkdir()
    shutil.copy(synth_dir.llama, repo_dir / "odd-name.gguf")
    shutil.copy(synth_dir.llama, repo_dir / "other.gguf")
    with running_hub({"acme/tiny-GGUF": repo_dir}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        out = tmp_path / "pkg"
        argv = ["write-package", "acme/tiny-GGUF:Q8_0", "--out-dir", str(out)]
        assert main([*argv, "--source-file", "odd-name.gguf", "--json"]) == 0, capsys.readouterr()
        assert hub.downloaded_paths("acme/tiny-GGUF") == {"odd-name.gguf"}
        capsys.readouterr()
        assert main([*argv[:-1], str(tmp_path / "x"), "--source-file", "nope.gguf"]) == 2
        assert "error [source_file_not_found]" in capsys.readouterr().err
    src = json.loads((out / MANIFEST_NAME).read_text())["source_model"]
    assert src["primary_file"] == "odd-name.gguf" and src["distribution_id"] == "Q8_0"
