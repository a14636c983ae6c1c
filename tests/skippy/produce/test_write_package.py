"""write-package on real GGUFs: layout, ownership, split-set keys, provenance, crash safety."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import pytest
from pkgtools import make_package

from skippy.cli import main
from skippy.constants import MANIFEST_NAME, layer_path
from skippy.errors import GGUFFormatError, InputUnreadable, ModelError, OutputExists, UsageError
from skippy.gguf.reader import open_gguf
from skippy.package.manifest import parse_manifest
from skippy.produce.validate import validate_package
from skippy.produce.write_package import local_provenance


def _tensors(path: Path) -> dict[str, tuple[int, tuple[int, ...], bytes]]:
    with open_gguf(path) as g:
        return {t.name: (t.ggml_type, t.shape, g.read_range(t.data_start, t.nbytes)) for t in g}


def test_llama_like_layout_and_ownership(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    result = make_package(synth_dir.llama, pkg)
    m = result.manifest
    assert m.layer_count == 4 and not m.tied_embeddings
    assert m.shared.metadata.path == "shared/metadata.gguf"
    assert [e.path for e in m.layers] == [layer_path(i) for i in range(4)]
    assert (pkg / "README.md").is_file()
    source = _tensors(synth_dir.llama)
    seen: dict[str, str] = {}
    for ref in m.artifacts():
        for name, facts in _tensors(pkg / ref.path).items():
            assert name not in seen, f"{name} in {seen.get(name)} and {ref.path}"
            seen[name] = ref.path
            assert facts == source[name]  # identical type, shape and bytes
    assert set(seen) == set(source)
    assert seen["rope_freqs.weight"] == "shared/metadata.gguf"
    assert seen["token_embd.weight"] == "shared/embeddings.gguf"
    assert seen["output.weight"] == "shared/output.gguf"
    assert seen["output_norm.weight"] == "shared/output.gguf"
    assert seen["blk.2.attn_q.weight"] == "layers/layer-00002.gguf"


def test_fragments_form_a_llama_cpp_split_set(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    m = make_package(synth_dir.llama, pkg).manifest
    refs = [r for r in m.artifacts() if r.role != "projector"]
    total = 0
    for split_no, ref in enumerate(refs):
        r = gguf.GGUFReader(pkg / ref.path)
        assert r.fields["split.no"].contents() == split_no
        assert r.fields["split.no"].types == [gguf.GGUFValueType.UINT16]
        assert r.fields["general.architecture"].contents() == "llama"
        assert r.fields["skippy.fragment.role"].contents() == ref.role
        total += len(r.tensors)
        if split_no == 0:
            assert r.fields["split.count"].contents() == len(refs)
            assert r.fields["split.count"].types == [gguf.GGUFValueType.UINT16]
            assert r.fields["split.tensors.count"].types == [gguf.GGUFValueType.INT32]
            assert "tokenizer.ggml.tokens" in r.fields
        else:
            assert "split.count" not in r.fields
            assert "tokenizer.ggml.tokens" not in r.fields  # tokenizer only in metadata
    meta = gguf.GGUFReader(pkg / "shared/metadata.gguf")
    assert meta.fields["split.tensors.count"].contents() == total


def test_metadata_fragment_keeps_every_source_kv_byte_for_byte(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    make_package(synth_dir.llama, pkg)
    with open_gguf(synth_dir.llama) as src, open_gguf(pkg / "shared/metadata.gguf") as meta:
        for key in src.fields:
            assert meta.raw_field(key) == src.raw_field(key)


def test_gemma_like_is_tied_and_alignment_is_kept(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    m = make_package(synth_dir.gemma, pkg).manifest
    assert m.tied_embeddings is True
    assert json.loads((pkg / MANIFEST_NAME).read_text())["tied_embeddings"] is True
    for ref in m.artifacts():
        with open_gguf(pkg / ref.path) as g:
            assert g.alignment == 64
            assert all(t.data_start % 64 == 0 for t in g)


def test_split_set_source_reads_every_shard(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    first = synth_dir.split[0]
    m = make_package(first, pkg).manifest
    assert [f.path for f in m.source_model.files] == [p.name for p in synth_dir.split]
    assert m.source_model.sha256 == hashlib.sha256(first.read_bytes()).hexdigest()
    for f, p in zip(m.source_model.files, synth_dir.split, strict=True):
        assert f.size_bytes == p.stat().st_size
        assert f.sha256 == hashlib.sha256(p.read_bytes()).hexdigest()
    assert m.source_model.distribution_id == "Q8_0"  # the model coordinate's, not a file's
    assert validate_package(first, pkg).valid


def test_missing_split_sibling_is_named(synth_dir, tmp_path):
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    first = lonely / synth_dir.split[0].name
    first.write_bytes(synth_dir.split[0].read_bytes())
    with pytest.raises(InputUnreadable) as exc:
        make_package(first, tmp_path / "pkg")
    assert exc.value.code == "missing_split_shard"
    assert synth_dir.split[1].name in exc.value.message


def test_provenance_fields(synth_dir, tmp_path):
    m = make_package(synth_dir.llama, tmp_path / "pkg", model_id="acme/tiny-GGUF:Q8_0").manifest
    src = m.source_model
    assert m.model_id == "acme/tiny-GGUF:Q8_0"
    assert src.repo == "acme/tiny-GGUF"
    assert src.revision == "0123abc"
    # Spec "Manifest Schema": canonical_ref is the model coordinate, distribution_id its part
    # after ':'; repository, revision and file have fields of their own.
    assert src.canonical_ref == "acme/tiny-GGUF:Q8_0"
    assert src.distribution_id == "Q8_0"
    assert src.primary_file == synth_dir.llama.name
    assert m.activation_width == 64
    assert m.skippy_abi_version == "1.0.0"
    readme = (tmp_path / "pkg" / "README.md").read_text()
    assert "`acme/tiny-GGUF` at revision `0123abc`" in readme
    assert f"Source file: `{synth_dir.llama.name}`" in readme


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"model_id": None}, "--model-id"),
        ({"source_revision": None}, "--source-revision"),
        ({"source_file": None}, "--source-file"),
    ],
)
def test_local_source_requires_each_provenance_flag(kwargs, flag):
    base = {"model_id": "a/b:c", "source_repo": None, "source_revision": "r", "source_file": "f"}
    with pytest.raises(UsageError) as exc:
        local_provenance(**{**base, **kwargs})
    assert exc.value.code == "missing_provenance"
    assert flag in exc.value.message


@pytest.mark.parametrize("bad", ["gemma", "a/b", "/abs/path.gguf:x", "a b/c:d"])
def test_model_id_must_be_a_coordinate(bad):
    with pytest.raises(UsageError) as exc:
        local_provenance(model_id=bad, source_repo=None, source_revision="r", source_file="f")
    assert exc.value.code == "invalid_model_id"


def test_existing_package_needs_overwrite(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    make_package(synth_dir.llama, pkg)
    with pytest.raises(OutputExists):
        make_package(synth_dir.llama, pkg)
    make_package(synth_dir.llama, pkg, overwrite=True)
    assert validate_package(synth_dir.llama, pkg).valid


def test_overwrite_with_fewer_layers_removes_stale_artifacts(synth_dir, tmp_path):
    import synth_gguf

    pkg = tmp_path / "pkg"
    make_package(synth_dir.llama, pkg)  # 4 layers
    small = synth_gguf.llama_like(tmp_path / "small.gguf", n_layers=2)
    result = make_package(small, pkg, overwrite=True)
    assert set(result.removed_stale) == {layer_path(2), layer_path(3)}
    assert not (pkg / layer_path(3)).exists()
    assert validate_package(small, pkg).valid


def test_manifest_is_canonical_apart_from_timestamp(synth_dir, tmp_path):
    a = make_package(synth_dir.llama, tmp_path / "a", created_at_unix_secs=1)
    make_package(synth_dir.llama, tmp_path / "b", created_at_unix_secs=1)
    raw_a = (tmp_path / "a" / MANIFEST_NAME).read_bytes()
    assert raw_a == (tmp_path / "b" / MANIFEST_NAME).read_bytes()
    assert a.manifest_sha256 == hashlib.sha256(raw_a).hexdigest()
    assert json.loads(raw_a) == json.loads(json.dumps(json.loads(raw_a), sort_keys=True))
    assert parse_manifest(raw_a) == a.manifest


def test_killed_write_leaves_no_manifest_and_no_visible_partials(synth_dir, tmp_path):
    """A real failure mid-way (a folder squats on one fragment's name, so its atomic rename
    fails) leaves no manifest pointing at missing files and no partial file behind."""
    pkg = tmp_path / "pkg"
    (pkg / layer_path(2)).mkdir(parents=True)
    with pytest.raises(IsADirectoryError):
        make_package(synth_dir.llama, pkg, workers=1, overwrite=True)
    assert not (pkg / MANIFEST_NAME).exists()
    assert not [p for p in pkg.rglob("*") if p.name.endswith(".partial")]


def test_killed_write_is_a_clean_cli_error(synth_dir, tmp_path, capsys):
    pkg = tmp_path / "pkg"
    (pkg / layer_path(2)).mkdir(parents=True)
    rc = main(
        [
            "write-package",
            str(synth_dir.llama),
            "--out-dir",
            str(pkg),
            "--model-id",
            "acme/tiny-GGUF:Q8_0",
            "--source-revision",
            "r",
            "--source-file",
            synth_dir.llama.name,
            "--overwrite",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error [") and "Traceback" not in err
    assert not (pkg / MANIFEST_NAME).exists()


def test_projector_is_copied_and_never_counted_as_layer_tensors(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    m = make_package(synth_dir.llama, pkg, projectors=(synth_dir.projector,)).manifest
    (proj,) = m.projectors
    assert proj.kind == "mmproj"
    assert proj.path == f"projectors/{synth_dir.projector.name}"
    assert (pkg / proj.path).read_bytes() == synth_dir.projector.read_bytes()
    assert proj.sha256 == hashlib.sha256(synth_dir.projector.read_bytes()).hexdigest()
    report = validate_package(synth_dir.llama, pkg)
    assert report.valid, report.findings


def test_projector_must_be_a_gguf(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    make_package(synth_dir.llama, pkg)
    before = (pkg / MANIFEST_NAME).read_bytes()
    bogus = tmp_path / "mmproj.gguf"
    bogus.write_bytes(b"not a gguf at all, just text" * 4)
    with pytest.raises(GGUFFormatError) as exc:
        make_package(synth_dir.llama, pkg, projectors=(bogus,), overwrite=True)
    assert exc.value.code == "gguf_bad_magic"
    # Refused before anything in the folder changed: the previous package is still whole.
    assert (pkg / MANIFEST_NAME).read_bytes() == before
    assert validate_package(synth_dir.llama, pkg).valid


def test_block_count_disagreeing_with_tensors_is_refused(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "odd.gguf", "llama")
    writer.add_block_count(3)
    writer.add_embedding_length(32)
    import numpy as np

    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError) as exc:
        make_package(tmp_path / "odd.gguf", tmp_path / "pkg")
    assert exc.value.code == "layer_count_mismatch"


@pytest.mark.slow
def test_gemma3_round_trip(gemma_gguf, gemma_package):
    # tests/conftest.py wrote it (make_package, once per session): what it wrote is checked
    pkg = gemma_package
    m = parse_manifest((pkg / MANIFEST_NAME).read_bytes())
    assert m.layer_count == 18 and m.activation_width == 640 and m.tied_embeddings
    assert len(list(m.artifacts())) == 21
    assert m.source_model.sha256 == (
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    )
    with open_gguf(gemma_gguf) as src:
        source_tensor_bytes = sum(t.nbytes for t in src)
        assert sum(a.artifact.tensor_bytes for a in m.artifacts()) == source_tensor_bytes
        assert sum(a.artifact.tensor_count for a in m.artifacts()) == len(src.tensors)
    assert sum((pkg / a.path).stat().st_size for a in m.artifacts()) == m.total_artifact_bytes()
    report = validate_package(gemma_gguf, pkg)
    assert report.valid, report.findings
    assert report.tensors_checked == 236


def test_nextn_evidence_yields_an_mtp_strategy(synth_dir, tmp_path):
    m = make_package(synth_dir.nextn, tmp_path / "pkg").manifest
    assert m.generation is not None
    spec = m.generation["speculative_decoding"]
    assert spec["default"] == "mtp"
    assert spec["proposers"]["mtp"] == {
        "type": "native-mtp",
        "prediction_depth": 1,
        "layer_indices": [m.layer_count - 1],
    }
    readme = (tmp_path / "pkg" / "README.md").read_text()
    assert '"native-mtp"' in readme  # generation defaults are listed in the package README


def test_no_evidence_no_generation_block(synth_dir, tmp_path):
    make_package(synth_dir.llama, tmp_path / "pkg")
    assert "generation" not in json.loads((tmp_path / "pkg" / MANIFEST_NAME).read_text())
