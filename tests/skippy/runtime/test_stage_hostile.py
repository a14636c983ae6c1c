"""Hostile or corrupt fragments give coded errors from both engines, never a native abort.

ggml aborts the whole process on a failed assertion, so every case here runs in the test
process itself (an abort would kill the run), plus one end-to-end `run` in a child process on
a package whose fragment was corrupted in place (same size, so only the runtime's own checks
stand between the bytes and ggml).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

import gguf
import synth_gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from pkgtools import make_package
from stagetools import stage_loads

from skippy.constants import ENV_VERIFY_PACKAGE_SHA
from skippy.errors import SkippyError
from skippy.gguf.reader import open_gguf
from skippy.runtime.boundary import StageLoad
from skippy.runtime.chain import open_stage
from skippy.runtime.stage import StageConfig

pytestmark = pytest.mark.llama

Tensor = tuple[str, tuple[int, ...], int, bytes]  # name, GGUF shape, ggml type, raw bytes


@pytest.fixture(scope="module")
def pkg(synth_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "pkg"
    make_package(synth_dir.llama, out)
    return out


@pytest.fixture(scope="module")
def load(pkg: Path) -> StageLoad:
    return stage_loads(pkg, ["0..2"])[0]  # metadata, embeddings, layer 0, layer 1


def read_fragment(path: Path) -> tuple[list[tuple[str, Any, int, int | None]], list[Tensor]]:
    with open_gguf(path) as g:
        kvs = [(k, g.value(k), f.value_type, f.item_type) for k, f in g.fields.items()]
        tensors = [(t.name, t.shape, t.ggml_type, g.read_range(t.data_start, t.nbytes)) for t in g]
    return kvs, tensors


def write_fragment(
    path: Path,
    kvs: list[tuple[str, Any, int, int | None]],
    tensors: list[Tensor],
    *,
    alignment: int | None = None,
) -> Path:
    arch = next(v for k, v, _, _ in kvs if k == "general.architecture")
    w = gguf.GGUFWriter(path, arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vtype, item in kvs:
        if key in ("general.architecture", "general.alignment"):
            continue
        w.add_key_value(key, value, V(vtype), V(item) if item is not None else None)
    for name, shape, qtype, raw in tensors:
        block, size = gguf.GGML_QUANT_SIZES[Q(qtype)]
        byte_shape = (*reversed(shape[1:]), shape[0] // block * size)
        data = np.frombuffer(raw, dtype=np.uint8).reshape(byte_shape)
        w.add_tensor(name, data, raw_shape=byte_shape, raw_dtype=Q(qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _set_kv(kvs: list, key: str, value: Any, vtype: int = V.UINT32) -> list:
    kept = [kv for kv in kvs if kv[0] != key]
    return [*kept, (key, value, vtype, None)]


def _f32(name: str, n: int) -> Tensor:
    return (name, (n,), Q.F32, np.ones(n, dtype=np.float32).tobytes())


# Each case edits one part (by index in the 0..2 load) and names the expected code.
Edit = Callable[[list, list[Tensor]], tuple[list, list[Tensor], dict[str, Any]]]


def _replace_tensor(tensors: list[Tensor], name: str, new: Tensor | None) -> list[Tensor]:
    out = [t for t in tensors if t[0] != name]
    return out if new is None else [*out, new]


def _misaligned(kvs: list, tensors: list[Tensor]) -> tuple[list, list[Tensor], dict[str, Any]]:
    return kvs, tensors, {"alignment": 8}


CASES: list[tuple[str, int, Edit, str]] = [
    (
        "shape",
        3,
        lambda kvs, ts: (
            kvs,
            _replace_tensor(
                ts, "blk.1.attn_q.weight", ("blk.1.attn_q.weight", (64, 32), Q.Q8_0, bytes(32 * 68))
            ),
            {},
        ),
        "fragment_tensor_shape",
    ),
    ("misaligned", 3, _misaligned, "fragment_tensor_misaligned"),
    (
        "unexpected",
        3,
        lambda kvs, ts: (kvs, [*ts, _f32("blk.1.attn_gate.weight", 64)], {}),
        "fragment_unexpected_tensor",
    ),
    (
        "missing",
        3,
        lambda kvs, ts: (kvs, _replace_tensor(ts, "blk.1.ffn_up.weight", None), {}),
        "fragment_missing_tensor",
    ),
    (
        "norm-as-f16",
        3,
        lambda kvs, ts: (
            kvs,
            _replace_tensor(
                ts, "blk.1.attn_norm.weight", ("blk.1.attn_norm.weight", (64,), Q.F16, bytes(128))
            ),
            {},
        ),
        "unsupported_tensor_type",
    ),
    (
        "iq2-matrix",
        3,
        lambda kvs, ts: (
            kvs,
            _replace_tensor(
                ts,
                "blk.1.ffn_down.weight",
                ("blk.1.ffn_down.weight", (256, 64), Q.IQ2_XXS, bytes(64 * 66)),
            ),
            {},
        ),
        "unsupported_tensor_type",
    ),
    (
        "other-layer",
        3,
        lambda kvs, ts: (kvs, [*ts, _f32("blk.2.attn_norm.weight", 64)], {}),
        "fragment_tensor_misplaced",
    ),
    (
        "embeddings-in-layer",
        2,
        lambda kvs, ts: (kvs, [*ts, ("token_embd.weight", (64, 4), Q.F32, bytes(64 * 16))], {}),
        "fragment_tensor_misplaced",
    ),
    (
        "arch",
        3,
        lambda kvs, ts: (_set_kv(kvs, "general.architecture", "gemma3", V.STRING), ts, {}),
        "fragment_architecture_mismatch",
    ),
    (
        "heads-zero",
        0,
        lambda kvs, ts: (_set_kv(kvs, "llama.attention.head_count", 0), ts, {}),
        "invalid_hyperparameters",
    ),
    (
        "kv-heads",
        0,
        lambda kvs, ts: (_set_kv(kvs, "llama.attention.head_count_kv", 3), ts, {}),
        "invalid_hyperparameters",
    ),
    (
        "huge-width",
        0,
        lambda kvs, ts: (_set_kv(kvs, "llama.embedding_length", 1 << 40, V.UINT64), ts, {}),
        "invalid_hyperparameters",
    ),
    (
        "head-array",
        0,
        lambda kvs, ts: (
            [kv for kv in kvs if kv[0] != "llama.attention.head_count"]
            + [("llama.attention.head_count", [4, 4, 4, 4], V.ARRAY, V.UINT32)],
            ts,
            {},
        ),
        "unsupported_hyperparameter",
    ),
    (
        "layer-count",
        0,
        lambda kvs, ts: (_set_kv(kvs, "llama.block_count", 5), ts, {}),
        "layer_count_mismatch",
    ),
    (
        "yarn",
        0,
        lambda kvs, ts: (_set_kv(kvs, "llama.rope.scaling.type", "yarn", V.STRING), ts, {}),
        "unsupported_rope_scaling",
    ),
    (
        "no-arch",
        0,
        lambda kvs, ts: (_set_kv(kvs, "general.architecture", "mamba", V.STRING), ts, {}),
        "unsupported_architecture",
    ),
]


def _hostile(load: StageLoad, tmp_path: Path, part: int, edit: Edit) -> StageLoad:
    kvs, tensors = read_fragment(load.part_paths[part])
    kvs, tensors, opts = edit(kvs, tensors)
    dst = tmp_path / f"part-{part}.gguf"
    for pad in range(32):  # with alignment 8, shift the header until a tensor is off the grid
        padding = [("skippy.test.pad", "x" * pad, V.STRING, None)] if pad else []
        write_fragment(dst, kvs + padding, tensors, **opts)
        with open_gguf(dst) as g:
            if not opts.get("alignment") or any(t.data_start % 32 for t in g):
                break
    paths = list(load.part_paths)
    paths[part] = dst
    return replace(load, part_paths=tuple(paths))


@pytest.mark.parametrize("engine", ["ggml", "numpy"])
@pytest.mark.parametrize("case,part,edit,code", CASES, ids=[c[0] for c in CASES])
def test_hostile_fragment_is_a_coded_error(
    load: StageLoad, tmp_path: Path, engine: str, case: str, part: int, edit: Edit, code: str
) -> None:
    hostile = _hostile(load, tmp_path, part, edit)
    with pytest.raises(SkippyError) as e:
        open_stage(engine, hostile, StageConfig(n_ctx=16, n_threads=1))
    assert e.value.code == code, e.value.message
    assert e.value.exit_code in (1, 2)


def test_truncated_and_garbage_parts(load: StageLoad, tmp_path: Path) -> None:
    src = load.part_paths[3]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00GGUF" * 100)
    for bad, code in ((cut, "gguf_tensor_out_of_bounds"), (junk, "gguf_bad_magic")):
        paths = list(load.part_paths)
        paths[3] = bad
        with pytest.raises(SkippyError) as e:
            open_stage(
                "ggml", replace(load, part_paths=tuple(paths)), StageConfig(n_ctx=16, n_threads=1)
            )
        assert e.value.code in (code, "gguf_truncated")


def test_unsupported_architecture_package(tmp_path: Path) -> None:
    # GLM's sparse-attention variant: an architecture the stage runtime does not run
    src = synth_gguf.nextn_like(tmp_path / "glm-dsa.gguf", arch="glm-dsa")
    out = tmp_path / "nextn"
    make_package(src, out, model_id="acme/glm-GGUF:Q8_0")
    with pytest.raises(SkippyError) as e:
        open_stage("ggml", stage_loads(out, ["0..4"])[0], StageConfig(n_ctx=16, n_threads=1))
    assert e.value.code == "unsupported_architecture" and e.value.exit_code == 2


def test_the_moe_refusal_says_what_is_supported_and_what_to_do(
    load: StageLoad, tmp_path: Path
) -> None:
    def experts(kvs: list, ts: list[Tensor]) -> tuple[list, list[Tensor], dict[str, Any]]:
        # A qwen2 (whose builder has no MoE block, unlike llama's) with well-formed MoE keys
        # (8 experts, 2 per token): malformed ones have their own codes.
        kvs = [(k.replace("llama.", "qwen2.", 1), *rest) for k, *rest in kvs]
        kvs = _set_kv(kvs, "general.architecture", "qwen2", V.STRING)
        kvs = _set_kv(kvs, "qwen2.expert_count", 8)
        return _set_kv(kvs, "qwen2.expert_used_count", 2), ts, {}

    moe = _hostile(load, tmp_path, 0, experts)
    with pytest.raises(SkippyError) as e:
        open_stage("ggml", moe, StageConfig(n_ctx=16, n_threads=1))
    assert e.value.code == "unsupported_architecture"
    assert e.value.message.startswith("qwen2 with experts (MoE)"), e.value.message
    assert "dense llama, qwen2, qwen3, gemma3" in e.value.message, e.value.message
    hint = e.value.remediation or ""
    assert "llama.cpp" in hint and "--engine llama" in hint, hint


def test_run_on_a_fragment_corrupted_in_place_exits_with_json(pkg: Path, tmp_path: Path) -> None:
    """Same size, unverified: the layer header now claims attn_q is 64 x 32. The runtime
    refuses it with a code in a real child process (an abort would be exit -6 and no JSON)."""
    copy = tmp_path / "pkg"
    shutil.copytree(pkg, copy)
    victim = copy / "layers" / "layer-00001.gguf"
    data = bytearray(victim.read_bytes())
    name = b"blk.1.attn_q.weight"
    at = data.index(name) + len(name)
    assert int.from_bytes(data[at : at + 4], "little") == 2  # n_dims
    dim1 = at + 4 + 8
    assert int.from_bytes(data[dim1 : dim1 + 8], "little") == 64
    data[dim1 : dim1 + 8] = (32).to_bytes(8, "little")
    victim.write_bytes(bytes(data))
    env = {**os.environ, ENV_VERIFY_PACKAGE_SHA: "0"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "skippy.cli",
            "run",
            str(copy),
            "--engine",
            "ggml",
            "--prompt",
            "Ω",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["error"]["code"] == "fragment_tensor_shape"
