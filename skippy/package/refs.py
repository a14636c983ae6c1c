"""Package references: a local package directory or an ``hf://`` package repo.

The spec accepts ``hf://namespace/repo``, ``hf://namespace/repo:revision`` and
``hf://namespace/repo@revision``. We parse once at the edge into frozen, validated values and
render one canonical form (``@``), so the rest of the code never re-splits strings.

Splitting rules: ``@`` splits on the first ``@``; without ``@``, ``:`` splits on the last
``:``. The repo part must be exactly ``namespace/name`` (Hub naming rules, as enforced by
``huggingface_hub.utils.validate_repo_id``). A revision may name a branch, a tag or a full
40-hex commit; only the latter is pinned (the Hub rejects abbreviated commit hashes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from skippy.errors import UsageError

HF_SCHEME: Final = "hf://"

ACCEPTED_FORMS: Final = (
    "hf://namespace/repo, hf://namespace/repo@revision, hf://namespace/repo:revision, "
    "or a local package directory"
)

# Hub repo-name rules (huggingface_hub validate_repo_id): ASCII letters, digits, '-', '_', '.';
# 1..96 characters; no leading/trailing '-' or '.'; no '--' or '..'; no '.git' suffix.
_NAME_PART_RE: Final = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?$")

# Same pattern huggingface_hub uses (REGEX_COMMIT_HASH): only a full lowercase sha is a commit
# it will look up in snapshots/ without asking the Hub.
COMMIT_SHA_RE: Final = re.compile(r"^[0-9a-f]{40}$")

# The only revisions that may contain '/', as in huggingface_hub's hf:// URI parser. Any other
# '/' after the repo is taken as an (unsupported) path inside the repo.
_SLASHED_REVISION_RE: Final = re.compile(r"^refs/(?:pr/\d+|convert/[A-Za-z0-9_.-]+)$")

# git check-ref-format forbids these anywhere in a ref name.
_REVISION_FORBIDDEN_RE: Final = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{")
_REVISION_MAX_CHARS: Final = 255
# Any URL scheme: s3://, https://... are not local directories, whatever the folder holds.
_SCHEME_RE: Final = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class InvalidPackageRef(UsageError):
    """A package reference does not parse; the message names the problem and the accepted forms."""

    code = "invalid_package_ref"

    def __init__(self, text: str, problem: str) -> None:
        super().__init__(
            f"invalid package reference {text!r}: {problem}. Accepted forms: {ACCEPTED_FORMS}.",
            actual=text,
            remediation=f"Write the reference as one of: {ACCEPTED_FORMS}.",
        )


def _repo_problem(repo_id: str) -> str | None:
    """Why ``repo_id`` is not a valid ``namespace/name``, or None if it is."""
    parts = repo_id.split("/")
    if len(parts) == 1:
        return f"repo {repo_id!r} has no namespace; write namespace/{repo_id}"
    if len(parts) > 2:
        return (
            f"repo {repo_id!r} has extra path segments; a package ref names a whole model repo "
            "(namespace/name), not a file, folder or repo type"
        )
    for label, part in zip(("namespace", "name"), parts, strict=True):
        if not part:
            return f"repo {repo_id!r} has an empty {label}"
        if not _NAME_PART_RE.match(part) or "--" in part or ".." in part:
            return (
                f"repo {label} {part!r} must be 1-96 characters of letters, digits, '-', '_' or "
                "'.', must not start or end with '-' or '.', and must not contain '--' or '..'"
            )
    if parts[1].endswith(".git"):
        return f"repo name {parts[1]!r} must not end with '.git'"
    return None


def _revision_problem(revision: str) -> str | None:
    """Why ``revision`` is not a usable git revision name, or None if it is."""
    if not revision:
        return "the revision after '@' or ':' is empty"
    if len(revision) > _REVISION_MAX_CHARS:
        return f"the revision is longer than {_REVISION_MAX_CHARS} characters"
    if "/" in revision and not _SLASHED_REVISION_RE.match(revision):
        return (
            f"revision {revision!r} contains '/'; only refs/pr/N and refs/convert/NAME may, "
            "and a package ref cannot name a path inside the repo"
        )
    if "@" in revision:
        return f"revision {revision!r} contains '@': a reference names one revision"
    if _REVISION_FORBIDDEN_RE.search(revision):
        return (
            f"revision {revision!r} contains whitespace, a control character, '..', '@{{' "
            "or one of ~^:?*[\\"
        )
    if revision.startswith(("-", ".")) or revision.endswith((".", ".lock")) or revision == "@":
        return f"revision {revision!r} is not a valid git ref name"
    return None


@dataclass(frozen=True)
class HfPackageRef:
    """A Hugging Face package repo at an optional revision (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    def __post_init__(self) -> None:
        problem = _repo_problem(self.repo_id)
        if problem is None and self.revision is not None:
            problem = _revision_problem(self.revision)
        if problem is not None:
            raise InvalidPackageRef(self._render(), problem)

    def _render(self) -> str:
        base = f"{HF_SCHEME}{self.repo_id}"
        return base if self.revision is None else f"{base}@{self.revision}"

    def __str__(self) -> str:
        return self._render()

    @property
    def namespace(self) -> str:
        return self.repo_id.split("/", 1)[0]

    @property
    def name(self) -> str:
        return self.repo_id.split("/", 1)[1]

    @property
    def is_pinned(self) -> bool:
        """True iff the revision is a full commit sha: the only ref that cannot move under us."""
        return self.revision is not None and COMMIT_SHA_RE.match(self.revision) is not None

    def at(self, commit: str) -> HfPackageRef:
        """The same repo pinned to ``commit`` (e.g. after resolving a branch)."""
        return HfPackageRef(self.repo_id, commit)


@dataclass(frozen=True)
class LocalPackageRef:
    """A package directory on local disk (not checked for existence here)."""

    path: Path

    def __str__(self) -> str:
        return str(self.path)


PackageRef = HfPackageRef | LocalPackageRef


def parse_hf_package_ref(text: str) -> HfPackageRef:
    """Parse ``hf://namespace/repo[@revision|:revision]``; raise InvalidPackageRef otherwise."""
    if not text.startswith(HF_SCHEME):
        raise InvalidPackageRef(text, f"it does not start with {HF_SCHEME!r}")
    body = text[len(HF_SCHEME) :]
    if not body:
        raise InvalidPackageRef(text, "it names no repo")
    revision: str | None = None
    if "@" in body:
        repo_id, _, revision = body.partition("@")
    elif ":" in body:
        repo_id, _, revision = body.rpartition(":")
    else:
        repo_id = body
    problem = _repo_problem(repo_id)
    if problem is None and revision is not None:
        problem = _revision_problem(revision)
    if problem is not None:
        raise InvalidPackageRef(text, problem)
    return HfPackageRef(repo_id, revision)


def parse_package_ref(text: str) -> PackageRef:
    """Parse a user-supplied package reference: ``hf://...`` or a local directory path.

    Anything starting with ``hf:`` (any case) is treated as an attempted Hub ref, so a typo
    such as ``hf:/ns/repo`` fails loudly instead of silently becoming a local path.
    """
    if not text:
        raise InvalidPackageRef(text, "it is empty")
    scheme = _SCHEME_RE.match(text)
    if scheme and scheme.group(1).lower() != "hf":
        raise InvalidPackageRef(
            text, f"the {scheme.group(1)}:// scheme is unsupported (only hf:// is)"
        )
    if text[:3].lower() == "hf:":
        if not text.startswith(HF_SCHEME):
            raise InvalidPackageRef(text, f"Hub references start with exactly {HF_SCHEME!r}")
        return parse_hf_package_ref(text)
    return LocalPackageRef(Path(text))
