"""Split serving of the real models with real processes (the issue's "done when" checks).

- `mesh-node lab --nodes 3 --package <gemma3-270m> --prompt "The capital of France is"
  --max-tokens 16 --json` prints exactly the text of the same runtime as one stage, token for
  token (the reference runs in this process: skippy.runtime, ggml, one stage).
- A 232-token SmolLM2 prompt, prefilled in 128-row chunks through a 3-node split, prints the
  same text as `run` and llama.cpp.
- SmolLM2-135M-Instruct (it has a chat template) under `mesh-node lab --serve`: the official
  openai client streams a chat completion from the split; the streamed text equals the
  non-streamed one and the single stage's greedy continuation of the same templated prompt.
The lab publishes the package on its hub; workers fetch their stages from the coordinator.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
pytest.importorskip("openai", reason="the openai client is a dev dependency")

import itertools

import openai
from stagetools import SMOL_LONG_GREEDY_16, SMOL_LONG_PROMPT, chain

from skippy.runtime.sampling import SamplingParams
from skippy.runtime.stage import StageConfig
from skippy.runtime.tokenizer import LlamaTokenizer
from skippy.serving.chat import ChatTemplate

pytestmark = [pytest.mark.llama, pytest.mark.slow]

PROMPT = "The capital of France is"


def _single_stage(
    pkg: Path, layers: int, ids: list[int], n: int, sampling: SamplingParams | None = None
) -> str:
    with chain("ggml", pkg, [f"0..{layers}"], StageConfig(n_ctx=512, n_threads=1)) as ch:
        ch.tokenizer = LlamaTokenizer(pkg / "shared" / "metadata.gguf")
        return ch.generate(ids, max_tokens=n, sampling=sampling).text


def test_lab_prompt_on_a_gemma_split_equals_the_single_stage_run(gemma_package: Path) -> None:
    """`mesh-node lab --nodes 3 --package <gemma3> --prompt ... --max-tokens 16 --json`."""
    pkg = gemma_package
    with LlamaTokenizer(pkg / "shared" / "metadata.gguf") as tok:
        ids = tok.tokenize(PROMPT)
    want = _single_stage(pkg, 18, ids, 16)
    out = subprocess.run(
        [sys.executable, "-m", "mesh_node", "lab", "--nodes", "3", "--package", str(pkg),
         "--prompt", PROMPT, "--max-tokens", "16", "--json", "--timeout", "300"],
        capture_output=True,
        text=True,
        timeout=400,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"] and report["prompt"]["text"] == want
    nodes = report["prompt"]["nodes"]
    bounds = [(n["layer_start"], n["layer_end"]) for n in nodes]
    assert len(bounds) == 3 and bounds[0][0] == 0 and bounds[-1][1] == 18
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert all(n["artifact_bytes"] > 0 and n["peak_rss_bytes"] > 0 for n in nodes)
    assert report["prompt"]["decode_tokens_per_s"] and report["prompt"]["prefill_tokens_per_s"]


def test_lab_prompt_longer_than_a_prefill_chunk_equals_run_and_llama_cpp(
    smollm_package: Path,
) -> None:
    """A 232-token prompt on a 3-node SmolLM2 split: serving prefills it in 128-row chunks
    through every stage, `run` in one 512-row chunk, llama.cpp in one batch; all three print
    the same greedy text (before: the split and the stage runtime drifted from llama.cpp by
    up to 1.7 logits and continued ". He brought it to the fire, ...")."""
    pkg = smollm_package
    with LlamaTokenizer(pkg / "shared" / "metadata.gguf") as tok:
        ids = tok.tokenize(SMOL_LONG_PROMPT)
    assert len(ids) == 232
    want = _single_stage(pkg, 30, ids, 16)
    assert want == SMOL_LONG_GREEDY_16  # llama.cpp's (tests/real_models/test_stage_real.py runs it)
    out = subprocess.run(
        [sys.executable, "-m", "mesh_node", "lab", "--nodes", "3", "--package", str(pkg),
         "--prompt", SMOL_LONG_PROMPT, "--max-tokens", "16", "--json", "--timeout", "300"],
        capture_output=True,
        text=True,
        timeout=400,
        env=_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"] and report["prompt"]["text"] == want
    assert len(report["prompt"]["nodes"]) == 3


def test_openai_client_streams_a_chat_completion_from_lab_serve(
    smollm_package: Path, tmp_path: Path
) -> None:
    """`mesh-node lab --nodes 3 --package <SmolLM2> --serve`: the official openai client
    streams a chat completion from the split; the streamed text equals the non-streamed one
    and the single stage's greedy continuation of the same templated prompt; Ctrl-C ends the
    lab and its nodes."""
    pkg = smollm_package
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    template = ChatTemplate.from_metadata(pkg / "shared" / "metadata.gguf")
    assert template is not None
    with LlamaTokenizer(pkg / "shared" / "metadata.gguf") as tok:
        ids = tok.tokenize(template.render(messages), add_special=False, parse_special=True)
    want = _single_stage(pkg, 30, ids, 24)
    # penalties sent the way a llama.cpp user sends them (repeat_penalty in extra_body)
    penalties = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repeat_penalty=1.3)
    want_penalized = _single_stage(pkg, 30, ids, 24, penalties)
    assert want_penalized != want
    lab = subprocess.Popen(
        [sys.executable, "-m", "mesh_node", "lab", "--nodes", "3", "--package", str(pkg),
         "--serve", "--json", "--timeout", "300", "--dir", str(tmp_path / "lab")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        # under --json, stdout is the one report at the end; the addresses come on stderr
        assert lab.stderr is not None
        lines = {}
        for line in lab.stderr:
            key, _, value = line.strip().partition(" ")
            lines[key] = value
            if key == "api":
                break
        assert lines["status-page"].startswith("http://127.0.0.1:")
        api = lines["api"]
        assert api == lines["status-page"].rstrip("/") + "/v1"  # one app per node
        model = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"
        client = openai.OpenAI(base_url=api, api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0, stream=True
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
        whole = client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0
        )
        # (this 135M model answers "L'Étoile, la Marseillaise, ..."; llama.cpp's own chat
        # completion of the same messages starts the same way)
        assert whole.choices[0].message.content == text == want
        # what chat clients send at its default is accepted and changes nothing
        neutral = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=24,
            temperature=0,
            n=1,
            logit_bias={},
            tools=[],
            response_format={"type": "text"},
        )
        assert neutral.choices[0].message.content == want
        penalized = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=24,
            temperature=0,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            extra_body={"repeat_penalty": 1.3},
        )
        assert penalized.choices[0].message.content == want_penalized
    finally:
        lab.send_signal(signal.SIGINT)
        out, _ = lab.communicate(timeout=60)
    assert lab.returncode == 130  # Ctrl-C (the report was printed once ready)
    report = json.loads(out)
    assert report["ok"] and report["api"] == api and report["status_page"]
    assert not list((tmp_path / "lab").glob("n*/data/mesh-node.sock"))  # every node stopped


def _env() -> dict[str, str]:
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
