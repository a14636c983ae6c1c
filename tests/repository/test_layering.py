"""The layering contract (docs/architecture.md), checked over the repository's own sources:
``mesh_node -> protocol, skippy``; ``skippy`` and ``protocol`` import nothing of ours beyond
themselves; ``protocol`` stays sans-IO; ``skippy``'s layers point down; no import cycles.
Every import counts, deferred and ``TYPE_CHECKING`` ones too (see tests/support/layering.py). The
synthetic trees below prove each check can fail, with the message it fails with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from layering import (
    Import,
    LayeringSourceError,
    cycle_edges,
    cycles,
    forbidden_external,
    graph,
    imports_of,
    layer_breaks,
    package_breaks,
    read_imports,
    unit_of,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "skippy", "mesh_node")
MAY_IMPORT: dict[str, set[str]] = {"mesh_node": {"protocol", "skippy"}, "skippy": set()}
# protocol is sans-IO: bytes in, events out; sockets and tasks live in mesh_node.
IO_LIBRARIES = {"trio", "trio_websocket", "asyncio", "socket", "selectors", "hypercorn"}
# skippy's floors, top down; a module in none of them is the ground floor (errors, constants,
# config, paths, atomic, generation, ...). A floor may import its own and any floor below.
SKIPPY_LAYERS: list[tuple[str, list[str]]] = [
    ("entry points", ["skippy.cli", "skippy.quantize_cli", "skippy.__main__"]),
    ("commands", ["skippy.commands"]),
    (
        "package users",
        [
            "skippy.produce",
            "skippy.consume",
            "skippy.runtime",
            "skippy.transfer",
            "skippy.serving",
            "skippy.stage",
        ],
    ),
    ("package", ["skippy.package"]),
    ("gguf", ["skippy.gguf"]),
]
GROUND = "ground floor"
# Cycles between skippy's subpackages that exist today; a new one fails the test. produce and
# consume meet twice: quantize_package (a write-package transform) reopens the package it wrote
# with the consumer's loader, and preflight reports recorded tensor types with the quantizer's
# rules.
KNOWN_SUBPACKAGE_CYCLES = [["skippy.consume", "skippy.produce"]]


def skippy_subpackage(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "skippy" else None


def top_level(module: str) -> str:
    return module.split(".")[0]


def explain(
    imports: list[Import], found: list[list[str]], unit: Callable[[str], str | None] = str
) -> str:
    """Each cycle, then the imports that make its edges."""
    lines = []
    for c in found:
        lines += ["cycle: " + " <-> ".join(c), *cycle_edges(imports, c, unit)]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    found = read_imports(ROOT, PACKAGES)
    # positive control: the reader sees the tree (mesh_node really imports both packages)
    assert {
        top_level(i.target) for i in found if i.importer.startswith("mesh_node.") and i.target
    } >= {"mesh_node", "protocol", "skippy"}
    return found


def test_packages_import_only_downwards(imports: list[Import]) -> None:
    breaks = package_breaks(imports, MAY_IMPORT)
    assert not breaks, "imports against the package layering:\n" + "\n".join(breaks)


def test_protocol_stays_sans_io(imports: list[Import]) -> None:
    breaks = forbidden_external(imports, "protocol", IO_LIBRARIES)
    assert not breaks, "protocol imports I/O libraries:\n" + "\n".join(breaks)


def test_skippy_layers_point_down(imports: list[Import]) -> None:
    breaks = layer_breaks(imports, "skippy", SKIPPY_LAYERS, GROUND)
    assert not breaks, "skippy imports against its layers:\n" + "\n".join(breaks)


def test_no_module_import_cycles(imports: list[Import]) -> None:
    found = cycles(graph(imports))
    assert not found, "import cycles between modules:\n" + explain(imports, found)


def test_no_cycles_between_top_level_packages(imports: list[Import]) -> None:
    found = cycles(graph(imports, top_level))
    assert not found, f"top-level packages import each other: {found}"


def test_skippy_subpackage_cycles_are_only_the_known_ones(imports: list[Import]) -> None:
    found = cycles(graph(imports, skippy_subpackage))
    new = [c for c in found if c not in KNOWN_SUBPACKAGE_CYCLES]
    detail = explain(imports, new, skippy_subpackage)
    assert not new, "new import cycles between skippy's subpackages:\n" + detail


# --- the checks fail on a tree that breaks them -------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


BAD_TREE = {
    "protocol/__init__.py": "",
    "protocol/frames.py": "import struct\nimport trio\n\ndef f():\n    from skippy import errors\n",
    "skippy/__init__.py": "",
    "skippy/errors.py": "",
    "skippy/gguf/__init__.py": "",
    "skippy/gguf/reader.py": "from ..package import manifest\n",
    "skippy/package/__init__.py": "",
    "skippy/package/manifest.py": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mesh_node.node import Node\n"
    ),
    "skippy/runtime.py": "import importlib\nimportlib.import_module('mesh_node.node')\n",
    "mesh_node/__init__.py": "",
    "mesh_node/node.py": "from . import link\nfrom skippy.errors import X\n",
    "mesh_node/link.py": "from mesh_node.node import Node\n",
}


def test_the_checks_report_each_bad_import(tmp_path: Path) -> None:
    write_tree(tmp_path, BAD_TREE)
    imports = read_imports(tmp_path, PACKAGES)
    layers = [("package", ["skippy.package"]), ("gguf", ["skippy.gguf"])]
    assert package_breaks(imports, MAY_IMPORT) == [
        "protocol/frames.py:5: protocol.frames imports skippy.errors (function): "
        "protocol may import nothing of ours",
        "skippy/package/manifest.py:3: skippy.package.manifest imports mesh_node.node "
        "(type-checking): skippy may import nothing of ours",
        "skippy/runtime.py:2: skippy.runtime imports mesh_node.node (dynamic): "
        "skippy may import nothing of ours",
    ]
    assert forbidden_external(imports, "protocol", IO_LIBRARIES) == [
        "protocol/frames.py:2: protocol.frames imports trio (module): protocol must not import trio"
    ]
    assert layer_breaks(imports, "skippy", layers, GROUND) == [
        "skippy/gguf/reader.py:1: skippy.gguf.reader imports skippy.package.manifest (module): "
        "layer 'gguf' is below 'package'"
    ]
    assert cycles(graph(imports)) == [["mesh_node.link", "mesh_node.node"]]
    assert cycle_edges(imports, ["mesh_node.link", "mesh_node.node"]) == [
        "mesh_node/link.py:1: mesh_node.link imports mesh_node.node (module)",
        "mesh_node/node.py:1: mesh_node.node imports mesh_node.link (module)",
    ]


def test_the_checks_pass_a_tree_that_keeps_the_rules(tmp_path: Path) -> None:
    good = {
        "protocol/__init__.py": "import msgpack\n",
        "skippy/__init__.py": "",
        "skippy/errors.py": "",
        "skippy/package/__init__.py": "from skippy import errors\n",
        "mesh_node/__init__.py": "",
        "mesh_node/node.py": "import protocol\nfrom skippy.package import x\n",
    }
    write_tree(tmp_path, good)
    imports = read_imports(tmp_path, PACKAGES)
    assert package_breaks(imports, MAY_IMPORT) == []
    assert forbidden_external(imports, "protocol", IO_LIBRARIES) == []
    assert layer_breaks(imports, "skippy", SKIPPY_LAYERS, GROUND) == []
    assert cycles(graph(imports)) == []


@pytest.mark.parametrize(
    ("module", "is_package", "source", "target"),
    [
        ("a.b.c", False, "from . import d", "a.b.d"),  # sibling module
        ("a.b.c", False, "from .. import e", "a.e"),
        ("a.b.c", False, "from ..e import name", "a.e"),  # a name inside a module
        ("a.b", True, "from . import d", "a.b.d"),  # a package's __init__ anchors at itself
        ("a.b.c", False, "from a.b import name", "a.b"),  # not a submodule: the package
        ("a.b.c", False, "import a.e.f", "a.e"),  # longest module of ours
    ],
)
def test_relative_and_partial_names_resolve(
    module: str, is_package: bool, source: str, target: str
) -> None:
    modules = ["a", "a.b", "a.b.c", "a.b.d", "a.e"]
    assert [i.target for i in imports_of(source, module, is_package, modules)] == [target]


def test_an_unparsable_file_is_an_error_not_a_pass() -> None:
    with pytest.raises(LayeringSourceError, match=r"x\.py:1: cannot parse"):
        imports_of("import (", "a.x", False, ["a", "a.x"], "a/x.py")


def test_unit_of_takes_the_first_matching_floor() -> None:
    unit = unit_of(SKIPPY_LAYERS, GROUND)
    assert unit("skippy.commands.producer") == "commands"
    assert unit("skippy.cli") == "entry points"
    assert unit("skippy.clients") == GROUND  # a prefix of a name is not a match
    assert unit("skippy.errors") == GROUND
