"""`policy`: the phase resolver's decision record through the CLI."""

from __future__ import annotations

import json
import logging

import pytest
from pkgtools import edit_manifest, make_package
from spec_examples import GLM_DSA_V1_GENERATION

from mesh_node.lab.hub_server import running_hub
from skippy.cli import main
from skippy.constants import MANIFEST_NAME

ALL = "dense,direct-sparse,compact-flash,sparse-chunked"


@pytest.fixture
def pkg(synth_dir, tmp_path):
    out = tmp_path / "pkg"
    make_package(synth_dir.llama, out)
    edit_manifest(out, lambda d: d.update(generation=GLM_DSA_V1_GENERATION))
    return out


def decide(capsys, *args: str) -> dict:
    assert main(["policy", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def decode(capsys, pkg, *extra: str) -> dict:
    """One decode step (1 token) over 4096 visible KV rows."""
    return decide(
        capsys, str(pkg), "--phase", "decode", "--n-tokens", "1", "--n-kv", "4096", *extra
    )


def test_package_path_is_used_when_the_backend_runs_it(pkg, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="skippy.generation"):
        d = decode(capsys, pkg, "--paths", ALL)
    assert (d["selected_path"], d["selected_source"]) == ("compact-flash", "package")
    assert d["package_recommendation_used"] is True
    assert not caplog.records  # the line is logged only when the package path is not used


def test_prefill_is_classified_by_the_package_threshold(pkg, capsys):
    short = decide(
        capsys,
        str(pkg),
        "--phase",
        "prefill",
        "--n-tokens",
        "2048",
        "--n-kv",
        "2048",
        "--paths",
        ALL,
    )
    long = decide(
        capsys,
        str(pkg),
        "--phase",
        "prefill",
        "--n-tokens",
        "2049",
        "--n-kv",
        "131072",
        "--paths",
        ALL,
    )
    assert (short["phase"], short["selected_path"]) == ("short_prefill", "dense")
    assert (long["phase"], long["selected_path"]) == ("long_prefill", "sparse-chunked")
    assert long["dense_mask_bytes"] == 2049 * 131072 * 4


def test_unsupported_package_path_falls_back_and_logs_why(pkg, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="skippy.generation"):
        d = decode(capsys, pkg)
    assert d["selected_path"] == "dense"  # the default backend runs dense only
    assert d["package_path"] == "compact-flash" and d["package_path_status"] == "rejected"
    assert d["fallback_reason"]
    assert len(caplog.records) == 1
    assert "compact-flash" in caplog.records[0].getMessage()


def test_override_wins_and_is_recorded(pkg, capsys):
    d = decode(capsys, pkg, "--paths", ALL, "--override", "decode=direct-sparse")
    assert (d["selected_path"], d["selected_source"]) == ("direct-sparse", "override")
    assert d["package_path_status"] == "overridden"


def test_bad_override_is_a_usage_error(pkg, capsys):
    rc = main(
        [
            "policy",
            str(pkg),
            "--phase",
            "decode",
            "--n-tokens",
            "1",
            "--n-kv",
            "1",
            "--override",
            "nonsense",
            "--json",
        ]
    )
    assert rc == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "usage"


def test_runtime_default_is_for_the_package_architecture(pkg, capsys):
    """The architecture is general.architecture from shared/metadata.gguf, not the model id."""
    d = decide(capsys, str(pkg), "--phase", "decode", "--n-tokens", "1", "--n-kv", "8")
    assert d["arch"] == "llama"
    assert main(["policy", str(pkg), "--phase", "decode", "--n-tokens", "1", "--n-kv", "8"]) == 0
    assert "runtime default for llama" in capsys.readouterr().out


def test_hub_package_architecture_is_unknown_without_downloading(pkg, capsys, monkeypatch):
    repo = "acme/policy-layers"
    with running_hub({repo: pkg}) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        d = decide(capsys, f"hf://{repo}", "--phase", "decode", "--n-tokens", "1", "--n-kv", "8")
        assert h.stats(repo, "shared/metadata.gguf").get_requests == 0
        assert h.downloaded_paths(repo) == {MANIFEST_NAME}
        assert d["arch"] == "unknown"
        # once the metadata is in the hub cache (a fetched stage), it is read from there
        assert main(["fetch", f"hf://{repo}", "--layers", "0..1", "--json"]) == 0
        capsys.readouterr()
        pinned = f"hf://{repo}@{h.commit_of(repo)}"
        d = decide(capsys, pinned, "--phase", "decode", "--n-tokens", "1", "--n-kv", "8")
        assert d["arch"] == "llama"


def test_an_unrecognised_default_strategy_does_not_stop_policy(pkg, capsys):
    """Speculation is not this request: an unknown default strategy type is ignored here
    (spec "Speculative Decoding": ignore it unless serving a request with that default)."""
    edit_manifest(
        pkg,
        lambda d: d["generation"].update(
            speculative_decoding={"default": "eagle", "strategies": {"eagle": {"type": "eagle3"}}}
        ),
    )
    d = decide(capsys, str(pkg), "--phase", "decode", "--n-tokens", "1", "--n-kv", "4096")
    assert d["profile"] == "glm-dsa-v1" and d["selected_path"] == "dense"
