"""Manifest model: strict parse errors name the field; checks produce coded findings."""

from __future__ import annotations

import json

import pytest
from pkgtools import make_package

from skippy.errors import ManifestError
from skippy.package.manifest import abi_compatible, check_manifest, dump_manifest, parse_manifest


@pytest.fixture(scope="module")
def base(tmp_path_factory, synth_dir) -> dict:
    out = tmp_path_factory.mktemp("m") / "pkg"
    make_package(synth_dir.llama, out)
    return json.loads((out / "model-package.json").read_text())


def parsed(data: dict):
    return parse_manifest(json.dumps(data).encode())


@pytest.mark.parametrize(
    ("mutate", "code", "path"),
    [
        (lambda d: d.update(schema_version=3), "unsupported_schema_version", "schema_version"),
        # schema 2 is read, as its own closed schema: v1 fields are unknown there
        (lambda d: d.update(schema_version=2), "unknown_field", "activation_width"),
        (lambda d: d.update(schema_version=True), "unsupported_schema_version", "schema_version"),
        (lambda d: d.pop("schema_version"), "unsupported_schema_version", "schema_version"),
        (lambda d: d.update(format="layers"), "invalid_format", "format"),
        (lambda d: d.pop("model_id"), "invalid_manifest", "model_id"),
        (lambda d: d.update(layer_count="4"), "invalid_manifest", "layer_count"),
        (
            lambda d: d["layers"][2].update(layer_index=-1),
            "invalid_manifest",
            "layers[2].layer_index",
        ),
        (lambda d: d["shared"].pop("output"), "invalid_manifest", "shared.output"),
        (
            lambda d: d["shared"]["metadata"].update(artifact_bytes=1.5),
            "invalid_manifest",
            "shared.metadata.artifact_bytes",
        ),
        (lambda d: d.update(projectors={}), "invalid_manifest", "projectors"),
        (lambda d: d.update(tied_embeddings="yes"), "invalid_manifest", "tied_embeddings"),
        (lambda d: d.update(generation=[]), "invalid_manifest", "generation"),
    ],
)
def test_parse_errors_name_the_field(base, mutate, code, path):
    data = json.loads(json.dumps(base))
    mutate(data)
    with pytest.raises(ManifestError) as exc:
        parsed(data)
    assert exc.value.code == code
    assert exc.value.path == path


def test_bad_json_and_oversize():
    with pytest.raises(ManifestError) as exc:
        parse_manifest(b"{not json")
    assert exc.value.code == "invalid_manifest_json"
    with pytest.raises(ManifestError) as exc:
        parse_manifest(b" " * (16 * 1024 * 1024 + 1))
    assert exc.value.code == "manifest_too_large"


def test_unknown_top_level_fields_are_kept(base):
    data = dict(base, future_field={"x": 1})
    m = parsed(data)
    assert m.extra == {"future_field": {"x": 1}}
    assert json.loads(dump_manifest(m))["future_field"] == {"x": 1}
    assert check_manifest(m) == []


def test_round_trip_is_canonical(base):
    raw = dump_manifest(parsed(base))
    assert dump_manifest(parse_manifest(raw)) == raw


@pytest.mark.parametrize(
    ("mutate", "code"),
    [
        (lambda d: d.update(model_id=" "), "empty_model_id"),
        (lambda d: d["source_model"].update(sha256="abc"), "invalid_source_model_sha256"),
        (lambda d: d["source_model"].update(revision=""), "empty_source_identity"),
        (lambda d: d.update(skippy_abi_version=""), "missing_skippy_abi_version"),
        (lambda d: d.update(skippy_abi_version="2.0.0"), "incompatible_skippy_abi_version"),
        (lambda d: d.update(skippy_abi_version="1.1.0"), "incompatible_skippy_abi_version"),
        (lambda d: d["layers"][1].update(layer_index=9), "layer_index_out_of_range"),
        (lambda d: d["layers"].append(dict(d["layers"][0])), "duplicate_layer"),
        (lambda d: d["layers"].pop(), "missing_layer"),
        (lambda d: d["layers"][0].update(path="/etc/passwd"), "unsafe_artifact_path"),
        (lambda d: d["layers"][0].update(path="layers\\x.gguf"), "unsafe_artifact_path"),
        (lambda d: d["layers"][0].update(artifact_bytes=0), "empty_artifact"),
        (lambda d: d["layers"][0].update(tensor_bytes=0), "invalid_tensor_bytes"),
        (
            lambda d: d["shared"]["metadata"].update(tensor_count=0, tensor_bytes=5),
            "invalid_tensor_bytes",
        ),
        (lambda d: d["layers"][0].update(sha256="g" * 64), "invalid_artifact_sha256"),
        (
            lambda d: d.update(projectors=[dict(d["layers"][0], kind="audio", path="p.gguf")]),
            "unsupported_projector_kind",
        ),
    ],
)
def test_semantic_findings(base, mutate, code):
    data = json.loads(json.dumps(base))
    mutate(data)
    found = {f.code for f in check_manifest(parsed(data))}
    assert code in found


def test_uppercase_digest_is_accepted(base):
    data = json.loads(json.dumps(base))
    data["layers"][0]["sha256"] = data["layers"][0]["sha256"].upper()
    assert check_manifest(parsed(data)) == []


@pytest.mark.parametrize(
    ("package", "runtime", "ok"),
    [
        ("1.0.0", "1.0.0", True),
        ("1.0.9", "1.0.0", True),
        ("1.0.0", "1.2.0", True),
        ("1.3.0", "1.2.0", False),
        ("2.0.0", "1.9.0", False),
        ("0.9.0", "1.0.0", False),
        ("1.0", "1.0.0", False),
        ("v1.0.0", "1.0.0", False),
    ],
)
def test_abi_rule(package, runtime, ok):
    assert abi_compatible(package, runtime) is ok


# --- hostile manifests stay cheap and typed (review findings) ------------------------------------
def test_huge_layer_count_is_refused_at_parse(base):
    data = dict(base, layer_count=10**15)
    with pytest.raises(ManifestError) as exc:
        parsed(data)
    assert exc.value.code == "layer_count_too_large"


def test_many_missing_layers_are_summarised(base):
    data = dict(base, layer_count=60_000)
    found = [f for f in check_manifest(parsed(data)) if f.code == "missing_layer"]
    assert len(found) == 21  # 20 named, then one summary with the total
    assert "59996 in all" in found[-1].message


def test_integer_beyond_the_conversion_limit_is_a_json_error():
    raw = b'{"schema_version": 1, "format": "layer-package", "layer_count": ' + b"9" * 5000 + b"}"
    with pytest.raises(ManifestError) as exc:
        parse_manifest(raw)
    assert exc.value.code == "invalid_manifest_json"


def test_duplicate_keys_are_refused(base):
    text = json.dumps(base)
    raw = text.replace('"format":', '"model_id": "x/y:z", "format":', 1).encode()
    with pytest.raises(ManifestError) as exc:
        parse_manifest(raw)
    assert exc.value.code == "duplicate_manifest_key"


def test_digest_with_a_trailing_newline_is_not_a_digest(base):
    data = json.loads(json.dumps(base))
    data["layers"][0]["sha256"] += "\n"
    data["source_model"]["sha256"] += "\n"
    found = {f.code for f in check_manifest(parsed(data))}
    assert {"invalid_artifact_sha256", "invalid_source_model_sha256"} <= found


def test_manifest_that_is_a_fifo_does_not_block(tmp_path):
    import os

    from skippy.errors import InputUnreadable
    from skippy.package.manifest import read_manifest_bytes

    os.mkfifo(tmp_path / "model-package.json")
    with pytest.raises(InputUnreadable) as exc:
        read_manifest_bytes(tmp_path)
    assert exc.value.code == "manifest_not_file"
