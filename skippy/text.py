"""Text that came from a user or a manifest, and the one rule for it.

Identity strings (model ids, repos, revisions, file names) may not contain control characters
(C0, DEL, C1: newlines would inject Markdown into README.md, ESC sequences would drive a
terminal) or Unicode bidirectional controls (a right-to-left override makes ``gguf.exe`` read
as ``exe.fugg``). write-package refuses them in provenance; consumers refuse them in manifests;
the CLI escapes them in anything it prints (``escape``).
"""

from __future__ import annotations

import re
from typing import Final

# C0 (incl. tab and newline), DEL, C1, and the bidi controls ALM, LRM, RLM, LRE..RLO, LRI..PDI.
UNSAFE_CHARS: Final = "\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_UNSAFE_RE: Final = re.compile(f"[{UNSAFE_CHARS}]")


def unsafe_char(text: str) -> str | None:
    """The first control or bidi character in ``text`` as an escape (``\\x1b``), or None."""
    m = _UNSAFE_RE.search(text)
    return None if m is None else _escape_char(m.group(0))


def _escape_char(ch: str) -> str:
    cp = ord(ch)
    return f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}"


def escape(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every control and bidi character written as an escape; ``keep_newlines``
    leaves newlines and tabs alone (for whole blocks of our own output)."""

    def sub(m: re.Match[str]) -> str:
        ch = m.group(0)
        return ch if keep_newlines and ch in "\n\t" else _escape_char(ch)

    return _UNSAFE_RE.sub(sub, text)
