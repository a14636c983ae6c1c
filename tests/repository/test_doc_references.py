"""The repository stands alone: nothing in the code, docs or scripts points at files outside
it (only public URLs do), and every section a comment or doc cites by name exists.

Citations checked: ``spec "Heading"`` (a heading of docs/layer-packages.md, where the
format is summarized) and ``layer-packages.md "Heading"`` / ``runtime-facts.md "Heading"``,
the two docs that took over what comments used to cite outside the repository."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("README.md", "docs", "skippy", "mesh_node", "protocol", "scripts", "tests", ".ci")
SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ""}
SPEC_DOC = "layer-packages.md"
# Places outside the repository that a clone does not have; spelled in pieces so this file
# does not match itself.
OUTSIDE = [
    re.compile(r"\.\./" + "shared"),
    re.compile(r"\b" + "GOT" + r"CHAS\b"),
    re.compile(r"\b[Nn]otes " + "§"),
    re.compile("package-v2-" + "notes"),
    re.compile(r"\b" + "STY" + r"LE( \d|\.md)"),
    re.compile("design " + "card"),
]
# ``spec "A"`` or ``spec "A" and "B"``; a long quotation of spec text is not a heading.
SPEC_CITE = re.compile(r'\b[Ss]pec,? "([^"\n]+)"(?: and "([^"\n]+)")?')
HEADING_LIKE = re.compile(r"\A(?:v2 [a-z]+|[A-Z][a-z]+(?: [A-Z][a-z]+){0,3})\Z")
DOC_CITE = re.compile(r'\b(layer-packages\.md|runtime-facts\.md)`?,? "([^"\n]+)"')


def scanned_files(root: Path) -> list[Path]:
    out = []
    for name in SCANNED:
        path = root / name
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        out += [
            p
            for p in files
            if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
        ]
    return out


def headings(markdown: str) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", markdown, re.M)}


def outside_pointers(name: str, text: str) -> list[str]:
    return [
        f"{name}:{n}: {line.strip()}"
        for n, line in enumerate(text.splitlines(), 1)
        if any(p.search(line) for p in OUTSIDE)
    ]


def broken_citations(name: str, text: str, docs: Mapping[str, set[str]]) -> list[str]:
    """Citations in ``text`` of a heading that its doc lacks (``docs``: file name -> headings).
    A line break inside a citation is read as a space."""
    flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)
    out = []
    for m in SPEC_CITE.finditer(flat):
        for cited in filter(None, m.groups()):
            if HEADING_LIKE.match(cited) and cited not in docs.get(SPEC_DOC, set()):
                out.append(f'{name}: spec "{cited}" is not a heading of docs/{SPEC_DOC}')
    for m in DOC_CITE.finditer(flat):
        doc, cited = m.groups()
        if doc in docs and cited not in docs[doc]:
            out.append(f'{name}: {doc} "{cited}" is not a heading of docs/{doc}')
    return out


def doc_headings(root: Path) -> dict[str, set[str]]:
    return {p.name: headings(p.read_text(encoding="utf-8")) for p in (root / "docs").glob("*.md")}


def check(files: Iterable[Path], root: Path, this: Path) -> tuple[list[str], list[str]]:
    docs = doc_headings(root)
    outside: list[str] = []
    broken: list[str] = []
    for p in files:
        if p == this:
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        name = p.relative_to(root).as_posix()
        outside += outside_pointers(name, text)
        broken += broken_citations(name, text, docs)
    return outside, broken


def test_nothing_points_outside_the_repository() -> None:
    outside, _ = check(scanned_files(ROOT), ROOT, Path(__file__).resolve())
    assert not outside, "pointers to files outside the repository:\n" + "\n".join(outside)


def test_cited_sections_exist() -> None:
    files = scanned_files(ROOT)
    assert ROOT / "skippy" / "package" / "select.py" in files  # positive control
    _, broken = check(files, ROOT, Path(__file__).resolve())
    assert not broken, "citations of missing sections:\n" + "\n".join(broken)


def test_the_checks_catch_each_kind_of_bad_reference() -> None:
    docs = {SPEC_DOC: {"Layer Selection", "v2 carrier"}, "runtime-facts.md": {"Hosts"}}
    text = (
        '"""Spec "Layer Selection" and "Consumer Checks"; spec "v2\n    carrier" fine.\n'
        'spec "v2 nothing"; runtime-facts.md "Hosts"; `runtime-facts.md`, "Guests".\n'
        'spec "Each artifact entry MUST include" is a quotation, not a heading."""\n'
        "see ../" + "shared/spec/x.md and " + "GOT" + "CHAS\n"
    )
    assert broken_citations("m.py", text, docs) == [
        f'm.py: spec "Consumer Checks" is not a heading of docs/{SPEC_DOC}',
        f'm.py: spec "v2 nothing" is not a heading of docs/{SPEC_DOC}',
        'm.py: runtime-facts.md "Guests" is not a heading of docs/runtime-facts.md',
    ]
    assert outside_pointers("m.py", text) == [
        "m.py:5: see ../" + "shared/spec/x.md and " + "GOT" + "CHAS"
    ]
