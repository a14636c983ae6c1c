"""Native MTP (``native-mtp``) speculation with real processes on loopback.

The package carries one NextN (multi-token prediction) block after its trunk, and its writer
declared the ``mtp`` strategy (``layer_indices`` naming that block, ``prediction_depth`` 1),
so ``auto`` resolves to it:

- `mesh-node lab --nodes 3 --prompt ...`: the planner keeps the NextN block with the final
  stage; the final stage's head drafts one token per pass, stage 0 verifies each in a verify
  window; the text is the single stage's plain greedy continuation and the report names the
  strategy and its drafts (random weights: rarely accepted).
- `mesh-node serve` over three stages: the official openai client gets exactly the plain
  split's greedy and seeded completions with ``--speculative mtp`` and with ``disabled``.

The model is the canary's synthetic glm4moe (four trunk layers, the first dense, then sigmoid-
routed experts with a shared expert, and one NextN layer; Q8_0) with a vocabulary that encodes
"a" and "Ω" words (``synth_gguf.with_text_vocabulary``; tests/processes/
test_speculative_processes.py); its weights are random, so drafts are rarely accepted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")
pytest.importorskip("openai", reason="the openai client is a dev dependency")

import synth_gguf
from pkgtools import make_package
from servetools import served_completions
from stagetools import chain

from mesh_node.lab.report import render_report
from skippy.runtime.canary import synth
from skippy.runtime.tokenizer import LlamaTokenizer

pytestmark = pytest.mark.llama

MESH = [sys.executable, "-m", "mesh_node"]
PROMPT = "a Ω a a Ω"
N = 24
GLM = synth.family("glm4moe")
LAYERS = GLM.dims().n_layers + 1  # the trunk, then the NextN layer


@pytest.fixture(scope="module")
def mtp_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mtp")
    canary = synth.write_model(GLM, root / "canary.gguf", dtype="Q8_0")
    src = synth_gguf.with_text_vocabulary(canary, root / "glm4moe.gguf")
    make_package(src, root / "pkg", model_id="acme/glm-GGUF:Q8_0")
    manifest = json.loads((root / "pkg" / "model-package.json").read_text())
    sd = manifest["generation"]["speculative_decoding"]
    assert sd["default"] == "mtp" and sd["proposers"]["mtp"]["layer_indices"] == [LAYERS - 1]
    return root / "pkg"


def _plain_greedy(pkg: Path) -> str:
    with LlamaTokenizer(pkg / "shared" / "metadata.gguf") as tok:
        ids = tok.tokenize(PROMPT)
    with chain("ggml", pkg, [f"0..{LAYERS}"]) as ch:
        ch.tokenizer = LlamaTokenizer(pkg / "shared" / "metadata.gguf")
        return ch.generate(ids, max_tokens=N).text


def test_a_three_node_lab_runs_native_mtp_with_the_plain_output(
    mtp_pkg: Path, tmp_path: Path
) -> None:
    out = subprocess.run(
        [*MESH, "lab", "--nodes", "3", "--package", str(mtp_pkg), "--prompt", PROMPT,
         "--max-tokens", str(N), "--timeout", "120", "--dir", str(tmp_path / "lab"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )  # fmt: skip
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"], report["problems"]
    assert report["prompt"]["text"] == _plain_greedy(mtp_pkg)
    stages = [(n["layer_start"], n["layer_end"]) for n in report["prompt"]["nodes"]]
    assert len(stages) == 3 and stages[-1][1] == LAYERS and stages[-1][0] < LAYERS - 1
    sp = report["speculative"]
    assert (sp["requested"], sp["strategy"], sp["mode"], sp["executed"]) == (
        "auto", "mtp", "native-mtp", True,
    )  # fmt: skip
    assert sp["window"]["max_window"] == 1
    # one NextN draft per verify window, every pass but the last drafted
    drafted, accepted = sp["drafted"], sp["accepted"]
    assert drafted > 0 and sp["verify_windows"] == drafted and 0 <= accepted <= drafted
    assert drafted + accepted >= N - 2
    assert f"{accepted} of {drafted} drafted tokens accepted" in render_report(report)


def _completions(root: Path, pkg: Path, strategy: str) -> dict[str, Any]:
    args = ("--speculative", strategy)
    return served_completions(
        root, pkg, prompt=PROMPT, max_tokens=N, workers=2, stages=3, serve_args=args
    )


def test_a_served_three_stage_split_gives_the_plain_completions_with_mtp(
    mtp_pkg: Path, tmp_path: Path
) -> None:
    plain = _completions(tmp_path / "plain", mtp_pkg, "disabled")
    mtp = _completions(tmp_path / "mtp", mtp_pkg, "mtp")
    assert plain["serving"]["speculative_strategy"] is None
    assert mtp["serving"]["speculative_strategy"] == "mtp"
    assert (mtp["greedy"], mtp["seeded"]) == (plain["greedy"], plain["seeded"])
    assert plain["greedy"] == _plain_greedy(mtp_pkg)
    counters = mtp["serving"]["speculative"]
    assert counters["verify_passes"] == counters["proposed"] > 0
    assert plain["serving"]["speculative"]["proposed"] == 0
