"""Calibrating the stage runtime on this machine: seconds per layer per
token, decode and prefill, that a cost-aware planner (``skippy.package.cost_plan``) weighs
nodes by.

The core of ``mesh_node.calibration`` (which caches and advertises what this measures).

A calibration runs a small built-in synthetic model (llama architecture, Q8_0 weights, layers
of ``CALIBRATION_LAYER_BYTES``-ish bytes: about one gemma3-270m layer) through the real stage
runtime: a middle stage of two layers (no embedding, no head), one prefill of
``PREFILL_TOKENS`` and ``DECODE_TOKENS`` decode steps. ``measure`` is the arithmetic over any
``Stage`` and a clock (so it is testable with the clock injected); ``run_calibration`` writes
the model and its package into a scratch folder, opens the stage and measures. What was
measured is named by ``CalibrationKey`` (engine, runtime, threads, model class): a cache keyed
by it is valid until one of those changes (the caller's, ``mesh_node.calibration``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from skippy.errors import UsageError
from skippy.runtime.stage import Stage

MODEL_CLASS: Final = "synthetic-llama-q8_0-w512-ff1536-v1"  # change it when the model changes
_WIDTH: Final = 512
_FF: Final = 1536
_HEADS: Final = 8
_VOCAB: Final = 64
_LAYERS: Final = 4  # the stage runs layers 1..3: a middle stage, activations in and out
MEASURED_LAYERS: Final = 2
PREFILL_TOKENS: Final = 32
DECODE_TOKENS: Final = 8


@dataclass(frozen=True)
class CalibrationKey:
    """What a calibration measured: a cached figure is reused only for the same key."""

    engine: str
    runtime_version: str
    threads: int
    model_class: str = MODEL_CLASS
    device: str = "CPU"  # the ggml device the stage ran on (``skippy.runtime.devices``)


@dataclass(frozen=True)
class Calibration:
    """A node's stage-runtime speed: seconds per layer per token (decode: one token at a time;
    prefill: per token of a batched prompt), measured on layers of ``layer_bytes`` bytes."""

    key: CalibrationKey
    decode_s_per_layer: float
    prefill_s_per_layer: float
    layer_bytes: int

    def __post_init__(self) -> None:
        for name in ("decode_s_per_layer", "prefill_s_per_layer"):
            v = getattr(self, name)
            if not (isinstance(v, float) and math.isfinite(v) and v > 0):
                raise UsageError(f"{name} must be a positive number", code="invalid_calibration")
        if self.layer_bytes < 1:
            raise UsageError("layer_bytes must be positive", code="invalid_calibration")

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": asdict(self.key),
            "decode_s_per_layer": self.decode_s_per_layer,
            "prefill_s_per_layer": self.prefill_s_per_layer,
            "layer_bytes": self.layer_bytes,
        }

    @classmethod
    def from_dict(cls, data: object) -> Calibration:
        """Strict parse (a cache file: anything unexpected is a cache miss for the caller)."""
        if not isinstance(data, dict) or set(data) != {
            "key",
            "decode_s_per_layer",
            "prefill_s_per_layer",
            "layer_bytes",
        }:
            raise UsageError("not a calibration record", code="invalid_calibration")
        k = data["key"]
        if not isinstance(k, dict) or set(k) != {
            "engine",
            "runtime_version",
            "threads",
            "model_class",
            "device",
        }:
            raise UsageError("not a calibration key", code="invalid_calibration")
        names = ("engine", "runtime_version", "model_class", "device")
        if not all(isinstance(k[f], str) for f in names):
            raise UsageError("a calibration key's names are strings", code="invalid_calibration")
        if isinstance(k["threads"], bool) or not isinstance(k["threads"], int):
            raise UsageError("a calibration key's threads is an int", code="invalid_calibration")
        layer_bytes = data["layer_bytes"]
        if isinstance(layer_bytes, bool) or not isinstance(layer_bytes, int):
            raise UsageError("layer_bytes is an integer", code="invalid_calibration")
        d, p = data["decode_s_per_layer"], data["prefill_s_per_layer"]
        if not (isinstance(d, float) and isinstance(p, float)):
            raise UsageError("calibrated seconds are numbers", code="invalid_calibration")
        return cls(CalibrationKey(**k), d, p, layer_bytes)


def measure(
    stage: Stage,
    *,
    width: int,
    layers: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """(decode, prefill) seconds per layer per token of ``stage`` (a middle stage of
    ``layers`` layers taking ``width``-wide activations): one warm-up token, one prefill of
    ``PREFILL_TOKENS``, then the median of ``DECODE_TOKENS`` decode steps."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((PREFILL_TOKENS + DECODE_TOKENS + 1, width)).astype(np.float32)
    try:
        stage.decode("calibrate-warm", 0, x[:1])  # first graph: allocation, not speed
        stage.free("calibrate-warm")
        t0 = clock()
        stage.prefill("calibrate", 0, x[:PREFILL_TOKENS])
        prefill_s = clock() - t0
        steps = []
        for p in range(PREFILL_TOKENS, PREFILL_TOKENS + DECODE_TOKENS):
            t = clock()
            stage.decode("calibrate", p, x[p : p + 1])
            steps.append(clock() - t)
    finally:
        for session in ("calibrate-warm", "calibrate"):
            stage.free(session)
    decode_s = statistics.median(steps)
    # A clock too coarse to see the work still yields a positive figure (1 ns floor).
    return max(decode_s / layers, 1e-9), max(prefill_s / (PREFILL_TOKENS * layers), 1e-9)


def write_calibration_model(path: Path) -> Path:
    """The built-in calibration model (deterministic bytes) as one GGUF file at ``path``."""
    import gguf  # ~0.23 s to import: only when a calibration actually runs

    q8 = gguf.GGMLQuantizationType.Q8_0
    rng = np.random.default_rng(21)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("skippy calibration model")
    writer.add_block_count(_LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(_WIDTH)
    writer.add_feed_forward_length(_FF)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(_WIDTH // _HEADS)
    writer.add_vocab_size(_VOCAB)
    writer.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>", *[f"▁w{i}" for i in range(_VOCAB - 3)]]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, _VOCAB)])
    writer.add_token_types([2, 3, 3] + [1] * (_VOCAB - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    quantize = _q8_0_quantizer()

    def matrix(name: str, rows: int, cols: int) -> None:
        w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        data = quantize(w)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=q8)

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(_WIDTH, dtype=np.float32))

    matrix("token_embd.weight", _VOCAB, _WIDTH)
    for i in range(_LAYERS):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight")
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            matrix(b + t + ".weight", _WIDTH, _WIDTH)
        norm(b + "ffn_norm.weight")
        matrix(b + "ffn_gate.weight", _FF, _WIDTH)
        matrix(b + "ffn_up.weight", _FF, _WIDTH)
        matrix(b + "ffn_down.weight", _WIDTH, _FF)
    norm("output_norm.weight")
    matrix("output.weight", _VOCAB, _WIDTH)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _q8_0_quantizer() -> Callable[[npt.NDArray[np.float32]], npt.NDArray[np.uint8]]:
    """Q8_0 rows of an f32 matrix: ggml's quantizer (C; a node's start-up writes this model)
    when libggml loads, else gguf-py's (numpy, ~4x slower here). Both are the reference
    Q8_0 rounding and give the same bytes (tests/skippy/runtime/test_calibration.py), so the
    model, and ``MODEL_CLASS``, do not depend on which ran."""
    import gguf

    from skippy.gguf import ggml  # ours: loads no library until ``load``

    try:
        g = ggml.load()
    except (ggml.GgmlUnavailable, ggml.GgmlVersionMismatch, OSError):
        return lambda w: np.asarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))
    q8 = int(gguf.GGMLQuantizationType.Q8_0)
    g.ggml_quantize_init(q8)

    def quantize(w: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        rows, cols = w.shape
        src = np.ascontiguousarray(w, dtype=np.float32)
        out = np.empty((rows, cols // 32 * 34), dtype=np.uint8)
        g.ggml_quantize_chunk(q8, src.ctypes.data, out.ctypes.data, 0, rows, cols, None)
        return out

    return quantize


def layer_bytes() -> int:
    """Weight bytes of one calibration layer (Q8_0: 34 bytes per 32 weights; F32 norms)."""
    weights = 4 * _WIDTH * _WIDTH + 3 * _FF * _WIDTH
    return weights // 32 * 34 + 2 * _WIDTH * 4


def run_calibration(
    workdir: Path, *, engine: str, threads: int, device: str = "CPU"
) -> Calibration:
    """Write the calibration model and package under ``workdir`` (a scratch folder the caller
    owns and removes), run its middle stage on ``engine`` with ``threads`` on ``device`` (a
    ggml device name, ``skippy.runtime.devices``; the ggml engine's) and measure."""
    from skippy.config import read_environment
    from skippy.constants import ENV_VERIFY_PACKAGE_SHA
    from skippy.consume.resolve import resolve_stage
    from skippy.produce.write_package import WriteOptions, local_provenance, write_package
    from skippy.runtime.boundary import StageLoad
    from skippy.runtime.chain import open_stage
    from skippy.runtime.stage import StageConfig

    source = write_calibration_model(workdir / "calibration.gguf")
    provenance = local_provenance(
        model_id="skippy/calibration-GGUF:Q8_0",
        source_repo=None,
        source_revision=MODEL_CLASS,
        source_file=source.name,
    )
    write_package(source, WriteOptions(out_dir=workdir / "package", provenance=provenance))
    env = read_environment({ENV_VERIFY_PACKAGE_SHA: "0"})  # we wrote it a moment ago
    first = 1
    resolved = resolve_stage(
        str(workdir / "package"),
        env,
        layers_text=f"{first}..{first + MEASURED_LAYERS}",
        text_only=True,
    )
    load = StageLoad.from_selection(resolved.stage.selection, resolved.files())
    config = StageConfig(
        n_ctx=PREFILL_TOKENS + DECODE_TOKENS + 8, n_threads=threads, device=device
    )
    stage = open_stage(engine, load, config, stage_index=1, stage_count=3)
    try:
        decode, prefill = measure(stage, width=_WIDTH, layers=MEASURED_LAYERS)
        version = str(getattr(stage, "runtime_version", "unknown"))
        ran_on = str(getattr(stage, "device", "CPU"))  # a whole-model engine: the CPU's
    finally:
        stage.close()
    key = CalibrationKey(engine, version, threads, device=ran_on)
    return Calibration(key, decode, prefill, layer_bytes())


__all__ = [
    "DECODE_TOKENS",
    "MODEL_CLASS",
    "PREFILL_TOKENS",
    "Calibration",
    "CalibrationKey",
    "layer_bytes",
    "measure",
    "run_calibration",
    "write_calibration_model",
]
