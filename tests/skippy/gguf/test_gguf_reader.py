"""The bounded GGUF reader, in layers.

1. Differential parity with gguf-py's ``GGUFReader`` on every synthetic kind and on the real
   gemma3-270m model (slow): same KV keys in order, types, values, record spans, tensors.
2. The synthetic fixtures themselves (tests/support/synth_gguf.py): deterministic, the split set
   equals the whole model, the kinds carry what their docstrings promise.
3. Robustness: truncations, random header mutations (hypothesis) and hand-built headers, one
   per error code. Anything escaping other than ``GGUFFormatError`` is a failure.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import synth_gguf
from conftest import REPO_ROOT, SYNTH_FILE_IDS, SynthModels, take_gemma_parity_child
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf import GGUFValueType as V
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from skippy.errors import GGUFFormatError
from skippy.gguf.constants import MAX_ARRAY_LEN, MAX_STRING_BYTES
from skippy.gguf.reader import GGUFFile, open_gguf

_PSEUDO_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


# ================================================================================================
# 1. Differential parity with gguf.GGUFReader
# ================================================================================================
def _ref_fields(ref: GGUFReader) -> dict[str, Any]:
    return {k: f for k, f in ref.fields.items() if k not in _PSEUDO_FIELDS}


def _field_span(field: Any) -> tuple[int, int]:
    return field.offset, field.offset + sum(int(p.nbytes) for p in field.parts)


def _assert_kv_parity(ours: GGUFFile, ref: GGUFReader, *, full_arrays: bool) -> None:
    ref_fields = _ref_fields(ref)
    assert list(ours.fields) == list(ref_fields)
    for key, rf in ref_fields.items():
        f = ours.fields[key]
        assert f.value_type == rf.types[0], key
        assert f.key == key
        assert (f.start, f.end) == _field_span(rf), key
        if f.value_type == V.ARRAY:
            assert f.count == len(rf.data), key
            if len(rf.types) > 1:
                assert f.item_type == rf.types[1], key
            if full_arrays:
                assert ours.value(key) == rf.contents(), key
        else:
            assert f.count == 1
            assert f.item_type is None
            assert ours.value(key) == rf.contents(), key
            assert ours.get(key) == rf.contents(), key


def _assert_tensor_parity(ours: GGUFFile, ref: GGUFReader, *, compare_data: bool) -> None:
    assert ours.alignment == ref.alignment
    assert ours.data_offset == ref.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t, rt in zip(ours.tensors, ref.tensors, strict=True):
        assert t.ggml_type == int(rt.tensor_type), t.name
        assert t.shape == tuple(int(d) for d in rt.shape), t.name
        assert t.data_start == rt.data_offset, t.name
        assert t.offset == rt.data_offset - ref.data_offset, t.name
        assert t.nbytes == int(rt.n_bytes), t.name
        assert t.n_elements == int(rt.n_elements), t.name
        assert ours.tensor(t.name) is t
        if compare_data:
            assert ours.read_range(t.data_start, t.nbytes) == rt.data.tobytes(), t.name


def _header(n_tensors: int, n_kv: int, *, version: int = 3, magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv)


def _pad(data: bytes, alignment: int = 32) -> bytes:
    return data + b"\0" * (-len(data) % alignment)


def _assert_raw_fields_reparse(ours: GGUFFile, tmp_path: Path) -> None:
    """Every record's raw bytes, copied into a fresh file, parse back to the same KV."""
    blob = _pad(
        _header(0, len(ours.fields)) + b"".join(ours.raw_field(k) for k in ours.fields),
        ours.alignment,
    )
    copy = tmp_path / "raw-fields.gguf"
    copy.write_bytes(blob)
    ref = GGUFReader(copy)
    with open_gguf(copy) as again:
        assert list(again.fields) == list(ours.fields)
        for key, f in ours.fields.items():
            g = again.fields[key]
            assert (g.value_type, g.item_type, g.count) == (f.value_type, f.item_type, f.count)
            assert again.raw_field(key) == ours.raw_field(key)
            assert again.value(key) == ours.value(key) == _ref_fields(ref)[key].contents(), key


@pytest.mark.parametrize("file_id", SYNTH_FILE_IDS)
def test_parity_with_gguf_reader(synth_dir: SynthModels, file_id: str, tmp_path: Path) -> None:
    path = synth_dir.files()[file_id]
    ref = GGUFReader(path)
    with open_gguf(path) as ours:
        assert ours.version == 3
        assert ours.file_size == path.stat().st_size
        _assert_kv_parity(ours, ref, full_arrays=True)
        _assert_tensor_parity(ours, ref, compare_data=True)
        _assert_raw_fields_reparse(ours, tmp_path)


def test_synth_files_cover_ids(synth_dir: SynthModels) -> None:
    assert tuple(synth_dir.files()) == SYNTH_FILE_IDS


@pytest.mark.slow
def test_parity_with_gguf_reader_on_gemma3(gemma_gguf: Path) -> None:
    """``gemma_parity`` runs in a child started when collection ended (tests/conftest.py):
    gguf-py's reader spends ~12-20 s on this file, overlapped with the tests before this one."""
    child = take_gemma_parity_child(gemma_gguf)
    try:
        _, err = child.communicate(timeout=600)
    finally:
        if child.returncode is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err[-6000:]


def gemma_parity(path: str | Path) -> None:
    """Our reader and gguf-py's agree on gemma3-270m (run in a child; raises on a mismatch)."""
    ref = GGUFReader(path)  # ~12-18 s: 262k-entry vocabulary as numpy views
    with open_gguf(Path(path)) as ours:
        _assert_kv_parity(ours, ref, full_arrays=False)
        _assert_tensor_parity(ours, ref, compare_data=False)
        assert ours.value("general.architecture") == "gemma3"
        assert ours.value("gemma3.block_count") == 18
        assert "output.weight" not in {t.name for t in ours.tensors}
        assert len(ours.tensors) == len(ref.tensors)

        tokens_ref = ref.fields["tokenizer.ggml.tokens"]
        tokens = ours.value("tokenizer.ggml.tokens")
        assert len(tokens) == len(tokens_ref.data) == ours.fields["tokenizer.ggml.tokens"].count
        assert len(tokens) == 262144
        for i in [*range(8), *range(len(tokens) - 8, len(tokens))]:
            assert tokens[i] == tokens_ref.contents(i), i
        scores_ref = ref.fields["tokenizer.ggml.scores"]
        scores = ours.value("tokenizer.ggml.scores")
        assert len(scores) == len(tokens)
        assert scores[:8] == [scores_ref.contents(i) for i in range(8)]


@pytest.mark.slow
def test_opens_gemma3_without_decoding_the_vocabulary(gemma_gguf: Path) -> None:
    # gguf.GGUFReader takes ~12 s on this file because it decodes 262,144 tokens into objects;
    # ours skips array elements until asked. Measured as allocations, not time: opening traces
    # ~0.15 MB, decoding the vocabulary's scores ~10 MB (the positive control: the measure
    # sees a decoded 262,144-entry array; the token strings, ~22 MB, take ~10 s to decode
    # under tracemalloc, so they are counted after it stops).
    import tracemalloc

    tracemalloc.start()
    try:
        with open_gguf(gemma_gguf) as g:
            _, open_peak = tracemalloc.get_traced_memory()
            assert g.file_size == 253_113_024
            assert len(g.tensors) > 0
            assert len(g.value("tokenizer.ggml.scores")) == 262144
            _, decoded_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert open_peak < 2 << 20, f"opening allocated {open_peak} bytes"
    assert decoded_peak > 8 * open_peak  # the measure sees a decoded vocabulary array
    with open_gguf(gemma_gguf) as g:
        assert len(g.value("tokenizer.ggml.tokens")) == 262144


# ================================================================================================
# 2. The synthetic fixtures
# ================================================================================================
_MAKERS: dict[str, Callable[[Path], Path]] = {
    "llama": lambda d: synth_gguf.llama_like(d / "llama.gguf"),
    "gemma": lambda d: synth_gguf.gemma_like(d / "gemma.gguf", alignment=64),
    "projector": lambda d: synth_gguf.projector(d / "mmproj.gguf"),
    "nextn": lambda d: synth_gguf.nextn_like(d / "nextn.gguf"),
}


@pytest.mark.parametrize("kind", sorted(_MAKERS))
def test_synth_is_deterministic(synth_dir: SynthModels, kind: str, tmp_path: Path) -> None:
    again = _MAKERS[kind](tmp_path)
    assert again.read_bytes() == getattr(synth_dir, kind).read_bytes()


def test_synth_seed_changes_tensor_bytes_only(synth_dir: SynthModels, tmp_path: Path) -> None:
    other = synth_gguf.llama_like(tmp_path / "seed1.gguf", seed=1)
    with open_gguf(synth_dir.llama) as a, open_gguf(other) as b:
        assert [a.raw_field(k) for k in a.fields] == [b.raw_field(k) for k in b.fields]
        assert [(t.name, t.shape, t.ggml_type) for t in a] == [
            (t.name, t.shape, t.ggml_type) for t in b
        ]
        for t in a:
            u = b.tensor(t.name)
            assert a.read_range(t.data_start, t.nbytes) != b.read_range(u.data_start, u.nbytes)


def test_split_set_is_deterministic(synth_dir: SynthModels, tmp_path: Path) -> None:
    again = synth_gguf.split_set(tmp_path, "llama", n_shards=2)
    assert [p.name for p in again] == [p.name for p in synth_dir.split]
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in synth_dir.split]


def _split_facts(paths: Sequence[Path]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        with open_gguf(p) as g:
            out.append(
                {
                    "types": {
                        k: g.fields[k].value_type for k in g.fields if k.startswith("split.")
                    },
                    "values": {k: g.value(k) for k in g.fields if k.startswith("split.")},
                    "n_keys": len(g.fields),
                    "n_tensors": len(g.tensors),
                }
            )
    return out


def test_split_set_has_llama_cpp_split_keys(synth_dir: SynthModels) -> None:
    assert [p.name for p in synth_dir.split] == [
        "llama-00001-of-00002.gguf",
        "llama-00002-of-00002.gguf",
    ]
    facts = _split_facts(synth_dir.split)
    with open_gguf(synth_dir.llama) as whole:
        n_tensors = len(whole.tensors)
        n_keys = len(whole.fields)
    for no, f in enumerate(facts):
        # gguf-py writes all three keys into every part; llama.cpp needs split.no (u16) in every
        # part and split.count (u16) and split.tensors.count (i32) in part 0.
        assert f["types"] == {
            "split.no": V.UINT16,
            "split.count": V.UINT16,
            "split.tensors.count": V.INT32,
        }
        assert f["values"] == {"split.no": no, "split.count": 2, "split.tensors.count": n_tensors}
    assert facts[0]["n_keys"] == n_keys + 3  # the whole KV section, then the split keys
    assert facts[1]["n_keys"] == 3  # later parts: the split keys only
    assert sum(f["n_tensors"] for f in facts) == n_tensors
    assert all(f["n_tensors"] > 0 for f in facts)


def test_split_set_equals_whole(synth_dir: SynthModels) -> None:
    parts = [open_gguf(p) for p in synth_dir.split]
    try:
        with open_gguf(synth_dir.llama) as whole:
            for k in whole.fields:
                assert parts[0].raw_field(k) == whole.raw_field(k), k
            split_tensors = [(g, t) for g in parts for t in g.tensors]
            assert [t.name for _, t in split_tensors] == [t.name for t in whole.tensors]
            for g, t in split_tensors:
                w = whole.tensor(t.name)
                assert (t.shape, t.ggml_type, t.nbytes) == (w.shape, w.ggml_type, w.nbytes)
                assert g.read_range(t.data_start, t.nbytes) == whole.read_range(
                    w.data_start, w.nbytes
                )
    finally:
        for g in parts:
            g.close()


def test_split_set_metadata_only_first(tmp_path: Path) -> None:
    paths = synth_gguf.split_set(tmp_path, "m", n_shards=3, metadata_only_first=True)
    assert [p.name for p in paths] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    facts = _split_facts(paths)
    assert facts[0]["n_tensors"] == 0
    assert all(f["n_tensors"] > 0 for f in facts[1:])
    assert [f["values"]["split.no"] for f in facts] == [0, 1, 2]
    with open_gguf(paths[0]) as g:
        assert g.data_offset == g.file_size  # header only, padded to the alignment
    assert GGUFReader(paths[0]).tensors == []  # gguf-py reads a tensor-less part too


def test_split_set_rejects_impossible_counts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        synth_gguf.split_set(tmp_path, "m", n_shards=1)
    # 40 tensors cannot be spread over exactly 39 parts by a per-part tensor cap.
    with pytest.raises(ValueError, match="exactly 39 parts"):
        synth_gguf.split_set(tmp_path, "m", n_shards=39)
    assert list(tmp_path.iterdir()) == []


def _types(path: Path) -> dict[str, int]:
    with open_gguf(path) as g:
        return {t.name: t.ggml_type for t in g.tensors}


def test_llama_like_content(synth_dir: SynthModels) -> None:
    types = _types(synth_dir.llama)
    with open_gguf(synth_dir.llama) as g:
        assert g.value("general.architecture") == "llama"
        n_layers = g.value("llama.block_count")
        width = g.value("llama.embedding_length")
        for key in (
            "llama.feed_forward_length",
            "llama.attention.head_count",
            "llama.attention.head_count_kv",
            "llama.rope.freq_base",
            "llama.context_length",
            "llama.attention.layer_norm_rms_epsilon",
            "general.name",
            "tokenizer.ggml.scores",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
        ):
            assert key in g.fields, key
        assert g.value("tokenizer.ggml.model") == "llama"
        tokens = g.value("tokenizer.ggml.tokens")
        assert len(tokens) == 128 == len(set(tokens))
        assert "▁日本" in tokens  # multi-byte UTF-8 survives
        assert g.tensor("token_embd.weight").shape == (width, 128)
    expected = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
    for i in range(n_layers):
        for part in [
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ]:
            expected.add(f"blk.{i}.{part}.weight")
    assert set(types) == expected
    assert {Q(v).name for v in types.values()} >= {"F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"}
    assert all(types[n] == Q.F32 for n in types if n.endswith("norm.weight"))


def test_gemma_like_content(synth_dir: SynthModels) -> None:
    types = _types(synth_dir.gemma)
    with open_gguf(synth_dir.gemma) as g:
        assert g.value("general.architecture") == "gemma3"
        assert g.alignment == 64 == g.value("general.alignment")
        assert all(t.offset % 64 == 0 for t in g.tensors)
        assert g.data_offset % 64 == 0
    assert "output.weight" not in types  # tied embeddings
    assert "token_embd.weight" in types and "output_norm.weight" in types
    for part in ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"):
        assert f"blk.3.{part}.weight" in types


def test_nextn_like_content(synth_dir: SynthModels) -> None:
    types = _types(synth_dir.nextn)
    with open_gguf(synth_dir.nextn) as g:
        arch = g.value("general.architecture")
        assert arch == "glm4moe"
        assert g.value(f"{arch}.nextn_predict_layers") == 1
        last = g.value(f"{arch}.block_count") - 1
    nextn = {n for n in types if ".nextn." in n}
    assert nextn == {
        f"blk.{last}.nextn.{p}.weight" for p in ("eh_proj", "enorm", "hnorm", "shared_head_norm")
    }


def test_projector_content(synth_dir: SynthModels) -> None:
    with open_gguf(synth_dir.projector) as g:
        assert g.value("general.architecture") == "clip"
        assert g.value("general.type") == "mmproj"
        assert g.value("clip.has_vision_encoder") is True
        assert all(t.name.startswith(("v.", "mm.")) for t in g.tensors)
        assert len(g.tensor("v.patch_embd.weight").shape) == 4


@pytest.mark.parametrize("file_id", ["llama", "gemma", "nextn"])
def test_synth_tensors_dequantize_to_finite_values(synth_dir: SynthModels, file_id: str) -> None:
    # Random K-quant blocks get finite fp16 scales, so every tensor is usable as weights.
    ref = GGUFReader(synth_dir.files()[file_id])
    for t in ref.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        assert values.size == t.n_elements, t.name
        assert np.isfinite(values).all(), t.name


def test_cli_writes_the_same_bytes_as_the_function(synth_dir: SynthModels, tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    assert synth_gguf.main(["gemma-like", str(out), "--alignment", "64"]) == 0
    assert out.read_bytes() == synth_dir.gemma.read_bytes()
    assert synth_gguf.main(["split_set", str(tmp_path / "s"), "--stem", "llama"]) == 0
    assert [p.read_bytes() for p in sorted((tmp_path / "s").iterdir())] == [
        p.read_bytes() for p in synth_dir.split
    ]
    assert synth_gguf.main(["big", str(tmp_path / "b.gguf")]) == 2  # --target-bytes missing


def _llama_cpp_last_logits(path: Path, tokens: Sequence[int]) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.Llama(
        model_path=str(path), n_ctx=32, n_threads=2, logits_all=True, verbose=False
    )
    try:
        model.eval(list(tokens))
        return np.array(model.scores[len(tokens) - 1], dtype=np.float32)
    finally:
        model.close()


@pytest.mark.llama
def test_llama_cpp_runs_the_synthetic_models(synth_dir: SynthModels) -> None:
    # "Real" means llama.cpp loads and runs them; the split set gives bit-identical logits.
    # (nextn_like is metadata-real only: glm4moe also needs MoE hyperparameters and tensors.)
    tokens = [1, 5, 6, 7]
    whole = _llama_cpp_last_logits(synth_dir.llama, tokens)
    assert whole.shape == (128,)
    assert np.isfinite(whole).all() and np.abs(whole).max() > 0
    assert np.array_equal(_llama_cpp_last_logits(synth_dir.split[0], tokens), whole)
    gemma = _llama_cpp_last_logits(synth_dir.gemma, [2, 5, 6, 7])
    assert gemma.shape == (128,)
    assert np.isfinite(gemma).all() and np.abs(gemma).max() > 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1048576", 1 << 20), ("2GiB", 2 << 30), ("512M", 512 << 20), ("1.5k", 1536)],
)
def test_cli_size_parser(text: str, expected: int) -> None:
    assert synth_gguf.parse_size(text) == expected


def test_big_is_about_the_target_and_deterministic(tmp_path: Path) -> None:
    target = 24 << 20
    a = synth_gguf.big(tmp_path / "a.gguf", target)
    b = synth_gguf.big(tmp_path / "b.gguf", target)
    size = a.stat().st_size
    assert abs(size - target) < target * 0.02
    assert a.read_bytes() == b.read_bytes()
    ref = GGUFReader(a)
    with open_gguf(a) as g:
        _assert_kv_parity(g, ref, full_arrays=True)
        _assert_tensor_parity(g, ref, compare_data=True)
        assert g.value("llama.block_count") >= 4
        assert {Q(t.ggml_type).name for t in g.tensors} >= {"Q8_0", "Q4_K", "Q6_K", "F32"}
        # Content is a pattern, not zeros, and tensors differ from each other.
        heads = {g.read_range(t.data_start, 64) for t in g.tensors if t.nbytes >= 64}
        assert b"\0" * 64 not in heads
        assert len(heads) > len(g.tensors) // 2
    for t in ref.tensors:
        if t.tensor_type in (Q.Q4_K, Q.Q6_K, Q.Q8_0):
            assert np.isfinite(gguf.quants.dequantize(t.data[:4], t.tensor_type)).all()


@pytest.mark.slow
def test_big_2gib_streams_in_bounded_memory(tmp_path: Path) -> None:
    out = tmp_path / "big.gguf"
    script = REPO_ROOT / "tests" / "support" / "synth_gguf.py"
    code = (
        "import resource, subprocess, sys;"
        f"subprocess.run([sys.executable, {str(script)!r}, 'big', {str(out)!r},"
        " '--target-bytes', '2GiB'], check=True, stdout=subprocess.DEVNULL);"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    peak_mib = int(done.stdout.strip()) / 1024  # Linux reports KiB
    try:
        size = out.stat().st_size
        assert abs(size - (2 << 30)) < (2 << 30) * 0.01
        assert peak_mib < 500, f"peak RSS {peak_mib:.0f} MiB"
        with open_gguf(out) as g:
            assert g.tensors[-1].data_end <= g.file_size
    finally:
        out.unlink(missing_ok=True)


# ================================================================================================
# 3. Robustness: truncation, mutation, hand-built headers
# ================================================================================================
def _exercise(path: Path) -> None:
    """Open and touch everything the reader hands out; only GGUFFormatError may escape."""
    with open_gguf(path) as g:
        for key in g.fields:
            g.value(key)
            g.raw_field(key)
        for t in g.tensors:
            assert g.data_offset <= t.data_start <= t.data_end <= g.file_size
            assert g.tensor(t.name) is t


def _outcome(path: Path) -> str | None:
    """None if the file opens, else the GGUFFormatError code; anything else fails the test."""
    try:
        _exercise(path)
    except GGUFFormatError as exc:
        assert exc.path == str(path)
        return exc.code
    except Exception as exc:  # the point of these tests: nothing else may escape
        pytest.fail(f"{type(exc).__name__} escaped from the reader: {exc!r}")
    return None


_TRUNCATION_CODES = {"gguf_truncated", "gguf_tensor_out_of_bounds"}


def _interesting_cuts(path: Path) -> list[int]:
    with open_gguf(path) as g:
        cuts = set(range(g.data_offset + 2))  # every cut in the header and just past it
        for t in g.tensors:
            cuts |= {t.data_start - 1, t.data_start + 1, t.data_end - 1, t.data_end, t.data_end + 1}
        cuts.add(g.file_size - 1)
    return sorted(c for c in cuts if 0 <= c < path.stat().st_size)


@pytest.mark.parametrize("file_id", ["llama", "projector", "split-2"])
def test_truncation_at_every_interesting_cut(
    synth_dir: SynthModels, file_id: str, tmp_path: Path
) -> None:
    path = synth_dir.files()[file_id]
    data = path.read_bytes()
    with open_gguf(path) as g:
        payload_end = max(t.data_end for t in g.tensors)
    cut_file = tmp_path / "cut.gguf"
    for cut in _interesting_cuts(path):
        cut_file.write_bytes(data[:cut])
        code = _outcome(cut_file)
        if cut >= payload_end:  # only trailing padding was lost
            assert code is None, cut
        else:
            assert code in _TRUNCATION_CODES, (cut, code)


_HYPOTHESIS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_HYPOTHESIS
@given(frac=st.floats(0.0, 1.0, allow_nan=False))
def test_truncation_at_random_cuts(synth_dir: SynthModels, tmp_path: Path, frac: float) -> None:
    data = synth_dir.gemma.read_bytes()
    cut = min(int(frac * len(data)), len(data) - 1)
    cut_file = tmp_path / "cut.gguf"
    cut_file.write_bytes(data[:cut])
    with open_gguf(synth_dir.gemma) as g:
        payload_end = max(t.data_end for t in g.tensors)
    code = _outcome(cut_file)
    assert (code is None) if cut >= payload_end else (code in _TRUNCATION_CODES), (cut, code)


def _mutate(data: bytes, header_end: int, edits: Iterable[tuple[int, bytes]]) -> bytes:
    """Overwrite bytes inside ``[0, header_end)`` only; the length never changes."""
    buf = bytearray(data)
    for pos, patch in edits:
        pos %= header_end
        patch = patch[: header_end - pos]
        buf[pos : pos + len(patch)] = patch
    assert len(buf) == len(data)
    return bytes(buf)


_edit = st.tuples(
    st.integers(0, 1 << 30),
    st.one_of(
        st.binary(min_size=1, max_size=1),
        st.binary(min_size=1, max_size=8),
        # a huge or boundary little-endian u64, to hit lengths and counts
        st.sampled_from(
            [0, 1, 0xFF, 1 << 32, MAX_STRING_BYTES + 1, MAX_ARRAY_LEN + 1, 2**64 - 1]
        ).map(lambda v: struct.pack("<Q", v)),
    ),
)


@settings(_HYPOTHESIS, max_examples=400)
@given(
    file_id=st.sampled_from(["llama", "gemma", "projector", "nextn", "split-1"]),
    edits=st.lists(_edit, min_size=1, max_size=6),
)
def test_header_mutations_raise_only_format_errors(
    synth_dir: SynthModels, tmp_path: Path, file_id: str, edits: list[tuple[int, bytes]]
) -> None:
    path = synth_dir.files()[file_id]
    data = path.read_bytes()
    with open_gguf(path) as g:
        header_end = g.data_offset
    mutated = tmp_path / "mutated.gguf"
    mutated.write_bytes(_mutate(data, header_end, edits))
    event(f"outcome: {_outcome(mutated) or 'opens'}")


# --- hand-built headers, one per error code --------------------------------------------------
def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _u32(key: str, value: int) -> bytes:
    return _kv(key, V.UINT32, struct.pack("<I", value))


def _arr(item_type: int, items: Sequence[bytes]) -> bytes:
    return struct.pack("<IQ", item_type, len(items)) + b"".join(items)


def _ti(name: str | bytes, shape: Sequence[int], ggml_type: int, offset: int) -> bytes:
    dims = b"".join(struct.pack("<Q", d) for d in shape)
    return _s(name) + struct.pack("<I", len(shape)) + dims + struct.pack("<IQ", ggml_type, offset)


# A valid baseline: two KVs, an F32 tensor [32] at 0 (128 bytes), a Q8_0 tensor [32, 2] at 128.
_BASE_KVS = (_kv("general.architecture", V.STRING, _s("llama")), _u32("llama.block_count", 1))
_BASE_TIS = (_ti("a", (32,), Q.F32, 0), _ti("b", (32, 2), Q.Q8_0, 128))
_BASE_DATA = _pad(bytes(range(128)) + bytes(68))


def _gguf(
    kvs: Sequence[bytes] = _BASE_KVS,
    tis: Sequence[bytes] = _BASE_TIS,
    *,
    data: bytes = _BASE_DATA,
    alignment: int = 32,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    version: int = 3,
    magic: bytes = b"GGUF",
    pad: bool = True,
) -> bytes:
    head = _header(
        len(tis) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
        version=version,
        magic=magic,
    )
    body = head + b"".join(kvs) + b"".join(tis)
    return (_pad(body, alignment) if pad else body) + data


def _with_kv(extra: bytes) -> bytes:
    return _gguf([*_BASE_KVS, extra])


def _nested(depth: int) -> bytes:
    """An array nested ``depth`` levels deep around a u8 array."""
    value = _arr(V.UINT8, [b"\x01", b"\x02"])
    for _ in range(depth - 1):
        value = _arr(V.ARRAY, [value])
    return _kv("nested", V.ARRAY, value)


def _alignment_kv(value: int, vtype: int = V.UINT32) -> bytes:
    fmt = {V.UINT32: "<I", V.UINT64: "<Q", V.INT32: "<i"}[V(vtype)]
    return _kv("general.alignment", vtype, struct.pack(fmt, value))


_CASES: dict[str, tuple[bytes, str]] = {
    "bad magic": (_gguf(magic=b"GGUG"), "gguf_bad_magic"),
    "ggml magic": (_gguf(magic=b"lmgg"), "gguf_bad_magic"),
    "version 1": (_gguf(version=1), "gguf_unsupported_version"),
    "version 4": (_gguf(version=4), "gguf_unsupported_version"),
    "big-endian version": (_gguf(version=3 << 24), "gguf_unsupported_version"),
    "huge tensor count": (_gguf(n_tensors=1 << 40), "gguf_count_too_large"),
    "huge kv count": (_gguf(n_kv=1 << 40), "gguf_count_too_large"),
    "huge key length": (
        _gguf([struct.pack("<Q", 1 << 40) + b"general.architecture"]),
        "gguf_string_too_long",
    ),
    "huge string value": (
        _with_kv(_kv("s", V.STRING, struct.pack("<Q", MAX_STRING_BYTES + 1) + b"abc")),
        "gguf_string_too_long",
    ),
    "huge string in array": (
        _with_kv(_kv("s", V.ARRAY, _arr(V.STRING, [_s("ok"), struct.pack("<Q", 1 << 62)]))),
        "gguf_string_too_long",
    ),
    "huge tensor name": (
        _gguf(tis=[struct.pack("<Q", MAX_STRING_BYTES + 1) + b"a"]),
        "gguf_string_too_long",
    ),
    "huge array length": (
        _with_kv(_kv("a", V.ARRAY, struct.pack("<IQ", V.UINT8, MAX_ARRAY_LEN + 1))),
        "gguf_array_too_long",
    ),
    "nesting depth 3": (_with_kv(_nested(3)), "gguf_nesting_too_deep"),
    "duplicate key": (_with_kv(_u32("llama.block_count", 2)), "gguf_duplicate_key"),
    "duplicate tensor": (
        _gguf(tis=[_BASE_TIS[0], _ti("a", (32, 2), Q.Q8_0, 128)]),
        "gguf_duplicate_tensor",
    ),
    "alignment 0": (_with_kv(_alignment_kv(0)), "gguf_bad_alignment"),
    "alignment 3": (_with_kv(_alignment_kv(3)), "gguf_bad_alignment"),
    "alignment 2**17": (_with_kv(_alignment_kv(1 << 17)), "gguf_bad_alignment"),
    "alignment u64": (_with_kv(_alignment_kv(32, V.UINT64)), "gguf_bad_alignment"),
    "alignment i32": (_with_kv(_alignment_kv(32, V.INT32)), "gguf_bad_alignment"),
    "alignment string": (
        _with_kv(_kv("general.alignment", V.STRING, _s("32"))),
        "gguf_bad_alignment",
    ),
    "tensor past EOF": (
        _gguf(tis=[_BASE_TIS[0], _ti("b", (32, 2), Q.Q8_0, 1024)]),
        "gguf_tensor_out_of_bounds",
    ),
    "tensor data cut short": (_gguf(data=_BASE_DATA[:150]), "gguf_tensor_out_of_bounds"),
    "huge tensor offset": (
        _gguf(tis=[_BASE_TIS[0], _ti("b", (32, 2), Q.Q8_0, 2**64 - 32)]),
        "gguf_tensor_out_of_bounds",
    ),
    "overlapping tensors": (
        _gguf(tis=[_BASE_TIS[0], _ti("b", (32, 2), Q.Q8_0, 96)]),
        "gguf_tensor_overlap",
    ),
    "same offset": (
        _gguf(tis=[_BASE_TIS[0], _ti("b", (32, 2), Q.Q8_0, 0)]),
        "gguf_tensor_overlap",
    ),
    "misaligned offset": (
        _gguf(tis=[_BASE_TIS[0], _ti("b", (32, 2), Q.Q8_0, 130)]),
        "gguf_misaligned_tensor",
    ),
    "unknown ggml type 4": (
        _gguf(tis=[_BASE_TIS[0], _ti("b", (32, 2), 4, 128)]),
        "gguf_unknown_tensor_type",
    ),
    "unknown ggml type 999": (
        _gguf(tis=[_BASE_TIS[0], _ti("b", (32, 2), 999, 128)]),
        "gguf_unknown_tensor_type",
    ),
    "ne0 not multiple of block": (
        _gguf(tis=[_BASE_TIS[0], _ti("b", (16, 2), Q.Q8_0, 128)]),
        "gguf_bad_tensor_shape",
    ),
    "K-quant ne0 not multiple of 256": (
        _gguf(tis=[_BASE_TIS[0], _ti("b", (128, 1), Q.Q4_K, 128)]),
        "gguf_bad_tensor_shape",
    ),
    "0 dims": (_gguf(tis=[_BASE_TIS[0], _ti("b", (), Q.Q8_0, 128)]), "gguf_bad_tensor_shape"),
    "5 dims": (
        _gguf(tis=[_BASE_TIS[0], _ti("b", (32, 1, 1, 1, 2), Q.Q8_0, 128)]),
        "gguf_bad_tensor_shape",
    ),
    "zero dim": (
        _gguf(tis=[_BASE_TIS[0], _ti("b", (32, 0), Q.Q8_0, 128)]),
        "gguf_bad_tensor_shape",
    ),
    "unknown value type": (_with_kv(_kv("x", 13, b"\0" * 8)), "gguf_bad_value_type"),
    "unknown array item type": (
        _with_kv(_kv("x", V.ARRAY, struct.pack("<IQ", 13, 1) + b"\0" * 8)),
        "gguf_bad_value_type",
    ),
    "non-UTF-8 key": (_with_kv(_kv(b"bad\xff\xfekey", V.UINT8, b"\x01")), "gguf_bad_string"),
    "non-UTF-8 tensor name": (
        _gguf(tis=[_BASE_TIS[0], _ti(b"b\xc3(", (32, 2), Q.Q8_0, 128)]),
        "gguf_bad_string",
    ),
    "too small for a header": (_gguf()[:20], "gguf_truncated"),
    "cut inside a key": (_gguf()[: 24 + 12], "gguf_truncated"),
    "cut inside tensor infos": (_gguf(data=b"", pad=False)[:-3], "gguf_truncated"),
    "data section past EOF": (_gguf(data=b"", pad=False), "gguf_truncated"),
    "array items past EOF": (
        _with_kv(_kv("a", V.ARRAY, struct.pack("<IQ", V.UINT64, 1 << 20))),
        "gguf_truncated",
    ),
}


def test_baseline_is_valid_and_matches_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "base.gguf"
    path.write_bytes(_gguf())
    ref = GGUFReader(path)
    with open_gguf(path) as g:
        _assert_kv_parity(g, ref, full_arrays=True)
        _assert_tensor_parity(g, ref, compare_data=True)
        assert [(t.name, t.offset, t.nbytes) for t in g.tensors] == [("a", 0, 128), ("b", 128, 68)]


@pytest.mark.parametrize("case", sorted(_CASES))
def test_hand_built_header_error_codes(case: str, tmp_path: Path) -> None:
    data, code = _CASES[case]
    path = tmp_path / "case.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFFormatError) as info:
        _exercise(path)
    assert info.value.code == code, info.value.message
    assert info.value.path == str(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "kv",
    [
        _kv("s", V.STRING, _s(b"caf\xe9")),
        _kv("s", V.ARRAY, _arr(V.STRING, [_s("ok"), _s(b"\xff")])),
    ],
    ids=["string", "string array item"],
)
def test_non_utf8_value_is_a_format_error_on_access(kv: bytes, tmp_path: Path) -> None:
    path = tmp_path / "bad-value.gguf"
    path.write_bytes(_with_kv(kv))
    with open_gguf(path) as g:  # values are decoded lazily: opening succeeds
        assert g.raw_field("s").startswith(_s("s"))
        with pytest.raises(GGUFFormatError) as info:
            g.value("s")
        assert info.value.code == "gguf_bad_string"
        with pytest.raises(GGUFFormatError):
            g.get("s")


def test_version_2_and_nesting_depth_2_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "v2.gguf"
    path.write_bytes(_gguf([*_BASE_KVS, _nested(2)], version=2))
    with open_gguf(path) as g:
        assert g.version == 2
        assert g.value("nested") == [[1, 2]]
        f = g.fields["nested"]
        assert (f.value_type, f.item_type, f.count) == (V.ARRAY, V.ARRAY, 1)


def test_zero_tensor_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(_gguf(tis=[], data=b""))
    with open_gguf(path) as g:
        assert g.tensors == ()
        assert g.data_offset == g.file_size


_SCALARS: list[tuple[str, int, str, Any]] = [
    ("u8", V.UINT8, "<B", 255),
    ("i8", V.INT8, "<b", -128),
    ("u16", V.UINT16, "<H", 65535),
    ("i16", V.INT16, "<h", -32768),
    ("u32", V.UINT32, "<I", 2**32 - 1),
    ("i32", V.INT32, "<i", -(2**31)),
    ("f32", V.FLOAT32, "<f", 1.5),
    ("bool", V.BOOL, "<?", True),
    ("u64", V.UINT64, "<Q", 2**64 - 1),
    ("i64", V.INT64, "<q", -(2**63)),
    ("f64", V.FLOAT64, "<d", -2.25),
]


def test_every_value_type_matches_gguf_reader(tmp_path: Path) -> None:
    kvs = [_kv(name, vtype, struct.pack(fmt, v)) for name, vtype, fmt, v in _SCALARS]
    kvs.append(_kv("str", V.STRING, _s("héllo ☃")))
    kvs.append(_kv("empty_str", V.STRING, _s("")))
    for name, vtype, fmt, v in _SCALARS:
        kvs.append(_kv(f"arr_{name}", V.ARRAY, _arr(vtype, [struct.pack(fmt, v)] * 3)))
    kvs.append(_kv("arr_str", V.ARRAY, _arr(V.STRING, [_s("a"), _s(""), _s("日本")])))
    kvs.append(_kv("arr_empty", V.ARRAY, _arr(V.INT32, [])))
    path = tmp_path / "types.gguf"
    path.write_bytes(_gguf(kvs))
    ref = GGUFReader(path)
    with open_gguf(path) as g:
        _assert_kv_parity(g, ref, full_arrays=True)
        for name, _, _, v in _SCALARS:
            assert g.value(name) == v
            assert g.value(f"arr_{name}") == [v] * 3
        assert g.value("arr_empty") == []
        assert g.fields["arr_empty"].item_type == V.INT32
        assert g.get("missing", "default") == "default"
        with pytest.raises(KeyError):
            g.value("missing")


def test_missing_file_is_unreadable_input(tmp_path: Path) -> None:
    from skippy.errors import InputUnreadable

    with pytest.raises(InputUnreadable):
        open_gguf(tmp_path / "nope.gguf")


def test_open_closes_file_on_format_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(_gguf(magic=b"XXXX"))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(GGUFFormatError):
            open_gguf(path)
    assert len(os.listdir("/proc/self/fd")) <= before
