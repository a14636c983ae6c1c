"""The qwen3moe family: a mixture-of-experts FFN on ggml, bit for bit llama.cpp's.

A synthetic qwen3moe (8 experts, 2 used per token, F32 router, Q8_0 and F16 experts as rank-3
tensors, zero-copy from the mapped fragments) prefilled over 300 positions in chunks of 128 and
of 7, as one stage and as two, gives llama.cpp's logits at every position; sessions decoded
in a batch get what each gets alone; malformed expert metadata is refused with a code before
ggml sees a tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

import synth_gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from pkgtools import make_package
from stagetools import chain, llama_logits
from test_stage_batch import _steps_alone, _steps_batched

from skippy.errors import SkippyError
from skippy.runtime.families import spec_from_metadata
from skippy.runtime.ggml_engine import GgmlStage
from skippy.runtime.stage import StageConfig

pytestmark = pytest.mark.llama

N_LAYERS, WIDTH, FF_EXP, VOCAB, N_EXPERT, N_USED = 4, 64, 64, 128, 8, 2
N_CTX = 512


# --- the model ------------------------------------------------------------------------------------
# The smallest qwen3moe generator this test needs, written with scripts/synth_gguf's writer.
# To be replaced by the shared family generators of skippy.runtime.canary.synth once that lands.
def qwen3moe_like(path: Path, *, experts: Q, used_count: int = N_USED, seed: int = 0) -> Path:
    d = synth_gguf._Dims(N_LAYERS, WIDTH, FF_EXP * N_USED, VOCAB)
    hd, w, e = d.head_dim, WIDTH, N_EXPERT
    q, kv = d.n_head * hd, d.n_head_kv * hd
    T = synth_gguf._Tensor
    tensors = [
        T("token_embd.weight", (w, VOCAB), Q.Q8_0),
        T("output_norm.weight", (w,), Q.F32, norm=True),
        T("output.weight", (w, VOCAB), Q.F16),
    ]
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        tensors += [
            T(p + "attn_norm.weight", (w,), Q.F32, norm=True),
            T(p + "attn_q.weight", (w, q), Q.Q8_0),
            T(p + "attn_k.weight", (w, kv), Q.F16),
            T(p + "attn_v.weight", (w, kv), Q.Q8_0),
            T(p + "attn_output.weight", (q, w), Q.F16),
            T(p + "attn_q_norm.weight", (hd,), Q.F32, norm=True),
            T(p + "attn_k_norm.weight", (hd,), Q.F32, norm=True),
            T(p + "ffn_norm.weight", (w,), Q.F32, norm=True),
            T(p + "ffn_gate_inp.weight", (w, e), Q.F32),
            T(p + "ffn_gate_exps.weight", (w, FF_EXP, e), experts),
            T(p + "ffn_up_exps.weight", (w, FF_EXP, e), experts),
            T(p + "ffn_down_exps.weight", (FF_EXP, w, e), experts),
        ]
    kvs = synth_gguf._llama_kvs("qwen3moe", "synth qwen3moe", d)
    kvs += [
        ("qwen3moe.expert_count", e, V.UINT32, None),
        ("qwen3moe.expert_used_count", used_count, V.UINT32, None),
        ("qwen3moe.expert_feed_forward_length", FF_EXP, V.UINT32, None),
    ]
    return synth_gguf._write_model(path, "qwen3moe", kvs, tensors, seed, None)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("stage_moe")
    out = {}
    for name, experts in (("q8_0", Q.Q8_0), ("f16", Q.F16)):
        src = qwen3moe_like(root / f"{name}.gguf", experts=experts)
        make_package(src, root / f"pkg-{name}", model_id=f"acme/moe-GGUF:{name}")
        out[name] = (src, root / f"pkg-{name}")
    return out


def _ids(n: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(n).integers(3, VOCAB, n)]


# --- parity with llama.cpp ----------------------------------------------------------------------
@pytest.mark.parametrize("ranges", [["0..4"], ["0..2", "2..4"]], ids=["1-stage", "2-stages"])
@pytest.mark.parametrize("name", ["q8_0", "f16"])
def test_every_position_equals_llama_cpp_in_chunks_of_128_and_7(
    models: dict[str, tuple[Path, Path]], name: str, ranges: list[str]
) -> None:
    gguf_path, pkg = models[name]
    ids = _ids(300)
    ref = llama_logits(gguf_path, ids, repack=False, n_ctx=N_CTX)
    for chunk in (128, 7):
        cfg = StageConfig(n_ctx=N_CTX, n_batch=chunk, n_threads=1)
        with chain("ggml", pkg, ranges, cfg) as ch:
            got = ch.logits(ids, all_positions=True)
        assert np.array_equal(got, ref), (chunk, np.abs(got - ref).max())


def test_decode_after_prefill_equals_llama_cpps_decode(
    models: dict[str, tuple[Path, Path]],
) -> None:
    """Prefill 40 positions, then decode 10 one token at a time (the reused decode graph):
    each row equals llama.cpp's."""
    gguf_path, pkg = models["q8_0"]
    ids, prefill = _ids(50), 40
    ref = llama_logits(gguf_path, ids, repack=False, n_ctx=N_CTX, prefill=prefill)
    with chain("ggml", pkg, ["0..2", "2..4"], StageConfig(n_ctx=N_CTX, n_threads=1)) as ch:
        first = ch.prefill("s", ids[:prefill]).logits
        assert first is not None
        rows = [first[-1]]
        for pos in range(prefill, len(ids)):
            step = ch.decode("s", pos, ids[pos]).logits
            assert step is not None
            rows.append(step[-1])
    assert np.array_equal(np.stack(rows), ref)


@pytest.mark.parametrize("ranges", [["0..4"], ["0..2", "2..4"]], ids=["whole", "split"])
def test_batched_decode_equals_each_session_alone(
    models: dict[str, tuple[Path, Path]], ranges: list[str]
) -> None:
    """Sessions joining and leaving a batch: every position's logits equal decoding alone
    (the router runs per column, the experts per token)."""
    _, pkg = models["q8_0"]
    with chain("ggml", pkg, ranges, StageConfig(n_ctx=32, n_threads=1)) as ch:
        stages = list(ch.stages)
        alone = _steps_alone(stages)
        batched = _steps_batched(stages)
        assert all(st._batch_graphs for st in stages if isinstance(st, GgmlStage))
    assert batched.keys() == alone.keys()
    for key, row in alone.items():
        assert np.array_equal(batched[key], row), key


def test_expert_tensors_are_the_mapped_fragment_bytes(
    models: dict[str, tuple[Path, Path]],
) -> None:
    """Rank-3 expert tensors are placed zero-copy: ggml's data pointer is the mapping's."""
    _, pkg = models["q8_0"]
    with chain("ggml", pkg, ["0..4"], StageConfig(n_ctx=32, n_threads=1)) as ch:
        st = ch.stages[0]
        assert isinstance(st, GgmlStage)
        weights = st._loaded()
        name = "blk.1.ffn_down_exps.weight"
        assert weights.ref(name).shape == (FF_EXP, WIDTH, N_EXPERT)
        assert st.g.ggml_get_data(st._tensors[name]) == weights.address(name)


def test_the_numpy_reference_runs_the_experts_split_or_whole(
    models: dict[str, tuple[Path, Path]],
) -> None:
    """The f32 oracle computes the same MoE on its own: split equals whole bit for bit, and
    its next tokens are ggml's at nearly every position (Q8 activations move a near tie)."""
    _, pkg = models["f16"]
    ids = _ids(100)
    cfg = StageConfig(n_ctx=N_CTX, n_threads=1)
    with chain("numpy", pkg, ["0..4"], cfg) as ch:
        whole = ch.logits(ids, all_positions=True)
    with chain("numpy", pkg, ["0..1", "1..4"], cfg) as ch:
        split = ch.logits(ids, all_positions=True)
    with chain("ggml", pkg, ["0..4"], cfg) as ch:
        ggml = ch.logits(ids, all_positions=True)
    assert np.array_equal(split, whole)
    assert (whole.argmax(axis=1) == ggml.argmax(axis=1)).mean() >= 0.95


# --- malformed expert metadata --------------------------------------------------------------------
def _kv(**changes: Any) -> dict[str, Any]:
    kv: dict[str, Any] = {
        "general.architecture": "qwen3moe",
        "qwen3moe.block_count": N_LAYERS,
        "qwen3moe.embedding_length": WIDTH,
        "qwen3moe.feed_forward_length": FF_EXP * N_USED,
        "qwen3moe.attention.head_count": 4,
        "qwen3moe.attention.head_count_kv": 2,
        "qwen3moe.attention.layer_norm_rms_epsilon": 1e-5,
        "qwen3moe.expert_count": N_EXPERT,
        "qwen3moe.expert_used_count": N_USED,
    }
    for key, value in changes.items():
        if value is None:
            kv.pop(f"qwen3moe.{key}")
        else:
            kv[f"qwen3moe.{key}"] = value
    return kv


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "more used than experts": ({"expert_used_count": 9}, "invalid_hyperparameters"),
    "no experts": ({"expert_count": 0}, "invalid_hyperparameters"),
    "none used": ({"expert_used_count": 0}, "invalid_hyperparameters"),
    "no expert count": ({"expert_count": None}, "missing_hyperparameter"),
    "no used count": ({"expert_used_count": None}, "missing_hyperparameter"),
    "too many experts": ({"expert_count": 1 << 20}, "invalid_hyperparameters"),
    "count is a string": ({"expert_count": "8"}, "unsupported_hyperparameter"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_malformed_expert_metadata_is_a_coded_error(case: str) -> None:
    changes, code = BAD[case]
    with pytest.raises(SkippyError) as e:
        spec_from_metadata(_kv(**changes))
    assert e.value.code == code, e.value.message


def test_a_stage_over_malformed_experts_is_refused_before_ggml(
    models: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """A model whose metadata says 9 of 8 experts per token (llama.cpp would index past its
    experts): no package is written of it, in this process, no abort. (A package whose parts
    disagree is refused when its stage opens: tests/skippy/package/test_experts.py.)"""
    bad = qwen3moe_like(tmp_path / "bad.gguf", experts=Q.Q8_0, used_count=9)
    with pytest.raises(SkippyError) as e:
        make_package(bad, tmp_path / "pkg", model_id="acme/moe-GGUF:bad")
    assert e.value.code == "moe_expert_used_count_invalid"
    assert "expert_used_count" in e.value.message
    assert not (tmp_path / "pkg" / "model-package.json").exists()
