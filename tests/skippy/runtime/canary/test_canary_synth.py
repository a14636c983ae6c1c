"""The canary's synthetic models, checked against llama.cpp (llama-cpp-python 0.3.36).

For every family x dtype: llama.cpp loads the file and reports the hyperparameters the spec
meant (no silent default); every key written reads back in llama.cpp with the value written;
a 320-token id prompt gives finite, varied logits at every position, bit-identical across
two runs and whether the prompt goes in as one batch or in chunks of 64; in every MoE layer
llama.cpp's router sends some of those tokens to every expert. Each family-specific
key is shown to be used: the same model with that one value changed gives other logits
(a sliding window changes only the positions past it).

One oracle fact found here: MoE models with K-quant experts give batch-dependent logits,
because ggml's tiled K-quant kernel takes an expert's rows only when it has 8 or more tokens
(``ggml_tiled_min_batch``): chunking changes how many tokens each expert gets. With the tiled
kernel off (``GGML_CPU_TILED_MM=0``, read once per process, hence a subprocess) chunked and
one-batch logits are identical again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

from skippy.errors import UsageError
from skippy.runtime.canary import synth
from skippy.runtime.canary.oracle import LlamaOracle, llama_logits

pytestmark = pytest.mark.llama

CASES = [(f.name, dt) for f in synth.FAMILIES for dt in f.dtypes]
MOE_KQUANT = [(f.name, "Q4_K") for f in synth.FAMILIES if f.moe is not None]
LONG = synth.long_prompt(320)
SHORT = LONG[:12]
CHUNK = 64
THREADS = 1  # a shared 2-core machine; results do not depend on the thread count


@dataclass(frozen=True)
class Run:
    path: Path
    one_batch: np.ndarray
    again: np.ndarray
    chunked: np.ndarray
    short: np.ndarray
    hparams: dict[str, int]
    meta: dict[str, str | None]


class Models:
    """Each model written once per session, and llama.cpp's runs of it computed once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[tuple[str, str], Path] = {}
        self._runs: dict[tuple[str, str], Run] = {}

    def path(self, name: str, dtype: str) -> Path:
        key = (name, dtype)
        if key not in self._paths:
            spec = synth.family(name)
            out = self.root / synth.model_file_name(spec, dtype)
            self._paths[key] = synth.write_model(spec, out, dtype=dtype)
        return self._paths[key]

    def run(self, name: str, dtype: str) -> Run:
        key = (name, dtype)
        if key not in self._runs:
            path = self.path(name, dtype)
            spec = synth.family(name)
            keys = synth.model_metadata(spec, spec.dims(), synth.check_dtype(dtype, spec))
            with LlamaOracle(path, n_threads=THREADS) as o:
                self._runs[key] = Run(
                    path=path,
                    one_batch=o.logits(LONG, n_batch=len(LONG)),
                    again=o.logits(LONG, n_batch=len(LONG)),
                    chunked=o.logits(LONG, n_batch=CHUNK),
                    short=o.logits(SHORT, n_batch=len(SHORT)),
                    hparams=o.hparams(),
                    meta={k: o.meta(k) for k in [*keys, "general.architecture"]},
                )
        return self._runs[key]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    return Models(tmp_path_factory.mktemp("canary_synth"))


def _case_id(case: tuple[str, str]) -> str:
    return f"{case[0]}-{case[1]}"


# --- the specs themselves -------------------------------------------------------------------------
def test_every_spec_names_tensors_its_architecture_has() -> None:
    """gguf-py's vocabulary: each tensor of a spec is one its architecture declares."""
    for spec in synth.FAMILIES:
        allowed = set(gguf.MODEL_TENSORS[spec.arch])
        used = {t.tensor for t in (*spec.model, *spec.layer)}
        assert used <= allowed, (spec.name, used - allowed)


def test_moe_specs_are_not_degenerate() -> None:
    for spec in synth.FAMILIES:
        if spec.moe is not None:
            assert spec.moe.n_expert >= 8 and 2 <= spec.moe.n_expert_used < spec.moe.n_expert


def test_bad_requests_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as exc:
        synth.family("gpt-j")
    assert exc.value.code == "unknown_synth_family"
    with pytest.raises(UsageError) as exc:
        synth.write_model(synth.family("llama"), tmp_path / "m.gguf", dtype="Q5_1")
    assert exc.value.code == "invalid_synth_dtype"
    with pytest.raises(UsageError) as exc:  # gpt-oss's own dtype is no other family's
        synth.write_model(synth.family("llama"), tmp_path / "m.gguf", dtype=synth.MXFP4)
    assert exc.value.code == "invalid_synth_dtype" and exc.value.expected == list(synth.DTYPES)
    odd = synth.Dims(ff=320)  # 320 is no multiple of Q4_K's 256-value rows
    with pytest.raises(UsageError) as exc:
        synth.write_model(synth.family("llama"), tmp_path / "m.gguf", dtype="Q4_K", dims=odd)
    assert exc.value.code == "invalid_synth_dims"
    assert list(tmp_path.iterdir()) == []  # refused before anything is written


def test_same_values_at_every_precision(models: Models) -> None:
    """A tensor's values depend on (seed, name) only: the Q8_0 file's weights are the F32
    file's, quantized (dequantized by gguf-py, within Q8_0's rounding)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    name = "blk.1.ffn_down_exps.weight"
    tensors = {}
    for dtype in ("F32", "Q8_0"):
        reader = GGUFReader(models.path("qwen3moe", dtype))
        t = next(t for t in reader.tensors if t.name == name)
        tensors[dtype] = dequantize(t.data, t.tensor_type).reshape(-1)
    scale = float(np.abs(tensors["F32"]).max())
    assert np.abs(tensors["F32"] - tensors["Q8_0"]).max() <= scale / 127
    assert not np.array_equal(tensors["F32"], tensors["Q8_0"])


# --- llama.cpp on every family x dtype ------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_llama_cpp_reads_the_intended_hyperparameters(
    models: Models, case: tuple[str, str]
) -> None:
    name, dtype = case
    spec = synth.family(name)
    d = spec.dims()
    run = models.run(name, dtype)
    swa = synth.SLIDING_WINDOW if gguf.Keys.Attention.SLIDING_WINDOW in spec.kv else 0
    assert run.hparams == {
        "n_layer": d.n_layers,
        "n_embd": d.embd,
        "n_head": d.n_head,
        "n_head_kv": d.n_head_kv,
        "n_ctx_train": d.n_ctx_train,
        "n_swa": swa,
        "n_vocab": d.vocab,
    }
    assert run.meta["general.architecture"] == spec.arch_name


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_key_reads_back_in_llama_cpp(models: Models, case: tuple[str, str]) -> None:
    name, dtype = case
    spec = synth.family(name)
    run = models.run(name, dtype)
    written = synth.model_metadata(spec, spec.dims(), synth.check_dtype(dtype, spec))
    for key, value in written.items():
        got = run.meta[key]
        if isinstance(value, list):  # llama.cpp keeps no text form of arrays
            continue
        assert got is not None, f"llama.cpp has no {key}"
        if isinstance(value, bool):
            assert got == str(value).lower(), key
        elif isinstance(value, (int, float)):
            assert float(got) == pytest.approx(value, rel=1e-6), key
        else:
            assert got == value, key


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_long_prompt_logits_are_finite_varied_and_deterministic(
    models: Models, case: tuple[str, str]
) -> None:
    run = models.run(*case)
    assert run.one_batch.shape == (len(LONG), synth.Dims().vocab)
    assert np.isfinite(run.one_batch).all()
    assert np.isfinite(run.short).all() and run.short.shape == (len(SHORT), synth.Dims().vocab)
    # Not degenerate: the predicted token changes along the prompt.
    assert len(set(run.one_batch.argmax(axis=1).tolist())) > 10
    assert np.array_equal(run.one_batch, run.again)


@pytest.mark.parametrize("case", [c for c in CASES if c not in MOE_KQUANT], ids=_case_id)
def test_chunks_of_64_equal_one_batch(models: Models, case: tuple[str, str]) -> None:
    run = models.run(*case)
    assert np.array_equal(run.chunked, run.one_batch)


_NO_TILED = """
import json, sys
from pathlib import Path
import numpy as np
from skippy.runtime.canary.oracle import LlamaOracle
ids = json.loads(sys.argv[1])
out = {}
for path in sys.argv[2:]:
    with LlamaOracle(Path(path)) as o:
        out[path] = bool(np.array_equal(o.logits(ids, n_batch=len(ids)), o.logits(ids, n_batch=64)))
print(json.dumps(out))
"""


def test_moe_kquant_chunks_equal_one_batch_without_the_tiled_kernel(models: Models) -> None:
    paths = [str(models.path(name, dtype)) for name, dtype in MOE_KQUANT]
    env = {**os.environ, "GGML_CPU_TILED_MM": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TILED, json.dumps(LONG), *paths],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == dict.fromkeys(paths, True)


@pytest.mark.parametrize(
    "case", [(f.name, dt) for f in synth.FAMILIES if f.moe for dt in f.dtypes], ids=_case_id
)
def test_routing_reaches_every_expert_in_every_layer(models: Models, case: tuple[str, str]) -> None:
    """llama.cpp's own top-k choices over the long prompt, read from its graph."""
    name, dtype = case
    moe = synth.family(name).moe
    assert moe is not None
    with LlamaOracle(models.path(name, dtype), n_threads=THREADS) as o:
        choices = o.expert_choices(LONG, n_batch=len(LONG))
    spec = synth.family(name)
    # every layer routes but the leading dense ones (glm4moe's first)
    assert sorted(choices) == list(range(spec.dense_lead, spec.n_layers))
    for layer, chosen in choices.items():
        assert chosen.shape == (len(LONG), moe.n_expert_used)
        counts = np.bincount(chosen.reshape(-1), minlength=moe.n_expert)
        assert counts.min() >= 1, (
            f"layer {layer}: experts never chosen {np.flatnonzero(counts == 0)}"
        )


def test_llama_logits_is_the_oracle_in_one_call(models: Models) -> None:
    run = models.run("gemma2", "Q8_0")
    got = llama_logits(run.path, LONG, n_batch=CHUNK, n_threads=THREADS)
    assert np.array_equal(got, run.chunked)


# --- the family's own keys are used, not defaulted ------------------------------------------------
FEATURE_KEYS = [
    (spec.name, key)
    for spec in synth.FAMILIES
    for key, value in spec.kv.items()
    # expert sizes shape the tensors: no load without (the shared experts' count too, and
    # deepseek2's q_lora_rank, 0: attn_q instead of attn_q_a and attn_q_b)
    if not isinstance(value, synth.Dim)
    and key not in (gguf.Keys.LLM.EXPERT_SHARED_COUNT, gguf.Keys.Attention.Q_LORA_RANK)
]


def _perturbed(value: synth.SpecValue) -> synth.SpecValue:
    if isinstance(value, bool):
        return not value
    if isinstance(value, str):
        return {"yarn": "linear"}[value]
    if isinstance(value, int):
        return value * 2
    assert isinstance(value, float)
    return value * 1.5


@pytest.mark.parametrize("feature", FEATURE_KEYS, ids=lambda f: f"{f[0]}-{f[1]}")
def test_each_family_key_changes_the_logits(
    models: Models, feature: tuple[str, str], tmp_path: Path
) -> None:
    name, key = feature
    spec = synth.family(name)
    variant = replace(spec, kv={**spec.kv, key: _perturbed(spec.kv[key])})
    path = synth.write_model(variant, tmp_path / "variant.gguf", dtype="F32")
    base = models.run(name, "F32").one_batch
    got = llama_logits(path, LONG, n_batch=len(LONG), n_threads=THREADS)
    if key == gguf.Keys.Attention.SLIDING_WINDOW:
        # A wider window changes nothing while the prompt fits the narrower one.
        window = synth.SLIDING_WINDOW
        assert np.array_equal(got[:window], base[:window])
        assert not np.array_equal(got[window + 1 :], base[window + 1 :])
    else:
        assert not np.array_equal(got, base)
