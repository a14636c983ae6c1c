"""The one ctypes binding to ggml (skippy.gguf.ggml): version pinning and the self-test."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="libggml ships with llama-cpp-python (not installed)")

from skippy.gguf import ggml


def test_load_binds_every_declaration_once() -> None:
    g = ggml.load()
    assert ggml.load() is g  # once per process
    assert g.ggml_version().decode() == ggml.GGML_VERSION
    assert g.ggml_commit().decode().startswith(ggml.GGML_COMMIT)
    names = ggml._declared_names()
    assert {"ggml_rope_ext", "ggml_mul_mat", "ggml_backend_tensor_alloc"} <= set(names)
    for name in names:  # every declaration is the ctypes function itself, with its signature
        fn = getattr(g, name)
        assert type(fn).__name__ == "_FuncPtr", name
        assert fn.argtypes is not None, name
    assert g.ggml_row_size(ggml.GgmlType.Q8_0, 64) == 68  # two 34-byte blocks


@pytest.mark.parametrize(
    "version,commit",
    [("0.25.4", "0c1e570"), ("0.25.3", "1234567-dirty"), ("0.9.0", "unknown")],
)
def test_a_different_ggml_is_refused(version: str, commit: str) -> None:
    with pytest.raises(ggml.GgmlVersionMismatch) as e:
        ggml.check_version(version, commit)
    assert e.value.code == "ggml_version_mismatch"
    assert e.value.exit_code == 2
    assert ggml.LLAMA_CPP_PYTHON_VERSION in (e.value.remediation or "")
    ggml.check_version(ggml.GGML_VERSION, ggml.GGML_COMMIT + "-dirty")  # the pinned one passes


def test_a_missing_symbol_is_a_version_mismatch() -> None:
    libs = ggml.load().libraries
    with pytest.raises(ggml.GgmlVersionMismatch):
        ggml._symbol(libs, "ggml_function_that_does_not_exist")


def test_self_test_catches_wrong_math() -> None:
    """A binding whose ggml_mul_mat computes something else (here: twice the product, as a
    shifted scale argument would) fails the numerical self-test instead of serving garbage."""
    good = ggml.load()
    bad = ggml.Ggml(good.libraries, good.lib_dir)

    def doubled(ctx: int, a: int, b: int) -> int:
        return good.ggml_scale(ctx, good.ggml_mul_mat(ctx, a, b), 2.0)

    bad.ggml_mul_mat = doubled  # type: ignore[method-assign]
    with pytest.raises(ggml.GgmlSelfTestFailed) as e:
        ggml.self_test(bad)
    assert e.value.code == "ggml_self_test_failed"
    ggml.self_test(good)


def test_importing_the_binding_loads_no_library() -> None:
    code = (
        "import sys, skippy.gguf.ggml\n"
        "assert 'llama_cpp' not in sys.modules and 'numpy' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_tensor_struct_reads_live_tensors() -> None:
    g = ggml.load()
    ctx = g.ggml_init(ggml.GgmlInitParams(mem_size=4 * g.ggml_tensor_overhead(), no_alloc=True))
    assert ctx
    try:
        t = g.ggml_new_tensor_3d(ctx, ggml.GgmlType.F32, 8, 3, 2)
        assert t
        s = ggml.tensor_struct(t)
        assert tuple(s.ne) == (8, 3, 2, 1)
        assert tuple(s.nb) == (4, 32, 96, 192)
        assert s.data is None  # no_alloc
        assert g.ggml_nelements(t) == int(np.prod([8, 3, 2]))
    finally:
        g.ggml_free(ctx)


@pytest.mark.parametrize("preset", [None, "300000"])
def test_openmp_idle_spin_is_set_before_libgomp_loads(preset: str | None) -> None:
    """Loading ggml (or llama_cpp) in a fresh process first sets GOMP_SPINCOUNT, which libgomp
    reads only when it loads; a value the user set is kept."""
    code = (
        "import os, sys\n"
        "from skippy.gguf import ggml\n"
        "ggml.load()\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(os.environ.get('GOMP_SPINCOUNT'), 'libgomp' in maps)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if preset is not None:
        env["GOMP_SPINCOUNT"] = preset
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    assert out == [preset or ggml.OPENMP_ENVIRONMENT["GOMP_SPINCOUNT"], "True"]
