"""Choosing a stage's device and its weights' placement (pure), ``[runtime]`` in the node
TOML, ``mesh-node devices``, and the scheduler's path on the CPU alone: a stage run through
``ggml_backend_sched`` equals the plain CPU backend bit for bit (prefill chunks, reused decode
graphs past a KV-length step, batched decode, verify windows). The lavapipe device tests are
in ``test_stage_device.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from skippy.config import RuntimeSettings, parse_rule, runtime_settings
from skippy.errors import UsageError
from skippy.runtime.devices import (
    CPU_MOE_PATTERN,
    DeviceInfo,
    DeviceTooSmall,
    UnknownDevice,
    choose_device,
    place_tensors,
)

GIB = 2**30
CPU = DeviceInfo("CPU", "host", "CPU", 64 * GIB, 64 * GIB)
SMALL_GPU = DeviceInfo("CUDA0", "small", "GPU", 2 * GIB, 8 * GIB)
BIG_GPU = DeviceInfo("CUDA1", "big", "GPU", 20 * GIB, 24 * GIB)
IGPU = DeviceInfo("Vulkan0", "integrated", "IGPU", 30 * GIB, 32 * GIB)
ALL = [SMALL_GPU, BIG_GPU, IGPU, CPU]


# --- choosing the device (pure) -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("requested", "devices", "need", "device"),
    [
        ("auto", ALL, 1 * GIB, "CUDA1"),  # a GPU before an IGPU, then the most free memory
        ("auto", ALL, 10 * GIB, "CUDA1"),
        ("auto", ALL, 25 * GIB, "Vulkan0"),  # no GPU fits: the integrated one does
        ("auto", ALL, 40 * GIB, "CPU"),  # nothing fits: the CPU
        ("auto", [CPU], 1, "CPU"),  # a CPU-only build
        ("CPU", ALL, 1, "CPU"),
        ("cpu", ALL, 1, "CPU"),
        ("CUDA0", ALL, 1 * GIB, "CUDA0"),  # named: taken although another has more
    ],
)
def test_choose_device(requested: str, devices: list[DeviceInfo], need: int, device: str) -> None:
    choice = choose_device(requested, devices, need)
    assert (choice.device, choice.fallback_reason) == (device, None)


def test_a_named_device_that_does_not_exist_is_a_coded_error_listing_those_that_do() -> None:
    with pytest.raises(UnknownDevice) as err:
        choose_device("CUDA7", ALL, 1)
    assert err.value.code == "unknown_device"
    assert "CUDA0, CUDA1, Vulkan0, CPU" in err.value.message
    assert "mesh-node devices" in (err.value.remediation or "")


def test_a_named_device_without_the_memory_refuses_or_falls_back_when_configured() -> None:
    with pytest.raises(DeviceTooSmall) as err:
        choose_device("CUDA0", ALL, 3 * GIB)
    assert err.value.code == "device_memory_short"
    assert "CUDA0" in err.value.message and "cpu_moe" in (err.value.remediation or "")
    choice = choose_device("CUDA0", ALL, 3 * GIB, fallback=True)
    assert choice.device == "CPU" and choice.requested == "CUDA0"
    assert choice.fallback_reason is not None and "2048 MiB free" in choice.fallback_reason


# --- placing the weights (pure) -----------------------------------------------------------------
NAMES = [
    "token_embd.weight",
    "blk.0.attn_q.weight",
    "blk.0.ffn_gate_inp.weight",
    "blk.0.ffn_up_exps.weight",
    "blk.0.ffn_gate_exps.weight",
    "blk.0.ffn_down_exps.weight",
    "blk.0.ffn_up_shexp.weight",
    "output.weight",
]


def test_placement_rules_cpu_moe_and_the_input_layer() -> None:
    plain = place_tensors(NAMES, "CUDA0")
    assert plain["token_embd.weight"] == "CPU"  # the lookup runs where llama.cpp runs it
    assert {plain[n] for n in NAMES[1:]} == {"CUDA0"}
    moe = place_tensors(NAMES, "CUDA0", cpu_moe=True)
    assert [n for n in NAMES if moe[n] == "CPU"] == [
        "token_embd.weight",
        "blk.0.ffn_up_exps.weight",
        "blk.0.ffn_gate_exps.weight",
        "blk.0.ffn_down_exps.weight",
    ]  # the shared expert and the router stay on the device
    assert place_tensors(NAMES, "CUDA0", [parse_rule("exps=CPU")]) == moe
    first = place_tensors(NAMES, "CUDA0", [parse_rule(r"attn_q=CUDA1"), parse_rule("blk=CPU")])
    assert first["blk.0.attn_q.weight"] == "CUDA1" and first["blk.0.ffn_up_shexp.weight"] == "CPU"
    # a stage that takes activations and drafts nothing looks nothing up: its tied head's
    # matrix is on the device (one that runs a NextN head embeds its drafts: the default)
    assert place_tensors(NAMES, "CUDA0", looks_up=False)["token_embd.weight"] == "CUDA0"
    assert set(place_tensors(NAMES, "CPU", cpu_moe=True).values()) == {"CPU"}
    assert CPU_MOE_PATTERN == r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # llama.cpp's


# --- [runtime] in the node TOML -----------------------------------------------------------------
def test_runtime_settings_parse_and_refuse_with_the_key_named() -> None:
    assert runtime_settings(None) == RuntimeSettings()
    s = runtime_settings(
        {"device": "Vulkan0", "placement": ["exps=CPU"], "cpu_moe": True, "device_fallback": True}
    )
    assert (s.device, s.cpu_moe, s.device_fallback) == ("Vulkan0", True, True)
    assert [(r.pattern, r.device) for r in s.placement] == [("exps", "CPU")]
    assert runtime_settings({"device": "CPU"}, "Vulkan0").device == "Vulkan0"  # the CLI wins
    for raw, key in (
        ({"devise": "CPU"}, "runtime.devise"),
        ({"device": ""}, "runtime.device"),
        ({"placement": "exps=CPU"}, "runtime.placement"),
        ({"placement": ["exps"]}, "runtime.placement"),
        ({"placement": ["(exps=CPU"]}, "runtime.placement"),
        ({"cpu_moe": "yes"}, "runtime.cpu_moe"),
    ):
        with pytest.raises(UsageError) as err:
            runtime_settings(raw)
        assert key in err.value.message, (raw, err.value.message)


def test_the_node_toml_reads_runtime(tmp_path: Path) -> None:
    from mesh_node.settings import load_node_settings

    toml = tmp_path / "node.toml"
    toml.write_text('identity = "k"\n[runtime]\ndevice = "CPU"\ncpu_moe = true\n')
    assert load_node_settings(toml).runtime == RuntimeSettings(device="CPU", cpu_moe=True)


# --- mesh-node devices --------------------------------------------------------------------------
def test_mesh_node_devices_lists_the_cpu_with_its_memory() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mesh_node", "devices", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    devices = json.loads(out.stdout)["devices"]
    cpu = next(d for d in devices if d["type"] == "CPU")
    assert cpu["name"] == "CPU" and 0 < cpu["free_bytes"] <= cpu["total_bytes"]
    text = subprocess.run(
        [sys.executable, "-m", "mesh_node", "devices"], capture_output=True, text=True, timeout=120
    )
    assert text.returncode == 0 and text.stdout.split()[:4] == ["NAME", "TYPE", "FREE", "MiB"]


def test_a_node_configured_with_a_device_it_lacks_refuses_to_start(tmp_path: Path) -> None:
    from servetools import node_toml

    cfg = tmp_path / "n.toml"
    cfg.write_text(node_toml(tmp_path, "n"))
    for extra in (["--device", "Vulkan7"], []):
        if not extra:  # the same from the file's [runtime]
            cfg.write_text(cfg.read_text() + '\n[runtime]\nplacement = ["exps=Metal0"]\n')
        out = subprocess.run(
            [sys.executable, "-m", "mesh_node", "run", "--config", str(cfg), *extra],
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 2, out.stderr
        assert "error [unknown_device]" in out.stderr and "hint: " in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and "listening" not in out.stdout


# --- the stage on a device that does not exist, and through the scheduler on the CPU -----------
pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

from skippy.runtime.canary import check, synth  # noqa: E402
from skippy.runtime.chain import StageChain  # noqa: E402
from skippy.runtime.ggml_engine import GgmlStage  # noqa: E402
from skippy.runtime.stage import DecodeStep, StageConfig  # noqa: E402


class ScheduledStage(GgmlStage):
    scheduled = True


@pytest.fixture(scope="module")
def moe_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("devices")
    return check.package_model(synth.family("qwen3moe"), "Q8_0", root)[1]


def _stages(pkg: Path, cls: type[GgmlStage], cfg: StageConfig) -> list[GgmlStage]:
    loads = check.stage_loads(pkg, ("0..1", "1..4"))
    return [cls(load, cfg, stage_index=i, stage_count=2) for i, load in enumerate(loads)]


def test_a_stage_on_an_unknown_device_is_refused_before_anything_loads(moe_pkg: Path) -> None:
    (load,) = check.stage_loads(moe_pkg, ("0..4",))
    with pytest.raises(UnknownDevice) as err:
        GgmlStage(load, StageConfig(n_ctx=64, device="Vulkan7"))
    assert err.value.code == "unknown_device" and "CPU" in err.value.message
    cfg = StageConfig(n_ctx=64, placement=(parse_rule("exps=Metal0"),))
    with pytest.raises(UnknownDevice, match="Metal0"):
        GgmlStage(load, cfg)


def _run(pkg: Path, cls: type[GgmlStage]) -> dict[str, object]:
    """Prefill in chunks of 16 past position 256, greedy decodes (the reused graph crosses
    the KV-length step at 256), a batch of two sessions, a verify window of 3."""
    ids = synth.long_prompt(250, vocab=512)
    cfg = StageConfig(n_ctx=1024, n_batch=16, n_threads=1, max_sessions=4)
    stages = _stages(pkg, cls, cfg)
    with StageChain(stages, None) as ch:  # type: ignore[arg-type]
        logits = ch.logits(list(ids), all_positions=True)
        tokens = list(ch.generate(list(ids), max_tokens=12).tokens)
        for s in ("a", "b"):
            ch.prefill(s, list(ids[:200] if s == "a" else ids[:100]))
        rows = []
        for step in range(3):
            steps = [DecodeStep("a", 200 + step, np.array([7 + step])),
                     DecodeStep("b", 100 + step, np.array([9 + step]))]
            acts = stages[0].decode_batch(steps)
            rows += [o.logits for o in stages[1].decode_batch(
                [DecodeStep(st.session, st.position, o.activations)
                 for st, o in zip(steps, acts, strict=True)]
            )]
        window = stages[0].decode_steps("a", 203, np.array([1, 2, 3]))
        verify = stages[1].decode_steps("a", 203, window.activations).logits
        devices = [(s.device, type(s._backend).__name__) for s in stages]
        where = [s.device_status() for s in stages]  # sessions open: their caches counted
    return {
        "logits": logits,
        "tokens": tokens,
        "rows": rows,
        "verify": verify,
        "on": devices,
        "where": where,
    }


def test_the_scheduler_on_the_cpu_equals_the_cpu_backend_bit_for_bit(moe_pkg: Path) -> None:
    plain, scheduled = _run(moe_pkg, GgmlStage), _run(moe_pkg, ScheduledStage)
    assert plain["on"] == [("CPU", "CpuBackend")] * 2
    assert scheduled["on"] == [("CPU", "DeviceBackend")] * 2
    for run in (plain, scheduled):  # on the CPU: nothing in a device's memory
        for where in run["where"]:  # type: ignore[attr-defined]
            assert where["device"] == "CPU" and where["placement"] == "cpu", where
            assert where["device_memory_bytes"] == 0 and where["device_fallback"] is None
    assert np.array_equal(plain["logits"], scheduled["logits"])
    assert plain["tokens"] == scheduled["tokens"]
    for a, b in zip(plain["rows"], scheduled["rows"], strict=True):  # type: ignore[call-overload]
        assert np.array_equal(a, b)
    assert np.array_equal(plain["verify"], scheduled["verify"])
