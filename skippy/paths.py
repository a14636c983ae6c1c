"""The one path-safety gate (spec "Repository Layout": paths MUST be relative and MUST NOT
escape the package root; consumers MUST reject unsafe paths).

Every artifact name that comes from a manifest or a peer passes ``check_relative_path`` before
it is joined to a root, and ``resolve_under`` before the resulting file is opened.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from skippy.errors import InputUnreadable, UnsafePath
from skippy.text import unsafe_char


def check_relative_path(rel: str) -> str:
    """Return ``rel`` unchanged if it is a safe repository-relative POSIX path, else raise.

    Rejected: empty, absolute, backslashes, drive letters, NUL and every other control or
    bidi character (``skippy.text``), and empty, ``.`` or ``..`` components (so ``a//b`` and
    ``./a`` are rejected too: one spelling per file).
    """
    reason = _unsafe_reason(rel)
    if reason:
        raise UnsafePath(
            f"unsafe artifact path {rel!r}: {reason}",
            path=rel,
            remediation="artifact paths must be relative POSIX paths inside the package root",
        )
    return rel


def _unsafe_reason(rel: object) -> str | None:
    if not isinstance(rel, str) or not rel:
        return "empty or not a string"
    if "\x00" in rel:
        return "contains NUL"
    bad = unsafe_char(rel)
    if bad is not None:  # a name that would drive a terminal or read backwards
        return f"contains the control or bidi character {bad}"
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from undecodable bytes (argv, file names)
        return "is not valid UTF-8"
    if "\\" in rel:
        return "contains a backslash"
    if rel.startswith("/"):
        return "is absolute"
    if len(rel) >= 2 and rel[1] == ":":
        return "starts with a drive letter"
    for part in rel.split("/"):
        if part == "":
            return "has an empty component"
        if part in (".", ".."):
            return f"has a {part!r} component"
    return None


def is_safe_relative_path(rel: object) -> bool:
    return _unsafe_reason(rel) is None


def is_within(path: Path, root: Path) -> bool:
    """True if ``path``, with every symlink resolved, is ``root`` or lies inside it."""
    boundary = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == boundary or real.startswith(boundary + os.sep)


def resolve_under(root: Path, rel: str, *, containment_root: Path | None = None) -> Path:
    """Join a checked relative path to ``root`` and prove the real file stays inside.

    ``containment_root`` defaults to ``root``. For the hub cache, pass the repo's cache folder
    (``models--ns--name``): snapshot files are symlinks into its ``blobs/`` (docs/runtime-facts.md).
    """
    check_relative_path(rel)
    joined = root / PurePosixPath(rel)
    if not is_within(joined, containment_root or root):
        real = os.path.realpath(joined)
        raise UnsafePath(
            f"artifact path {rel!r} resolves outside the package root (to {real})",
            path=rel,
            remediation="remove the symlink or replace it with the real file",
        )
    return joined


# --- paths the user names on the command line ---------------------------------------------------
def require_dir(path: Path, what: str) -> Path:
    """``path`` if it is a directory; else ``does not exist`` or ``is not a directory`` (a
    file where a folder was expected is not "missing")."""
    if path.is_dir():
        return path
    if path.exists() or path.is_symlink():
        raise InputUnreadable(
            f"{what} {path} is not a directory", code="not_a_directory", path=str(path)
        )
    raise InputUnreadable(f"{what} {path} does not exist", path=str(path))


def require_file(path: Path, what: str) -> Path:
    """``path`` if it is a regular file (symlinks followed); else ``does not exist`` or
    ``is not a file`` (a folder, a FIFO or a device)."""
    if path.is_file():
        return path
    if path.exists() or path.is_symlink():
        raise InputUnreadable(f"{what} {path} is not a file", code="not_a_file", path=str(path))
    raise InputUnreadable(f"{what} {path} does not exist", path=str(path))
