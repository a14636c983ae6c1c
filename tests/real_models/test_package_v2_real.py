"""The "Done when" on the real gemma3-270m: a v2 package verifies source-complete, runs
through the ggml stage runtime (three chained stages) and through llama.cpp (composed from its
parts) with output identical to the v1 package's, and ``mesh-node lab --nodes 3`` serves it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from skippy.cli import main
from skippy.produce.write_package import local_provenance
from skippy.produce.write_package_v2 import WriteOptionsV2, write_package_v2

pytestmark = pytest.mark.slow

MODEL_ID = "google/gemma-3-270m-GGUF:Q4_K_M"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma_pair(gemma_gguf, gemma_package, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gemma-v1-v2")
    v1, v2 = gemma_package, root / "gemma-v2"  # v1: tests/conftest.py, once per session
    prov = local_provenance(
        model_id=MODEL_ID, source_repo=None, source_revision="0123abc", source_file=gemma_gguf.name
    )
    write_package_v2(gemma_gguf, WriteOptionsV2(out_dir=v2, provenance=prov))
    return v1, v2


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["run", *args, "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_v2_verifies_source_complete(gemma_gguf, gemma_pair, capsys):
    v2 = gemma_pair[1]
    assert main(["verify-package-v2", str(v2), "--source", str(gemma_gguf)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source_completeness_verified"] is True
    assert report["checked_tensors"] == 236 and report["checked_source_files"] == 1


def test_v2_inspect_says_what_v1_says_of_gemma3(gemma_pair, capsys):
    """Width and tied embeddings live in v2's carrier, not its root: inspect reads them."""
    docs = []
    for pkg in gemma_pair:
        assert main(["inspect", str(pkg), "--json"]) == 0
        docs.append(json.loads(capsys.readouterr().out))
    v1, v2 = docs
    assert (v2["activation_width"], v2["tied_embeddings"]) == (640, True)
    assert (v1["activation_width"], v1["tied_embeddings"]) == (640, True)
    assert [e["layer_index"] for e in v2["layers"]] == list(range(18))
    assert sum(e["tensor_count"] for e in v2["layers"]) == sum(
        e["tensor_count"] for e in v1["layers"]
    )


@pytest.mark.parametrize(
    "engine_args", [("--stages", "3", "--engine", "ggml"), ("--engine", "llama")]
)
def test_v2_runs_with_output_identical_to_v1(gemma_pair, capsys, engine_args):
    v1, v2 = gemma_pair
    common = ("--prompt", PROMPT, "--max-tokens", "12", *engine_args)
    a = run_json(capsys, str(v1), *common)
    b = run_json(capsys, str(v2), *common)
    assert b["tokens"] == a["tokens"] and b["completion"] == a["completion"]
    assert len(a["tokens"]) == 12


def test_lab_three_nodes_on_a_v2_package(gemma_pair):
    v2 = gemma_pair[1]
    proc = subprocess.run(
        [sys.executable, "-m", "mesh_node", "lab", "--nodes", "3", "--package", str(v2), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"], report.get("problems")
    workers = [n for n in report["nodes"] if n["role"] == "worker"]
    assert len(workers) == 2
    for w in workers:
        assert w["state"] == "ready" and w["report"] == "accepted" and w["exact"]
        assert w["artifacts"] and all(
            a["source"] == "peer" and a["verified"] for a in w["artifacts"]
        )
    assert report["totals"]["hub_bytes"] == 0
