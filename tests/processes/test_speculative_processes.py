"""Speculative decoding chosen at serve time, with real processes on loopback.

- `mesh-node serve --speculative ngram-suffix` on a package that declares no speculation: the
  official openai client gets exactly the plain split's greedy and seeded completions, and
  drafted tokens were accepted (the coordinator's status counts them).
- `mesh-node lab --prompt ... --speculative ngram-suffix --json`: the report names the resolved
  strategy and its acceptance (drafted, accepted, rate) and the text is the single stage's
  greedy continuation.
- An unknown strategy is a coded usage error (exit 2) from `serve` and from `lab`, whose check
  runs before any node starts.

The synthetic model's vocabulary encodes almost no text
(tests/skippy/runtime/test_prompt_guard.py) but "a"
and "Ω" words; the prompt is one of those whose greedy continuation on this (seeded) model falls
into a loop within 40 tokens, so N-gram drafts get accepted.
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
from servetools import node_toml, served_completions
from stagetools import chain

from mesh_node.lab.report import render_report
from skippy.runtime.tokenizer import LlamaTokenizer

pytestmark = pytest.mark.llama

MESH = [sys.executable, "-m", "mesh_node"]
PROMPT = "a Ω a a Ω"
N = 40


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A package whose manifest declares no speculative decoding at all."""
    root = tmp_path_factory.mktemp("spec_tiny")
    src = synth_gguf.llama_like(root / "llama.gguf", n_layers=6)
    make_package(src, root / "pkg", model_id="acme/tiny-GGUF:Q8_0")
    manifest = json.loads((root / "pkg" / "model-package.json").read_text())
    assert "speculative_decoding" not in (manifest.get("generation") or {})
    return root / "pkg"


def _completions(root: Path, pkg: Path, serve_args: tuple[str, ...]) -> dict[str, Any]:
    return served_completions(
        root, pkg, prompt=PROMPT, max_tokens=N, workers=1, stages=2, serve_args=serve_args
    )


def test_serve_time_ngram_speculation_gives_the_plain_splits_completions(
    tiny_pkg: Path, tmp_path: Path
) -> None:
    plain = _completions(tmp_path / "plain", tiny_pkg, ())
    spec = _completions(tmp_path / "spec", tiny_pkg, ("--speculative", "ngram-suffix"))
    assert plain["serving"]["speculative_strategy"] is None
    assert spec["serving"]["speculative_strategy"] == "ngram-suffix"
    assert (spec["greedy"], spec["seeded"]) == (plain["greedy"], plain["seeded"])
    counters = spec["serving"]["speculative"]
    assert counters["verify_passes"] > 0 and 0 < counters["accepted"] <= counters["proposed"]
    assert plain["serving"]["speculative"]["proposed"] == 0


def _lab(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [*MESH, "lab", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out


def test_the_lab_serves_with_a_strategy_and_reports_its_acceptance(
    tiny_pkg: Path, tmp_path: Path
) -> None:
    out = _lab(
        "--nodes", "2", "--package", str(tiny_pkg), "--prompt", PROMPT, "--max-tokens", str(N),
        "--speculative", "ngram-suffix", "--timeout", "120", "--dir", str(tmp_path / "lab"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"], report["problems"]
    with LlamaTokenizer(tiny_pkg / "shared" / "metadata.gguf") as tok:
        ids = tok.tokenize(PROMPT)
    with chain("ggml", tiny_pkg, ["0..6"]) as ch:
        ch.tokenizer = LlamaTokenizer(tiny_pkg / "shared" / "metadata.gguf")
        want = ch.generate(ids, max_tokens=N).text
    assert report["prompt"]["text"] == want  # the plain single stage's greedy text
    sp = report["speculative"]
    assert (sp["requested"], sp["source"], sp["strategy"], sp["mode"], sp["executed"]) == (
        "ngram-suffix", "cli", "ngram-suffix", "ngram-suffix", True,
    )  # fmt: skip
    ngram = sp["ngram"]
    assert (ngram["ngram_min"], ngram["ngram_max"], ngram["max_proposal_tokens"]) == (3, 16, 8)
    assert sp["window"]["default"] == "adaptive" and sp["window"]["max_window"] == 8
    drafted, accepted = sp["drafted"], sp["accepted"]
    assert 0 < accepted <= drafted and sp["verify_windows"] > 0
    assert sp["acceptance"] == round(accepted / drafted, 4)
    assert any("declares no ngram-suffix strategy" in n for n in sp["notes"])
    text = render_report(report)  # what the lab prints without --json
    assert (
        "speculative: ngram-suffix (cli: ngram-suffix; n-gram 3..16, up to 8 drafts, adaptive "
        f"window 4 (1..8)): {accepted} of {drafted} drafted tokens accepted" in text
    )


def test_an_unknown_strategy_is_a_coded_usage_error(tiny_pkg: Path, tmp_path: Path) -> None:
    for args, code, says in (
        (["--prompt", "Ω", "--speculative", "ngram"], "undeclared_speculative_strategy",
         "ngram-suffix"),
        (["--serve", "--speculative-strategy", "eagle"], "undeclared_speculative_strategy",
         "declared: none"),
        (["--speculative", "ngram-suffix"], "usage", "needs --prompt or --serve"),
        (["--prompt", "Ω", "--speculative", " "], "invalid_speculative_config", "non-empty"),
    ):  # fmt: skip
        out = _lab("--nodes", "2", "--package", str(tiny_pkg), *args, timeout=120)
        error = json.loads(out.stdout)["error"]
        assert (out.returncode, error["code"]) == (2, code), out.stdout
        assert says in error["message"] + (error.get("remediation") or "")
    cfg = tmp_path / "coord.toml"
    cfg.write_text(node_toml(tmp_path, "coord"))
    out = subprocess.run(
        [*MESH, "serve", "--config", str(cfg), "--package", str(tiny_pkg), "--http",
         "127.0.0.1:0", "--speculative", "ngram", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert json.loads(out.stdout)["error"]["code"] == "undeclared_speculative_strategy"
    assert "Traceback" not in out.stderr
