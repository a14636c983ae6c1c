"""The node's stage-runtime calibration: measured once, cached in
``data_dir``, advertised in the hello (``protocol.messages.ComputeCost``).

The shell of ``skippy.runtime.calibration`` (which measures; this module caches and advertises).

A node whose stages run on a device is calibrated there, and on the CPU too (the part of a
stage that stays in RAM runs at the CPU's speed): ``mesh_node.device_adverts`` puts each
figure beside its device in the hello.

``mesh-node run`` calls ``load_or_calibrate`` before the node starts linking, so its first
hello carries the figure. The cache (``calibration.json``) holds one record per
``CalibrationKey`` (engine, runtime version, threads, model class): a restart with the same
key reuses it and measures nothing; a changed runtime, thread count or calibration model
measures again. A calibration that fails (a runtime that cannot load here) is logged and the
node starts without one: planners then treat it as uncalibrated, never as fast.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Final

from mesh_node.device_adverts import advertise, experts_on_cpu, stage_device
from mesh_node.settings import NodeSettings
from protocol.messages import ComputeCost, Devices
from skippy.atomic import atomic_write_bytes
from skippy.errors import SkippyError
from skippy.runtime.calibration import MODEL_CLASS, Calibration, run_calibration

log = logging.getLogger("mesh_node.calibration")

CACHE_NAME: Final = "calibration.json"
CACHE_VERSION: Final = 1
MAX_RECORDS: Final = 8  # one per key seen; the oldest go first


def calibration_threads(settings: NodeSettings) -> int:
    """The threads calibrated with: ``[serving] threads`` when set, else 1. Several nodes of a
    lab share a machine's cores, and a single-thread figure is the one that does not depend
    on who else is running; a node that pins its threads is calibrated at that count."""
    return settings.serving.threads or 1


def read_cache(path: Path) -> list[Calibration]:
    """The cached records; an unreadable or foreign file is an empty cache (logged)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("ignoring the calibration cache %s: %s", path, exc)
        return []
    if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION:
        log.warning("ignoring the calibration cache %s: not version %d", path, CACHE_VERSION)
        return []
    out = []
    for record in doc.get("records", []) if isinstance(doc.get("records"), list) else []:
        try:
            out.append(Calibration.from_dict(record))
        except SkippyError as exc:
            log.warning("ignoring a calibration cache record: %s", exc)
    return out


def write_cache(path: Path, records: list[Calibration]) -> None:
    doc = {"version": CACHE_VERSION, "records": [r.to_dict() for r in records[-MAX_RECORDS:]]}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(doc, indent=1).encode("utf-8"), durable=False)


def cached(
    records: list[Calibration], engine: str, threads: int, device: str = "CPU"
) -> Calibration | None:
    """The record measured for this engine, thread count and device with today's calibration
    model. (The engine's exact version is recorded too; a pinned llama-cpp-python means
    one.)"""
    for r in reversed(records):
        k = r.key
        if (k.engine, k.threads, k.model_class, k.device) == (
            engine,
            threads,
            MODEL_CLASS,
            device,
        ):
            return r
    return None


def load_or_calibrate(settings: NodeSettings, device: str = "CPU") -> Calibration | None:
    """The cached calibration for this node's key on ``device`` (a ggml device name), else a
    fresh one (stored); ``None`` when calibration is off or cannot run here."""
    if not settings.calibrate:
        return None
    if settings.serving.engine == "llama":  # whole models on this node: nothing to plan
        log.info("calibration skipped: [serving] engine = llama serves whole models only")
        return None
    engine, threads = settings.serving.engine, calibration_threads(settings)
    path = settings.data_dir / CACHE_NAME
    records = read_cache(path)
    hit = cached(records, engine, threads, device)
    if hit is not None:
        log.info("calibration (cached): %s", describe(hit))
        return hit
    scratch = Path(tempfile.mkdtemp(prefix=".calibration-", dir=_scratch_parent(settings)))
    try:
        fresh = run_calibration(scratch, engine=engine, threads=threads, device=device)
    except (SkippyError, OSError, ValueError) as exc:
        log.warning("calibration failed, advertising none: %s", exc)
        return None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    kept = [r for r in records if r.key != fresh.key]
    try:
        write_cache(path, [*kept, fresh])
    except OSError as exc:  # the figure is still good for this run
        log.warning("could not cache the calibration in %s: %s", path, exc)
    log.info("calibration (measured): %s", describe(fresh))
    return fresh


def _scratch_parent(settings: NodeSettings) -> Path:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    writable = os.access(settings.data_dir, os.W_OK)
    return settings.data_dir if writable else Path(tempfile.gettempdir())


def describe(c: Calibration) -> str:
    return (
        f"{c.key.engine} {c.key.runtime_version} on {c.key.device}, {c.key.threads} "
        f"thread(s): decode "
        f"{c.decode_s_per_layer * 1000:.3f} ms, prefill {c.prefill_s_per_layer * 1000:.3f} ms "
        f"per layer per token ({c.layer_bytes} bytes per layer)"
    )


def measure_node(settings: NodeSettings) -> tuple[ComputeCost | None, Devices | None]:
    """What this node's hello advertises about its speed and devices: the calibration on the
    device its stages run on (``compute``), and its devices with their memory, each with the
    figure measured on it (the stage device's and the CPU's). A ggml that cannot load leaves
    the devices out (logged), as a failed calibration leaves ``compute`` out."""
    from skippy.gguf import ggml
    from skippy.runtime.devices import CPU, list_devices

    try:
        infos = list_devices(ggml.load())
    except (ggml.GgmlUnavailable, ggml.GgmlVersionMismatch, OSError) as exc:
        log.warning("advertising no devices: %s", exc)
        infos = []
    runtime = settings.runtime
    stage = stage_device(runtime.device, infos)
    # Only the ggml engine runs a stage on a device; the others' figure is the CPU's.
    measured_on = stage if settings.serving.engine == "ggml" else CPU
    main = load_or_calibrate(settings, measured_on)
    cpu = main if measured_on == CPU else load_or_calibrate(settings, CPU)
    speeds = {measured_on: compute_cost(main), CPU: compute_cost(cpu)}
    devices = advertise(
        infos,
        stage,
        experts_in_ram=experts_on_cpu(runtime.cpu_moe, runtime.placement),
        speeds=speeds,
    )
    return compute_cost(main), devices


def compute_cost(c: Calibration | None) -> ComputeCost | None:
    """What the hello advertises (no key: peers only weigh numbers)."""
    if c is None:
        return None
    return ComputeCost(c.decode_s_per_layer, c.prefill_s_per_layer, c.layer_bytes)
