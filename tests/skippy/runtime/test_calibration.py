"""The stage-runtime calibration: measured once on the real ggml stage
runtime, cached in data_dir by what it measured, advertised in the hello as a known optional
key that is validated strictly when present."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import msgpack
import pytest
from meshtools import settings

import mesh_node.calibration as calibration
from mesh_node.settings import node_settings, read_node_config
from protocol import constants as pc
from protocol.errors import ProtocolError
from protocol.messages import ComputeCost, Hello, decode_link_message
from skippy.config import NodeConfig, read_environment
from skippy.errors import UsageError
from skippy.runtime.calibration import MODEL_CLASS, Calibration, CalibrationKey

COST = ComputeCost(0.0007, 0.0002, 3_624_960)


def test_a_hello_carries_compute_and_one_without_it_is_still_valid() -> None:
    hello = Hello("ws://127.0.0.1:1", {}, 1 << 30, host="h1", boot="b1", compute=COST)
    assert decode_link_message(hello.encode()) == hello
    plain = Hello("ws://127.0.0.1:1", {}, 1 << 30)
    assert decode_link_message(plain.encode()).compute is None  # older nodes send none


def _hello_with(compute: object) -> bytes:
    doc = msgpack.unpackb(Hello(None, {}, 0).encode(), raw=False)
    doc["compute"] = compute
    body: bytes = msgpack.packb(doc, use_bin_type=True)
    return body


@pytest.mark.parametrize(
    "compute",
    [
        None,
        {"decode_s_per_layer": -1.0, "prefill_s_per_layer": 0.1, "layer_bytes": 1},
        {"decode_s_per_layer": math.nan, "prefill_s_per_layer": 0.1, "layer_bytes": 1},
        {"decode_s_per_layer": 1e9, "prefill_s_per_layer": 0.1, "layer_bytes": 1},
        {"decode_s_per_layer": True, "prefill_s_per_layer": 0.1, "layer_bytes": 1},
        {"decode_s_per_layer": 0.1, "prefill_s_per_layer": 0.1, "layer_bytes": 0},
        {"decode_s_per_layer": 0.1, "prefill_s_per_layer": 0.1, "layer_bytes": "1"},
        {"decode_s_per_layer": 0.1, "prefill_s_per_layer": 0.1},
        {"decode_s_per_layer": 0.1, "prefill_s_per_layer": 0.1, "layer_bytes": 1, "x": 1},
        [0.1, 0.1, 1],
    ],
)
def test_a_hello_with_a_malformed_compute_is_refused(compute: object) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_link_message(_hello_with(compute), pc.DEFAULT_LIMITS)
    assert info.value.code == "malformed_message"


def test_the_node_calibrates_once_and_a_restart_reads_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = settings(tmp_path, "n", calibrate=True)
    first = calibration.load_or_calibrate(s)  # the real ggml stage runtime, a few tokens
    assert first is not None
    assert first.key == CalibrationKey("ggml", first.key.runtime_version, 1, MODEL_CLASS)
    assert first.key.runtime_version.startswith("skippy-stage/1 ggml/")
    assert 0 < first.decode_s_per_layer < 1 and 0 < first.prefill_s_per_layer < 1
    assert (s.data_dir / calibration.CACHE_NAME).is_file()
    assert not [p for p in s.data_dir.iterdir() if p.name.startswith(".calibration-")]

    def must_not_run(*a: Any, **kw: Any) -> Calibration:
        raise AssertionError("a cached calibration was measured again")

    monkeypatch.setattr(calibration, "run_calibration", must_not_run)
    assert calibration.load_or_calibrate(s) == first  # a restart: same key, cached
    assert calibration.compute_cost(first) == ComputeCost(
        first.decode_s_per_layer, first.prefill_s_per_layer, first.layer_bytes
    )


def test_another_thread_count_is_measured_again_and_both_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def fake_run(
        workdir: Path, *, engine: str, threads: int, device: str = "CPU"
    ) -> Calibration:
        calls.append(threads)  # a stand-in for the real run (measured in the test above)
        return Calibration(CalibrationKey(engine, "v", threads), 0.001 * threads, 0.0005, 10)

    monkeypatch.setattr(calibration, "run_calibration", fake_run)
    one = settings(tmp_path, "n", calibrate=True)
    two = dataclasses.replace(one, serving=dataclasses.replace(one.serving, threads=2))
    a, b = calibration.load_or_calibrate(one), calibration.load_or_calibrate(two)
    assert calls == [1, 2] and a is not None and b is not None and a != b
    assert calibration.load_or_calibrate(one) == a and calls == [1, 2]
    records = calibration.read_cache(one.data_dir / calibration.CACHE_NAME)
    assert [r.key.threads for r in records] == [1, 2]


def test_a_damaged_cache_is_measured_again_and_calibration_off_measures_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def fake_run(
        workdir: Path, *, engine: str, threads: int, device: str = "CPU"
    ) -> Calibration:
        calls.append(threads)
        return Calibration(CalibrationKey(engine, "v", threads), 0.001, 0.0005, 10)

    monkeypatch.setattr(calibration, "run_calibration", fake_run)
    s = settings(tmp_path, "n", calibrate=True)
    s.data_dir.mkdir(parents=True)
    (s.data_dir / calibration.CACHE_NAME).write_text('{"version": 1, "records": [{"key": 3}]}')
    assert calibration.load_or_calibrate(s) is not None and calls == [1]
    off = settings(tmp_path, "m", calibrate=False)
    assert calibration.load_or_calibrate(off) is None and calls == [1]
    assert not (off.data_dir / calibration.CACHE_NAME).exists()


def _config(tmp_path: Path, extra: str) -> NodeConfig:
    path = tmp_path / "node.toml"
    path.write_text(f'identity = "k.key"\n{extra}\n')
    return read_node_config(path)


def test_the_calibration_setting_is_auto_or_off_and_the_environment_wins(tmp_path: Path) -> None:
    env = read_environment({})
    assert node_settings(_config(tmp_path, ""), env).calibrate is True
    assert node_settings(_config(tmp_path, 'calibration = "off"'), env).calibrate is False
    env_off = read_environment({"MESH_NODE_CALIBRATION": "off"})
    assert node_settings(_config(tmp_path, 'calibration = "auto"'), env_off).calibrate is False
    with pytest.raises(UsageError, match="expected auto or off"):
        node_settings(_config(tmp_path, 'calibration = "fast"'), env)
    with pytest.raises(UsageError, match="MESH_NODE_CALIBRATION"):
        node_settings(_config(tmp_path, ""), read_environment({"MESH_NODE_CALIBRATION": "1"}))


def test_the_calibration_model_has_the_same_bytes_with_ggml_or_gguf_py_quantizing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model a node writes at start-up is quantized by ggml when libggml loads and by
    gguf-py otherwise; both are the reference Q8_0 rounding, so the file (and MODEL_CLASS,
    which names it) is the same either way."""
    import hashlib

    pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")
    import gguf

    from skippy.gguf import ggml
    from skippy.runtime.calibration import write_calibration_model

    calls = []
    real = gguf.quants.quantize
    monkeypatch.setattr(gguf.quants, "quantize", lambda *a: calls.append(1) or real(*a))
    fast = write_calibration_model(tmp_path / "ggml.gguf")
    assert calls == []  # ggml quantized every matrix

    def unavailable() -> None:
        raise ggml.GgmlUnavailable("not here", code="ggml_unavailable")

    monkeypatch.setattr(ggml, "load", unavailable)
    slow = write_calibration_model(tmp_path / "gguf-py.gguf")
    assert calls  # gguf-py did
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (fast, slow)]
    assert digest[0] == digest[1]
