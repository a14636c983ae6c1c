"""The runtime boundary and the llama.cpp full-range runtime.

Split-equals-whole: gemma3-270m's package, loaded in place as a split set, must give logits
bit-identical to the original GGUF and the same greedy tokens (golden ids in runtime-facts.md). Each
model is loaded once per module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install 'skippy-mesh[llama]')"
)


from skippy.cli import main  # noqa: E402
from skippy.config import read_environment  # noqa: E402
from skippy.constants import ENV_VERIFY_PACKAGE_SHA, MANIFEST_NAME, ROLE_METADATA  # noqa: E402
from skippy.consume.resolve import resolve_stage  # noqa: E402
from skippy.errors import ArtifactMissing, SkippyError, UsageError  # noqa: E402
from skippy.generation import parse_generation, resolve_speculative_plan  # noqa: E402
from skippy.hashing import sha256_file  # noqa: E402
from skippy.package.manifest import Manifest  # noqa: E402
from skippy.package.ranges import LayerRange  # noqa: E402
from skippy.package.select import select_stage  # noqa: E402
from skippy.produce.inspect import read_manifest  # noqa: E402
from skippy.runtime.boundary import (  # noqa: E402
    RuntimeUnavailable,
    StageLoad,
    StageNotLoaded,
    StageRuntime,
    StageUnsupported,
)
from skippy.runtime.llama_cpp import (  # noqa: E402
    LlamaRuntimeConfig,
    LlamaStageRuntime,
    link_split_set,
    split_part_name,
)

pytestmark = [pytest.mark.llama, pytest.mark.slow]

PROMPT = "The capital of France is"
PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]
TOP5 = [506, 496, 9079, 886, 3224]
GREEDY_16 = " the capital of the country of France. It is the largest city in France."
MODEL_ID = "google/gemma-3-270m-GGUF:Q4_K_M"
CONFIG = LlamaRuntimeConfig(n_ctx=512, n_threads=2)


# --- fixtures: one package, one split-set load, one original load --------------------------------
@pytest.fixture(scope="module")
def gemma_pkg(gemma_package: Path) -> Path:
    return gemma_package  # tests/conftest.py: written once per session, with MODEL_ID


@pytest.fixture(scope="module")
def manifest(gemma_pkg: Path) -> Manifest:
    return read_manifest(gemma_pkg)


def full(m: Manifest) -> LayerRange:
    return LayerRange(0, m.layer_count, m.layer_count)


def stage_for(pkg: Path, layers: str | None = None, *, verify: bool = True) -> StageLoad:
    """The consumer path a node takes: resolve, select, check, verify, then the hand-off."""
    env = read_environment({} if verify else {ENV_VERIFY_PACKAGE_SHA: "0"})
    resolved = resolve_stage(str(pkg), env, layers_text=layers)
    return StageLoad.from_selection(
        resolved.stage.selection,
        resolved.files(),
        manifest_sha256=resolved.stage.package.manifest_sha256,
        sha256_verified=resolved.stage.verification is not None,
    )


@pytest.fixture(scope="module")
def full_stage(gemma_pkg: Path) -> StageLoad:
    return stage_for(gemma_pkg)


@pytest.fixture(scope="module")
def split_rt(full_stage: StageLoad) -> Iterator[LlamaStageRuntime]:
    with LlamaStageRuntime(CONFIG) as rt:
        rt.load(full_stage)
        yield rt


@pytest.fixture(scope="module")
def original(gemma_gguf: Path) -> Iterator[Any]:
    llm = llama_cpp.Llama(
        model_path=str(gemma_gguf),
        n_ctx=CONFIG.n_ctx,
        n_batch=CONFIG.n_batch,
        n_threads=CONFIG.n_threads,
        n_threads_batch=CONFIG.n_threads,
        verbose=False,
    )
    yield llm
    llm.close()


def original_logits(llm: Any, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy()


def top5(logits: np.ndarray) -> list[int]:
    return [int(i) for i in np.argsort(-logits, kind="stable")[:5]]


# --- split set == original ------------------------------------------------------------------------
def test_full_selection_is_the_whole_package_in_split_order(
    full_stage: StageLoad, manifest: Manifest
) -> None:
    assert full_stage.is_full and full_stage.owns_input and full_stage.owns_output
    assert full_stage.part_roles[0] == ROLE_METADATA
    assert len(full_stage.part_paths) == manifest.layer_count + 3  # metadata, embd, output
    assert full_stage.sha256_verified
    assert full_stage.model_id == MODEL_ID
    assert full_stage.source_sha256 == manifest.source_model.sha256


def test_tokenize_matches_original(split_rt: LlamaStageRuntime, original: Any) -> None:
    ids = split_rt.tokenize(PROMPT)
    assert ids == PROMPT_IDS
    assert ids == original.tokenize(PROMPT.encode())


def test_logits_bit_identical_to_original(split_rt: LlamaStageRuntime, original: Any) -> None:
    got = split_rt.logits_for_prompt(PROMPT_IDS)
    want = original_logits(original, PROMPT_IDS)
    assert got.dtype == np.float32 and got.shape == want.shape == (split_rt.n_vocab,)
    assert np.array_equal(got, want)  # bit-identical, not merely close
    assert top5(got) == TOP5


def test_greedy_generation_equals_original(split_rt: LlamaStageRuntime, original: Any) -> None:
    gen = split_rt.generate(PROMPT_IDS, max_tokens=16)
    original.reset()
    want = []
    for tok in original.generate(PROMPT_IDS, temp=0.0, repeat_penalty=1.0):
        want.append(tok)
        if len(want) == 16:
            break
    assert list(gen.tokens) == want
    assert gen.tokens[0] == TOP5[0]
    assert gen.text == GREEDY_16
    assert gen.stop_reason == "length"
    assert gen.prompt_tokens == tuple(PROMPT_IDS)
    # deterministic: the same call again gives the same tokens (fresh state each time)
    assert split_rt.generate(PROMPT_IDS, max_tokens=16).tokens == gen.tokens


def test_runtime_satisfies_the_protocol(split_rt: LlamaStageRuntime) -> None:
    assert isinstance(split_rt, StageRuntime)


def test_prompt_limits(split_rt: LlamaStageRuntime) -> None:
    with pytest.raises(UsageError) as e:
        split_rt.generate([], max_tokens=4)
    assert e.value.code == "empty_prompt"
    with pytest.raises(UsageError) as e:
        split_rt.logits_for_prompt([2] * CONFIG.n_ctx)
    assert e.value.code == "prompt_too_long"
    with pytest.raises(UsageError) as e:
        split_rt.generate(PROMPT_IDS, max_tokens=0)
    assert e.value.code == "invalid_max_tokens"


# --- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize("start,stop", [(0, 9), (9, 18), (3, 4)])
def test_partial_range_is_refused(
    gemma_pkg: Path, manifest: Manifest, start: int, stop: int
) -> None:
    layers = LayerRange(start, stop, manifest.layer_count)
    stage = stage_for(gemma_pkg, str(layers), verify=False)
    rt = LlamaStageRuntime(CONFIG)
    with pytest.raises(StageUnsupported) as e:
        rt.require_supported(layers)
    assert e.value.code == "partial_range_unsupported"
    with pytest.raises(StageUnsupported) as e:
        rt.load(stage)
    assert e.value.code == "partial_range_unsupported"
    assert e.value.exit_code == 2
    assert "later runtime" in e.value.message
    assert rt.stage is None


def test_missing_llama_cpp_is_runtime_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    monkeypatch.setitem(sys.modules, "llama_cpp.llama", None)
    with pytest.raises(RuntimeUnavailable) as e:
        LlamaStageRuntime()
    assert e.value.code == "runtime_unavailable"
    assert e.value.exit_code == 2


def test_importing_skippy_never_imports_llama_cpp() -> None:
    code = (
        "import sys, skippy, skippy.runtime.boundary, skippy.runtime.llama_cpp\n"
        "import skippy.commands.runtime\n"
        "assert 'llama_cpp' not in sys.modules, 'llama_cpp imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_calls_before_load_raise() -> None:
    rt = LlamaStageRuntime(CONFIG)
    with pytest.raises(StageNotLoaded) as e:
        rt.tokenize("x")
    assert e.value.code == "stage_not_loaded"
    rt.close()
    rt.close()  # idempotent


# --- no byte copied -------------------------------------------------------------------------------
def _mapped_files() -> set[str]:
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                out.add(fields[5].strip())
    return out


def test_link_split_set_creates_only_links(full_stage: StageLoad, tmp_path: Path) -> None:
    first = link_split_set(full_stage.part_paths, tmp_path)
    n = len(full_stage.part_paths)
    assert first.name == f"stage-00001-of-{n:05d}.gguf"
    entries = sorted(tmp_path.iterdir())
    assert [e.name for e in entries] == [split_part_name(i, n) for i in range(n)]
    assert all(e.is_symlink() for e in entries)
    assert [os.path.realpath(e) for e in entries] == [
        os.path.realpath(p) for p in full_stage.part_paths
    ]
    assert sum(e.lstat().st_size for e in entries) < 1024 * 1024


def test_load_maps_the_package_files_and_leaves_nothing_behind(
    full_stage: StageLoad, manifest: Manifest, tmp_path: Path
) -> None:
    link_parent = tmp_path / "links"
    link_parent.mkdir()
    with LlamaStageRuntime(LlamaRuntimeConfig(link_parent=link_parent)) as rt:
        rt.load(full_stage)
        assert rt.load_s is not None and rt.load_s < 30
        mapped = _mapped_files()
        # every part that holds tensors is mmapped from the package's own file
        refs = select_stage(manifest, full(manifest)).parts
        with_tensors = [
            os.path.realpath(p)
            for p, ref in zip(full_stage.part_paths, refs, strict=True)
            if ref.artifact.tensor_count > 0
        ]
        assert with_tensors and set(with_tensors) <= mapped
        assert not any(str(link_parent) in m for m in mapped)
        # the links are gone as soon as the model is loaded; nothing was written
        assert list(link_parent.iterdir()) == []
        assert rt.tokenize(PROMPT) == PROMPT_IDS


# --- the boundary value ---------------------------------------------------------------------------
def test_stage_load_from_mapping_and_validation(manifest: Manifest, gemma_pkg: Path) -> None:
    sel = select_stage(manifest, full(manifest))
    resolved = {r.path: gemma_pkg / r.path for r in sel.parts}
    stage = StageLoad.from_selection(sel, resolved, manifest_sha256="ab" * 32)
    assert stage.part_paths == tuple(resolved[r.path] for r in sel.parts)
    assert stage.to_dict()["owns_output"] is True
    missing = dict(resolved)
    missing.pop(sel.parts[-1].path)
    with pytest.raises(ArtifactMissing):
        StageLoad.from_selection(sel, missing)
    with pytest.raises(UsageError) as e:
        StageLoad(
            model_id=MODEL_ID,
            source_sha256="0" * 64,
            layers=full(manifest),
            part_paths=stage.part_paths[1:],
            part_roles=stage.part_roles[1:],
        )
    assert e.value.code == "invalid_stage_load"


# --- the run command ------------------------------------------------------------------------------
@pytest.fixture
def cli() -> Any:
    def run(*args: Any) -> int:
        return main([str(a) for a in args])

    return run


def test_run_json(cli: Any, gemma_pkg: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli("run", gemma_pkg, "--engine", "llama", "--prompt", PROMPT, "--max-tokens", 8, "--json")
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["engine"] == "llama"
    assert out["prompt_tokens"] == PROMPT_IDS
    assert len(out["tokens"]) == 8 and out["tokens"][0] == TOP5[0]
    assert GREEDY_16.startswith(out["completion"])
    assert out["sha256_verified"] is True
    assert out["manifest_sha256"] == sha256_file(gemma_pkg / MANIFEST_NAME)
    assert out["layers"] == "0..18" and out["model_id"] == MODEL_ID
    assert out["tokens_per_s"] > 0


def test_run_text(cli: Any, gemma_pkg: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("run", gemma_pkg, "--engine", "llama", "--prompt", PROMPT, "--max-tokens", 16) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT + GREEDY_16)
    assert "engine llama, 1 stage (0..18)" in out
    assert "tok/s" in out


def test_run_without_verification_says_so(
    cli: Any, gemma_pkg: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VERIFY_PACKAGE_SHA, "0")
    assert cli("run", gemma_pkg, "--prompt", PROMPT, "--max-tokens", 2) == 0
    captured = capsys.readouterr()
    assert "NOT verified" in captured.out
    assert ENV_VERIFY_PACKAGE_SHA in captured.err


@pytest.mark.parametrize(
    "args,code",
    [
        (["--layers", "0..9"], "partial_range_unsupported"),
        (["--layers", "0..19"], "invalid_layer_range"),
        (["--max-tokens", "0"], "invalid_max_tokens"),
    ],
)
def test_run_usage_errors(
    cli: Any, gemma_pkg: Path, capsys: pytest.CaptureFixture[str], args: list[str], code: str
) -> None:
    rc = cli("run", gemma_pkg, "--prompt", PROMPT, "--json", *args)
    out = json.loads(capsys.readouterr().out)
    assert rc == 2 and out["error"]["code"] == code


def test_run_missing_dir(cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli("run", tmp_path / "nope", "--prompt", PROMPT, "--json")
    assert rc == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "unreadable_input"


@pytest.fixture
def pkg_copy(gemma_pkg: Path, tmp_path: Path) -> Path:
    """A hard-linked copy of the package: free to make; replace a file (never write into one)
    to corrupt it without touching the shared package."""
    dst = tmp_path / "pkg"
    for src in gemma_pkg.rglob("*"):
        target = dst / src.relative_to(gemma_pkg)
        if src.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, target)
    return dst


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


@pytest.mark.parametrize(
    "corrupt,code",
    [
        (lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]), "artifact_sha256_mismatch"),
        (lambda b: b[:-1], "artifact_size_mismatch"),
    ],
    ids=["flipped-byte", "truncated"],
)
def test_run_refuses_a_damaged_package(
    cli: Any,
    pkg_copy: Path,
    manifest: Manifest,
    capsys: pytest.CaptureFixture[str],
    corrupt: Any,
    code: str,
) -> None:
    victim = pkg_copy / manifest.shared.output.path
    _replace(victim, corrupt(victim.read_bytes()))
    rc = cli("run", pkg_copy, "--prompt", PROMPT, "--json")
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["error"]["code"] == code
    with pytest.raises(SkippyError) as e:
        stage_for(pkg_copy)
    assert e.value.code == code


# --- operator speculation settings on the serving command -------------------
def test_run_resolves_and_reports_the_speculative_plan(
    cli: Any, gemma_pkg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("run", gemma_pkg, "--prompt", PROMPT, "--max-tokens", 2, "--json") == 0
    assert json.loads(capsys.readouterr().out)["speculative"]["mode"] == "disabled"
    rc = cli("run", gemma_pkg, "--prompt", PROMPT, "--speculative-strategy", "mtp", "--json")
    assert rc == 2  # forcing native MTP on a package without an MTP source is refused
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "native_mtp_unavailable"
    cfg = tmp_path / "node.toml"
    cfg.write_text('[speculative]\nstrategy = "mtp-cache"\n')
    rc = cli("run", gemma_pkg, "--prompt", PROMPT, "--config", cfg, "--json")
    assert rc == 2  # a named strategy the package does not declare
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "undeclared_speculative_strategy"
    # The CLI wins over the config file.
    rc = cli(
        "run",
        gemma_pkg,
        "--prompt",
        PROMPT,
        "--max-tokens",
        2,
        "--config",
        cfg,
        "--speculative-strategy",
        "disabled",
        "--json",
    )
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["speculative"]["requested_source"] == "cli"


def _with_generation(pkg: Path, generation: dict[str, Any]) -> None:
    path = pkg / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["generation"] = generation
    path.unlink()  # hard-linked copy: replace, never write through
    path.write_text(json.dumps(data))


def test_mtp_layers_without_nextn_tensors_are_refused(
    cli: Any, pkg_copy: Path, manifest: Manifest, capsys: pytest.CaptureFixture[str]
) -> None:
    """Spec "Speculative Decoding": layer_indices MUST list layers holding NextN tensors.
    gemma's last layer holds none, so no native-MTP plan is built for it: run refuses the
    package with the code preflight reports, instead of planning speculation on nothing."""
    last = manifest.layer_count - 1
    _with_generation(
        pkg_copy,
        {
            "speculative_decoding": {
                "default": "mtp",
                "strategies": {
                    "mtp": {"type": "native-mtp", "prediction_depth": 1, "layer_indices": [last]}
                },
            }
        },
    )
    rc = cli("run", pkg_copy, "--prompt", PROMPT, "--max-tokens", 2, "--json")
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["error"]["code"] == "mtp_layer_missing_nextn_tensors"
    assert cli("preflight", pkg_copy, "--json") != 0
    assert "mtp_layer_missing_nextn_tensors" in capsys.readouterr().out


def test_unexecutable_speculation_plan_falls_back_with_a_reason(
    full_stage: StageLoad, caplog: pytest.LogCaptureFixture
) -> None:
    """A native-MTP plan this runtime cannot execute: it decodes without speculation (same
    greedy tokens) and says why in one structured log line."""
    generation = parse_generation(
        {
            "speculative_decoding": {
                "default": "mtp",
                "strategies": {
                    "mtp": {"type": "native-mtp", "prediction_depth": 1, "layer_indices": [17]}
                },
            }
        },
        layer_count=full_stage.layers.layer_count,
    )
    plan = resolve_speculative_plan(package=generation)
    assert plan.mode == "native-mtp"
    with LlamaStageRuntime(CONFIG) as rt, caplog.at_level("WARNING", "skippy.runtime.llama_cpp"):
        rt.load(replace(full_stage, speculative=plan))
        gen = rt.generate(PROMPT_IDS, max_tokens=16)
    assert gen.text == GREEDY_16
    lines = [
        r.getMessage() for r in caplog.records if "speculative decoding fallback" in r.getMessage()
    ]
    assert len(lines) == 1
    record = json.loads(lines[0].split("fallback ", 1)[1])
    assert (record["requested"], record["mode"]) == ("auto", "native-mtp")
    assert record["selected"] == "disabled" and record["fallback_reason"]


def test_an_unrecognised_default_strategy_blocks_only_auto(
    cli: Any, pkg_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Spec "Speculative Decoding": an unknown strategy type is ignored unless it is the
    declared default of the request being served."""
    _with_generation(
        pkg_copy,
        {"speculative_decoding": {"default": "eagle", "strategies": {"eagle": {"type": "eagle3"}}}},
    )
    rc = cli("run", pkg_copy, "--prompt", PROMPT, "--max-tokens", 2, "--json")
    out = json.loads(capsys.readouterr().out)
    assert rc == 2 and out["error"]["code"] == "unsupported_speculative_strategy_type"
    rc = cli(
        "run",
        pkg_copy,
        "--prompt",
        PROMPT,
        "--max-tokens",
        2,
        "--speculative-strategy",
        "disabled",
        "--json",
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["speculative"]["mode"] == "disabled"
    assert out["speculative"]["package_default"] == "eagle"


def test_a_model_entry_that_matches_nothing_is_a_warning(
    cli: Any, gemma_pkg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """[[models]] entries are selected by the package's model_id; "gemma-3" is not it."""
    cfg = tmp_path / "node.toml"
    cfg.write_text('[[models]]\nname = "gemma-3"\nspeculative = { strategy = "mtp" }\n')
    rc = cli("run", gemma_pkg, "--prompt", PROMPT, "--max-tokens", 2, "--config", cfg)
    err = capsys.readouterr().err
    assert rc == 0
    assert "'gemma-3'" in err and MODEL_ID in err and "model_id" in err
    cfg.write_text(f'[[models]]\nname = "{MODEL_ID}"\nspeculative = {{ strategy = "mtp" }}\n')
    rc = cli("run", gemma_pkg, "--prompt", PROMPT, "--max-tokens", 2, "--config", cfg, "--json")
    assert rc == 2  # the matching entry applies: forced mtp, which gemma cannot serve
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "native_mtp_unavailable"
