"""Per-tensor type recipes: ``REGEX=TYPE`` a line, first match wins (pure).

The convention is llama-quantize's ``--tensor-type PATTERN=TYPE``: the pattern is searched
(``std::regex_search``, here ``re.search`` with ASCII classes) in each tensor name, and the
first rule that matches decides the tensor's type. Differences, all on the side of clarity:
one rule a line (blank lines and ``#`` comments allowed, also after a rule), the line splits
at its *last* ``=`` (type names never hold one, so a pattern may), the pattern keeps its case
(llama-quantize lower-cases it, which would turn ``\\D`` into ``\\d``), and every failure is a
coded error naming the line. Whether a rule matches anything is decided against the model in
``skippy.produce.quant_rules.plan_types``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Final

from skippy.errors import UsageError
from skippy.gguf.constants import GGML_TYPES

MAX_RECIPE_BYTES: Final = 1024 * 1024
MAX_LINE_CHARS: Final = 1024
MAX_RULES: Final = 4096

# A comment starts at '#' at the start of a line or after whitespace ('#' inside a pattern,
# e.g. "a#b", stays part of it).
_COMMENT_RE: Final = re.compile(r"(?:^|\s)#.*\Z", re.DOTALL)


class RecipeError(UsageError):
    """A recipe that cannot be used as written; ``line`` names where (1-based)."""

    code = "invalid_recipe"

    def __init__(self, message: str, *, code: str, line: int | None = None) -> None:
        where = f"recipe line {line}: " if line is not None else "recipe: "
        super().__init__(where + message, code=code, actual=line)


@dataclass(frozen=True)
class RecipeRule:
    line_no: int
    pattern: str
    regex: re.Pattern[str]
    type_id: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0]


@dataclass(frozen=True)
class Recipe:
    text: str  # exactly what was read (recorded in the manifest)
    rules: tuple[RecipeRule, ...]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def _type_by_name(name: str, allowed: frozenset[int]) -> int | None:
    """ggml type names case-insensitively (llama-quantize's parse_ggml_type)."""
    want = name.upper()
    for tid, (tname, _, _) in GGML_TYPES.items():
        if tname == want and tid in allowed:
            return tid
    return None


def parse_recipe(data: bytes, *, allowed_types: frozenset[int]) -> Recipe:
    """Parse recipe bytes; ``allowed_types`` are the types a rule may name."""
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError(
            f"{len(data)} bytes is over the {MAX_RECIPE_BYTES}-byte limit",
            code="recipe_too_large",
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(
            f"not UTF-8 text ({exc.reason} at byte {exc.start})", code="recipe_not_utf8"
        ) from exc
    rules: list[RecipeRule] = []
    for line_no, raw in enumerate(text.splitlines(), start=1):
        if len(raw) > MAX_LINE_CHARS:
            raise RecipeError(
                f"{len(raw)} characters is over the {MAX_LINE_CHARS}-character line limit",
                code="recipe_line_too_long",
                line=line_no,
            )
        line = _COMMENT_RE.sub("", raw).strip()
        if not line:
            continue
        pattern, sep, type_text = line.rpartition("=")
        pattern, type_text = pattern.strip(), type_text.strip()
        if not sep or not pattern or not type_text:
            raise RecipeError(
                f"{raw.strip()!r} is not REGEX=TYPE", code="recipe_malformed_line", line=line_no
            )
        if "\0" in pattern:
            raise RecipeError("the pattern holds a NUL byte", code="recipe_bad_regex", line=line_no)
        try:
            regex = re.compile(pattern, re.ASCII)
        except (re.error, RecursionError, OverflowError) as exc:
            raise RecipeError(
                f"{pattern!r} is not a valid regular expression: {exc}",
                code="recipe_bad_regex",
                line=line_no,
            ) from exc
        type_id = _type_by_name(type_text, allowed_types)
        if type_id is None:
            known = ", ".join(sorted(GGML_TYPES[t][0] for t in allowed_types))
            raise RecipeError(
                f"{type_text!r} is not a ggml type this tool can quantize to (one of: {known})",
                code="recipe_unknown_type",
                line=line_no,
            )
        rules.append(RecipeRule(line_no, pattern, regex, type_id))
        if len(rules) > MAX_RULES:
            raise RecipeError(f"more than {MAX_RULES} rules", code="recipe_too_large")
    if not rules:
        raise RecipeError("it holds no REGEX=TYPE rule", code="recipe_empty")
    return Recipe(text=text, rules=tuple(rules))
