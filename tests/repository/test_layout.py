"""The test tree mirrors the code (tests/README.md): a test file sits in tests/ under the path of
the package it tests (``tests/skippy/runtime/`` for ``skippy/runtime/``), or in one of the flat
directories apart (``processes``, ``real_models``, ``repository``); helpers sit in
``tests/support/`` and nowhere else. Test files are imported by their basename (pytest's default
import mode, no ``__init__.py``), so a basename is used once, and a test file that imports another
sits beside it."""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "skippy", "mesh_node")
APART = ("processes", "real_models", "repository")  # flat: no subdirectories
SUPPORT = "support"
TEST_FILE = re.compile(r"\Atest_\w+\.py\Z")


def package_dirs(root: Path) -> set[str]:
    """Every package directory of ours, as a path relative to the root (``skippy/runtime``)."""
    return {
        p.parent.relative_to(root).as_posix()
        for name in PACKAGES
        for p in (root / name).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }


def imported_tests(source: str) -> set[str]:
    """The test modules (``test_*``) a file imports by name."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {name for name in out if name.startswith("test_") and "." not in name}


def problems(files: Mapping[str, str], packages: set[str]) -> list[str]:
    """What in ``files`` (path under tests/ -> source) breaks the layout; ``packages``: the
    package directories a test directory may mirror."""
    out: list[str] = []
    seen: dict[str, list[str]] = {}
    for name in sorted(files):
        path = PurePosixPath(name)
        where = path.parent.as_posix()
        top = path.parts[0]
        if path.suffix != ".py":
            continue
        if path.name == "__init__.py":
            out.append(f"tests/{name}: no __init__.py in tests/ (test files go by basename)")
        elif path.name == "conftest.py":
            if where != ".":
                out.append(f"tests/{name}: the one conftest.py is tests/conftest.py")
        elif top == SUPPORT:
            if where != SUPPORT:
                out.append(f"tests/{name}: tests/support/ is flat")
        elif not TEST_FILE.match(path.name):
            out.append(f"tests/{name}: a helper module belongs in tests/support/")
        elif where == ".":
            out.append(f"tests/{name}: flat in tests/; put it under its package's path")
        elif top in APART:
            if where != top:
                out.append(f"tests/{name}: tests/{top}/ is flat")
        elif where not in packages:
            out.append(f"tests/{name}: tests/{where}/ mirrors no package directory")
        if TEST_FILE.match(path.name) and top != SUPPORT:
            seen.setdefault(path.name, []).append(f"tests/{name}")
    for base, paths in sorted(seen.items()):
        if len(paths) > 1:
            out.append(f"{base}: one basename, several files: {', '.join(paths)}")
    where_of = {PurePosixPath(p).stem: PurePosixPath(p).parent for p in files}
    for name, source in sorted(files.items()):
        for imported in sorted(imported_tests(source)):
            home = where_of.get(imported)
            if home is not None and home != PurePosixPath(name).parent:
                out.append(f"tests/{name} imports {imported}: put them in one directory")
    return out


def tree(root: Path) -> dict[str, str]:
    tests = root / "tests"
    return {
        p.relative_to(tests).as_posix(): p.read_text(encoding="utf-8")
        for p in sorted(tests.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def test_the_test_tree_follows_the_layout() -> None:
    files = tree(ROOT)
    assert "conftest.py" in files and len(files) > 100  # positive control: the tree was read
    found = problems(files, package_dirs(ROOT))
    assert not found, "tests/README.md says where each file goes:\n" + "\n".join(found)


def test_the_check_catches_each_kind_of_misplaced_file() -> None:
    packages = {"skippy", "skippy/runtime", "mesh_node"}
    files: dict[str, str] = {
        "conftest.py": "",
        "skippy/runtime/test_a.py": "from test_b import helper\n",
        "mesh_node/test_b.py": "",
        "skippy/runtime/test_c.py": "import test_d\n",
        "skippy/runtime/test_d.py": "from skippy.test_x import y\n",
        "test_flat.py": "",
        "skippy/nothing/test_e.py": "",
        "processes/deep/test_f.py": "",
        "mesh_node/test_c.py": "",
        "skippy/helper.py": "",
        "support/deep/tool.py": "",
        "support/tool.py": "",
        "skippy/__init__.py": "",
        "mesh_node/conftest.py": "",
        "repository/test_g.py": "",
    }
    assert problems(files, packages) == [
        "tests/mesh_node/conftest.py: the one conftest.py is tests/conftest.py",
        "tests/processes/deep/test_f.py: tests/processes/ is flat",
        "tests/skippy/__init__.py: no __init__.py in tests/ (test files go by basename)",
        "tests/skippy/helper.py: a helper module belongs in tests/support/",
        "tests/skippy/nothing/test_e.py: tests/skippy/nothing/ mirrors no package directory",
        "tests/support/deep/tool.py: tests/support/ is flat",
        "tests/test_flat.py: flat in tests/; put it under its package's path",
        "test_c.py: one basename, several files: tests/mesh_node/test_c.py, "
        "tests/skippy/runtime/test_c.py",
        "tests/skippy/runtime/test_a.py imports test_b: put them in one directory",
    ]


def test_package_directories_are_read_from_the_tree(tmp_path: Path) -> None:
    for d in ("skippy", "skippy/runtime", "skippy/runtime/__pycache__", "mesh_node/http"):
        (tmp_path / d).mkdir(parents=True)
    for d in ("skippy", "skippy/runtime", "mesh_node/http"):
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "skippy/runtime/__pycache__/__init__.py").write_text("")
    assert package_dirs(tmp_path) == {"skippy", "skippy/runtime", "mesh_node/http"}


def test_every_layer_of_the_layout_exists() -> None:
    """The directories tests/README.md names are there (a renamed one would leave the rule
    describing nothing)."""
    tests = ROOT / "tests"
    missing = [
        d for d in (*APART, SUPPORT, *PACKAGES) if not any((tests / d).glob("*.py"))
    ]
    assert not missing
    assert all(p.name.startswith("test_") for d in APART for p in (tests / d).glob("*.py"))
