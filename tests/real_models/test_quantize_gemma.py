"""skippy-quantize on a real model: gemma3-270m dequantized to F32 (gguf-py), quantized both
ways, then run.

The F32 source (~1.1 GB) is built once per machine into .work/models/ (tests/support/f32_source.py);
each quantization runs once per module.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install 'skippy-mesh[llama]')"
)

from f32_source import gemma_f32  # noqa: E402
from quant_reference import differences, gguf_tensors, llama_quantize, package_tensors  # noqa: E402

from skippy.cli import main as package_main  # noqa: E402
from skippy.quantize_cli import main  # noqa: E402

pytestmark = [pytest.mark.llama, pytest.mark.slow]

MODEL_CACHE_DIR = Path(__file__).resolve().parents[2] / ".work" / "models"
PROMPT = "The capital of France is"
PROV = [
    "--source-revision",
    "0123abc",
    "--source-file",
    "gemma-3-270m-f32.gguf",
]


@pytest.fixture(scope="session")
def gemma_f32_gguf(gemma_gguf: Path) -> Path:
    return gemma_f32(gemma_gguf, MODEL_CACHE_DIR)


@pytest.fixture(scope="module")
def q8_pkg(gemma_f32_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gemma_q8") / "pkg"
    argv = ["quantize-layer-package", str(gemma_f32_gguf), "--out-dir", str(out)]
    assert main([*argv, "--type", "Q8_0", "--model-id", "google/gemma-3-270m:Q8_0", *PROV]) == 0
    return out


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K_M"])
def test_gemma_tensors_equal_llama_cpps(gemma_f32_gguf, q8_pkg, tmp_path, type_name):
    if type_name == "Q8_0":
        pkg = q8_pkg
    else:
        pkg = tmp_path / "pkg"
        argv = ["quantize-layer-package", str(gemma_f32_gguf), "--out-dir", str(pkg)]
        model_id = f"google/gemma-3-270m:{type_name}"
        assert main([*argv, "--type", type_name, "--model-id", model_id, *PROV]) == 0
    ref = llama_quantize(gemma_f32_gguf, tmp_path / "ref.gguf", type_name)
    ours = package_tensors(pkg)
    assert differences(ours, gguf_tensors(ref)) == []
    assert len(ours) == 236  # 18 layers x 13 + embeddings + output norm


def test_gemma_q8_0_package_runs_and_keeps_llama_cpps_top1(gemma_f32_gguf, q8_pkg, capsys):
    llm = llama_cpp.Llama(
        model_path=str(gemma_f32_gguf), n_ctx=64, n_threads=2, logits_all=True, verbose=False
    )
    tokens = llm.tokenize(PROMPT.encode())
    llm.eval(tokens)
    top1 = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    del llm
    code = package_main(["run", str(q8_pkg), "--prompt", PROMPT, "--max-tokens", "1", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == tokens
    assert out["tokens"][0] == top1


def test_gemma_q8_0_package_validates_against_the_f32_source(gemma_f32_gguf, q8_pkg, capsys):
    assert package_main(["validate-package", str(gemma_f32_gguf), str(q8_pkg), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] and report["tensors_checked"] == 236
