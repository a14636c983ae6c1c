"""A MoE model split across a mesh and served: `mesh-node lab --nodes 3 --serve` over the
synthetic qwen3moe package (the canary's Q8_0 model, written by `write-package`) answers the
official `openai` client with llama.cpp's greedy continuation of the original GGUF.

The synthetic vocabulary has no real text, so the prompt is token ids (`/v1/completions`
accepts a list of ids); the answer's text is compared with llama.cpp's greedy tokens
detokenized by the package's own vocabulary.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
pytest.importorskip("openai", reason="the openai client is a dev dependency")

import openai

from skippy.runtime.canary import check, synth
from skippy.runtime.tokenizer import LlamaTokenizer

pytestmark = pytest.mark.llama

N_TOKENS = 16
PROMPT = synth.long_prompt(40)


def test_openai_client_gets_llama_cpps_greedy_text_from_a_3_node_qwen3moe_split(
    tmp_path: Path,
) -> None:
    spec = synth.family("qwen3moe")
    model, pkg = check.package_model(spec, "Q8_0", tmp_path / "models")
    with LlamaTokenizer(pkg / "shared" / "metadata.gguf") as tok:
        greedy = check.oracle_greedy(model, PROMPT, N_TOKENS, n_batch=len(PROMPT))
        # the server stops at an end-of-generation token; llama.cpp's list does not
        ends = [i for i, t in enumerate(greedy) if tok.is_eog(t)]
        want_tokens = greedy[: ends[0]] if ends else greedy
        want = tok.detokenize(want_tokens)
    assert len(want_tokens) >= 4 and want  # a real continuation, not an immediate stop
    lab = subprocess.Popen(
        [sys.executable, "-m", "mesh_node", "lab", "--nodes", "3", "--package", str(pkg),
         "--serve", "--json", "--timeout", "300", "--dir", str(tmp_path / "lab")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )  # fmt: skip
    api = ""
    try:
        assert lab.stderr is not None
        for line in lab.stderr:  # under --json the addresses come on stderr
            key, _, value = line.strip().partition(" ")
            if key == "api":
                api = value
                break
        assert api.startswith("http://127.0.0.1:"), "the lab never printed its API address"
        client = openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=120)
        done = client.completions.create(
            model="canary/qwen3moe-GGUF:Q8_0", prompt=PROMPT, max_tokens=N_TOKENS, temperature=0
        )
        assert done.choices[0].text == want
        assert done.usage is not None and done.usage.prompt_tokens == len(PROMPT)
        assert done.usage.completion_tokens == len(want_tokens)
    finally:
        lab.send_signal(signal.SIGINT)
        out, _ = lab.communicate(timeout=60)
    assert lab.returncode == 130
    report = json.loads(out)
    assert report["ok"] and report["api"] == api
    # three nodes, each running its own stage of the 4 layers: a real split
    ranges = sorted((n["layer_start"], n["layer_end"]) for n in report["nodes"])
    assert len(ranges) == 3 and ranges[0][0] == 0 and ranges[-1][1] == 4
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
