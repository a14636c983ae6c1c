"""Our packages use their dependencies through public API only: no module reads or writes a
private attribute (``obj._name``) of an object that is not ours. Read from the sources with
``ast``: an access to ``_name`` on anything but ``self``/``cls`` is allowed only when ``_name``
is defined by our own code in the same module (one module's classes working together), or
listed below as one of our modules reaching into another of ours; reflective access with a
private name (``getattr(obj, "_name")``) is never allowed. A private attribute of a
dependency then has no way in: it is defined nowhere in our code, or defined elsewhere than
where it is read. The synthetic sources below prove each rule can fail."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "skippy", "mesh_node")
# Names with a leading underscore that are documented public API.
DOCUMENTED = {"os._exit"}
# Our modules using a private of another of our modules: (reading module, expression).
OUR_CROSS_MODULE = {
    ("skippy/produce/verify_v2.py", "m._artifact"),
    ("skippy/runtime/llama_stage.py", "StageBase._check_session_id"),
    ("skippy/transfer/chunk_sink.py", "sink._start"),
    ("skippy/transfer/chunk_sink.py", "sink._close_fd"),
    ("mesh_node/serving/api.py", "server._check_ready"),
}
REFLECTIVE = {"getattr", "hasattr", "setattr", "delattr"}


@dataclass(frozen=True)
class Access:
    path: str
    line: int
    text: str  # the expression, as written
    name: str  # the private attribute
    reflective: bool


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def scan(path: str, source: str) -> tuple[set[str], list[Access]]:
    """The private names a module defines, and its accesses to private attributes of
    objects other than ``self``/``cls``."""
    defined: set[str] = set()
    accesses: list[Access] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.ctx, ast.Store) and _own(node.value):
                defined.add(node.attr)
            elif not _own(node.value):
                accesses.append(Access(path, node.lineno, ast.unparse(node), node.attr, False))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in REFLECTIVE
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and not _own(node.args[0])
        ):
            name = node.args[1].value
            accesses.append(Access(path, node.lineno, ast.unparse(node), name, True))
    return {n for n in defined if _private(n)}, accesses


def violations(sources: dict[str, str], cross_module: set[tuple[str, str]]) -> list[str]:
    """Each access that may reach a dependency's private attribute, explained."""
    scanned = {path: scan(path, source) for path, source in sources.items()}
    ours = set().union(*(defined for defined, _ in scanned.values()))
    out = []
    for path, (defined, accesses) in scanned.items():
        for a in accesses:
            where = f"{a.path}:{a.line}: {a.text}"
            if a.text in DOCUMENTED or (path, a.text) in cross_module:
                continue
            if a.reflective:
                out.append(f"{where}: a private attribute reached by name")
            elif a.name not in ours:
                out.append(f"{where}: {a.name} is no attribute of ours (a dependency's private)")
            elif a.name not in defined:
                out.append(f"{where}: {a.name} is defined in another module")
    return out


def test_no_module_touches_a_dependencys_private_attribute() -> None:
    sources = {
        str(p.relative_to(ROOT)): p.read_text()
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
    }
    assert len(sources) > 50  # the scan sees the tree
    assert violations(sources, OUR_CROSS_MODULE) == []


@pytest.mark.parametrize(
    ("sources", "found"),
    [
        (  # trio-websocket's send lock, defined nowhere in our code
            {"a.py": "async def f(ws):\n    async with ws._stream_lock:\n        pass\n"},
            ["a.py:2: ws._stream_lock: _stream_lock is no attribute of ours"],
        ),
        (  # a private of a dependency reached through getattr
            {"a.py": "def f(s):\n    return getattr(s.socket, '_sock', None)\n"},
            ["a.py:2: getattr(s.socket, '_sock', None): a private attribute reached by name"],
        ),
        (  # a name ours elsewhere does not make a dependency's attribute of that name ours
            {
                "a.py": "class A:\n    def __init__(self):\n        self._stream = 1\n",
                "b.py": "def f(ws):\n    return ws._stream\n",
            },
            ["b.py:2: ws._stream: _stream is defined in another module"],
        ),
        (  # allowed: one module's classes together, ``self``, documented names
            {
                "a.py": (
                    "import os\nclass A:\n    def __init__(self):\n        self._held = 0\n"
                    "def f(a):\n    os._exit(1)\n    return a._held + getattr(a, 'x')\n"
                )
            },
            [],
        ),
    ],
)
def test_the_rules(sources: dict[str, str], found: list[str]) -> None:
    got = violations(sources, set())
    assert len(got) == len(found)
    for line, prefix in zip(got, found, strict=True):
        assert line.startswith(prefix), line
