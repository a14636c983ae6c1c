"""docs/architecture.md's module map is the tree's: every module of skippy/, mesh_node/ and
protocol/ is listed with its docstring's first sentence, and nothing else is
(scripts/module_map.py writes it)."""

from __future__ import annotations

from pathlib import Path

from scripts import module_map as mm


def test_the_module_map_is_current() -> None:
    have = mm.current(mm.DOC.read_text(encoding="utf-8"))
    assert have is not None, "docs/architecture.md lost its module map markers"
    assert have == mm.render(), "stale module map: run python scripts/module_map.py"


def test_every_module_says_what_it_is() -> None:
    missing = [f"{d}/{m}" for d, mods in mm.modules().items() for m, t in mods if t == mm.NO_DOC]
    assert not missing, f"modules without a docstring: {missing}"


def test_a_new_module_makes_the_map_stale(tmp_path: Path) -> None:
    for pkg in mm.PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "a.py").write_text('"""A module. More text."""\n')
    before = mm.render(tmp_path)
    (tmp_path / "skippy" / "b.py").write_text("x = 1\n")
    after = mm.render(tmp_path)
    assert before != after
    assert "| `a.py` | A module. |" in before
    assert f"| `b.py` | {mm.NO_DOC} |" in after
