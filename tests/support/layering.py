"""The import graph of our packages, read with ``ast`` (nothing is imported or run), and the
checks ``tests/repository/test_layering.py`` applies to it: which package may import which,
the layers
inside ``skippy``, and import cycles. Pure functions over ``Import`` records, one reader.

Every import counts, wherever it sits: at module level, inside a function or class, under
``if TYPE_CHECKING:``, in a ``try``. A deferred or annotation-only import still ties the code
to the other package; it only changes when the cost is paid. ``importlib.import_module`` and
``__import__`` with a literal name count too. A name computed at run time cannot be seen.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module, dotted
    name: str  # the absolute dotted name imported (``from a import b`` -> ``a.b``)
    target: str | None  # the module of ours it resolves to; None for stdlib / third party
    path: str  # the importing file, relative to the root
    line: int
    where: str  # "module", "function", "type-checking" or "dynamic"

    def render(self) -> str:
        shown = self.target or self.name
        return f"{self.path}:{self.line}: {self.importer} imports {shown} ({self.where})"


class LayeringSourceError(ValueError):
    """A file of ours that ``ast`` cannot parse: its imports cannot be checked."""


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    return {
        module_name(root, p): p
        for pkg in packages
        for p in sorted((root / pkg).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def resolve(name: str, modules: Iterable[str]) -> str | None:
    """The longest module of ours that ``name`` lies in (``a.b.func`` -> ``a.b``), or None."""
    known = set(modules)
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _dynamic_name(call: ast.Call) -> str | None:
    """The literal module name of ``importlib.import_module("x")`` / ``__import__("x")``."""
    f = call.func
    named = (isinstance(f, ast.Name) and f.id in ("__import__", "import_module")) or (
        isinstance(f, ast.Attribute) and f.attr == "import_module"
    )
    if not named or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value[:1] != ".":
        return arg.value
    return None


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: set[str], path: str) -> None:
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.modules = modules
        self.path = path
        self.context = ["module"]
        self.found: list[Import] = []

    def _add(self, name: str, line: int, where: str | None = None) -> None:
        target = resolve(name, self.modules)
        found = Import(self.module, name, target, self.path, line, where or self.context[-1])
        if target != self.module and found not in self.found:  # ``from m import a, b``: once
            self.found.append(found)

    def _nested(self, node: ast.AST, where: str) -> None:
        self.context.append(where)
        self.generic_visit(node)
        self.context.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._nested(node, "function" if self.context[-1] == "module" else self.context[-1])

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._nested(node, "function" if self.context[-1] == "module" else self.context[-1])

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self.context.append("type-checking")
        for stmt in node.body:
            self.visit(stmt)
        self.context.pop()
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            # ``from pkg import submodule`` depends on the submodule, not on pkg/__init__
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in self.modules else base, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        name = _dynamic_name(node)
        if name is not None:
            self._add(name, node.lineno, "dynamic")
        self.generic_visit(node)


def imports_of(
    source: str, module: str, is_package: bool, modules: Iterable[str], path: str = "<source>"
) -> list[Import]:
    """Every import in one file's source (pure: the caller reads the file)."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise LayeringSourceError(f"{path}:{e.lineno}: cannot parse: {e.msg}") from e
    collector = _Collector(module, is_package, set(modules), path)
    collector.visit(tree)
    return collector.found


def read_imports(root: Path, packages: Iterable[str]) -> list[Import]:
    """Every import in every module of ``packages`` under ``root``."""
    modules = find_modules(root, packages)
    out: list[Import] = []
    for module, p in modules.items():
        rel = p.relative_to(root).as_posix()
        text = p.read_text(encoding="utf-8")
        out.extend(imports_of(text, module, p.name == "__init__.py", modules, rel))
    return out


def package_breaks(imports: Iterable[Import], may_import: Mapping[str, set[str]]) -> list[str]:
    """Imports from one top-level package into another that ``may_import`` does not allow."""
    out = []
    for imp in imports:
        src, dst = imp.importer.split(".")[0], (imp.target or "").split(".")[0]
        if imp.target and dst != src and dst not in may_import.get(src, set()):
            allowed = ", ".join(sorted(may_import.get(src, set()))) or "nothing of ours"
            out.append(f"{imp.render()}: {src} may import {allowed}")
    return out


def forbidden_external(imports: Iterable[Import], package: str, names: set[str]) -> list[str]:
    """Imports from ``package`` of outside libraries named in ``names`` (top-level names)."""
    return [
        f"{imp.render()}: {package} must not import {imp.name.split('.')[0]}"
        for imp in imports
        if imp.target is None
        and imp.importer.split(".")[0] == package
        and imp.name.split(".")[0] in names
    ]


def unit_of(layers: Sequence[tuple[str, Sequence[str]]], default: str) -> Callable[[str], str]:
    """Module -> layer name: the first layer holding a prefix of the module, else ``default``."""

    def unit(module: str) -> str:
        for layer, prefixes in layers:
            if any(module == p or module.startswith(p + ".") for p in prefixes):
                return layer
        return default

    return unit


def layer_breaks(
    imports: Iterable[Import],
    scope: str,
    layers: Sequence[tuple[str, Sequence[str]]],
    ground: str,
) -> list[str]:
    """Inside ``scope``, an import from a lower layer up to a higher one. ``layers`` runs top
    down; modules of ``scope`` in no layer are the ``ground`` layer, below all of them."""
    unit = unit_of(layers, ground)
    rank = {name: i for i, (name, _) in enumerate(layers)} | {ground: len(layers)}
    out = []
    for imp in imports:
        if imp.target is None or not all(
            m == scope or m.startswith(scope + ".") for m in (imp.importer, imp.target)
        ):
            continue
        lo, hi = unit(imp.importer), unit(imp.target)
        if rank[hi] < rank[lo]:
            out.append(f"{imp.render()}: layer {lo!r} is below {hi!r}")
    return out


def graph(
    imports: Iterable[Import], unit: Callable[[str], str | None] = lambda m: m
) -> dict[str, set[str]]:
    """The import graph between units (modules by default); self-edges dropped."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if imp.target is None:
            continue
        a, b = unit(imp.importer), unit(imp.target)
        if a is None or b is None:
            continue
        edges.setdefault(a, set())
        edges.setdefault(b, set())
        if a != b:
            edges[a].add(b)
    return edges


def cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative), each
    sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, successors = work[-1]
            w = next(successors, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def cycle_edges(
    imports: Iterable[Import],
    component: Iterable[str],
    unit: Callable[[str], str | None] = lambda m: m,
) -> list[str]:
    """The imports that make up one cycle's edges, rendered (for a readable failure)."""
    members = set(component)
    return [
        imp.render()
        for imp in imports
        if imp.target is not None
        and unit(imp.importer) in members
        and unit(imp.target) in members
        and unit(imp.importer) != unit(imp.target)
    ]
