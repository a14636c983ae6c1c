"""Names that mean one thing: no two modules of skippy/, mesh_node/ and protocol/ share a file
name unless they are a stated core/shell mirror or a per-package convention
(docs/architecture.md, "Module names"), and nothing in the repository cites an issue number
where it should say why."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("skippy", "mesh_node", "protocol")

# Every package may have these: its init, its branch of the one error hierarchy, its
# vocabulary, and the entry of a console script (skippy-model-package, mesh-node).
CONVENTIONS = frozenset({"__init__.py", "errors.py", "constants.py", "cli.py"})

# A decision module in skippy (pure, or file I/O without network) and the mesh_node module that
# does its I/O keep one name; each one's docstring names the other. (core, shell)
MIRRORS = (
    ("skippy.runtime.calibration", "mesh_node.calibration"),
    ("skippy.package.topology", "mesh_node.topology"),
    ("skippy.serving.replicas", "mesh_node.serving.replicas"),
    ("skippy.transfer.partials", "mesh_node.transfer.partials"),
    ("skippy.transfer.policy", "mesh_node.transfer.policy"),
    ("skippy.transfer.serve", "mesh_node.transfer.serve"),
    ("skippy.transfer.siblings", "mesh_node.transfer.siblings"),
)

# Spelled in pieces so this file does not match itself.
ISSUE_REF = re.compile(r"\b" + "issue" + r"s?\s*#\s*\d", re.IGNORECASE)
SCANNED = ("skippy", "mesh_node", "protocol", "docs", "scripts", "tests", "README.md")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ".js", ".css", ".html", ""}


def module_files(root: Path) -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))]


def dotted(root: Path, path: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts)


def duplicate_names(
    root: Path,
    mirrors: Iterable[tuple[str, str]] = MIRRORS,
    conventions: frozenset[str] = CONVENTIONS,
) -> list[str]:
    """Each file name that several modules share without a stated reason, with the modules."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in module_files(root):
        by_name[path.name].append(dotted(root, path))
    pairs = {frozenset(pair) for pair in mirrors}
    return [
        f"{name}: {', '.join(sorted(mods))}"
        for name, mods in sorted(by_name.items())
        if len(mods) > 1 and name not in conventions and frozenset(mods) not in pairs
    ]


def mirror_problems(root: Path, mirrors: Iterable[tuple[str, str]] = MIRRORS) -> list[str]:
    """A listed mirror whose modules are gone or renamed apart, or whose docstrings do not name
    each other."""
    problems = []
    for core, shell in mirrors:
        paths = {m: root / (m.replace(".", "/") + ".py") for m in (core, shell)}
        missing = [m for m, p in paths.items() if not p.is_file()]
        if missing:
            problems.append(f"{core} / {shell}: no module {', '.join(missing)}")
            continue
        if core.rsplit(".", 1)[1] != shell.rsplit(".", 1)[1]:
            problems.append(f"{core} / {shell}: a mirror keeps one name")
        for module, twin in ((core, shell), (shell, core)):
            doc = ast.get_docstring(ast.parse(paths[module].read_text(encoding="utf-8"))) or ""
            if f"``{twin}``" not in doc:
                problems.append(f"{module}: its docstring does not name its twin ``{twin}``")
    return problems


def scanned_files(root: Path) -> list[Path]:
    out = []
    for name in SCANNED:
        path = root / name
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        out += [
            p
            for p in files
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts
        ]
    return out


def issue_references(root: Path) -> list[str]:
    """``path:line: text`` for each issue-number citation."""
    hits = []
    for path in scanned_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if ISSUE_REF.search(line):
                hits.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return hits


def test_no_two_modules_share_a_name_without_a_stated_reason():
    found = duplicate_names(ROOT)
    assert not found, (
        "modules that share a file name; name each for what it is, or, for a core/shell pair, "
        "add it to MIRRORS with docstrings naming each other:\n" + "\n".join(found)
    )


def test_every_mirror_exists_and_names_its_twin():
    problems = mirror_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_nothing_cites_an_issue_number():
    hits = issue_references(ROOT)
    assert not hits, "say why, not which issue:\n" + "\n".join(hits)


def _module(root: Path, name: str, doc: str) -> None:
    path = root / (name.replace(".", "/") + ".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'"""{doc}"""\n', encoding="utf-8")


def test_the_checks_see_what_they_refuse(tmp_path):
    # Each check on a small tree of its own, so a check that stopped seeing would fail here.
    _module(tmp_path, "skippy.errors", "Errors.")
    _module(tmp_path, "mesh_node.errors", "Errors.")
    _module(tmp_path, "skippy.a.pair", "The core of ``mesh_node.pair``.")
    _module(tmp_path, "mesh_node.pair", "The shell of ``skippy.a.pair``.")
    _module(tmp_path, "skippy.stage.service", "One thing.")
    _module(tmp_path, "mesh_node.service", "Another thing.")
    pair = [("skippy.a.pair", "mesh_node.pair")]
    assert duplicate_names(tmp_path, pair) == [
        "service.py: mesh_node.service, skippy.stage.service"
    ]
    assert mirror_problems(tmp_path, pair) == []
    _module(tmp_path, "mesh_node.pair", "Names no twin.")
    assert mirror_problems(tmp_path, pair) == [
        "mesh_node.pair: its docstring does not name its twin ``skippy.a.pair``"
    ]
    assert mirror_problems(tmp_path, [("skippy.gone", "mesh_node.gone")]) == [
        "skippy.gone / mesh_node.gone: no module skippy.gone, mesh_node.gone"
    ]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("ok\nfixed in " + "Issue" + " #12\n", encoding="utf-8")
    assert issue_references(tmp_path) == ["docs/a.md:2: fixed in " + "Issue" + " #12"]
