"""Start-up of ``skippy-model-package`` and the conventions every command
shares: which modules a command imports, ``--version``, global flags on
either side of the command, argparse errors in our format, help text on every option.

The import set is checked in a child interpreter (``sys.modules`` after ``main`` returns), never
by timing: speed is measured by ``scripts/bench``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pkgtools import make_package

from skippy.cli import build_parser, main
from skippy.commands import COMMANDS

# Modules that cost tens to hundreds of milliseconds to import, none of which inspect, plan,
# preflight (without --verify-sha256), --help or --version needs.
HEAVY = (
    "numpy",
    "gguf",
    "huggingface_hub",
    "httpx2",
    "llama_cpp",
    "tqdm",
    # the package itself is light (its names load on first use); these are not
    "skippy.generation.schema",
    "skippy.generation.resolver",
    "skippy.generation.speculative",
    "skippy.consume.hub",
    "skippy.produce.write_package",
    "importlib.metadata",  # ~40 ms (email, zipfile, csv...): --version reads a constant
)

_CHILD = """
import json, sys
from skippy.cli import main
try:
    code = main(sys.argv[2:])
except SystemExit as exc:
    code = exc.code
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""


def _imports_of(tmp_path: Path, *argv: str) -> tuple[object, set[str]]:
    out = tmp_path / "modules.json"
    subprocess.run(
        [sys.executable, "-c", _CHILD, str(out), *argv],
        check=True,
        capture_output=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    data = json.loads(out.read_text())
    return data["code"], set(data["modules"])


@pytest.fixture(scope="module")
def llama_pkg(synth_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("startup") / "pkg"
    make_package(synth_dir.llama, out)
    return out


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["inspect", "{gguf}"],
        ["inspect", "{pkg}"],
        ["plan", "{gguf}", "--stages", "2"],
        ["plan", "{pkg}", "--stages", "2", "--balance", "bytes"],
        ["preflight", "{pkg}"],
        ["preflight", "{pkg}", "--stages", "2", "--json"],
        ["inspect", "--help"],
        ["write-package", "--help"],
    ],
    ids=lambda a: " ".join(a),
)
def test_light_commands_import_no_heavy_module(tmp_path, synth_dir, llama_pkg, argv):
    args = [a.format(gguf=synth_dir.llama, pkg=llama_pkg) for a in argv]
    code, modules = _imports_of(tmp_path, *args)
    assert code == 0
    loaded = sorted(m for m in HEAVY if m in modules)
    assert loaded == [], f"{' '.join(argv)} imported {loaded}"


def test_help_imports_no_command_module(tmp_path):
    code, modules = _imports_of(tmp_path, "--help")
    assert code == 0
    assert {info.module for info in COMMANDS.values()}.isdisjoint(modules)


def test_a_command_imports_only_its_own_module(tmp_path, synth_dir):
    _, modules = _imports_of(tmp_path, "inspect", str(synth_dir.llama))
    others = {info.module for name, info in COMMANDS.items() if name != "inspect"}
    others.discard(COMMANDS["inspect"].module)
    assert others.isdisjoint(modules), sorted(others & modules)


# What ``inspect`` of a GGUF needs is the header reader; the writer (with hashing and atomic
# installs), the manifest, the stage planner and the fragment planner are for other commands.
INSPECT_GGUF_NEEDS_NONE_OF = (
    "skippy.gguf.writer",
    "skippy.hashing",
    "skippy.atomic",
    "skippy.package.manifest",
    "skippy.package.plan",
    "skippy.produce.fragments",
    "skippy.produce.sizes",
    "hashlib",
    "concurrent.futures",
)


def test_inspect_of_a_gguf_imports_only_the_header_reader(tmp_path, synth_dir):
    code, modules = _imports_of(tmp_path, "inspect", str(synth_dir.llama), "--json")
    assert code == 0
    assert "skippy.gguf.reader" in modules  # the check sees the modules inspect does load
    loaded = sorted(m for m in INSPECT_GGUF_NEEDS_NONE_OF if m in modules)
    assert loaded == [], f"inspect imported {loaded}"


def test_version(capsys):
    from importlib.metadata import version

    from skippy.cli import DISTRIBUTION

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    # the constant --version prints is the version the package is installed under
    assert out == f"skippy-model-package {version(DISTRIBUTION)}\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["--json", "inspect", "{gguf}"],
        ["inspect", "{gguf}", "--json"],
        ["-v", "inspect", "{gguf}", "--json"],
        ["inspect", "-v", "{gguf}", "--json"],
        ["--json", "-v", "inspect", "{gguf}"],
    ],
    ids=lambda a: " ".join(a),
)
def test_json_and_verbose_work_before_or_after_the_command(capsys, synth_dir, argv):
    assert main([a.format(gguf=synth_dir.llama) for a in argv]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect"],
        ["plan", "x.gguf"],
        ["nonsense"],
        ["inspect", "x", "--no-such-flag"],
        ["plan", "x.gguf", "--stages", "two"],
    ],
    ids=lambda a: " ".join(a),
)
def test_usage_errors_use_our_format_and_exit_2(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error [usage]: "), err
    assert "Traceback" not in err


def test_usage_errors_as_json(capsys):
    assert main(["plan", "x.gguf", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["error"]["code"] == "usage"
    assert doc["findings"] and doc["findings"][0]["code"] == "usage"


def _all_parsers() -> list[argparse.ArgumentParser]:
    parser = build_parser(list(COMMANDS))
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out += list(action.choices.values())
    return out


def test_every_option_and_argument_has_help():
    missing = []
    for p in _all_parsers():
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{p.prog}: {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


def test_every_command_in_the_table_is_registered_by_its_module():
    parser = build_parser(list(COMMANDS))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in COMMANDS:
        p = sub.choices[name]
        assert p.get_default("handler") is not None, name
