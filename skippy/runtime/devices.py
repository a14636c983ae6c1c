"""Which ggml devices a stage may run on, and where each of its weights goes.

ggml registers one device per backend it was built with (the CPU always; Vulkan, CUDA, Metal,
ROCm where the installed llama-cpp-python was built with them: docs/devices.md).
``list_devices`` reads them (name, type, free and total memory); everything else here is a
pure decision over that list:

- ``choose_device``: ``[runtime] device`` = ``"auto"`` (the non-CPU device with the most free
  memory that fits the stage, else the CPU), ``"CPU"``, or a device's own name (it must exist
  and fit, or, with ``device_fallback``, the stage runs on the CPU and says why).
- ``place_tensors``: per-weight placement by name pattern (llama.cpp's
  ``--override-tensor PATTERN=DEVICE``, the pattern searched in the name as ``std::regex_search``
  does) and ``cpu_moe`` (the routed experts kept in system memory, llama.cpp's ``--cpu-moe``);
  the token embedding stays on the CPU as llama.cpp keeps its input layer there.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from skippy.config import PlacementRule, parse_rule
from skippy.errors import UsageError
from skippy.gguf import ggml
from skippy.runtime.boundary import RuntimeLoadError

CPU: Final = "CPU"
AUTO: Final = "auto"
# llama.cpp's --cpu-moe pattern (common/arg.cpp, llm_ffn_exps_cpu_override): the routed
# experts' up, gate and down tensors, not the shared expert's
CPU_MOE_PATTERN: Final = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
# the input layer's embedding lookup runs where llama.cpp runs it (dev_input = CPU)
INPUT_TENSOR: Final = "token_embd.weight"
# Room a device keeps beyond the stage's weights and caches (compute buffers, the driver's
# own allocations): a stage needs this fraction more than it counts.
FIT_MARGIN: Final = 0.10

_TYPE_NAMES: Final = {
    ggml.GGML_BACKEND_DEVICE_TYPE_CPU: "CPU",
    ggml.GGML_BACKEND_DEVICE_TYPE_GPU: "GPU",
    ggml.GGML_BACKEND_DEVICE_TYPE_IGPU: "IGPU",
    ggml.GGML_BACKEND_DEVICE_TYPE_ACCEL: "ACCEL",
}
# which kind of device "auto" prefers, best first
_AUTO_RANK: Final = {"GPU": 0, "IGPU": 1}


class UnknownDevice(UsageError):
    """The configuration names a device this ggml does not have."""

    code = "unknown_device"


class DeviceTooSmall(RuntimeLoadError):
    """The chosen device's free memory cannot hold the stage."""

    code = "device_memory_short"


class DeviceAllocationFailed(RuntimeLoadError):
    """The device refused an allocation while the stage was loading."""

    code = "device_alloc_failed"


class DeviceComputeFailed(ggml.GgmlCallFailed):
    """A graph failed on the device (a driver error): the stage's results are not trusted."""

    code = "device_compute_failed"


@dataclass(frozen=True)
class DeviceInfo:
    """One device as ggml reports it."""

    name: str
    description: str
    kind: str  # CPU, GPU, IGPU, ACCEL
    free_bytes: int
    total_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "type": self.kind,
            "free_bytes": self.free_bytes,
            "total_bytes": self.total_bytes,
        }


@dataclass(frozen=True)
class DeviceChoice:
    """Where a stage runs: ``device`` (a name from ``list_devices``), and when it is the CPU
    although another device was asked for, why (``fallback_reason``)."""

    device: str
    requested: str
    fallback_reason: str | None = None


def device_handles(g: ggml.Ggml) -> dict[str, int]:
    """Every registered device's handle by its name, in the registry's order (a backend's
    own start-up lines, e.g. Vulkan's "No devices found.", kept off stderr)."""
    out: dict[str, int] = {}
    with ggml.without_debug_log(g, below=ggml.GGML_LOG_LEVEL_WARN):
        count = int(g.ggml_backend_dev_count())
    for i in range(count):
        dev = ggml.non_null(g.ggml_backend_dev_get(i), "ggml_backend_dev_get")
        out[g.ggml_backend_dev_name(dev).decode()] = dev
    return out


def list_devices(g: ggml.Ggml) -> list[DeviceInfo]:
    """The devices this process's ggml sees, in the registry's order (the CPU last in the
    builds with devices, as ggml registers it)."""
    out = []
    for name, dev in device_handles(g).items():
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = _TYPE_NAMES.get(int(g.ggml_backend_dev_type(dev)), "OTHER")
        out.append(
            DeviceInfo(
                name=name,
                description=g.ggml_backend_dev_description(dev).decode(errors="replace"),
                kind=kind,
                free_bytes=int(free.value),
                total_bytes=int(total.value),
            )
        )
    return out


def _known(devices: Sequence[DeviceInfo]) -> str:
    return ", ".join(d.name for d in devices) or "none"


def choose_device(
    requested: str,
    devices: Sequence[DeviceInfo],
    need_bytes: int,
    *,
    fallback: bool = False,
) -> DeviceChoice:
    """The device a stage needing ``need_bytes`` on it runs on (see the module doc).

    A named device that does not exist is always an error (a typo must not silently run on
    the CPU); one that lacks the memory is an error unless ``fallback``."""
    want = int(need_bytes * (1 + FIT_MARGIN))
    if requested.upper() == CPU:
        return DeviceChoice(CPU, requested)
    if requested == AUTO:
        fits = [d for d in devices if d.kind in _AUTO_RANK and d.free_bytes >= want]
        if not fits:
            return DeviceChoice(CPU, requested)
        best = min(fits, key=lambda d: (_AUTO_RANK[d.kind], -d.free_bytes))
        return DeviceChoice(best.name, requested)
    named = next((d for d in devices if d.name == requested), None)
    if named is None:
        raise UnknownDevice(
            f"no device named {requested!r}; this ggml has: {_known(devices)}",
            actual=requested,
            expected=[d.name for d in devices],
            remediation="run `mesh-node devices` to list them, or use device = \"auto\"",
        )
    if named.kind == CPU:
        return DeviceChoice(CPU, requested)
    if named.free_bytes < want:
        reason = (
            f"the stage needs about {want / 2**20:.0f} MiB on {named.name}, which has "
            f"{named.free_bytes / 2**20:.0f} MiB free"
        )
        if fallback:
            return DeviceChoice(CPU, requested, fallback_reason=reason)
        raise DeviceTooSmall(
            reason,
            expected=want,
            actual=named.free_bytes,
            remediation="keep the experts on the CPU (cpu_moe = true), take fewer layers, "
            "or set device_fallback = true to run on the CPU instead",
        )
    return DeviceChoice(named.name, requested)


def place_tensors(
    names: Iterable[str],
    device: str,
    rules: Sequence[PlacementRule] = (),
    *,
    cpu_moe: bool = False,
    looks_up: bool = True,
) -> dict[str, str]:
    """Each weight's device: the first matching rule's (``cpu_moe`` adds llama.cpp's experts
    rule after them), else ``device``; the input embedding on the CPU where the stage looks
    tokens up (``looks_up``: it takes tokens, or it runs a NextN draft head, which embeds its
    drafts), as llama.cpp's input layer. On the CPU alone, everything is on the CPU."""
    all_rules = list(rules) + ([PlacementRule(CPU_MOE_PATTERN, CPU)] if cpu_moe else [])
    out: dict[str, str] = {}
    for name in names:
        if device == CPU:
            out[name] = CPU
            continue
        rule = next((r for r in all_rules if r.matches(name)), None)
        if rule is not None:
            out[name] = rule.device
        elif name == INPUT_TENSOR and looks_up:
            out[name] = CPU
        else:
            out[name] = device
    return out


def placement_mode(placement: Mapping[str, str], device: str) -> str:
    """A loaded stage's placement in the planner's words (``skippy.package.placement``):
    ``device`` (every weight on its device but the input embedding), ``experts on CPU`` (the
    routed experts in RAM, the rest there), ``cpu``, or ``mixed`` (rules put other weights
    elsewhere)."""
    if device == CPU:
        return "cpu"
    off = [n for n, d in placement.items() if d != device and n != INPUT_TENSOR]
    if not off:
        return "device"
    if all(placement[n] == CPU and re.search(CPU_MOE_PATTERN, n) for n in off):
        return "experts on CPU"
    return "mixed"


def check_configured(
    devices: Sequence[DeviceInfo], device: str, rules: Sequence[PlacementRule]
) -> None:
    """A node's ``[runtime]`` names only devices this ggml has (checked at start-up, before a
    stage is planned onto the node)."""
    choose_device(device, devices, 0)  # a name that does not exist is refused there
    check_rule_devices(rules, {d.name: d for d in devices})


def check_rule_devices(rules: Sequence[PlacementRule], devices: Mapping[str, Any]) -> None:
    """Every rule names a device this ggml has."""
    for r in rules:
        if r.device not in devices and r.device.upper() != CPU:
            raise UnknownDevice(
                f"placement rule {r.pattern}={r.device} names no device of this ggml "
                f"(it has: {', '.join(devices) or 'none'})",
                actual=r.device,
                remediation="run `mesh-node devices` to list them",
            )


__all__ = [
    "AUTO",
    "CPU",
    "CPU_MOE_PATTERN",
    "DeviceAllocationFailed",
    "DeviceChoice",
    "DeviceComputeFailed",
    "DeviceInfo",
    "DeviceTooSmall",
    "PlacementRule",
    "UnknownDevice",
    "check_configured",
    "check_rule_devices",
    "choose_device",
    "device_handles",
    "list_devices",
    "parse_rule",
    "place_tensors",
    "placement_mode",
]
