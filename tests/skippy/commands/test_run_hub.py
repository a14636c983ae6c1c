"""`run` against a hub: the real huggingface_hub client, our fake hub on 127.0.0.1, and a tiny
synthetic llama model that llama.cpp runs.

A moving reference is resolved once per `run` (one lookup, one warning, and the manifest the
up-front checks read is the one loaded), and a text-only runtime never fetches a projector.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install 'skippy-mesh[llama]')"
)

from pkgtools import make_package

from mesh_node.lab.hub_server import running_hub
from skippy.cli import main
from skippy.constants import MANIFEST_NAME

pytestmark = pytest.mark.llama

REPO = "acme/run-layers"
# The synthetic vocabulary has no byte tokens, and llama.cpp aborts the process on text it cannot
# tokenize; "Ω" becomes the one piece "▁Ω" (dummy prefix + a declared token).
PROMPT = "Ω"


@pytest.fixture(scope="module")
def mm_pkg(synth_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama_like with a declared projector (a multimodal package served text-only)."""
    out = tmp_path_factory.mktemp("run_hub") / "mm"
    make_package(synth_dir.llama, out, projectors=(synth_dir.projector,))
    return out


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    rc = main(["run", *args, "--prompt", PROMPT, "--max-tokens", "2", "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_a_moving_ref_is_resolved_once(mm_pkg, capsys, caplog, monkeypatch):
    with running_hub({REPO: mm_pkg}) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        commit = h.commit_of(REPO)
        with caplog.at_level(logging.WARNING, logger="skippy.consume.hub"):
            rc, out = run_json(capsys, f"hf://{REPO}")
        manifest_gets = h.stats(REPO, MANIFEST_NAME).get_requests
    assert rc == 0, out
    moving = [r for r in caplog.records if "moving reference" in r.getMessage()]
    assert len(moving) == 1
    assert manifest_gets == 1
    # the stage loaded is the commit the up-front checks read
    assert out["package"] == f"hf://{REPO}@{commit}"
    assert out["sha256_verified"] is True and len(out["tokens"]) == 2


def test_a_text_only_run_never_fetches_the_projector(mm_pkg, synth_dir, capsys, monkeypatch):
    """A full-range stage owns the input, so a projector-aware selection would take the first
    mmproj; this runtime cannot load one, so it is neither downloaded nor hashed."""
    proj = f"projectors/{synth_dir.projector.name}"
    with running_hub({REPO: mm_pkg}) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        rc, out = run_json(capsys, f"hf://{REPO}")
        assert rc == 0, out
        assert h.stats(REPO, proj).get_requests == 0
        assert proj not in h.downloaded_paths(REPO)
    assert out["parts"] == 4 + 3  # metadata, embeddings, 4 layers, output
