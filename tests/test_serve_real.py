"""Split serving of the real models with real processes (the issue's "done when" checks).

- gemma3-270m as a 3-node split (`mesh-node serve` + two `mesh-node run` workers)
  greedy-continues "The capital of France is" exactly as the same runtime as one stage does,
  token for token (the reference runs in this process: skippy.runtime, ggml, one stage).
- SmolLM2-135M-Instruct (it has a chat template): the official openai client streams a chat
  completion from the split; the streamed text equals the non-streamed one and the single
  stage's greedy continuation of the same templated prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
pytest.importorskip("openai", reason="the openai client is a dev dependency")

import openai
from pkgtools import make_package
from servetools import split_cluster, wait_ready
from stagetools import chain

from skippy.runtime.tokenizer import LlamaTokenizer
from skippy.serving.chat import ChatTemplate

pytestmark = [pytest.mark.llama, pytest.mark.slow]

PROMPT = "The capital of France is"


def _single_stage(pkg: Path, layers: int, ids: list[int], n: int) -> str:
    with chain("ggml", pkg, [f"0..{layers}"]) as ch:
        ch.tokenizer = LlamaTokenizer(pkg / "shared" / "metadata.gguf")
        return ch.generate(ids, max_tokens=n).text


def test_gemma_three_node_split_equals_the_single_stage_run(
    gemma_gguf: Path, tmp_path: Path
) -> None:
    pkg = tmp_path / "gemma"
    make_package(gemma_gguf, pkg, model_id="google/gemma-3-270m-GGUF:Q4_K_M")
    with LlamaTokenizer(pkg / "shared" / "metadata.gguf") as tok:
        ids = tok.tokenize(PROMPT)
    want = _single_stage(pkg, 18, ids, 16)
    with split_cluster(tmp_path, pkg, workers=2, stages=3, budget="4GiB") as cluster:
        wait_ready(cluster.api)
        client = openai.OpenAI(base_url=cluster.api, api_key="unused", max_retries=0)
        got = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=16, temperature=0
        )
        assert got.choices[0].text == want
        assert got.usage is not None and got.usage.prompt_tokens == len(ids)
        stages = cluster.status()["topology"]["stages"]
        assert len(stages) == 3 and stages[0]["layer_start"] == 0
        # a base model has no chat template: a clear 400, not a guess
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}]
            )
        assert err.value.body["code"] == "chat_template_missing"


def test_openai_client_streams_a_chat_completion_from_the_split(
    smollm_gguf: Path, tmp_path: Path
) -> None:
    pkg = tmp_path / "smol"
    make_package(smollm_gguf, pkg, model_id="HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    template = ChatTemplate.from_metadata(pkg / "shared" / "metadata.gguf")
    assert template is not None
    with LlamaTokenizer(pkg / "shared" / "metadata.gguf") as tok:
        ids = tok.tokenize(template.render(messages), add_special=False, parse_special=True)
    want = _single_stage(pkg, 30, ids, 24)
    with split_cluster(tmp_path, pkg, workers=2, stages=3, budget="4GiB") as cluster:
        wait_ready(cluster.api)
        client = openai.OpenAI(base_url=cluster.api, api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=24, temperature=0, stream=True
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
        whole = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=24, temperature=0
        )
        # (this 135M model answers "L'Étoile, la Marseillaise, ..."; llama.cpp's own chat
        # completion of the same messages starts the same way)
        assert whole.choices[0].message.content == text == want
