"""API keys of the HTTP surface: loaded once, compared in constant time.

Sources: ``[http] api_key_file`` / ``--api-key-file`` (one key per line; blank lines and
``#`` comments ignored; the file must be readable by its owner only, the rule of node keys)
and ``MESH_NODE_API_KEY`` (one key). No key anywhere: the surface is open (loopback by
default; a public bind warns). A key is never logged, shown or put in an error message.
"""

from __future__ import annotations

import errno
import hmac
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from mesh_node.errors import IdentityError
from mesh_node.identity import check_private_mode
from mesh_node.settings import HttpSettings
from skippy.errors import UsageError

MAX_KEY_FILE_BYTES: Final = 64 * 1024
MAX_KEY_CHARS: Final = 512
BEARER: Final = "bearer "


class ApiKeyError(UsageError):
    code = "invalid_api_key_file"


@dataclass(frozen=True)
class ApiKeys:
    """The accepted keys (empty: no authentication). ``repr`` shows only how many."""

    keys: tuple[bytes, ...] = field(default=(), repr=False)

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self.keys)} keys)"

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys (``Bearer K``).
        Every key is compared, each with ``hmac.compare_digest``: the time taken does not
        say which key, or how much of one, matched."""
        if authorization is None or authorization[: len(BEARER)].lower() != BEARER:
            return False
        given = authorization[len(BEARER) :].strip().encode("utf-8", "surrogateescape")
        found = False
        for key in self.keys:
            found |= hmac.compare_digest(given, key)
        return found


def parse_key_lines(text: str, source: str) -> list[str]:
    """Keys of a key file's text (pure): one per line, ``#`` comments and blanks skipped."""
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if len(key) > MAX_KEY_CHARS or not key.isascii() or not key.isprintable() or " " in key:
            # the line is not quoted: it may be a real key with a typo
            raise ApiKeyError(
                f"{source} line {number}: an API key is printable ASCII without spaces, "
                f"at most {MAX_KEY_CHARS} characters",
                path=source,
            )
        keys.append(key)
    return keys


def read_key_file(path: Path) -> list[str]:
    """The keys of ``path``, which must be a regular file of its own, readable by its owner
    only: a symbolic link (whose target's mode is not the rule's to check) and a FIFO or
    device (whose open or read would block start-up, or never end) are refused."""
    try:
        # O_NONBLOCK: opening a FIFO for reading waits for a writer; the node must not hang.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise ApiKeyError(
                f"the API key file {path} is a symbolic link: an API key file is read only "
                "from a regular file of its own",
                path=str(path),
                remediation=f"name the file itself ({os.path.realpath(path)})",
            ) from None
        raise ApiKeyError(
            f"cannot open the API key file {path}: {exc.strerror}", path=str(path)
        ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ApiKeyError(
            f"the API key file {path} is not a regular file ({_file_kind(st.st_mode)}): "
            "reading it could block the node's start or never end",
            path=str(path),
            remediation="write the keys to a regular file, mode 0600",
        )
    with os.fdopen(fd, "rb") as f:
        check_private_mode(st, path, "an API key file")
        data = f.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ApiKeyError(f"{path} is larger than {MAX_KEY_FILE_BYTES} bytes", path=str(path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiKeyError(f"{path} is not UTF-8 text", path=str(path)) from None
    keys = parse_key_lines(text, str(path))
    if not keys:
        raise ApiKeyError(
            f"the API key file {path} holds no key",
            path=str(path),
            remediation="one key per line (# starts a comment)",
        )
    return keys


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "a special file")


def load_api_keys(settings: HttpSettings) -> ApiKeys:
    """Every configured key; ``key_file_permissions`` for a file others can read."""
    keys: list[str] = []
    if settings.api_key_file is not None:
        keys += read_key_file(settings.api_key_file)
    if settings.api_key is not None:
        keys += parse_key_lines(settings.api_key, "MESH_NODE_API_KEY")
    return ApiKeys(tuple(dict.fromkeys(k.encode() for k in keys)))


def check_tls_key(path: Path) -> None:
    """The TLS private key obeys the same rule as every other secret file."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise IdentityError(
            f"cannot read the TLS key {path}: {exc.strerror}", path=str(path)
        ) from None
    check_private_mode(st, path, "a TLS private key")
