"""`mesh-node serve --package PKG` with no config: real processes, the real `openai` client.

A fresh data directory (XDG's default, or --data-dir) gets its node and owner on the first
run, which the terminal says; a second run reuses them. A model whose family the stage
runtime does not cover is served whole by llama.cpp on the one node, labelled so, and a
peer that joins is refused a split with the code. Prompts are token ids (the synthetic
vocabulary cannot encode most text: tests/skippy/runtime/test_prompt_guard.py).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")
pytest.importorskip("openai", reason="the openai client is a dev dependency")

import openai
import synth_gguf
from pkgtools import make_package
from servetools import Proc, _pump, http, node_toml, wait_ready
from stagetools import chain, stage_loads

from mesh_node.identity import (
    issue_certificate,
    load_private_key,
    node_id_of,
    write_certificate,
    write_private_key,
)

pytestmark = pytest.mark.llama

IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]
N = 10


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("noconfig_tiny")
    src = synth_gguf.llama_like(root / "llama.gguf")
    make_package(src, root / "pkg", model_id="acme/t-GGUF:Q8_0")
    return root / "pkg"


@pytest.fixture(scope="module")
def uncovered_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("noconfig_exaone")
    src = synth_gguf.uncovered_like(root / "exaone.gguf")
    make_package(src, root / "pkg", model_id="acme/exa-GGUF:Q8_0")
    return root / "pkg"


def _serve(args: list[str], env: dict[str, str] | None = None) -> Proc:
    popen = subprocess.Popen(
        [sys.executable, "-m", "mesh_node", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    proc = Proc("serve", popen)
    threading.Thread(target=_pump, args=(popen.stdout, proc.lines), daemon=True).start()
    threading.Thread(target=_pump, args=(popen.stderr, proc.log), daemon=True).start()
    return proc


def _stop(proc: Proc) -> None:
    if proc.popen.poll() is None:
        proc.popen.send_signal(signal.SIGTERM)
    try:
        proc.popen.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.popen.kill()
        proc.popen.wait()


def _complete(api: str, max_tokens: int = N) -> str:
    client = openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=60)
    done = client.completions.create(
        model=client.models.list().data[0].id, prompt=IDS, max_tokens=max_tokens, temperature=0
    )
    assert done.usage is not None and done.usage.completion_tokens == max_tokens
    return done.choices[0].text


def _detok(pkg: Path, ids: list[int]) -> str:
    from skippy.runtime.tokenizer import LlamaTokenizer

    with LlamaTokenizer(pkg / "shared" / "metadata.gguf") as tok:
        return tok.detokenize(ids)


def _wait_log(proc: Proc, needle: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        hit = next((line for line in proc.log if needle in line), None)
        if hit is not None:
            return hit
        time.sleep(0.1)
    raise AssertionError(f"no log line with {needle!r}; stderr tail: {proc.log[-15:]}")


def test_serve_without_config_answers_the_openai_client_on_a_fresh_data_dir(
    tiny_pkg: Path, isolated_home: Path
) -> None:
    data = isolated_home / "xdg_data" / "mesh-node"  # XDG_DATA_HOME/mesh-node (conftest)
    assert not data.exists()
    args = ["--package", str(tiny_pkg), "--http", "127.0.0.1:0", "--listen", "127.0.0.1:0"]
    with chain("ggml", tiny_pkg, ["0..4"]) as ch:
        expected = _detok(tiny_pkg, list(ch.generate(IDS, max_tokens=N).tokens))

    first = _serve(args)
    try:
        address = first.wait_line("listening ")
        api = first.wait_line("api ")
        assert api.startswith("http://127.0.0.1:") and api.endswith("/v1")
        wait_ready(api)
        assert _complete(api) == expected
        # the status page's /health says what serves: the stage runtime here
        assert http("GET", api.removesuffix("/v1") + "/health")[1]["engine"] == "engine: ggml"
    finally:
        _stop(first)
    assert first.popen.returncode == 0, first.log[-15:]
    said = "\n".join(first.log)
    assert f"created node key {data / 'node.key'}" in said and "created owner key" in said
    assert f"wrote {data / 'node.toml'}" in said and "loopback" in said
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for name in ("node.key", "owner.key", "node.cert", "node.toml"):
        assert stat.S_IMODE((data / name).stat().st_mode) == 0o600, name
    node_id = node_id_of(load_private_key(data / "node.key"))
    assert address.endswith("#" + node_id)

    # A second run reuses the node (and says so); `status` finds it without --config.
    second = _serve(args)
    try:
        assert second.wait_line("listening ").endswith("#" + node_id)
        wait_ready(second.wait_line("api "))
        status = subprocess.run(
            [sys.executable, "-m", "mesh_node", "status", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert f'"node_id": "{node_id}"' in status.stdout
        assert '"owner_status": "verified"' in status.stdout
    finally:
        _stop(second)
    said = "\n".join(second.log)
    assert f"using the node in {data}" in said and "created" not in said


def test_an_uncovered_family_is_served_whole_by_llama_cpp_and_never_split(
    uncovered_pkg: Path, tmp_path: Path
) -> None:
    from skippy.runtime.llama_cpp import LlamaRuntimeConfig, LlamaStageRuntime

    # llama.cpp's own greedy continuation of the same package: the reference
    (load,) = stage_loads(uncovered_pkg, ["0..4"])
    with LlamaStageRuntime(LlamaRuntimeConfig(n_ctx=64, n_threads=1)) as ref:
        ref.load(load)
        expected = ref.detokenize(list(ref.generate(IDS, max_tokens=N).tokens))

    data = tmp_path / "node"
    label = (
        "engine: llama.cpp (one node; split placement refused: exaone is not supported by "
        "the stage runtime)"
    )
    coord = _serve(
        ["--package", str(uncovered_pkg), "--data-dir", str(data), "--http", "127.0.0.1:0",
         "--listen", "127.0.0.1:0"]
    )
    worker: subprocess.Popen[str] | None = None
    try:
        address = coord.wait_line("listening ")
        api = coord.wait_line("api ")
        wait_ready(api)
        assert _complete(api) == expected
        _wait_log(coord, label)
        health = http("GET", api.removesuffix("/v1") + "/health")
        assert health == (200, {"status": "ok", "engine": label})

        # A peer of the same owner joins (certified with the owner key the first run made):
        # capable, yet the split is refused with the code, and the one node keeps serving.
        key = write_private_key(tmp_path / "w.key")
        cert = issue_certificate(load_private_key(data / "owner.key"), node_id_of(key), days=1)
        write_certificate(tmp_path / "w.cert", cert)
        (tmp_path / "w.toml").write_text(
            'identity = "w.key"\ncertificate = "w.cert"\ndata_dir = "w-data"\n'
            f'listen = "127.0.0.1:0"\npeers = ["{address}"]\n'
        )
        worker = subprocess.Popen(
            [sys.executable, "-m", "mesh_node", "run", "--config", str(tmp_path / "w.toml")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        refused = _wait_log(coord, "split placement refused [family_unsupported]")
        assert node_id_of(key)[:12] in refused
        assert _complete(api) == expected
        serving = _status_serving(data)
        assert serving["engine"]["code"] == "family_unsupported"
        assert serving["engine"]["engine"] == "llama" and serving["stages"] == 1
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=15)
        _stop(coord)


def _status_serving(data: Path) -> dict[str, object]:
    import json

    out = subprocess.run(
        [sys.executable, "-m", "mesh_node", "status", "--data-dir", str(data), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout)["serving"])


def test_asking_to_split_an_uncovered_family_is_refused_with_the_runtimes_code(
    uncovered_pkg: Path, tmp_path: Path
) -> None:
    (tmp_path / "coord.toml").write_text(node_toml(tmp_path, "coord"))
    out = subprocess.run(
        [sys.executable, "-m", "mesh_node", "serve", "--package", str(uncovered_pkg),
         "--stages", "2", "--config", str(tmp_path / "coord.toml"), "--http", "127.0.0.1:0",
         "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    assert '"code": "unsupported_architecture"' in out.stdout and "Traceback" not in out.stderr
    assert "cannot split this model over 2 stages" in out.stdout and "'exaone'" in out.stdout


def test_serving_engine_llama_serves_a_covered_family_whole(tiny_pkg: Path, tmp_path: Path) -> None:
    from skippy.runtime.llama_cpp import LlamaRuntimeConfig, LlamaStageRuntime

    (load,) = stage_loads(tiny_pkg, ["0..4"])
    with LlamaStageRuntime(LlamaRuntimeConfig(n_ctx=64, n_threads=1)) as ref:
        ref.load(load)
        expected = ref.detokenize(list(ref.generate(IDS, max_tokens=N).tokens))
    # the [serving] table is the last one node_toml writes
    (tmp_path / "coord.toml").write_text(node_toml(tmp_path, "coord") + 'engine = "llama"\n')
    coord = _serve(
        ["--package", str(tiny_pkg), "--config", str(tmp_path / "coord.toml"), "--http",
         "127.0.0.1:0"]
    )
    try:
        coord.wait_line("listening ")
        api = coord.wait_line("api ")
        wait_ready(api)
        assert _complete(api) == expected
        health = http("GET", api.removesuffix("/v1") + "/health")[1]
        assert health["engine"] == (
            'engine: llama.cpp (one node; split placement refused: [serving] engine = "llama" '
            "runs the whole model in llama.cpp)"
        )
    finally:
        _stop(coord)


@pytest.mark.slow
def test_gemma3_served_whole_by_llama_cpp_answers_text_as_run_engine_llama(
    gemma_package: Path, tmp_path: Path
) -> None:
    """A real model and a text prompt through the llama engine: the openai client gets
    `skippy-model-package run --engine llama`'s greedy text, token for token."""
    from skippy.runtime.llama_cpp import LlamaRuntimeConfig, LlamaStageRuntime

    prompt = "The capital of France is"
    (load,) = stage_loads(gemma_package, ["0..18"])
    with LlamaStageRuntime(LlamaRuntimeConfig(n_ctx=256, n_threads=1)) as ref:
        ref.load(load)
        want = ref.generate(ref.tokenize(prompt), max_tokens=16).text
    assert want.startswith(" the capital of the country of France")  # golden: runtime-facts.md
    toml = node_toml(tmp_path, "coord", budget="4GiB") + 'engine = "llama"\n'
    (tmp_path / "coord.toml").write_text(toml)
    coord = _serve(
        ["--package", str(gemma_package), "--config", str(tmp_path / "coord.toml"), "--http",
         "127.0.0.1:0"]
    )
    try:
        coord.wait_line("listening ", timeout_s=120)
        api = coord.wait_line("api ", timeout_s=120)
        wait_ready(api, timeout_s=180)
        client = openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=120)
        done = client.completions.create(
            model=client.models.list().data[0].id, prompt=prompt, max_tokens=16, temperature=0
        )
        assert done.choices[0].text == want
    finally:
        _stop(coord)
