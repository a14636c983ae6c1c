"""Split serving with real processes on loopback: `mesh-node serve` (stage 0 and the API) and
plain `mesh-node run` workers, driven through the official `openai` client.

The synthetic model's vocabulary cannot encode most text
(tests/skippy/runtime/test_prompt_guard.py), so
prompts here are token ids (``/v1/completions`` accepts them); text and chat are tested on
SmolLM2 and gemma3 in tests/real_models/test_serve_real.py.
"""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")
pytest.importorskip("openai", reason="the openai client is a dev dependency")

import openai
import synth_gguf
from pkgtools import make_package
from servetools import http, split_cluster, wait_ready
from stagetools import chain

from mesh_node.serving.completion_report import prompt_report, render_prompt_report

pytestmark = pytest.mark.llama

IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve_tiny")
    src = synth_gguf.llama_like(root / "llama.gguf", n_layers=6)
    make_package(src, root / "pkg", model_id="acme/tiny-GGUF:Q8_0")
    return root / "pkg"


def _greedy(pkg: Path, ids: list[int], n: int) -> list[int]:
    """The same runtime as one stage, in this process: the reference."""
    with chain("ggml", pkg, ["0..6"]) as ch:
        return list(ch.generate(ids, max_tokens=n).tokens)


def _client(api: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=60)


def test_openai_client_against_a_three_stage_split(tiny_pkg: Path, tmp_path: Path) -> None:
    with split_cluster(tmp_path, tiny_pkg, workers=2, stages=3) as cluster:
        wait_ready(cluster.api)
        client = _client(cluster.api)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        done = client.completions.create(model="tiny", prompt=IDS, max_tokens=12, temperature=0)
        streamed = client.completions.create(
            model="tiny", prompt=IDS, max_tokens=12, temperature=0, stream=True
        )
        pieces = [c.choices[0].text for c in streamed]
        assert done.choices[0].text == "".join(pieces)
        assert done.usage is not None and done.usage.completion_tokens == 12
        # the text is the single-stage runtime's greedy continuation, token for token
        ids = _greedy(tiny_pkg, IDS, 12)
        assert done.choices[0].text == _detok(tiny_pkg, ids)
        # seeded sampling is reproducible through the split
        a, b = (
            client.completions.create(
                model="tiny",
                prompt=IDS,
                max_tokens=8,
                temperature=0.9,
                seed=7,
                extra_body={"top_k": 20},
            ).choices[0].text
            for _ in range(2)
        )
        assert a == b
        # a stop sequence cuts the text before it
        stop = pieces[3].strip()
        cut = client.completions.create(
            model="tiny", prompt=IDS, max_tokens=12, temperature=0, stop=[stop]
        )
        assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
        # bad requests: 4xx with OpenAI's error body
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}]
            )
        assert err.value.body["code"] == "chat_template_missing"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt=IDS, max_tokens=1)
        for body, code in (
            ({"prompt": IDS, "max_tokens": 0}, "invalid_value"),
            ({"prompt": IDS, "n": 2}, "unsupported_parameter"),
            ({"prompt": [10**9]}, "token_out_of_range"),
            ({"prompt": IDS, "max_tokens": 10_000}, "invalid_value"),
        ):
            status, doc = http("POST", f"{cluster.api}/completions", body)
            assert status == 400 and doc["error"]["code"] == code, doc
        status, doc = http("GET", cluster.api.removesuffix("/v1") + "/v1/nothing")
        assert status == 404
        # the coordinator's status document has the serving section
        serving = cluster.status()["serving"]
        assert serving["state"] == "ready" and sum(serving["requests"].values()) >= 5
        # /metrics (the node's one app, beside /v1) counts the requests and tokens
        from prometheus_client.parser import text_string_to_metric_families

        page = cluster.api.removesuffix("/v1")
        with urllib.request.urlopen(f"{page}/metrics", timeout=10) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        ok = [s.value for s in families["mesh_node_requests"].samples
              if s.name.endswith("_total") and s.labels == {"outcome": "ok"}]
        assert ok and ok[0] >= 5
        rejected = [s.value for s in families["mesh_node_requests"].samples
                    if s.name.endswith("_total") and s.labels == {"outcome": "rejected"}]
        assert rejected and rejected[0] >= 1  # the other model's 404 never reached the split
        assert "mesh_node_time_to_first_token_seconds" in families
        # the lab's prompt report: text, speeds, and per node its range, bytes and peak RSS
        statuses = [cluster.status(p.name) for p in cluster.procs]
        report = prompt_report(
            client.completions.create(model="tiny", prompt=IDS, max_tokens=12, temperature=0)
            .model_dump(),
            statuses,
        )
        assert report["text"] == done.choices[0].text
        assert [(n["layer_start"], n["layer_end"]) for n in report["nodes"]] == [
            (s["layer_start"], s["layer_end"]) for s in cluster.status()["topology"]["stages"]
        ]
        assert all(n["artifact_bytes"] > 0 and n["peak_rss_bytes"] > 0 for n in report["nodes"])
        assert report["decode_tokens_per_s"] and "stage 2: layers" in render_prompt_report(report)


def test_the_openai_client_sampling_controls_through_a_split(
    tiny_pkg: Path, tmp_path: Path
) -> None:
    """What llama.cpp, ollama and vLLM users send, through the real `openai` client (the
    non-OpenAI fields in ``extra_body``) to a 3-stage split: penalties, logit bias, top-k,
    min-p and typical-p are honoured (greedy: the in-process chain's tokens with the same
    controls, not plain greedy's; seeded: reproducible, streamed or not); fields at their
    neutral default are accepted; what is not implemented, or unknown, is refused."""
    from skippy.runtime.sampling import SamplingParams

    with split_cluster(tmp_path, tiny_pkg, workers=2, stages=3) as cluster:
        wait_ready(cluster.api)
        client = _client(cluster.api)
        plain = client.completions.create(model="tiny", prompt=IDS, max_tokens=12, temperature=0)
        assert plain.choices[0].text == _detok(tiny_pkg, _greedy(tiny_pkg, IDS, 12))
        greedy = client.completions.create(
            model="tiny",
            prompt=IDS,
            max_tokens=12,
            temperature=0,
            presence_penalty=0.5,
            frequency_penalty=0.25,
            logit_bias={"3": 1.5, "44": -100},
            extra_body={"repeat_penalty": 1.6, "repeat_last_n": 8, "top_k": 30, "min_p": 0.02},
        )
        controls = SamplingParams(
            presence_penalty=0.5,
            frequency_penalty=0.25,
            logit_bias=((3, 1.5), (44, -100.0)),
            repeat_penalty=1.6,
            repeat_last_n=8,
            top_k=30,
            min_p=0.02,
        )
        with chain("ggml", tiny_pkg, ["0..6"]) as ch:
            want = list(ch.generate(IDS, max_tokens=12, sampling=controls).tokens)
        assert greedy.choices[0].text == _detok(tiny_pkg, want) != plain.choices[0].text
        seeded = {
            "model": "tiny",
            "prompt": IDS,
            "max_tokens": 12,
            "temperature": 0.9,
            "top_p": 0.95,
            "seed": 5,
            "frequency_penalty": 0.4,
            "logit_bias": {"9": -100},
            "extra_body": {"typical_p": 0.97, "min_p": 0.02, "repeat_penalty": 1.2},
        }
        a = client.completions.create(**seeded).choices[0].text  # type: ignore[call-overload]
        b = client.completions.create(**seeded).choices[0].text  # type: ignore[call-overload]
        streamed = client.completions.create(**seeded, stream=True)  # type: ignore[call-overload]
        assert a == b == "".join(c.choices[0].text for c in streamed)
        # clients that send the neutral defaults
        neutral = client.completions.create(
            model="tiny",
            prompt=IDS,
            max_tokens=12,
            temperature=0,
            logit_bias={},
            n=1,
            presence_penalty=0,
            extra_body={"response_format": {"type": "text"}, "tools": [], "mirostat": 0},
        )
        assert neutral.choices[0].text == plain.choices[0].text
        for extra, param in (
            ({"mirostat": 2}, "mirostat"),
            ({"response_format": {"type": "json_object"}}, "response_format"),
            ({"frobnicate": True}, "frobnicate"),
        ):
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(
                    model="tiny", prompt=IDS, max_tokens=2, extra_body=extra
                )
            assert err.value.body["code"] == "unsupported_parameter"
            assert err.value.body["param"] == param
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(
                model="tiny", prompt=IDS, max_tokens=2, logit_bias={"1000000": 1}
            )
        assert err.value.body["code"] == "token_out_of_range"


def test_a_killed_stage_is_replaced_and_the_generation_continues(
    tiny_pkg: Path, tmp_path: Path
) -> None:
    """SIGKILL a stage node mid-generation: a spare peer takes its layers, the request's
    committed tokens are replayed, and the greedy output equals the undisturbed run's. Then,
    with no spare left, losing another stage gives the client a clear error, not a hang."""
    n = 200
    with split_cluster(tmp_path, tiny_pkg, workers=2, stages=3, spares=1) as cluster:
        wait_ready(cluster.api)
        client = _client(cluster.api)
        undisturbed = client.completions.create(
            model="tiny", prompt=IDS, max_tokens=n, temperature=0
        ).choices[0].text
        topo = cluster.status()["topology"]
        victim = cluster.proc_of(topo["stages"][1]["node_id"])
        stream = client.completions.create(
            model="tiny", prompt=IDS, max_tokens=n, temperature=0, stream=True
        )
        pieces = []
        for chunk in stream:
            pieces.append(chunk.choices[0].text)
            if len(pieces) == 2:
                os.kill(victim.popen.pid, signal.SIGKILL)
        assert "".join(pieces) == undisturbed
        status = cluster.status()
        assert status["serving"]["failovers_total"] >= 1
        new_topo = status["topology"]
        assert new_topo["topology_id"] != topo["topology_id"]
        assert new_topo["stages"][1]["node_id"] != topo["stages"][1]["node_id"]
        assert [s["node_id"] for i, s in enumerate(new_topo["stages"]) if i != 1] == [
            s["node_id"] for i, s in enumerate(topo["stages"]) if i != 1
        ]

        # no capable peer left: a clear error to the client, not a hang
        victim2 = cluster.proc_of(new_topo["stages"][2]["node_id"])
        stream = client.completions.create(
            model="tiny", prompt=IDS, max_tokens=n, temperature=0, stream=True
        )
        with pytest.raises(openai.APIError) as err:
            for i, _chunk in enumerate(stream):
                if i == 1:
                    os.kill(victim2.popen.pid, signal.SIGKILL)
        assert "no_capable_peer" in str(err.value.body) or "no capable peer" in str(err.value)
        status_code, doc = http("POST", f"{cluster.api}/completions", {"prompt": IDS})
        assert status_code == 503 and doc["error"]["code"] == "no_capable_peer"
        # a capable peer that joins later takes the stage: the split serves again
        cluster.add_worker("late")
        wait_ready(cluster.api)
        again = client.completions.create(model="tiny", prompt=IDS, max_tokens=n, temperature=0)
        assert again.choices[0].text == undisturbed


# --- helpers -------------------------------------------------------------------------------------
def _detok(pkg: Path, ids: list[int]) -> str:
    from skippy.runtime.tokenizer import LlamaTokenizer

    with LlamaTokenizer(pkg / "shared" / "metadata.gguf") as tok:
        return tok.detokenize(ids)


def test_serve_usage_errors_are_codes_not_tracebacks(tiny_pkg: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from servetools import node_toml

    cfg = tmp_path / "coord.toml"
    cfg.write_text(node_toml(tmp_path, "coord"))
    for args, code in (
        (["--package", str(tmp_path / "missing")], "unreadable_input"),
        (["--package", str(tiny_pkg), "--http", "10.255.255.1:80"], "http_not_loopback"),
        (
            ["--package", str(tiny_pkg), "--http", "10.255.255.1:80", "--http-public"],
            "http_bind_failed",
        ),
        (["--package", str(tiny_pkg), "--http", "nope"], "invalid_config"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "mesh_node", "serve", "--config", str(cfg), "--json", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, out.stderr
        assert f'"code": "{code}"' in out.stdout and "Traceback" not in out.stderr
