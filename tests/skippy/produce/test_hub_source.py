"""write-package from a hub coordinate ORG/REPO:DIST (real huggingface_hub, fake hub)."""

from __future__ import annotations

import json
import shutil

import pytest
from hubfaults import running_hub

from skippy.cli import main
from skippy.errors import UsageError
from skippy.produce.hub_source import choose_distribution_files, parse_model_coordinate
from skippy.produce.validate import validate_package


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("google/gemma-3-270m-GGUF:Q4_K_M", ("google/gemma-3-270m-GGUF", "Q4_K_M")),
        ("a/b:UD-Q4_K_XL", ("a/b", "UD-Q4_K_XL")),
        ("./model.gguf", None),
        ("a/b", None),
        ("hf://a/b:c", None),
    ],
)
def test_parse_model_coordinate(text, expected):
    assert parse_model_coordinate(text) == expected


SPLIT = [f"UD-Q4_K_XL/Big-UD-Q4_K_XL-{k:05d}-of-00003.gguf" for k in (3, 1, 2)]


@pytest.mark.parametrize(
    ("files", "dist", "chosen"),
    [
        (["m-Q8_0.gguf", "m-Q4_K_M.gguf", "README.md"], "Q4_K_M", ["m-Q4_K_M.gguf"]),
        (["m-q4_k_m.gguf"], "Q4_K_M", ["m-q4_k_m.gguf"]),  # case-insensitive
        (["mmproj-Q8_0.gguf", "m-Q8_0.gguf"], "Q8_0", ["m-Q8_0.gguf"]),  # projectors never
        ([*SPLIT, "other/Big-Q8_0.gguf"], "UD-Q4_K_XL", sorted(SPLIT)),  # shards in order
        (
            ["Q4_0/model-00001-of-00002.gguf", "Q4_0/model-00002-of-00002.gguf"],
            "Q4_0",
            ["Q4_0/model-00001-of-00002.gguf", "Q4_0/model-00002-of-00002.gguf"],
        ),
    ],
)
def test_choose_distribution_files(files, dist, chosen):
    assert choose_distribution_files(files, dist) == chosen


@pytest.mark.parametrize(
    ("files", "dist", "code"),
    [
        (["m-Q8_0.gguf"], "Q4_K_M", "distribution_not_found"),
        (["a-Q8_0.gguf", "b-Q8_0.gguf"], "Q8_0", "ambiguous_distribution"),
        (
            ["m-Q8_0-00001-of-00003.gguf", "m-Q8_0-00003-of-00003.gguf"],
            "Q8_0",
            "missing_split_shard",
        ),
        (["m-Q8_0.gguf", "m-Q8_0-00001-of-00001.gguf"], "Q8_0", "missing_split_shard"),
        (["xQ8_0.gguf"], "Q8_0", "distribution_not_found"),  # needs a separator
        (["m-Q4_K_M.gguf", "m-Q8_0.gguf"], "K_M", "distribution_not_found"),  # "_" is no separator
        (["m-Q4_K_M.gguf", "m-Q8_0.gguf"], "0", "distribution_not_found"),
    ],
)
def test_choose_distribution_files_errors(files, dist, code):
    with pytest.raises(UsageError) as exc:
        choose_distribution_files(files, dist)
    assert exc.value.code == code


def test_write_package_from_a_hub_coordinate(synth_dir, tmp_path, monkeypatch, capsys):
    repo_dir = tmp_path / "repo"
    repo_dir.mkdir()
    shutil.copy(synth_dir.llama, repo_dir / "tiny-Q8_0.gguf")
    for p in synth_dir.split:  # a split set of another distribution in the same repo
        shutil.copy(p, repo_dir / p.name.replace("llama-", "tiny-SPLIT-"))
    shutil.copy(synth_dir.projector, repo_dir / "mmproj-tiny-Q8_0.gguf")
    with running_hub({"acme/tiny-GGUF": repo_dir}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        commit = hub.commit_of("acme/tiny-GGUF")
        out = tmp_path / "pkg"
        rc = main(["write-package", "acme/tiny-GGUF:Q8_0", "--out-dir", str(out), "--json"])
        assert rc == 0, capsys.readouterr()
        assert hub.downloaded_paths("acme/tiny-GGUF") == {"tiny-Q8_0.gguf"}
        capsys.readouterr()
        out2 = tmp_path / "pkg2"
        rc = main(
            [
                "write-package",
                "acme/tiny-GGUF:SPLIT",
                "--out-dir",
                str(out2),
                "--source-revision",
                commit,
                "--json",
            ]
        )
        assert rc == 0, capsys.readouterr()
        rc = main(
            ["write-package", "acme/tiny-GGUF:Q2_K", "--out-dir", str(tmp_path / "x"), "--json"]
        )
        assert rc == 2
        assert "distribution_not_found" in capsys.readouterr().out
        rc = main(
            [
                "write-package",
                "acme/tiny-GGUF:Q8_0",
                "--out-dir",
                str(tmp_path / "y"),
                "--source-file",
                "x.gguf",
                "--json",
            ]
        )
        assert rc == 2
    src = json.loads((out / "model-package.json").read_text())["source_model"]
    assert src["repo"] == "acme/tiny-GGUF" and src["revision"] == commit
    assert src["primary_file"] == "tiny-Q8_0.gguf"
    assert src["canonical_ref"] == "acme/tiny-GGUF:Q8_0"  # spec: the model coordinate
    assert src["distribution_id"] == "Q8_0"
    assert validate_package(synth_dir.llama, out).valid
    split_src = json.loads((out2 / "model-package.json").read_text())["source_model"]
    assert [f["path"] for f in split_src["files"]] == [
        "tiny-SPLIT-00001-of-00002.gguf",
        "tiny-SPLIT-00002-of-00002.gguf",
    ]
    assert split_src["distribution_id"] == "SPLIT"
    assert split_src["canonical_ref"] == "acme/tiny-GGUF:SPLIT"


def test_a_corrupt_source_download_never_becomes_provenance(
    synth_dir, tmp_path, monkeypatch, capsys
):
    import hashlib

    from hubfaults import Fault

    repo_dir = tmp_path / "repo"
    repo_dir.mkdir()
    shutil.copy(synth_dir.llama, repo_dir / "tiny-Q8_0.gguf")
    true_sha = hashlib.sha256(synth_dir.llama.read_bytes()).hexdigest()
    out = tmp_path / "pkg"
    argv = ["write-package", "acme/tiny-GGUF:Q8_0", "--out-dir", str(out), "--json"]
    with running_hub({"acme/tiny-GGUF": repo_dir}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        hub.inject("acme/tiny-GGUF", "tiny-Q8_0.gguf", Fault.FLIP_BYTE)
        assert main(argv) == 1
        assert json.loads(capsys.readouterr().out)["error"]["code"] == "artifact_sha256_mismatch"
        assert not (out / "model-package.json").exists()
        hub.clear_faults()
        assert main(argv) == 0  # the corrupt blob was evicted: this run downloads it again
    assert (
        json.loads((out / "model-package.json").read_text())["source_model"]["sha256"] == true_sha
    )
