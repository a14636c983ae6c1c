"""A stage on a ggml device: weights in the device's memory, graphs run by the scheduler.

``ggml_backend_sched`` splits each graph between the stage's device (first: preferred) and the
CPU (last: the fallback for any op the device lacks, and where CPU-placed weights are read),
copying activations between them at the splits, as llama.cpp runs its models. Where the
weights go is ``skippy.runtime.devices.place_tensors``'s decision: the device's weights are
uploaded from the mapped fragments into one device buffer, a bounded chunk at a time, each
tensor's pages dropped from the mapping once uploaded (host memory stays bounded during a
load); the CPU's stay zero-copy in the mapping, as on a CPU-only stage. The sessions' KV
caches are allocated from the device's buffer type, so they live on the device; only the
stage's inputs and its result cross to and from the host.

Each graph of the engine gets its own scheduler (``SchedRunner``): a scheduler holds one
allocated graph at a time, and a reused decode graph must stay allocated between its runs.
The CPU alone can be scheduled too (``device = "CPU"`` with ``GgmlStage.scheduled``): the same
path with one backend, which the tests compare with the plain CPU backend.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Mapping
from typing import Final

from skippy.gguf import ggml
from skippy.gguf.ggml import GgmlInitParams
from skippy.runtime.backend import map_weights, new_weight_tensor
from skippy.runtime.devices import (
    CPU,
    DeviceAllocationFailed,
    DeviceComputeFailed,
    device_handles,
)
from skippy.runtime.weights import StageWeights, WeightRef

log = logging.getLogger(__name__)
_ok = ggml.non_null
# Bytes of one upload call: the host reads this much of a mapped fragment at a time.
UPLOAD_CHUNK_BYTES: Final = 16 * 1024 * 1024


class DeviceBackend:
    """A device (or the CPU alone) and the CPU, their weights' buffers and backends.
    ``close()`` frees them."""

    # The scheduler copies a graph's inputs between backends at run time with the shapes
    # they had when the graph was split: a reused graph is rebuilt when its KV length
    # changes instead of being resized in place (``GgmlStage``).
    host_results = False
    resizes_graphs = False

    def __init__(self, g: ggml.Ggml, device: str, n_threads: int) -> None:
        self.g = g
        self.device = device
        self.n_threads = self.threads_now = n_threads
        self.repacked_bytes = 0
        self.device_weight_bytes = 0  # uploaded to the device
        self._ctxs: list[int] = []
        self._buffers: list[int] = []
        handles = device_handles(g)
        self._cpu = _ok(g.ggml_backend_cpu_init(), "ggml_backend_cpu_init")
        g.ggml_backend_cpu_set_n_threads(self._cpu, n_threads)
        self._dev: int | None = None
        self._device_backend: int | None = None
        if device != CPU:
            self._dev = handles[device]
            with ggml.without_debug_log(g, below=ggml.GGML_LOG_LEVEL_WARN):
                self._device_backend = g.ggml_backend_dev_init(self._dev, None)
            if not self._device_backend:
                g.ggml_backend_free(self._cpu)
                raise DeviceAllocationFailed(
                    f"ggml could not start device {device}",
                    actual=device,
                    remediation="check the driver with `mesh-node devices`",
                )
        self.backends = [b for b in (self._device_backend, self._cpu) if b]

    def buffer_type(self) -> int:
        """Where KV caches are allocated: the device's memory."""
        if self._dev is None:
            return self.g.ggml_backend_cpu_buffer_type()
        return _ok(self.g.ggml_backend_dev_buffer_type(self._dev), "dev_buffer_type")

    def place_weights(
        self, w: StageWeights, placement: Mapping[str, str], *, tied_head: str | None = None
    ) -> dict[str, int]:
        """One tensor per checked weight, on the device ``placement`` names for it: the
        CPU's mapped in place, each other device's allocated there and uploaded. A tied head
        (``tied_head``: the name the engine looks the output head up by) whose embedding
        stays on the CPU for the lookup gets its own copy on the device, as llama.cpp
        duplicates it into the output layer."""
        g = self.g
        refs = list(w)
        on: dict[str, list[tuple[str, WeightRef]]] = {}
        for r in refs:
            on.setdefault(placement[r.name], []).append((r.name, r))
        embd = next((r for r in refs if r.name == "token_embd.weight"), None)
        if (
            tied_head is not None
            and tied_head not in w
            and embd is not None
            and placement[embd.name] == CPU
            and self.device != CPU
        ):
            on.setdefault(self.device, []).append((tied_head, embd))
        tensors: dict[str, int] = {}
        for dev_name, items in on.items():
            params = GgmlInitParams(
                mem_size=g.ggml_tensor_overhead() * (len(items) + 2),
                mem_buffer=None,
                no_alloc=True,
            )
            ctx = _ok(g.ggml_init(params), "ggml_init")
            self._ctxs.append(ctx)
            for key, r in items:
                tensors[key] = new_weight_tensor(g, ctx, r)
            if dev_name == CPU:
                self._buffers += map_weights(g, w, tensors, {k for k, _ in items})
            else:
                self._upload(w, ctx, dev_name, [(tensors[k], r) for k, r in items])
        return tensors

    def _upload(
        self, w: StageWeights, ctx: int, dev_name: str, items: list[tuple[int, WeightRef]]
    ) -> None:
        g = self.g
        handles = device_handles(g)
        if dev_name not in handles:  # placement was checked against the registry
            raise DeviceAllocationFailed(f"no device {dev_name}", actual=dev_name)
        buft = _ok(g.ggml_backend_dev_buffer_type(handles[dev_name]), "dev_buffer_type")
        buffer = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
        if not buffer:
            need = sum(r.nbytes for _, r in items)
            raise DeviceAllocationFailed(
                f"{dev_name} could not allocate {need / 2**20:.1f} MiB for the stage's weights",
                expected=need,
                remediation="keep the experts on the CPU (cpu_moe = true), take fewer layers, "
                'or use device = "CPU"',
            )
        self._buffers.append(buffer)
        g.ggml_backend_buffer_set_usage(buffer, ggml.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        for t, r in items:
            src = w.address(r.name)
            for off in range(0, r.nbytes, UPLOAD_CHUNK_BYTES):
                n = min(UPLOAD_CHUNK_BYTES, r.nbytes - off)
                g.ggml_backend_tensor_set(t, src + off, off, n)
            w.release_pages(r.name)
            self.device_weight_bytes += r.nbytes

    def runner(self, graph_size: int) -> SchedRunner:
        return SchedRunner(self, graph_size)

    def compute(self, graph: int, *, step: bool = False) -> None:
        """Graphs run through a runner's scheduler; nothing computes on a bare backend."""
        raise DeviceComputeFailed("a device stage computes through its schedulers")

    def close(self) -> None:
        g = self.g
        for buf in self._buffers:
            g.ggml_backend_buffer_free(buf)
        self._buffers = []
        for b in self.backends:
            g.ggml_backend_free(b)
        self.backends = []
        for ctx in self._ctxs:
            g.ggml_free(ctx)
        self._ctxs = []


class SchedRunner:
    """One graph at a time on a scheduler over the backend's device and CPU (device
    first), ops offloaded to the device as llama.cpp's default does."""

    def __init__(self, backend: DeviceBackend, graph_size: int) -> None:
        g = self.g = backend.g
        self._backend = backend
        n = len(backend.backends)
        self._array = (ctypes.c_void_p * n)(*backend.backends)
        self._sched = _ok(
            g.ggml_backend_sched_new(self._array, None, n, graph_size, False, True), "sched_new"
        )

    def alloc(self, graph: int) -> None:
        g = self.g
        g.ggml_backend_sched_reset(self._sched)
        if not g.ggml_backend_sched_alloc_graph(self._sched, graph):
            raise DeviceAllocationFailed(
                f"{self._backend.device} could not allocate a graph's compute buffer",
                remediation="lower [serving] prefill_chunk or max_sessions",
            )

    def compute(self, graph: int, *, step: bool = False) -> None:
        status = self.g.ggml_backend_sched_graph_compute(self._sched, graph)
        if status != ggml.GGML_STATUS_SUCCESS:
            raise DeviceComputeFailed(
                f"a graph failed on {self._backend.device} (ggml status {status})",
                actual=status,
            )

    def splits(self) -> int:
        """How many pieces the scheduler cut the last graph into (1: all on one backend)."""
        return int(self.g.ggml_backend_sched_get_n_splits(self._sched))

    def backend_of(self, tensor: int) -> int | None:
        return self.g.ggml_backend_sched_get_tensor_backend(self._sched, tensor)

    def buffer_bytes(self) -> int:
        return sum(
            int(self.g.ggml_backend_sched_get_buffer_size(self._sched, b))
            for b in self._backend.backends
        )

    def free(self) -> None:
        if self._sched:
            self.g.ggml_backend_sched_free(self._sched)
            self._sched = 0


__all__ = ["UPLOAD_CHUNK_BYTES", "DeviceBackend", "SchedRunner"]
