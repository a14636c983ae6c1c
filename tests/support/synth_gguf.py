"""Deterministic generator of tiny but real GGUF files (fixtures for tests and demos).

Every file is written by gguf-py's ``GGUFWriter`` (the reference writer llama.cpp's own
converters use), so it is a GGUF file in every respect: KV section, tensor infos, aligned data.
Tensor payloads are seeded: the same arguments give the same bytes, and a tensor's content
depends only on ``(seed, tensor name, shape, type)``, so ``split_set`` with the same arguments
as ``llama_like`` holds exactly the same tensors, split over several files.

Kinds (importable functions, and a CLI:
``python tests/support/synth_gguf.py KIND OUT [--options]``):

    llama_like(path, *, n_layers=4, width=64, ff=256, vocab=128, seed=0, alignment=None,
               arch="llama")
    gemma_like(path, *, n_layers=4, width=64, ff=256, vocab=128, seed=0, alignment=None)
    qwen3_like(path, *, n_layers=4, width=64, ff=256, vocab=128, seed=0, alignment=None)
    qwen2_like(path, *, n_layers=4, width=64, ff=256, vocab=128, seed=0, alignment=None)
    nextn_like(path, *, n_layers=4, width=64, ff=256, vocab=128, seed=0, arch="glm4moe")
    uncovered_like(path, *, arch="exaone", <llama_like options>)
    split_set(directory, stem, *, n_shards=2, metadata_only_first=False, <llama_like options>)
    projector(path, *, seed=0)
    big(path, target_bytes, *, seed=0)
    high_precision(path, *, dtype="F32", n_layers=8, width=256, ff=640, vocab=512, n_head_kv=2,
                   tied=False, n_experts=0, seed=0)
    imatrix(model, path, *, seed=0, chunks=4)

Tensor types are mixed on purpose: F32 norms; F16, BF16; Q8_0, Q4_0, Q4_1, Q5_0 made with
``gguf.quants.quantize``; K-quants (Q4_K, Q6_K) written as random blocks of the right byte
shape with finite fp16 scales (gguf-py cannot quantize K-quants). K-quants need ne0 to be a
multiple of 256, so they go on ``ffn_down`` (ne0 = ff) when ``ff % 256 == 0`` (hence the
default ff=256); with another ``ff`` that tensor falls back to Q8_0.

llama.cpp (llama-cpp-python) loads and runs llama_like, gemma_like and split_set outputs; the
split set's logits are bit-identical to the whole file's (tests/skippy/gguf/test_gguf_reader.py).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf import GGUFWriter

__all__ = [
    "KINDS",
    "big",
    "gemma_like",
    "high_precision",
    "imatrix",
    "llama_like",
    "main",
    "moe_like",
    "nextn_like",
    "projector",
    "qwen2_like",
    "qwen3_like",
    "split_set",
    "with_text_vocabulary",
]

KINDS = (
    "llama_like",
    "gemma_like",
    "qwen3_like",
    "qwen2_like",
    "split_set",
    "projector",
    "nextn_like",
    "big",
    "high_precision",
)

# Byte offsets of the fp16 scale fields inside one block of each K-quant we write as random
# bytes (ggml-common.h block_q*_K): fixing them to small finite values keeps the random blocks
# dequantizable to finite numbers.
_KQUANT_SCALE_OFFSETS: dict[Q, tuple[int, ...]] = {
    Q.Q2_K: (80, 82),  # scales[16] qs[64] d dmin
    Q.Q3_K: (108,),  # hmask[32] qs[64] scales[12] d
    Q.Q4_K: (0, 2),  # d dmin scales[12] qs[128]
    Q.Q5_K: (0, 2),  # d dmin scales[12] qh[32] qs[128]
    Q.Q6_K: (208,),  # ql[128] qh[64] scales[16] d
}
_QUANTIZABLE = frozenset({Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0})


# --- tensor plans ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tensor:
    """One planned tensor. ``shape`` is GGUF order (ne0 first), as the reader reports it."""

    name: str
    shape: tuple[int, ...]
    qtype: Q
    norm: bool = False  # values around 1.0 instead of around 0.0
    zero: bool = False  # every value 0 (a head whose logits all tie)

    @property
    def np_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def nbytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * type_size


def _rng(seed: int, t: _Tensor) -> np.random.Generator:
    """A generator private to one tensor: its bytes do not depend on the other tensors."""
    tag = f"{t.name}|{t.shape}|{t.qtype.name}".encode()
    return np.random.default_rng([seed, zlib.crc32(tag)])


def _random_blocks(rng: np.random.Generator, qtype: Q, n_blocks: int) -> np.ndarray:
    """``n_blocks`` random blocks of a K-quant, (n_blocks, type_size) uint8, finite scales."""
    offsets = _KQUANT_SCALE_OFFSETS.get(qtype)
    if offsets is None:
        raise ValueError(f"cannot synthesize {qtype.name} blocks")
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in offsets:
        scale = rng.uniform(1e-3, 2e-2, size=n_blocks).astype("<f2")
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def _payload(seed: int, t: _Tensor) -> np.ndarray:
    """The array to hand to ``GGUFWriter.add_tensor`` (numpy shape, or uint8 byte shape)."""
    rng = _rng(seed, t)
    if t.qtype in _KQUANT_SCALE_OFFSETS:
        block, type_size = gguf.GGML_QUANT_SIZES[t.qtype]
        rows = math.prod(t.shape[1:])
        blocks = _random_blocks(rng, t.qtype, rows * (t.shape[0] // block))
        return blocks.reshape(*t.np_shape[:-1], t.shape[0] // block * type_size)
    values = rng.standard_normal(t.np_shape, dtype=np.float32)
    values = 1.0 + 0.05 * values if t.norm else 0.02 * values
    if t.zero:
        values[...] = 0.0
    if t.qtype == Q.F32:
        return values.astype(np.float32)
    if t.qtype == Q.F16:
        return values.astype(np.float16)
    if t.qtype in _QUANTIZABLE:
        return gguf.quants.quantize(values, t.qtype)
    raise ValueError(f"cannot synthesize {t.qtype.name} tensors")


def _add_tensor(writer: GGUFWriter, seed: int, t: _Tensor) -> None:
    data = _payload(seed, t)
    raw_dtype = None if t.qtype in (Q.F32, Q.F16) else t.qtype
    writer.add_tensor(t.name, data, raw_dtype=raw_dtype)
    # The writer derives ne from the byte shape; make sure it is the one we planned.
    written = tuple(writer.tensors[-1][t.name].shape[::-1])
    if written != t.shape:
        raise RuntimeError(f"{t.name}: planned shape {t.shape}, gguf-py wrote {written}")


def _check_dims(width: int, ff: int, n_layers: int, vocab: int, head_dim: int = 16) -> None:
    if width % 32 or ff % 32 or width % head_dim:
        raise ValueError(f"width ({width}) and ff ({ff}) must be multiples of 32 and {head_dim}")
    if n_layers < 1 or vocab < 8:
        raise ValueError(f"need n_layers >= 1 and vocab >= 8 (got {n_layers}, {vocab})")


def _ffn_down_type(ff: int, layer: int) -> Q:
    if ff % 256:
        return Q.Q8_0
    return Q.Q4_K if layer % 2 == 0 else Q.Q6_K


@dataclass(frozen=True)
class _Dims:
    n_layers: int
    width: int
    ff: int
    vocab: int
    head_dim: int = 16

    @property
    def n_head(self) -> int:
        return self.width // self.head_dim

    @property
    def n_head_kv(self) -> int:
        return max(1, self.n_head // 2)


def _llama_tensors(d: _Dims, *, nextn_layers: int = 0) -> list[_Tensor]:
    w, kv = d.width, d.n_head_kv * d.head_dim
    out = [
        _Tensor("token_embd.weight", (w, d.vocab), Q.Q8_0),
        _Tensor("output_norm.weight", (w,), Q.F32, norm=True),
        _Tensor("output.weight", (w, d.vocab), Q.F16),
        _Tensor("rope_freqs.weight", (d.head_dim // 2,), Q.F32, norm=True),
    ]
    for i in range(d.n_layers):
        p = f"blk.{i}."
        out += [
            _Tensor(p + "attn_norm.weight", (w,), Q.F32, norm=True),
            _Tensor(p + "attn_q.weight", (w, w), Q.Q8_0),
            _Tensor(p + "attn_k.weight", (w, kv), Q.Q4_0),
            _Tensor(p + "attn_v.weight", (w, kv), Q.F16 if i % 2 == 0 else Q.Q8_0),
            _Tensor(p + "attn_output.weight", (w, w), Q.Q4_0),
            _Tensor(p + "ffn_norm.weight", (w,), Q.F32, norm=True),
            _Tensor(p + "ffn_gate.weight", (w, d.ff), Q.Q8_0),
            _Tensor(p + "ffn_up.weight", (w, d.ff), Q.F16 if i % 2 else Q.Q4_1),
            _Tensor(p + "ffn_down.weight", (d.ff, w), _ffn_down_type(d.ff, i)),
        ]
        if i >= d.n_layers - nextn_layers:
            out += [
                _Tensor(p + "nextn.eh_proj.weight", (2 * w, w), Q.Q8_0),
                _Tensor(p + "nextn.enorm.weight", (w,), Q.F32, norm=True),
                _Tensor(p + "nextn.hnorm.weight", (w,), Q.F32, norm=True),
                _Tensor(p + "nextn.shared_head_norm.weight", (w,), Q.F32, norm=True),
            ]
    return out


def _gemma_tensors(d: _Dims) -> list[_Tensor]:
    w, hd = d.width, d.head_dim
    q, kv = d.n_head * hd, d.n_head_kv * hd
    out = [
        _Tensor("token_embd.weight", (w, d.vocab), Q.Q8_0),  # tied: no output.weight
        _Tensor("output_norm.weight", (w,), Q.F32, norm=True),
    ]
    for i in range(d.n_layers):
        p = f"blk.{i}."
        out += [
            _Tensor(p + "attn_norm.weight", (w,), Q.F32, norm=True),
            _Tensor(p + "attn_q.weight", (w, q), Q.Q5_0),
            _Tensor(p + "attn_k.weight", (w, kv), Q.Q8_0),
            _Tensor(p + "attn_v.weight", (w, kv), Q.BF16 if i % 2 == 0 else Q.Q8_0),
            _Tensor(p + "attn_output.weight", (q, w), Q.Q5_0),
            _Tensor(p + "attn_q_norm.weight", (hd,), Q.F32, norm=True),
            _Tensor(p + "attn_k_norm.weight", (hd,), Q.F32, norm=True),
            _Tensor(p + "post_attention_norm.weight", (w,), Q.F32, norm=True),
            _Tensor(p + "ffn_norm.weight", (w,), Q.F32, norm=True),
            _Tensor(p + "ffn_gate.weight", (w, d.ff), Q.Q4_0),
            _Tensor(p + "ffn_up.weight", (w, d.ff), Q.Q4_0),
            _Tensor(p + "ffn_down.weight", (d.ff, w), Q.Q6_K if d.ff % 256 == 0 else Q.Q8_0),
            _Tensor(p + "post_ffw_norm.weight", (w,), Q.F32, norm=True),
        ]
    return out


def _qwen_tensors(d: _Dims, *, bias: bool, qk_norm: bool) -> list[_Tensor]:
    """qwen2 (q/k/v biases) and qwen3 (per-head q/k RMS norms): llama's layout plus those."""
    w, hd = d.width, d.head_dim
    q, kv = d.n_head * hd, d.n_head_kv * hd
    out = [
        _Tensor("token_embd.weight", (w, d.vocab), Q.Q8_0),
        _Tensor("output_norm.weight", (w,), Q.F32, norm=True),
        _Tensor("output.weight", (w, d.vocab), Q.Q5_1),
    ]
    for i in range(d.n_layers):
        p = f"blk.{i}."
        out += [
            _Tensor(p + "attn_norm.weight", (w,), Q.F32, norm=True),
            _Tensor(p + "attn_q.weight", (w, q), Q.Q8_0),
            _Tensor(p + "attn_k.weight", (w, kv), Q.Q5_0),
            _Tensor(p + "attn_v.weight", (w, kv), Q.BF16 if i % 2 else Q.F16),
            _Tensor(p + "attn_output.weight", (q, w), Q.Q5_1),
            _Tensor(p + "ffn_norm.weight", (w,), Q.F32, norm=True),
            _Tensor(p + "ffn_gate.weight", (w, d.ff), Q.Q4_0),
            _Tensor(p + "ffn_up.weight", (w, d.ff), Q.Q8_0),
            _Tensor(p + "ffn_down.weight", (d.ff, w), _ffn_down_type(d.ff, i + 1)),
        ]
        if bias:
            out += [
                _Tensor(p + "attn_q.bias", (q,), Q.F32),
                _Tensor(p + "attn_k.bias", (kv,), Q.F32),
                _Tensor(p + "attn_v.bias", (kv,), Q.F32),
            ]
        if qk_norm:
            out += [
                _Tensor(p + "attn_q_norm.weight", (hd,), Q.F32, norm=True),
                _Tensor(p + "attn_k_norm.weight", (hd,), Q.F32, norm=True),
            ]
    return out


# --- metadata ------------------------------------------------------------------------------------
_KV = tuple[str, Any, V, V | None]  # key, value, type, array item type


def _tokenizer_kvs(vocab: int, specials: Sequence[str], ids: dict[str, int]) -> list[_KV]:
    """A small SentencePiece-style ("llama") vocabulary with a few non-ASCII pieces."""
    words = ["▁the", "▁a", "▁of", "▁France", "▁capital", "▁is", "▁café", "▁日本", "▁Ω", "."]
    tokens = list(specials) + words
    tokens += [f"▁w{i}" for i in range(vocab - len(tokens))]
    tokens = tokens[:vocab]
    token_type = [1] * vocab  # normal
    for i, s in enumerate(specials[:vocab]):
        token_type[i] = 2 if s == "<unk>" else 3  # unknown / control
    scores = [0.0 if i < len(specials) else -float(i) for i in range(vocab)]
    out: list[_KV] = [
        ("tokenizer.ggml.model", "llama", V.STRING, None),
        ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
        ("tokenizer.ggml.scores", scores, V.ARRAY, V.FLOAT32),
        ("tokenizer.ggml.token_type", token_type, V.ARRAY, V.INT32),
    ]
    out += [(f"tokenizer.ggml.{k}", v, V.UINT32, None) for k, v in ids.items()]
    out += [
        ("tokenizer.ggml.add_bos_token", True, V.BOOL, None),
        ("tokenizer.ggml.add_eos_token", False, V.BOOL, None),
    ]
    return out


def _llama_kvs(arch: str, name: str, d: _Dims, *, nextn_layers: int = 0) -> list[_KV]:
    a = arch + "."
    kvs: list[_KV] = [
        ("general.type", "model", V.STRING, None),
        ("general.name", name, V.STRING, None),
        (a + "block_count", d.n_layers, V.UINT32, None),
        (a + "context_length", 2048, V.UINT32, None),
        (a + "embedding_length", d.width, V.UINT32, None),
        (a + "feed_forward_length", d.ff, V.UINT32, None),
        (a + "attention.head_count", d.n_head, V.UINT32, None),
        (a + "attention.head_count_kv", d.n_head_kv, V.UINT32, None),
        (a + "rope.freq_base", 10000.0, V.FLOAT32, None),
        (a + "attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32, None),
        (a + "rope.dimension_count", d.head_dim, V.UINT32, None),
        (a + "vocab_size", d.vocab, V.UINT32, None),
    ]
    if nextn_layers:
        kvs.append((a + "nextn_predict_layers", nextn_layers, V.UINT32, None))
    kvs.append(("general.file_type", int(gguf.LlamaFileType.MOSTLY_Q4_K_M), V.UINT32, None))
    specials = ["<unk>", "<s>", "</s>"]
    ids = {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}
    kvs += _tokenizer_kvs(d.vocab, specials, ids)
    kvs.append(("general.quantization_version", 2, V.UINT32, None))
    return kvs


def _gemma_kvs(d: _Dims, sliding_window: int = 512) -> list[_KV]:
    a = "gemma3."
    kvs: list[_KV] = [
        ("general.type", "model", V.STRING, None),
        ("general.name", "synth gemma-like", V.STRING, None),
        (a + "context_length", 32768, V.UINT32, None),
        (a + "embedding_length", d.width, V.UINT32, None),
        (a + "block_count", d.n_layers, V.UINT32, None),
        (a + "feed_forward_length", d.ff, V.UINT32, None),
        (a + "attention.head_count", d.n_head, V.UINT32, None),
        (a + "attention.layer_norm_rms_epsilon", 1e-6, V.FLOAT32, None),
        (a + "attention.key_length", d.head_dim, V.UINT32, None),
        (a + "attention.value_length", d.head_dim, V.UINT32, None),
        (a + "rope.freq_base", 1000000.0, V.FLOAT32, None),
        (a + "attention.sliding_window", sliding_window, V.UINT32, None),
        (a + "attention.head_count_kv", d.n_head_kv, V.UINT32, None),
        ("general.file_type", int(gguf.LlamaFileType.MOSTLY_Q4_K_M), V.UINT32, None),
    ]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    ids = {"bos_token_id": 2, "eos_token_id": 1, "unknown_token_id": 3, "padding_token_id": 0}
    kvs += _tokenizer_kvs(d.vocab, specials, ids)
    kvs.append(("general.quantization_version", 2, V.UINT32, None))
    return kvs


# --- writing -------------------------------------------------------------------------------------
def _new_writer(
    path: Path, arch: str, kvs: Sequence[_KV], alignment: int | None, **kw: Any
) -> GGUFWriter:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch, **kw)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value, vtype, sub_type in kvs:
        writer.add_key_value(key, value, vtype, sub_type)
    return writer


def _finish(writer: GGUFWriter) -> None:
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _write_model(
    path: Path,
    arch: str,
    kvs: Sequence[_KV],
    tensors: Sequence[_Tensor],
    seed: int,
    alignment: int | None,
) -> Path:
    writer = _new_writer(path, arch, kvs, alignment)
    for t in tensors:
        _add_tensor(writer, seed, t)
    _finish(writer)
    return path


def llama_like(
    path: str | Path,
    *,
    n_layers: int = 4,
    width: int = 64,
    ff: int = 256,
    vocab: int = 128,
    seed: int = 0,
    alignment: int | None = None,
    zero_head: bool = False,
    arch: str = "llama",
    f16_norm_layer: int | None = None,
) -> Path:
    """A llama-architecture model: full hyperparameter set, small tokenizer, mixed types.
    ``zero_head``: an all-zero ``output.weight``, so every logit is 0 (a tie everywhere).
    ``arch``: the same tensors and hyperparameters under another architecture name (e.g.
    ``baichuan``: a family the stage runtime refuses, for its refusal paths).
    ``f16_norm_layer``: that layer's ``attn_norm`` stored as F16, a type the stage runtime
    refuses for a norm: a model whose metadata passes and whose one layer cannot load."""
    _check_dims(width, ff, n_layers, vocab)
    d = _Dims(n_layers, width, ff, vocab)
    kvs = _llama_kvs(arch, f"synth {arch}-like", d)
    odd_norm = f"blk.{f16_norm_layer}.attn_norm.weight"
    tensors = [
        replace(t, zero=True)
        if zero_head and t.name == "output.weight"
        else replace(t, qtype=Q.F16)
        if t.name == odd_norm
        else t
        for t in _llama_tensors(d)
    ]
    return _write_model(Path(path), arch, kvs, tensors, seed, alignment)


def gemma_like(
    path: str | Path,
    *,
    n_layers: int = 4,
    width: int = 64,
    ff: int = 256,
    vocab: int = 128,
    seed: int = 0,
    alignment: int | None = None,
    sliding_window: int = 512,
) -> Path:
    """A gemma3-architecture model with tied embeddings (no ``output.weight``); its layers
    (all sliding at 4 layers: every 6th is global) see ``sliding_window`` positions back."""
    _check_dims(width, ff, n_layers, vocab)
    d = _Dims(n_layers, width, ff, vocab)
    kvs = _gemma_kvs(d, sliding_window)
    return _write_model(Path(path), "gemma3", kvs, _gemma_tensors(d), seed, alignment)


def _qwen_like(
    path: str | Path,
    arch: str,
    *,
    bias: bool,
    qk_norm: bool,
    n_layers: int,
    width: int,
    ff: int,
    vocab: int,
    seed: int,
    alignment: int | None,
) -> Path:
    _check_dims(width, ff, n_layers, vocab)
    d = _Dims(n_layers, width, ff, vocab)
    kvs = _llama_kvs(arch, f"synth {arch}-like", d)
    tensors = _qwen_tensors(d, bias=bias, qk_norm=qk_norm)
    return _write_model(Path(path), arch, kvs, tensors, seed, alignment)


def qwen3_like(
    path: str | Path,
    *,
    n_layers: int = 4,
    width: int = 64,
    ff: int = 256,
    vocab: int = 128,
    seed: int = 0,
    alignment: int | None = None,
) -> Path:
    """A qwen3-architecture model: per-head q/k RMS norms, NEOX RoPE, untied output head."""
    dims = {"n_layers": n_layers, "width": width, "ff": ff, "vocab": vocab}
    return _qwen_like(
        path, "qwen3", bias=False, qk_norm=True, seed=seed, alignment=alignment, **dims
    )


def qwen2_like(
    path: str | Path,
    *,
    n_layers: int = 4,
    width: int = 64,
    ff: int = 256,
    vocab: int = 128,
    seed: int = 0,
    alignment: int | None = None,
) -> Path:
    """A qwen2-architecture model: q/k/v biases, NEOX RoPE, untied output head."""
    dims = {"n_layers": n_layers, "width": width, "ff": ff, "vocab": vocab}
    return _qwen_like(
        path, "qwen2", bias=True, qk_norm=False, seed=seed, alignment=alignment, **dims
    )


def nextn_like(
    path: str | Path,
    *,
    n_layers: int = 4,
    width: int = 64,
    ff: int = 256,
    vocab: int = 128,
    seed: int = 0,
    arch: str = "glm4moe",
    alignment: int | None = None,
) -> Path:
    """Llama-like under ``arch`` with ``<arch>.nextn_predict_layers = 1`` and the NextN/MTP
    tensors ``blk.{n_layers-1}.nextn.{eh_proj,enorm,hnorm,shared_head_norm}.weight``.

    As in GLM conversions, ``block_count`` counts the NextN layer (it is the last block).
    The container and metadata are real; llama.cpp will not *run* it as glm4moe (that also
    needs MoE hyperparameters and expert tensors), unlike llama_like, gemma_like and split_set.
    """
    _check_dims(width, ff, n_layers, vocab)
    d = _Dims(n_layers, width, ff, vocab)
    kvs = _llama_kvs(arch, "synth nextn-like", d, nextn_layers=1)
    tensors = _llama_tensors(d, nextn_layers=1)
    return _write_model(Path(path), arch, kvs, tensors, seed, alignment)


def with_text_vocabulary(src: str | Path, dst: str | Path) -> Path:
    """``src`` (a canary model, say: its ``▁w<i>`` vocabulary encodes no text) written to
    ``dst`` with this module's vocabulary of the same size instead, so that prompts of text
    ("a Ω a") reach it; every other key and every tensor unchanged (raw bytes)."""
    from skippy.gguf.reader import open_gguf

    with open_gguf(Path(src)) as g:
        arch = str(g.value("general.architecture"))
        vocab = len(g.value("tokenizer.ggml.tokens"))
        kvs: list[_KV] = [
            (k, g.value(k), V(f.value_type), V(f.item_type) if f.item_type is not None else None)
            for k, f in g.fields.items()
            if not k.startswith("tokenizer.")
            and k not in ("general.architecture", "general.alignment")
        ]
        tensors = [
            (t.name, t.shape, Q(t.ggml_type), g.read_range(t.data_start, t.nbytes)) for t in g
        ]
    specials = ["<unk>", "<s>", "</s>"]
    kvs += _tokenizer_kvs(
        vocab, specials, {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}
    )
    writer = _new_writer(Path(dst), arch, kvs, None)
    for name, shape, qtype, raw in tensors:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        byte_shape = (*reversed(shape[1:]), shape[0] // block * size)
        data = np.frombuffer(raw, dtype=np.uint8).reshape(byte_shape)
        writer.add_tensor(name, data, raw_shape=byte_shape, raw_dtype=qtype)
    _finish(writer)
    return Path(dst)


# --- a family the stage runtime does not cover (the one-node llama.cpp serving path) -------------
def uncovered_like(
    path: str | Path,
    *,
    arch: str = "exaone",
    n_layers: int = 4,
    width: int = 64,
    ff: int = 256,
    vocab: int = 128,
    seed: int = 0,
    alignment: int | None = None,
) -> Path:
    """llama_like's tensors and hyperparameters under ``arch``, an architecture the stage
    runtime (skippy.runtime.model) refuses and llama.cpp runs: its exaone builder reads
    exactly llama's tensor names and keys (rope_freqs included)."""
    _check_dims(width, ff, n_layers, vocab)
    d = _Dims(n_layers, width, ff, vocab)
    kvs = _llama_kvs(arch, f"synth {arch}-like", d)
    return _write_model(Path(path), arch, kvs, _llama_tensors(d), seed, alignment)


# --- a mixture of experts, for size accounting and MoE validation -----------------------------
def moe_like(
    path: str | Path,
    *,
    experts: int = 4,
    used: int = 2,
    n_layers: int = 2,
    width: int = 64,
    expert_ff: int = 64,
    vocab: int = 64,
    dense_layers: int = 0,
    shared_ff: int = 0,
    seed: int = 0,
    meta_experts: int | None = None,
    omit_expert_count: bool = False,
    meta_expert_ff: int | None = None,
    router_shape: tuple[int, ...] | None = None,
    expert_dim: int | None = None,
) -> Path:
    """A qwen3moe-shaped mixture of experts, for size accounting and MoE validation tests
    only (not a model to run: a richer generator of runnable MoE families lives elsewhere).

    Each layer: qwen3 attention (per-head q/k norms), a router ``ffn_gate_inp`` (F32,
    ``[width, experts]``) and routed experts ``ffn_{gate,up,down}_exps`` (rank 3, experts
    last; Q8_0, F16 and Q4_0 so their bytes differ). ``dense_layers``: the first N layers
    have a dense FFN instead (``ffn_{gate,up,down}``, ``expert_ff`` wide); ``shared_ff`` > 0
    adds shared experts ``ffn_{gate,up,down}_shexp``. Metadata: ``expert_count`` =
    ``meta_experts`` (default ``experts``; left out with ``omit_expert_count``),
    ``expert_used_count`` = ``used``, ``expert_feed_forward_length`` = ``meta_expert_ff``
    (default ``expert_ff``). Malformed variants: ``router_shape`` (GGUF order) and
    ``expert_dim`` (the experts dimension every expert tensor is written with)."""
    head_dim = 16
    _check_dims(width, expert_ff, n_layers, vocab, head_dim)
    d = _Dims(n_layers, width, expert_ff, vocab, head_dim=head_dim)
    w, hd, e = width, head_dim, experts if expert_dim is None else expert_dim
    q, kv = d.n_head * hd, d.n_head_kv * hd
    tensors = [
        _Tensor("token_embd.weight", (w, vocab), Q.Q8_0),
        _Tensor("output_norm.weight", (w,), Q.F32, norm=True),
        _Tensor("output.weight", (w, vocab), Q.Q8_0),
    ]
    for i in range(n_layers):
        p = f"blk.{i}."
        tensors += [
            _Tensor(p + "attn_norm.weight", (w,), Q.F32, norm=True),
            _Tensor(p + "attn_q.weight", (w, q), Q.Q8_0),
            _Tensor(p + "attn_k.weight", (w, kv), Q.Q8_0),
            _Tensor(p + "attn_v.weight", (w, kv), Q.Q8_0),
            _Tensor(p + "attn_output.weight", (q, w), Q.Q8_0),
            _Tensor(p + "attn_q_norm.weight", (hd,), Q.F32, norm=True),
            _Tensor(p + "attn_k_norm.weight", (hd,), Q.F32, norm=True),
            _Tensor(p + "ffn_norm.weight", (w,), Q.F32, norm=True),
        ]
        if i < dense_layers:
            tensors += [
                _Tensor(p + "ffn_gate.weight", (w, expert_ff), Q.Q8_0),
                _Tensor(p + "ffn_up.weight", (w, expert_ff), Q.F16),
                _Tensor(p + "ffn_down.weight", (expert_ff, w), Q.Q4_0),
            ]
            continue
        tensors += [
            _Tensor(p + "ffn_gate_inp.weight", router_shape or (w, experts), Q.F32),
            _Tensor(p + "ffn_gate_exps.weight", (w, expert_ff, e), Q.Q8_0),
            _Tensor(p + "ffn_up_exps.weight", (w, expert_ff, e), Q.F16),
            _Tensor(p + "ffn_down_exps.weight", (expert_ff, w, e), Q.Q4_0),
        ]
        if shared_ff:
            tensors += [
                _Tensor(p + "ffn_gate_shexp.weight", (w, shared_ff), Q.Q8_0),
                _Tensor(p + "ffn_up_shexp.weight", (w, shared_ff), Q.Q8_0),
                _Tensor(p + "ffn_down_shexp.weight", (shared_ff, w), Q.Q8_0),
            ]
    a = "qwen3moe."
    kvs = _llama_kvs("qwen3moe", "synth qwen3moe-like", d)
    kvs += [
        (a + "attention.key_length", hd, V.UINT32, None),
        (a + "attention.value_length", hd, V.UINT32, None),
        (a + "expert_used_count", used, V.UINT32, None),
        (a + "expert_feed_forward_length", meta_expert_ff or expert_ff, V.UINT32, None),
    ]
    if not omit_expert_count:
        count = experts if meta_experts is None else meta_experts
        kvs.append((a + "expert_count", count, V.UINT32, None))
    if shared_ff:
        kvs.append((a + "expert_shared_feed_forward_length", shared_ff, V.UINT32, None))
    return _write_model(Path(path), "qwen3moe", kvs, tensors, seed, None)


def split_set(
    directory: str | Path,
    stem: str,
    *,
    n_shards: int = 2,
    metadata_only_first: bool = False,
    n_layers: int = 4,
    width: int = 64,
    ff: int = 256,
    vocab: int = 128,
    seed: int = 0,
) -> list[Path]:
    """``llama_like`` (same arguments, same tensors) written as a llama.cpp split set.

    gguf-py names the parts ``{stem}-{k:05d}-of-{n:05d}.gguf`` (k from 1) and writes
    ``split.no`` (u16), ``split.count`` (u16) and ``split.tensors.count`` (i32) into every part;
    part 1 carries the whole KV section, the others only those three keys (and no
    ``general.architecture``). With ``metadata_only_first`` the first part holds no tensors
    (llama.cpp's ``gguf-split --no-tensor-first-split``). Returns the paths in ``split.no`` order.
    """
    _check_dims(width, ff, n_layers, vocab)
    tensor_shards = n_shards - 1 if metadata_only_first else n_shards
    if tensor_shards < 1 or n_shards < 2:
        raise ValueError(f"a split set needs at least 2 parts (got n_shards={n_shards})")
    d = _Dims(n_layers, width, ff, vocab)
    tensors = _llama_tensors(d)
    per_shard = -(-len(tensors) // tensor_shards)
    kvs = _llama_kvs("llama", "synth llama-like", d)
    base = Path(directory) / f"{stem}.gguf"
    writer = _new_writer(
        base,
        "llama",
        kvs,
        None,
        split_max_tensors=per_shard,
        small_first_shard=metadata_only_first,
    )
    try:
        for t in tensors:
            _add_tensor(writer, seed, t)
        if len(writer.tensors) != n_shards:
            raise ValueError(
                f"{len(tensors)} tensors cannot be spread over exactly {n_shards} parts "
                f"({per_shard} per part gives {len(writer.tensors)}); choose another n_shards"
            )
        paths: list[Path] = writer.format_shard_names(base)
    except BaseException:
        writer.close()
        raise
    _finish(writer)
    return paths


def projector(path: str | Path, *, seed: int = 0) -> Path:
    """A small llama.cpp mmproj (clip.cpp) file: arch ``clip``, ``general.type = "mmproj"``."""
    e, ff, proj, patch, image = 64, 128, 64, 8, 32
    n_patches = (image // patch) ** 2
    kvs: list[_KV] = [
        ("general.type", "mmproj", V.STRING, None),
        ("general.name", "synth projector", V.STRING, None),
        ("clip.has_vision_encoder", True, V.BOOL, None),
        ("clip.projector_type", "mlp", V.STRING, None),
        ("clip.vision.image_size", image, V.UINT32, None),
        ("clip.vision.patch_size", patch, V.UINT32, None),
        ("clip.vision.embedding_length", e, V.UINT32, None),
        ("clip.vision.feed_forward_length", ff, V.UINT32, None),
        ("clip.vision.projection_dim", proj, V.UINT32, None),
        ("clip.vision.block_count", 1, V.UINT32, None),
        ("clip.vision.attention.head_count", 4, V.UINT32, None),
        ("clip.vision.attention.layer_norm_epsilon", 1e-6, V.FLOAT32, None),
        ("clip.vision.image_mean", [0.5, 0.5, 0.5], V.ARRAY, V.FLOAT32),
        ("clip.vision.image_std", [0.5, 0.5, 0.5], V.ARRAY, V.FLOAT32),
        ("clip.use_gelu", True, V.BOOL, None),
        ("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16), V.UINT32, None),
    ]
    tensors = [
        _Tensor("v.patch_embd.weight", (patch, patch, 3, e), Q.F16),  # 4-D
        _Tensor("v.patch_embd.bias", (e,), Q.F32),
        _Tensor("v.position_embd.weight", (e, n_patches), Q.F16),
        _Tensor("v.blk.0.ln1.weight", (e,), Q.F32, norm=True),
        _Tensor("v.blk.0.ln1.bias", (e,), Q.F32),
        _Tensor("v.blk.0.attn_q.weight", (e, e), Q.F16),
        _Tensor("v.blk.0.attn_k.weight", (e, e), Q.F16),
        _Tensor("v.blk.0.attn_v.weight", (e, e), Q.F16),
        _Tensor("v.blk.0.attn_out.weight", (e, e), Q.F16),
        _Tensor("v.blk.0.ln2.weight", (e,), Q.F32, norm=True),
        _Tensor("v.blk.0.ln2.bias", (e,), Q.F32),
        _Tensor("v.blk.0.ffn_up.weight", (e, ff), Q.F16),
        _Tensor("v.blk.0.ffn_down.weight", (ff, e), Q.F16),
        _Tensor("v.post_ln.weight", (e,), Q.F32, norm=True),
        _Tensor("mm.0.weight", (e, proj), Q.F16),
        _Tensor("mm.0.bias", (proj,), Q.F32),
        _Tensor("mm.2.weight", (proj, proj), Q.F16),
        _Tensor("mm.2.bias", (proj,), Q.F32),
    ]
    return _write_model(Path(path), "clip", kvs, tensors, seed, None)


# --- big: streamed, never held in memory --------------------------------------------------------
_BIG_WIDTHS = (256, 512, 1024, 2048, 4096)
_PATTERN_BYTES = 1 << 20


def _big_layer(i: int, w: int, ff: int) -> list[_Tensor]:
    p = f"blk.{i}."
    return [
        _Tensor(p + "attn_norm.weight", (w,), Q.F32, norm=True),
        _Tensor(p + "attn_q.weight", (w, w), Q.Q8_0),
        _Tensor(p + "attn_k.weight", (w, w), Q.Q8_0),
        _Tensor(p + "attn_v.weight", (w, w), Q.Q8_0),
        _Tensor(p + "attn_output.weight", (w, w), Q.Q8_0),
        _Tensor(p + "ffn_norm.weight", (w,), Q.F32, norm=True),
        _Tensor(p + "ffn_gate.weight", (w, ff), Q.Q4_K),
        _Tensor(p + "ffn_up.weight", (w, ff), Q.Q4_K),
        _Tensor(p + "ffn_down.weight", (ff, w), Q.Q6_K),
    ]


def _big_plan(target_bytes: int) -> tuple[_Dims, list[_Tensor]]:
    """Pick width, layer count and vocabulary so the tensors add up to about target_bytes."""
    width = _BIG_WIDTHS[0]
    for w in _BIG_WIDTHS:
        if sum(t.nbytes for t in _big_layer(0, w, 4 * w)) * 8 <= target_bytes:
            width = w
    ff = 4 * width
    per_layer = sum(t.nbytes for t in _big_layer(0, width, ff))
    per_token = width // 32 * 34 + width // 256 * 210  # token_embd Q8_0 + output Q6_K row
    min_vocab = 256
    n_layers = max(1, (target_bytes - min_vocab * per_token) // per_layer)
    # The tokenizer section costs ~17 bytes per token in the header; keep it out of the budget.
    vocab = max(min_vocab, (target_bytes - n_layers * per_layer - 64 * 1024) // (per_token + 17))
    d = _Dims(n_layers, width, ff, vocab, head_dim=64)
    tensors = [
        _Tensor("token_embd.weight", (width, vocab), Q.Q8_0),
        _Tensor("output_norm.weight", (width,), Q.F32, norm=True),
        _Tensor("output.weight", (width, vocab), Q.Q6_K),
    ]
    for i in range(n_layers):
        tensors += _big_layer(i, width, ff)
    return d, tensors


def _pattern(seed: int, qtype: Q) -> bytes:
    """About 1 MiB of valid, seeded blocks of ``qtype``, reused cyclically for big tensors."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = _PATTERN_BYTES // type_size
    probe = _Tensor(f"pattern.{qtype.name}", (block * n_blocks,), qtype)
    return _payload(seed, probe).tobytes()


def _stream_tensor(out: Any, seed: int, index: int, t: _Tensor, patterns: dict[Q, bytes]) -> None:
    if t.qtype in (Q.F32, Q.F16):
        out.write(_payload(seed, t).tobytes())
        return
    pat = patterns.get(t.qtype)
    if pat is None:
        pat = patterns[t.qtype] = _pattern(seed, t.qtype)
    type_size = gguf.GGML_QUANT_SIZES[t.qtype][1]
    view = memoryview(pat)
    n_blocks = len(pat) // type_size
    pos = (index * 7919 % n_blocks) * type_size  # each tensor starts elsewhere in the pattern
    left = t.nbytes
    while left:
        chunk = view[pos : pos + left]
        out.write(chunk)
        left -= len(chunk)
        pos = 0


def big(path: str | Path, target_bytes: int, *, seed: int = 0) -> Path:
    """A llama-like model of about ``target_bytes``, streamed to disk in ~1 MiB pieces: test
    data for transfers, not a model to run (its K and V are full width, which its grouped
    heads do not match: the stage runtime refuses it with ``fragment_tensor_shape``).

    The header comes from ``GGUFWriter`` (tensor infos only); the payload is a seeded block
    pattern per type (valid fp16 scales, not zeros), cycled with a per-tensor start. Memory stays
    at a few MiB whatever the size (2 GiB writes in seconds).
    """
    if target_bytes < 1 << 20:
        raise ValueError(f"big() is for sizes of 1 MiB and more (got {target_bytes})")
    path = Path(path)
    d, tensors = _big_plan(target_bytes)
    kvs = _llama_kvs("llama", "synth big", d)
    writer = _new_writer(path, "llama", kvs, None)
    for t in tensors:
        if t.qtype in (Q.F32, Q.F16):
            dtype = np.dtype(np.float32 if t.qtype == Q.F32 else np.float16)
            writer.add_tensor_info(t.name, t.np_shape, dtype, t.nbytes)
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[t.qtype]
            byte_shape = (*t.np_shape[:-1], t.shape[0] // block * type_size)
            writer.add_tensor_info(
                t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype
            )
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if writer.fout is None:  # the writer opens its files in write_header_to_file
            raise RuntimeError("GGUFWriter did not open its output file")
        out = writer.fout[0]
        writer.write_padding(out, out.tell())
        patterns: dict[Q, bytes] = {}
        for index, t in enumerate(tensors):
            _stream_tensor(out, seed, index, t, patterns)
            writer.write_padding(out, t.nbytes)
    finally:
        writer.close()
    return path


# --- high precision: a source to quantize -------------------------------------------------------
_HP_DTYPES = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16}
_HP_FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
}


def high_precision(
    path: str | Path,
    *,
    dtype: str = "F32",
    n_layers: int = 8,
    width: int = 256,
    ff: int = 640,
    vocab: int = 512,
    n_head_kv: int = 2,
    tied: bool = False,
    n_experts: int = 0,
    seed: int = 0,
) -> Path:
    """A llama-architecture model as a converter writes it before quantization: every matrix
    in ``dtype`` (F32, F16 or BF16), norms in F32, ``general.file_type`` to match.

    The defaults exercise llama.cpp's per-tensor rules: 8 layers (Q4_K_M gives attn_v and
    ffn_down of layers 0, 3, 6, 7 more bits), width 256 (K-quant rows fit), ff 640 (ffn_down
    rows do not fit 256-blocks: K-quants fall back to 32-block types), 4 query heads over
    ``n_head_kv`` KV heads (n_gqa 2), and ``tied`` drops ``output.weight`` (the embeddings
    then take the output's type). ``n_experts`` > 0 makes the FFN a mixture of experts
    (``ffn_{gate,up,down}_exps`` of shape (…, …, n_experts), a router ``ffn_gate_inp``,
    ``expert_count`` / ``expert_used_count`` = 2): 3-D tensors, and llama.cpp's 8-expert rules.
    """
    if dtype not in _HP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_HP_DTYPES)} (got {dtype!r})")
    head_dim = 64
    _check_dims(width, ff, n_layers, vocab, head_dim)
    d = _Dims(n_layers, width, ff, vocab, head_dim=head_dim)
    if not 1 <= n_head_kv <= d.n_head or d.n_head % n_head_kv:
        raise ValueError(f"n_head_kv must divide the {d.n_head} heads (got {n_head_kv})")
    q, kv, w = _HP_DTYPES[dtype], n_head_kv * head_dim, width
    tensors = [
        _Tensor("token_embd.weight", (w, vocab), q),
        _Tensor("output_norm.weight", (w,), Q.F32, norm=True),
    ]
    if not tied:
        tensors.append(_Tensor("output.weight", (w, vocab), q))
    for i in range(n_layers):
        p = f"blk.{i}."
        tensors += [
            _Tensor(p + "attn_norm.weight", (w,), Q.F32, norm=True),
            _Tensor(p + "attn_q.weight", (w, w), q),
            _Tensor(p + "attn_k.weight", (w, kv), q),
            _Tensor(p + "attn_v.weight", (w, kv), q),
            _Tensor(p + "attn_output.weight", (w, w), q),
            _Tensor(p + "ffn_norm.weight", (w,), Q.F32, norm=True),
        ]
        if n_experts:
            e = n_experts
            tensors += [
                _Tensor(p + "ffn_gate_inp.weight", (w, e), Q.F32),
                _Tensor(p + "ffn_gate_exps.weight", (w, ff, e), q),
                _Tensor(p + "ffn_up_exps.weight", (w, ff, e), q),
                _Tensor(p + "ffn_down_exps.weight", (ff, w, e), q),
            ]
        else:
            tensors += [
                _Tensor(p + "ffn_gate.weight", (w, ff), q),
                _Tensor(p + "ffn_up.weight", (w, ff), q),
                _Tensor(p + "ffn_down.weight", (ff, w), q),
            ]
    kvs = [
        (key, n_head_kv, vtype, sub)
        if key == "llama.attention.head_count_kv"
        else (key, int(_HP_FILE_TYPES[dtype]), vtype, sub)
        if key == "general.file_type"
        else (key, value, vtype, sub)
        for key, value, vtype, sub in _llama_kvs("llama", f"synth {dtype} llama", d)
        if key != "general.quantization_version"  # converters write none before quantizing
    ]
    if n_experts:
        kvs += [
            ("llama.expert_count", n_experts, V.UINT32, None),
            ("llama.expert_used_count", 2, V.UINT32, None),
        ]
    return _write_model(Path(path), "llama", kvs, tensors, seed, None)


def imatrix(model: str | Path, path: str | Path, *, seed: int = 0, chunks: int = 4) -> Path:
    """An importance matrix for ``model`` in llama-imatrix's GGUF layout: per matrix weight
    ``NAME.in_sum2`` (F32, ne0 x experts) and ``NAME.counts`` (F32, 1 x experts), plus the
    ``imatrix.datasets`` / ``chunk_count`` / ``chunk_size`` keys llama-quantize requires.
    Values are seeded positive sums (the token embeddings get none, as in llama-imatrix)."""
    from skippy.gguf.reader import open_gguf

    with open_gguf(model) as g:
        shapes = [
            (t.name, t.shape)
            for t in g.tensors
            if len(t.shape) >= 2 and t.name.endswith(".weight") and "token_embd" not in t.name
        ]
    rng = np.random.default_rng(seed)
    chunk_size = 512
    writer = GGUFWriter(Path(path), "imatrix")
    writer.add_type("imatrix")
    writer.add_array("imatrix.datasets", ["synthetic"])
    writer.add_uint32("imatrix.chunk_count", chunks)
    writer.add_uint32("imatrix.chunk_size", chunk_size)
    for name, shape in shapes:
        experts = shape[2] if len(shape) > 2 else 1
        tokens = float(chunks * chunk_size)
        sums = rng.uniform(0.01, 2.0, size=(experts, shape[0])).astype(np.float32) * tokens
        writer.add_tensor(f"{name}.in_sum2", sums)
        writer.add_tensor(f"{name}.counts", np.full((experts, 1), tokens, dtype=np.float32))
    _finish(writer)
    return Path(path)


# --- CLI -----------------------------------------------------------------------------------------
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``2GiB``, ``512M``, ``1.5G`` or plain bytes -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB, 512MiB, 1048576)")
    scale = 1024 ** "_KMGT".index(m.group(2).upper() or "_")
    return int(float(m.group(1)) * scale)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="synth_gguf.py",
        description="Write deterministic synthetic GGUF files (tiny real models) for tests.",
    )
    p.add_argument("kind", choices=KINDS, type=lambda s: s.replace("-", "_"))
    p.add_argument("out", type=Path, help="output file (split_set: output directory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--ff", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--alignment", type=int, default=None, help="write general.alignment")
    p.add_argument("--stem", default="model", help="split_set: file name stem")
    p.add_argument("--n-shards", type=int, default=2, help="split_set: number of parts")
    p.add_argument(
        "--metadata-only-first", action="store_true", help="split_set: first part has no tensors"
    )
    p.add_argument("--arch", default="glm4moe", help="nextn_like: architecture name")
    p.add_argument("--target-bytes", type=parse_size, default=None, help="big: e.g. 2GiB")
    p.add_argument("--dtype", default="F32", help="high_precision: F32, F16 or BF16")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    model = {
        "n_layers": args.n_layers,
        "width": args.width,
        "ff": args.ff,
        "vocab": args.vocab,
        "seed": args.seed,
    }
    makers: dict[str, Callable[[], Path | list[Path]]] = {
        "llama_like": lambda: llama_like(args.out, alignment=args.alignment, **model),
        "gemma_like": lambda: gemma_like(args.out, alignment=args.alignment, **model),
        "qwen3_like": lambda: qwen3_like(args.out, alignment=args.alignment, **model),
        "qwen2_like": lambda: qwen2_like(args.out, alignment=args.alignment, **model),
        "nextn_like": lambda: nextn_like(
            args.out, arch=args.arch, alignment=args.alignment, **model
        ),
        "split_set": lambda: split_set(
            args.out,
            args.stem,
            n_shards=args.n_shards,
            metadata_only_first=args.metadata_only_first,
            **model,
        ),
        "projector": lambda: projector(args.out, seed=args.seed),
        "big": lambda: big(args.out, args.target_bytes, seed=args.seed),
        "high_precision": lambda: high_precision(args.out, dtype=args.dtype, **model),
    }
    if args.kind == "big" and args.target_bytes is None:
        print("synth_gguf.py: big needs --target-bytes", file=sys.stderr)
        return 2
    try:
        result = makers[args.kind]()
    except ValueError as exc:
        print(f"synth_gguf.py: {exc}", file=sys.stderr)
        return 2
    for p in result if isinstance(result, list) else [result]:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
