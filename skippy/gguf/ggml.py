"""The one ctypes binding to ggml: every foreign function it uses is declared once, here.

Which library: the ``libggml-base.so`` / ``libggml-cpu.so`` that the pinned
llama-cpp-python wheel ships in ``llama_cpp/lib/`` (ggml 0.25.3, llama.cpp commit 0c1e570;
docs/runtime-facts.md "ggml through ctypes"). The wheel also ships the C headers
(``site-packages/include/ggml*.h``); every declaration below is copied from them.

ggml has no stable ABI: an op's argument list changes between llama.cpp versions
(``ggml_rope_ext`` has 13 arguments here) and a ctypes signature that no longer matches
crashes or silently computes garbage. So ``load()`` refuses any ggml whose
``ggml_version()``/``ggml_commit()`` differ from the ones these declarations were written
for (``ggml_version_mismatch``), and the first load in a process runs a small numerical
self-test (matmuls against numpy, plus the ``ggml_tensor`` struct layout) before anything
else may use the library (``ggml_self_test_failed``).

ggml aborts the whole process on a failed ``GGML_ASSERT`` (no exception). Callers validate
every shape, type, size and alignment in Python *before* calling in (the stage runtime does
it in ``skippy.runtime.weights`` and at each call).

How to add a declaration (e.g. the quantize functions): add a stub method to
``Ggml`` in the section it belongs to, decorated with ``@_c(restype, *argtypes)`` with the
exact C signature from the header, and a typed Python signature. ``load()`` binds every
decorated method to the library symbol of the same name (searched in ggml-base, then
ggml-cpu, then ggml). Pointers are plain ``int`` addresses (``c_void_p``); a NULL result is
``None``.
"""

# The declarations are stubs with empty bodies, replaced by ctypes functions in Ggml.__init__.
# mypy: disable-error-code="empty-body"
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator
from ctypes import (
    c_bool,
    c_char,
    c_char_p,
    c_float,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_void_p,
)
from pathlib import Path
from typing import Any, Final, TypeVar

from skippy.errors import EXIT_USAGE, SkippyError

# --- what these declarations were written for ------------------------------------------------
LLAMA_CPP_PYTHON_VERSION: Final = "0.3.36"
GGML_VERSION: Final = "0.25.3"
GGML_COMMIT: Final = "0c1e570"  # ggml_commit() may carry a "-dirty" suffix
LIBRARY_FILES: Final = ("libggml-base.so", "libggml-cpu.so", "libggml.so")

# ggml.h constants
GGML_MAX_DIMS: Final = 4
GGML_MAX_SRC: Final = 10
GGML_MAX_OP_PARAMS: Final = 64
GGML_MAX_NAME: Final = 64
GGML_DEFAULT_GRAPH_SIZE: Final = 2048
GGML_ROPE_TYPE_NORMAL: Final = 0
GGML_ROPE_TYPE_NEOX: Final = 2
GGML_STATUS_SUCCESS: Final = 0
GGML_BACKEND_BUFFER_USAGE_WEIGHTS: Final = 1
GGML_LOG_LEVEL_DEBUG: Final = 1
GGML_LOG_LEVEL_INFO: Final = 2
GGML_LOG_LEVEL_WARN: Final = 3
GGML_LOG_LEVEL_CONT: Final = 5
GGML_PREC_F32: Final = 10  # enum ggml_prec
# enum ggml_backend_dev_type
GGML_BACKEND_DEVICE_TYPE_CPU: Final = 0
GGML_BACKEND_DEVICE_TYPE_GPU: Final = 1
GGML_BACKEND_DEVICE_TYPE_IGPU: Final = 2
GGML_BACKEND_DEVICE_TYPE_ACCEL: Final = 3
# The CPU backend's tensor alignment (ggml-backend TENSOR_ALIGNMENT): a buffer made from a
# pointer, and every tensor placed in it, must be aligned to this or ggml aborts.
TENSOR_ALIGNMENT: Final = 32


class GgmlType:
    """``enum ggml_type`` values used by the runtime (the full table is
    ``skippy.gguf.constants.GGML_TYPES``)."""

    F32: Final = 0
    F16: Final = 1
    Q8_0: Final = 8
    I32: Final = 26
    I64: Final = 27
    BF16: Final = 30


# libgomp (ggml's CPU backend is built with OpenMP) reads its environment once, when it is
# loaded. By default an idle OpenMP thread spins ~300,000 pauses (~7 ms of a core here) after
# every graph before it sleeps. A stage of a split is idle while the next stage computes on the
# same cores, so that spin steals a core from the stage doing the work, on every token of every
# hop. ggml's barriers inside a graph are OpenMP barriers too, so OMP_WAIT_POLICY=passive
# (sleep at once) makes each graph ~2-3x slower. 4,000 pauses (~0.1 ms) keep the barriers as
# fast as 10,000 did (one stage's decode and prefill unchanged, side by side) and let the stage
# that just finished leave the cores sooner: a 3-node split's decode 8-14% faster
# (docs/performance.md, "the OpenMP spin after a graph").
OPENMP_ENVIRONMENT: Final = {"GOMP_SPINCOUNT": "4000"}


def configure_openmp() -> None:
    """Set OpenMP's idle behaviour before libgomp loads (a value the user set is kept). Call
    before loading ggml or importing llama_cpp; once libgomp is loaded it has no effect."""
    for key, value in OPENMP_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


# --- errors ---------------------------------------------------------------------------------------
class GgmlUnavailable(SkippyError, ImportError):
    """llama-cpp-python (which ships libggml) is not installed, or its libraries do not load."""

    code = "runtime_unavailable"
    exit_code = EXIT_USAGE


class GgmlVersionMismatch(SkippyError, RuntimeError):
    """The installed ggml is not the version these ctypes declarations were written for."""

    code = "ggml_version_mismatch"
    exit_code = EXIT_USAGE


class GgmlSelfTestFailed(SkippyError, RuntimeError):
    """The first-load numerical self-test disagreed with numpy: the binding is not trusted."""

    code = "ggml_self_test_failed"


class GgmlCallFailed(SkippyError, RuntimeError):
    """A ggml call reported failure through its return value (NULL or a bad status)."""

    code = "ggml_call_failed"


# --- C structs ------------------------------------------------------------------------------------
class GgmlInitParams(ctypes.Structure):
    """``struct ggml_init_params`` (passed by value to ``ggml_init``)."""

    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


class GgmlTensorStruct(ctypes.Structure):
    """``struct ggml_tensor``: the runtime reads ``ne``/``nb``/``type``/``data`` of tensors it
    created to check them (the self-test checks this layout). The one writer is the ggml stage
    engine's reused decode graph, which sets the KV length (``ne``, and ``nb`` of its own
    contiguous results) of attention tensors it built, before each run
    (``skippy.runtime.ggml_engine._DecodeGraph``)."""

    _fields_ = [
        ("type", c_int),
        ("buffer", c_void_p),
        ("ne", c_int64 * GGML_MAX_DIMS),
        ("nb", c_size_t * GGML_MAX_DIMS),
        ("op", c_int),
        ("op_params", c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", c_int32),
        ("src", c_void_p * GGML_MAX_SRC),
        ("view_src", c_void_p),
        ("view_offs", c_size_t),
        ("data", c_void_p),
        ("name", c_char * GGML_MAX_NAME),
        ("extra", c_void_p),
        ("padding", c_char * 8),
    ]


def tensor_struct(tensor: int) -> GgmlTensorStruct:
    """A view of a live ``ggml_tensor`` (valid while its context lives)."""
    return GgmlTensorStruct.from_address(tensor)


GGML_LOG_CALLBACK = ctypes.CFUNCTYPE(None, c_int, c_char_p, c_void_p)


# --- quantization structs (skippy-quantize) --------------------------------------
# ggml_to_float_t: void (*)(const void * x, float * y, int64_t k). A CFUNCTYPE call releases
# the GIL like any other foreign call, so dequantizing runs on several threads.
GGML_TO_FLOAT = ctypes.CFUNCTYPE(None, c_void_p, c_void_p, c_int64)


class GgmlTypeTraits(ctypes.Structure):
    """``struct ggml_type_traits`` (ggml.h), read-only: block geometry and ``to_float``, the
    dequantizer requantizing needs (``from_float_ref`` is declared for the layout only)."""

    _fields_ = [
        ("type_name", c_char_p),
        ("blck_size", c_int64),
        ("blck_size_interleave", c_int64),
        ("type_size", c_size_t),
        ("is_quantized", c_bool),
        ("to_float", c_void_p),
        ("from_float_ref", c_void_p),
    ]


def type_traits(g: Ggml, type: int) -> GgmlTypeTraits:
    """The traits of one ggml type (a static table in libggml-base: valid for the process)."""
    ptr = g.ggml_get_type_traits(type)
    if not ptr:
        raise GgmlCallFailed(f"ggml_get_type_traits({type}) returned NULL")
    return GgmlTypeTraits.from_address(ptr)


# --- the declaration decorator ----------------------------------------------------------------
_F = TypeVar("_F", bound=Callable[..., Any])
_SIGNATURE = "__ggml_signature__"

# Short names for the C types of the declarations below.
_ptr = c_void_p  # any pointer: ggml_context*, ggml_tensor*, ggml_cgraph*, backend handles
_i64 = c_int64
_f32 = c_float


def _c(restype: Any, *argtypes: Any) -> Callable[[_F], _F]:
    """Declare a C function: ``restype`` and ``argtypes`` exactly as in the header."""

    def mark(fn: _F) -> _F:
        setattr(fn, _SIGNATURE, (restype, list(argtypes)))
        return fn

    return mark


class Ggml:
    """Every ggml function the project calls, bound by ``load()``.

    The methods below are declarations: calling one on an unbound instance raises. After
    ``load()`` each name is an instance attribute holding the ctypes function itself (one
    attribute lookup, no Python wrapper per call: graph building makes thousands of calls).
    """

    def __init__(self, libraries: tuple[ctypes.CDLL, ...], lib_dir: Path) -> None:
        self.libraries = libraries
        self.lib_dir = lib_dir
        for name in _declared_names():
            restype, argtypes = getattr(getattr(Ggml, name), _SIGNATURE)
            fn = _symbol(libraries, name)
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)

    # ==== version and misc (ggml.h) ===============================================================
    @_c(c_char_p)
    def ggml_version(self) -> bytes: ...
    @_c(c_char_p)
    def ggml_commit(self) -> bytes: ...
    @_c(c_size_t)
    def ggml_tensor_overhead(self) -> int: ...
    @_c(c_size_t, c_size_t, c_bool)
    def ggml_graph_overhead_custom(self, size: int, grads: bool) -> int: ...
    @_c(c_size_t, c_int, _i64)
    def ggml_row_size(self, type: int, ne: int) -> int: ...
    @_c(c_size_t, c_int)
    def ggml_type_size(self, type: int) -> int: ...
    @_c(_i64, c_int)
    def ggml_blck_size(self, type: int) -> int: ...
    @_c(c_char_p, c_int)
    def ggml_type_name(self, type: int) -> bytes: ...
    @_c(None, _ptr, _ptr)
    def ggml_log_set(self, callback: Any, user_data: int | None) -> None: ...
    @_c(None, ctypes.POINTER(c_void_p), ctypes.POINTER(c_void_p))
    def ggml_log_get(self, callback: Any, user_data: Any) -> None: ...

    # ==== contexts and tensors (ggml.h)
    @_c(_ptr, GgmlInitParams)
    def ggml_init(self, params: GgmlInitParams) -> int | None: ...
    @_c(None, _ptr)
    def ggml_free(self, ctx: int) -> None: ...
    @_c(_ptr, _ptr, c_int, _i64)
    def ggml_new_tensor_1d(self, ctx: int, type: int, ne0: int) -> int | None: ...
    @_c(_ptr, _ptr, c_int, _i64, _i64)
    def ggml_new_tensor_2d(self, ctx: int, type: int, ne0: int, ne1: int) -> int | None: ...
    @_c(_ptr, _ptr, c_int, _i64, _i64, _i64)
    def ggml_new_tensor_3d(
        self, ctx: int, type: int, ne0: int, ne1: int, ne2: int
    ) -> int | None: ...
    @_c(_ptr, _ptr, c_int, _i64, _i64, _i64, _i64)
    def ggml_new_tensor_4d(
        self, ctx: int, type: int, ne0: int, ne1: int, ne2: int, ne3: int
    ) -> int | None: ...
    @_c(c_size_t, _ptr)
    def ggml_nbytes(self, tensor: int) -> int: ...
    @_c(_i64, _ptr)
    def ggml_nelements(self, tensor: int) -> int: ...
    @_c(_ptr, _ptr)
    def ggml_get_data(self, tensor: int) -> int | None: ...
    @_c(_ptr, _ptr, c_char_p)
    def ggml_set_name(self, tensor: int, name: bytes) -> int: ...
    @_c(None, _ptr)
    def ggml_set_input(self, tensor: int) -> None: ...
    @_c(None, _ptr)
    def ggml_set_output(self, tensor: int) -> None: ...

    # ==== views and layout (ggml.h) ===============================================================
    @_c(_ptr, _ptr, _ptr, _i64, c_size_t)
    def ggml_view_1d(self, ctx: int, a: int, ne0: int, offset: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _i64, _i64, c_size_t, c_size_t)
    def ggml_view_2d(self, ctx: int, a: int, ne0: int, ne1: int, nb1: int, offset: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _i64, _i64, _i64, c_size_t, c_size_t, c_size_t)
    def ggml_view_3d(
        self, ctx: int, a: int, ne0: int, ne1: int, ne2: int, nb1: int, nb2: int, offset: int
    ) -> int: ...
    @_c(_ptr, _ptr, _ptr, _i64, _i64)
    def ggml_reshape_2d(self, ctx: int, a: int, ne0: int, ne1: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _i64, _i64, _i64)
    def ggml_reshape_3d(self, ctx: int, a: int, ne0: int, ne1: int, ne2: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64)
    def ggml_reshape_4d(self, ctx: int, a: int, ne0: int, ne1: int, ne2: int, ne3: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, c_size_t, c_size_t, c_size_t, c_size_t)
    def ggml_view_4d(
        self,
        ctx: int,
        a: int,
        ne0: int,
        ne1: int,
        ne2: int,
        ne3: int,
        nb1: int,
        nb2: int,
        nb3: int,
        offset: int,
    ) -> int: ...
    @_c(_ptr, _ptr, _ptr, c_int, c_int, c_int, c_int)
    def ggml_permute(self, ctx: int, a: int, ax0: int, ax1: int, ax2: int, ax3: int) -> int: ...
    @_c(_ptr, _ptr, _ptr)
    def ggml_transpose(self, ctx: int, a: int) -> int: ...
    @_c(_ptr, _ptr, _ptr)
    def ggml_cont(self, ctx: int, a: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _i64, _i64)
    def ggml_cont_2d(self, ctx: int, a: int, ne0: int, ne1: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _ptr)
    def ggml_cpy(self, ctx: int, a: int, b: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _ptr)
    def ggml_get_rows(self, ctx: int, a: int, b: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _ptr, c_int)
    def ggml_concat(self, ctx: int, a: int, b: int, dim: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _ptr, _ptr)
    def ggml_set_rows(self, ctx: int, a: int, b: int, c: int) -> int: ...

    # ==== arithmetic and activations (ggml.h)
    @_c(_ptr, _ptr, _ptr, _ptr)
    def ggml_add(self, ctx: int, a: int, b: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _ptr)
    def ggml_mul(self, ctx: int, a: int, b: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _f32)
    def ggml_scale(self, ctx: int, a: int, s: float) -> int: ...
    @_c(_ptr, _ptr, _ptr)
    def ggml_tanh(self, ctx: int, a: int) -> int: ...
    @_c(_ptr, _ptr, _ptr)
    def ggml_silu(self, ctx: int, a: int) -> int: ...
    @_c(_ptr, _ptr, _ptr)
    def ggml_sigmoid(self, ctx: int, a: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _f32)
    def ggml_rms_norm(self, ctx: int, a: int, eps: float) -> int: ...
    @_c(_ptr, _ptr, _ptr, _ptr)
    def ggml_mul_mat(self, ctx: int, a: int, b: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _ptr, _f32, _f32)
    def ggml_soft_max_ext(
        self, ctx: int, a: int, mask: int | None, scale: float, max_bias: float
    ) -> int: ...
    @_c(None, _ptr, _ptr)
    def ggml_soft_max_add_sinks(self, a: int, sinks: int | None) -> None: ...  # a's softmax op
    @_c(_ptr, _ptr, _ptr, _ptr, _ptr, c_int, c_int, c_int, _f32, _f32, _f32, _f32, _f32, _f32)
    def ggml_rope_ext(
        self,
        ctx: int,
        a: int,
        positions: int,
        freq_factors: int | None,
        n_dims: int,
        mode: int,
        n_ctx_orig: int,
        freq_base: float,
        freq_scale: float,
        ext_factor: float,
        attn_factor: float,
        beta_fast: float,
        beta_slow: float,
    ) -> int: ...
    @_c(_ptr, _ptr, _ptr, _ptr)
    def ggml_swiglu_split(self, ctx: int, gate: int, up: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _ptr)
    def ggml_geglu_split(self, ctx: int, gate: int, up: int) -> int: ...
    @_c(_ptr, _ptr, _ptr)
    def ggml_swiglu(self, ctx: int, a: int) -> int: ...  # silu(first half) * second half
    @_c(_ptr, _ptr, _ptr, _ptr, _f32, _f32)
    def ggml_swiglu_oai(self, ctx: int, a: int, b: int, alpha: float, limit: float) -> int: ...

    # ==== mixture of experts (ggml.h; llama.cpp's build_moe_ffn uses these) ==================
    @_c(_ptr, _ptr, _ptr)
    def ggml_soft_max(self, ctx: int, a: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, c_int)
    def ggml_argsort_top_k(self, ctx: int, a: int, k: int) -> int: ...
    @_c(_ptr, _ptr, _ptr)
    def ggml_sum_rows(self, ctx: int, a: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _f32, _f32)
    def ggml_clamp(self, ctx: int, a: int, min: float, max: float) -> int: ...
    @_c(_ptr, _ptr, _ptr, _f32)
    def ggml_fill(self, ctx: int, a: int, c: float) -> int: ...  # a's shape, every value c
    @_c(_ptr, _ptr, _ptr, _ptr)
    def ggml_div(self, ctx: int, a: int, b: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _ptr, _ptr)
    def ggml_mul_mat_id(self, ctx: int, as_: int, b: int, ids: int) -> int: ...
    @_c(_ptr, _ptr, _ptr, _ptr, _ptr)
    def ggml_add_id(self, ctx: int, a: int, b: int, ids: int) -> int: ...  # a + b[:, ids]

    # ==== precision hints (ggml.h, TAG_GGML_PREC) ================================================
    @_c(c_bool, _ptr, c_int)
    def ggml_prec_set_acc(self, a: int, prec: int) -> bool: ...

    # ==== graphs (ggml.h) =========================================================================
    @_c(_ptr, _ptr, c_size_t, c_bool)
    def ggml_new_graph_custom(self, ctx: int, size: int, grads: bool) -> int | None: ...
    @_c(None, _ptr, _ptr)
    def ggml_build_forward_expand(self, graph: int, tensor: int) -> None: ...
    @_c(c_int, _ptr)
    def ggml_graph_n_nodes(self, graph: int) -> int: ...

    # ==== backend buffers (ggml-backend.h)
    @_c(_ptr, _ptr, c_size_t)
    def ggml_backend_cpu_buffer_from_ptr(self, ptr: int, size: int) -> int | None: ...
    @_c(_ptr)
    def ggml_backend_cpu_buffer_type(self) -> int: ...
    @_c(_ptr, _ptr, c_size_t)
    def ggml_backend_buft_alloc_buffer(self, buft: int, size: int) -> int | None: ...
    @_c(_ptr, _ptr, _ptr)
    def ggml_backend_alloc_ctx_tensors_from_buft(self, ctx: int, buft: int) -> int | None: ...
    @_c(None, _ptr)
    def ggml_backend_buffer_free(self, buffer: int) -> None: ...
    @_c(_ptr, _ptr)
    def ggml_backend_buffer_get_base(self, buffer: int) -> int | None: ...
    @_c(c_size_t, _ptr)
    def ggml_backend_buffer_get_size(self, buffer: int) -> int: ...
    @_c(None, _ptr, c_uint8)
    def ggml_backend_buffer_clear(self, buffer: int, value: int) -> None: ...
    @_c(c_int, _ptr, _ptr, _ptr)
    def ggml_backend_tensor_alloc(self, buffer: int, tensor: int, addr: int) -> int: ...
    @_c(None, _ptr, _ptr, c_size_t, c_size_t)
    def ggml_backend_tensor_set(self, tensor: int, data: int, offset: int, size: int) -> None: ...
    @_c(None, _ptr, _ptr, c_size_t, c_size_t)
    def ggml_backend_tensor_get(self, tensor: int, data: int, offset: int, size: int) -> None: ...
    @_c(c_size_t, _ptr)
    def ggml_backend_buft_get_alignment(self, buft: int) -> int: ...
    @_c(c_size_t, _ptr, _ptr)
    def ggml_backend_buft_get_alloc_size(self, buft: int, tensor: int) -> int: ...
    @_c(None, _ptr, c_int)
    def ggml_backend_buffer_set_usage(self, buffer: int, usage: int) -> None: ...

    # ==== devices and registries (ggml-backend.h, ggml-cpu.h)
    @_c(_ptr)
    def ggml_backend_cpu_reg(self) -> int | None: ...
    @_c(_ptr, _ptr, c_size_t)
    def ggml_backend_reg_dev_get(self, reg: int, index: int) -> int | None: ...
    @_c(_ptr, _ptr, c_char_p)
    def ggml_backend_reg_get_proc_address(self, reg: int, name: bytes) -> int | None: ...
    @_c(c_bool, _ptr, _ptr)
    def ggml_backend_dev_supports_op(self, device: int, op: int) -> bool: ...
    @_c(c_size_t)
    def ggml_backend_dev_count(self) -> int: ...
    @_c(_ptr, c_size_t)
    def ggml_backend_dev_get(self, index: int) -> int | None: ...
    @_c(_ptr, c_char_p)
    def ggml_backend_dev_by_name(self, name: bytes) -> int | None: ...
    @_c(c_char_p, _ptr)
    def ggml_backend_dev_name(self, device: int) -> bytes: ...
    @_c(c_char_p, _ptr)
    def ggml_backend_dev_description(self, device: int) -> bytes: ...
    @_c(None, _ptr, ctypes.POINTER(c_size_t), ctypes.POINTER(c_size_t))
    def ggml_backend_dev_memory(self, device: int, free: Any, total: Any) -> None: ...
    @_c(c_int, _ptr)
    def ggml_backend_dev_type(self, device: int) -> int: ...
    @_c(_ptr, _ptr, c_char_p)
    def ggml_backend_dev_init(self, device: int, params: bytes | None) -> int | None: ...
    @_c(_ptr, _ptr)
    def ggml_backend_dev_buffer_type(self, device: int) -> int | None: ...
    @_c(_ptr, _ptr)
    def ggml_backend_get_device(self, backend: int) -> int | None: ...
    @_c(c_bool, _ptr)
    def ggml_backend_buffer_is_host(self, buffer: int) -> bool: ...
    @_c(c_char_p, _ptr)
    def ggml_backend_buft_name(self, buft: int) -> bytes: ...

    # ==== the scheduler: one graph over several backends (ggml-backend.h)
    @_c(_ptr, ctypes.POINTER(c_void_p), ctypes.POINTER(c_void_p), c_int, c_size_t, c_bool, c_bool)
    def ggml_backend_sched_new(
        self,
        backends: Any,
        bufts: Any,
        n_backends: int,
        graph_size: int,
        parallel: bool,
        op_offload: bool,
    ) -> int | None: ...
    @_c(None, _ptr)
    def ggml_backend_sched_free(self, sched: int) -> None: ...
    @_c(c_bool, _ptr, _ptr)
    def ggml_backend_sched_alloc_graph(self, sched: int, graph: int) -> bool: ...
    @_c(c_int, _ptr, _ptr)
    def ggml_backend_sched_graph_compute(self, sched: int, graph: int) -> int: ...
    @_c(None, _ptr)
    def ggml_backend_sched_reset(self, sched: int) -> None: ...
    @_c(c_int, _ptr)
    def ggml_backend_sched_get_n_splits(self, sched: int) -> int: ...
    @_c(c_int, _ptr)
    def ggml_backend_sched_get_n_copies(self, sched: int) -> int: ...
    @_c(c_size_t, _ptr, _ptr)
    def ggml_backend_sched_get_buffer_size(self, sched: int, backend: int) -> int: ...
    @_c(_ptr, _ptr, _ptr)
    def ggml_backend_sched_get_tensor_backend(self, sched: int, node: int) -> int | None: ...

    # ==== graph allocator (ggml-alloc.h)
    @_c(_ptr, _ptr)
    def ggml_gallocr_new(self, buft: int) -> int | None: ...
    @_c(None, _ptr)
    def ggml_gallocr_free(self, galloc: int) -> None: ...
    @_c(c_bool, _ptr, _ptr)
    def ggml_gallocr_alloc_graph(self, galloc: int, graph: int) -> bool: ...
    @_c(c_size_t, _ptr, c_int)
    def ggml_gallocr_get_buffer_size(self, galloc: int, buffer_id: int) -> int: ...

    # ==== CPU backend (ggml-cpu.h, ggml-backend.h)
    @_c(_ptr)
    def ggml_backend_cpu_init(self) -> int | None: ...
    @_c(None, _ptr, c_int)
    def ggml_backend_cpu_set_n_threads(self, backend: int, n_threads: int) -> None: ...
    @_c(None, _ptr)
    def ggml_backend_free(self, backend: int) -> None: ...
    @_c(c_int, _ptr, _ptr)
    def ggml_backend_graph_compute(self, backend: int, graph: int) -> int: ...

    # ==== quantization (ggml.h, skippy-quantize) =====================================
    # ggml_quantize_chunk aborts (GGML_ASSERT) on an imatrix-only type without an imatrix and on
    # a start that is not a whole row; skippy.produce.quant_stream checks both first.
    @_c(None, c_int)
    def ggml_quantize_init(self, type: int) -> None: ...
    @_c(None)
    def ggml_quantize_free(self) -> None: ...
    @_c(c_bool, c_int)
    def ggml_quantize_requires_imatrix(self, type: int) -> bool: ...
    @_c(c_size_t, c_int, _ptr, _ptr, _i64, _i64, _i64, _ptr)
    def ggml_quantize_chunk(
        self,
        type: int,
        src: int,
        dst: int,
        start: int,
        nrows: int,
        n_per_row: int,
        imatrix: int | None,
    ) -> int: ...
    @_c(c_bool, c_int, _ptr, c_size_t)
    def ggml_validate_row_data(self, type: int, data: int, nbytes: int) -> bool: ...
    @_c(c_bool, c_int)
    def ggml_is_quantized(self, type: int) -> bool: ...
    @_c(_ptr, c_int)
    def ggml_get_type_traits(self, type: int) -> int | None: ...


def _declared_names() -> list[str]:
    return [n for n, v in vars(Ggml).items() if callable(v) and hasattr(v, _SIGNATURE)]


def _symbol(libraries: tuple[ctypes.CDLL, ...], name: str) -> Any:
    for lib in libraries:
        try:
            return getattr(lib, name)
        except AttributeError:
            continue
    raise GgmlVersionMismatch(
        f"ggml symbol {name} is missing from {', '.join(LIBRARY_FILES)}: the installed "
        f"llama-cpp-python is not the {LLAMA_CPP_PYTHON_VERSION} these declarations were "
        "written for",
        code="ggml_version_mismatch",
        expected=LLAMA_CPP_PYTHON_VERSION,
        remediation=f"pip install llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
    )


# --- loading --------------------------------------------------------------------------------------
def library_dir() -> Path:
    """``llama_cpp/lib`` of the installed llama-cpp-python, found without importing it
    (importing ``llama_cpp`` loads libllama too, which the stage runtime does not need)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise GgmlUnavailable(
            "the ggml stage runtime needs libggml from llama-cpp-python, which is not installed",
            remediation=f"pip install 'llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}'",
        )
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def _open_libraries(lib_dir: Path) -> tuple[ctypes.CDLL, ...]:
    configure_openmp()
    libs = []
    for name in LIBRARY_FILES:
        path = lib_dir / name
        try:
            libs.append(ctypes.CDLL(str(path)))
        except OSError as exc:
            raise GgmlUnavailable(
                f"cannot load {path}: {exc}",
                path=str(path),
                remediation=f"reinstall llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
            ) from exc
    return tuple(libs)


def check_version(version: str, commit: str) -> None:
    """Refuse any ggml other than the one the declarations were written for."""
    if version != GGML_VERSION or commit.split("-", 1)[0] != GGML_COMMIT:
        raise GgmlVersionMismatch(
            f"the installed ggml is {version} (commit {commit}); these ctypes declarations "
            f"were written for ggml {GGML_VERSION} (commit {GGML_COMMIT}, llama-cpp-python "
            f"{LLAMA_CPP_PYTHON_VERSION}). ggml has no stable ABI: a mismatched signature "
            "crashes or computes garbage, so the stage runtime refuses to start",
            expected=f"{GGML_VERSION} ({GGML_COMMIT})",
            actual=f"{version} ({commit})",
            remediation=f"pip install llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
        )


_lock = threading.Lock()
_loaded: Ggml | None = None


def load() -> Ggml:
    """The bound library, loaded, version-checked and self-tested once per process."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        lib_dir = library_dir()
        libs = _open_libraries(lib_dir)
        # Check the version through a declaration that cannot have changed before binding
        # anything whose signature might have.
        version_fn = _symbol(libs, "ggml_version")
        commit_fn = _symbol(libs, "ggml_commit")
        version_fn.restype = commit_fn.restype = c_char_p
        version_fn.argtypes = commit_fn.argtypes = []
        check_version(version_fn().decode(), commit_fn().decode())
        g = Ggml(libs, lib_dir)
        self_test(g)
        _loaded = g
        return g


# --- the first-load self-test -----------------------------------------------------------------
def self_test(g: Ggml) -> None:
    """Matmuls of F32 and F16 weights against numpy through the same path the runtime uses
    (tensors in a no-alloc context, a backend buffer, graph compute on the CPU backend),
    plus the ``ggml_tensor`` layout (``ne``, ``nb``, ``type``) the runtime reads."""
    import numpy as np

    rng = np.random.default_rng(20261130)
    w32 = rng.standard_normal((24, 64), dtype=np.float32)  # numpy (rows, cols) = ggml (ne1, ne0)
    w16 = rng.standard_normal((24, 64)).astype(np.float16)
    x = rng.standard_normal((5, 64), dtype=np.float32)
    n_tensors = 8
    params = GgmlInitParams(
        mem_size=g.ggml_tensor_overhead() * n_tensors + g.ggml_graph_overhead_custom(16, False),
        mem_buffer=None,
        no_alloc=True,
    )
    ctx = g.ggml_init(params)
    if not ctx:
        raise GgmlSelfTestFailed("ggml_init returned NULL in the self-test")
    backend = buffer = None
    try:
        tw32 = _checked(g.ggml_new_tensor_2d(ctx, GgmlType.F32, 64, 24))
        tw16 = _checked(g.ggml_new_tensor_2d(ctx, GgmlType.F16, 64, 24))
        tx = _checked(g.ggml_new_tensor_2d(ctx, GgmlType.F32, 64, 5))
        layout = tensor_struct(tw16)
        if (
            tuple(layout.ne) != (64, 24, 1, 1)
            or layout.type != GgmlType.F16
            or tuple(layout.nb[:2]) != (2, g.ggml_row_size(GgmlType.F16, 64))
        ):
            raise GgmlSelfTestFailed(
                "struct ggml_tensor layout differs from the declaration "
                f"(ne={tuple(layout.ne)}, nb={tuple(layout.nb)}, type={layout.type})"
            )
        y32 = g.ggml_mul_mat(ctx, tw32, tx)
        y16 = g.ggml_mul_mat(ctx, tw16, tx)
        graph = _checked(g.ggml_new_graph_custom(ctx, 16, False))
        g.ggml_build_forward_expand(graph, y32)
        g.ggml_build_forward_expand(graph, y16)
        buffer = _checked(
            g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, g.ggml_backend_cpu_buffer_type())
        )
        for t, arr in ((tw32, w32), (tw16, w16), (tx, x)):
            g.ggml_backend_tensor_set(t, arr.ctypes.data, 0, arr.nbytes)
        backend = _checked(g.ggml_backend_cpu_init())
        g.ggml_backend_cpu_set_n_threads(backend, 1)
        status = g.ggml_backend_graph_compute(backend, graph)
        if status != GGML_STATUS_SUCCESS:
            raise GgmlSelfTestFailed(f"ggml_backend_graph_compute returned status {status}")
        for t, want, tol in (
            (y32, x @ w32.T, 1e-4),
            (y16, x @ w16.astype(np.float32).T, 2e-2),  # x is rounded to f16 for F16 weights
        ):
            got = np.empty((5, 24), dtype=np.float32)
            g.ggml_backend_tensor_get(t, got.ctypes.data, 0, got.nbytes)
            err = float(np.max(np.abs(got - want)))
            if not err <= tol:
                raise GgmlSelfTestFailed(
                    f"ggml matmul differs from numpy by {err} (tolerance {tol}): the ctypes "
                    "declarations do not match the library",
                    expected=tol,
                    actual=err,
                )
    finally:
        if backend:
            g.ggml_backend_free(backend)
        if buffer:
            g.ggml_backend_buffer_free(buffer)
        g.ggml_free(ctx)


def non_null(ptr: int | None, what: str) -> int:
    """``ptr``, or ``GgmlCallFailed`` naming the call ``what`` that returned NULL."""
    if not ptr:
        raise GgmlCallFailed(f"{what} returned NULL (out of memory?)")
    return ptr


# ggml-backend.h: ``typedef ggml_backend_buffer_type_t * (*ggml_backend_dev_get_extra_bufts_t)
# (ggml_backend_dev_t device)``, reached through the registry's proc address of that name.
_GET_EXTRA_BUFTS = ctypes.CFUNCTYPE(ctypes.POINTER(c_void_p), c_void_p)


def cpu_extra_buffer_types(g: Ggml) -> tuple[int, list[int]]:
    """The CPU device and its extra buffer types (llama.cpp's
    ``make_cpu_buft_list``: weight repacking's ``CPU_REPACK`` in this build), in the
    registry's order; an empty list where the registry offers none."""
    reg = non_null(g.ggml_backend_cpu_reg(), "ggml_backend_cpu_reg")
    dev = non_null(g.ggml_backend_reg_dev_get(reg, 0), "ggml_backend_reg_dev_get")
    addr = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not addr:
        return dev, []
    array = _GET_EXTRA_BUFTS(addr)(dev)
    out: list[int] = []
    for i in range(64):  # NULL-terminated; a bound against a malformed list
        if not array or not array[i]:
            break
        out.append(int(array[i]))
    return dev, out


# ggml.h: ``typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text,
# void * user_data)``
LOG_CALLBACK = ctypes.CFUNCTYPE(None, c_int, c_char_p, c_void_p)


@contextlib.contextmanager
def without_debug_log(g: Ggml, *, below: int = GGML_LOG_LEVEL_INFO) -> Iterator[None]:
    """ggml's messages under level ``below`` dropped for the duration (weight repacking logs
    one debug line per tensor on stderr; a device registry's first read, with ``below =
    GGML_LOG_LEVEL_WARN``, its devices at info level), everything else passed to the logger
    in place before."""
    cb, ud = c_void_p(), c_void_p()
    g.ggml_log_get(ctypes.byref(cb), ctypes.byref(ud))
    previous = LOG_CALLBACK(cb.value) if cb.value else None
    dropping = False

    def log(level: int, text: bytes | None, user_data: int | None) -> None:
        nonlocal dropping
        if level != GGML_LOG_LEVEL_CONT:
            dropping = level < below
        if not dropping and previous is not None:
            previous(level, text, user_data)

    hook = LOG_CALLBACK(log)
    g.ggml_log_set(hook, ud.value)
    try:
        yield
    finally:
        g.ggml_log_set(previous, ud.value)


def _checked(ptr: int | None) -> int:
    if not ptr:
        raise GgmlSelfTestFailed("a ggml call returned NULL in the self-test")
    return ptr


__all__ = [
    "GGML_COMMIT",
    "GGML_LOG_CALLBACK",
    "GGML_ROPE_TYPE_NEOX",
    "GGML_ROPE_TYPE_NORMAL",
    "GGML_TO_FLOAT",
    "GGML_VERSION",
    "LLAMA_CPP_PYTHON_VERSION",
    "TENSOR_ALIGNMENT",
    "Ggml",
    "GgmlCallFailed",
    "GgmlInitParams",
    "GgmlSelfTestFailed",
    "GgmlTensorStruct",
    "GgmlType",
    "GgmlTypeTraits",
    "GgmlUnavailable",
    "GgmlVersionMismatch",
    "check_version",
    "library_dir",
    "load",
    "non_null",
    "self_test",
    "tensor_struct",
    "type_traits",
]
