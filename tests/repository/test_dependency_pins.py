"""Every requirement in pyproject.toml has an upper bound: the next major release past the
version installed and tested here, or the next minor one for a 0.x package (whose minor
releases may break), or an exact pin. A release that renames what we call then cannot reach
a user's install unnoticed."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def requirements(doc: dict[str, object]) -> dict[str, list[str]]:
    """Each requirement string of a pyproject document, by where it is listed."""
    project = doc["project"]
    build = doc["build-system"]
    assert isinstance(project, dict) and isinstance(build, dict)
    out = {"build-system": list(build["requires"]), "dependencies": list(project["dependencies"])}
    for extra, listed in project.get("optional-dependencies", {}).items():
        out[f"extra {extra}"] = list(listed)
    return out


def next_boundary(version: Version) -> Version:
    """The first release that may break what ``version`` offers (semantic versioning; a 0.x
    package's minor releases count as breaking)."""
    major, minor = (*version.release, 0)[:2]
    return Version(f"{major + 1}") if major else Version(f"0.{minor + 1}")


def bound_problem(requirement: str, installed: Version | None) -> str | None:
    """What is wrong with ``requirement``'s upper bound (None: nothing). ``installed``: the
    version tested here, which the bound must admit and be the next boundary of."""
    req = Requirement(requirement)
    exact = [s for s in req.specifier if s.operator == "=="]
    uppers = [Version(s.version) for s in req.specifier if s.operator == "<"]
    if exact:
        pinned = Version(exact[0].version)
        if installed is not None and installed != pinned:
            return f"{req.name} is pinned to {pinned} but {installed} is installed"
        return None
    if not uppers:
        return f"{req.name} has no upper bound"
    upper = min(uppers)
    if installed is None:
        return None
    if installed not in req.specifier:
        return f"{req.name} {installed} (installed) is outside {req.specifier}"
    if upper != next_boundary(installed):
        return f"{req.name} <{upper}: the bound past {installed} is <{next_boundary(installed)}"
    return None


@pytest.mark.parametrize(
    ("requirement", "installed", "problem"),
    [
        ("trio>=0.25,<0.36", "0.35.0", None),
        ("numpy>=1.26,<3", "2.4.6", None),
        ("llama-cpp-python==0.3.36", "0.3.36", None),
        ("setuptools>=68,<85", None, None),  # build requirements: not installed here
        ("trio>=0.25", "0.35.0", "trio has no upper bound"),
        ("trio-websocket>=0.11", "0.12.2", "trio-websocket has no upper bound"),
        ("trio>=0.25,<1", "0.35.0", "trio <1: the bound past 0.35.0 is <0.36"),
        ("numpy>=1.26,<4", "2.4.6", "numpy <4: the bound past 2.4.6 is <3"),
        ("gguf>=0.17,<0.19", "0.19.0", "gguf 0.19.0 (installed) is outside <0.19,>=0.17"),
        (
            "llama-cpp-python==0.3.35",
            "0.3.36",
            "llama-cpp-python is pinned to 0.3.35 but 0.3.36 is installed",
        ),
    ],
)
def test_the_rule(requirement: str, installed: str | None, problem: str | None) -> None:
    assert bound_problem(requirement, Version(installed) if installed else None) == problem


def test_every_requirement_of_the_project_has_its_upper_bound() -> None:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    problems = []
    for where, listed in requirements(doc).items():
        for requirement in listed:
            name = Requirement(requirement).name
            installed = None
            if where != "build-system":  # built in an isolated environment, not this one
                installed = Version(importlib.metadata.version(name))
            problem = bound_problem(requirement, installed)
            if problem is not None:
                problems.append(f"{where}: {problem}")
    assert problems == []
