"""SHA-256 chaining values at chunk boundaries: every chunk checked, the whole file proven, one
pass.

SHA-256 reads its message 64 bytes at a time and carries a 32-byte state (the chaining value
H, FIPS 180-4 section 6.2.2) from one block to the next; the digest is the state after the
last, padded block. Cut a file at multiples of 64 bytes and the state after chunk ``i``
depends only on the state after chunk ``i - 1`` and chunk ``i``'s own bytes. The coordinator
publishes, from its verified copy, the state after each chunk but the last, and for the last
chunk the file's digest itself (the *chain*; ``chain_states``). A receiver checks chunk ``i``
on its own, in any order and from any source: start from the published state ``i - 1`` (the
standard initial value for chunk 0), hash the chunk, and compare the state it reaches
(``check_chunk``); for the last chunk the state it reaches is finished into a digest and
compared with the **manifest's** SHA-256, not with the list.

Why that is the whole-file check and not a weaker one: chunk 0 starts from the fixed initial
value, so once it passes, the published state 0 is the true state of this file's first chunk;
chunk 1 then starts from a true state, and so on. When every chunk has passed, the receiver
has itself computed SHA-256 over every byte of the file, in order, and found the manifest's
digest: spec "Peer Cache Transfer" ("installed only after size and SHA-256 verification")
holds without the second pass over the file that independent per-chunk digests need (each
chunk hashed against its digest, then the whole file again). A wrong list can only make good
chunks fail (as a wrong per-chunk digest list can); it cannot make a wrong file pass, since
the last comparison is against the manifest.

hashlib cannot start from a given state, so this uses libcrypto's SHA256_Init/Update/Final
(the same SHA-NI code hashlib runs; ctypes releases the GIL for each call). The structure is
OpenSSL's public ``SHA256_CTX`` (``openssl/sha.h``): ``h[8]``, ``Nl``, ``Nh``, ``data[16]``,
``num``, ``md_len``. ``available()`` says whether the library loaded and passed a self-test
against hashlib; a node without it does not advertise ``chunk-chain`` and is sent plain
per-chunk digests.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import struct
import threading
from collections.abc import Iterable
from typing import Final

from skippy.errors import UsageError

BLOCK_BYTES: Final = 64  # a chain can be cut only at whole SHA-256 blocks
STATE_BYTES: Final = 32
# FIPS 180-4 section 5.3.3: SHA-256's initial hash value, the state chunk 0 starts from.
INITIAL_STATE: Final = struct.pack(
    ">8I",
    0x6A09E667,
    0xBB67AE85,
    0x3C6EF372,
    0xA54FF53A,
    0x510E527F,
    0x9B05688C,
    0x1F83D9AB,
    0x5BE0CD19,
)


class _Sha256Ctx(ctypes.Structure):
    _fields_ = (
        ("h", ctypes.c_uint32 * 8),
        ("Nl", ctypes.c_uint32),
        ("Nh", ctypes.c_uint32),
        ("data", ctypes.c_uint32 * 16),
        ("num", ctypes.c_uint),
        ("md_len", ctypes.c_uint),
    )


_lib: ctypes.CDLL | None = None
_checked: bool | None = None
_load_lock = threading.RLock()  # available() runs a self-test that calls back into it


def _libcrypto_path() -> str | None:
    """The libcrypto Python's own ``_hashlib`` runs (the same build hashlib uses), else the
    one the loader would find."""
    try:
        import _hashlib  # noqa: F401  (loads libcrypto, so it shows in our mappings)

        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libcrypto.so" in path:
                    return path
    except (ImportError, OSError):
        pass
    return ctypes.util.find_library("crypto")


def _load() -> ctypes.CDLL | None:
    path = _libcrypto_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        ctx_p = ctypes.POINTER(_Sha256Ctx)
        lib.SHA256_Init.argtypes = [ctx_p]
        lib.SHA256_Init.restype = ctypes.c_int
        lib.SHA256_Update.argtypes = [ctx_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.SHA256_Update.restype = ctypes.c_int
        lib.SHA256_Final.argtypes = [ctypes.c_char_p, ctx_p]
        lib.SHA256_Final.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


def _library() -> ctypes.CDLL | None:
    """libcrypto, loaded and checked against hashlib once; None when either failed."""
    global _lib, _checked
    with _load_lock:
        if _checked is None:
            lib = _load()
            _checked = lib is not None and _self_test(lib)
            _lib = lib if _checked else None
        return _lib


def available() -> bool:
    """libcrypto's SHA-256 loaded and agrees with hashlib, states included (checked once)."""
    return _library() is not None


def _self_test(lib: ctypes.CDLL) -> bool:
    """Three 128-byte chunks and a short tail, against hashlib: the state after each chunk
    continued over the rest reaches the message's digest, and so does the whole chain."""
    message = bytes(range(256)) * 2 + b"tail"
    want = hashlib.sha256(message).digest()
    try:
        h = ChainHasher(lib=lib)
        states = []
        for start in (0, 128, 256):
            h.update(message[start : start + 128])
            states.append(h.state())
        h.update(message[384:])
        if h.digest() != want:
            return False
        for i, state in enumerate(states):
            rest = ChainHasher(state, 128 * (i + 1), lib=lib)
            rest.update(message[128 * (i + 1) :])
            if rest.digest() != want:
                return False
        return True
    except (OSError, ValueError, ctypes.ArgumentError):
        return False


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (in the stable ABI since 3.11)."""

    _fields_ = (
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    )


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None
_PYBUF_SIMPLE: Final = 0  # contiguous bytes, read-only allowed


class ChainHasher:
    """SHA-256 that starts from ``state`` with ``offset`` bytes already hashed (a multiple of
    64); ``state()`` after a whole number of blocks, ``digest()`` to finish."""

    def __init__(
        self, state: bytes = INITIAL_STATE, offset: int = 0, *, lib: ctypes.CDLL | None = None
    ) -> None:
        lib = lib or _library()
        if lib is None:
            raise UsageError("SHA-256 chaining needs libcrypto", code="sha256_chain_unavailable")
        if len(state) != STATE_BYTES or offset < 0 or offset % BLOCK_BYTES:
            raise UsageError(
                f"a SHA-256 chain resumes from a 32-byte state at a multiple of {BLOCK_BYTES} "
                f"bytes, not {len(state)} bytes at {offset}",
                code="sha256_chain_misaligned",
            )
        self._lib = lib
        self._ctx = _Sha256Ctx()
        lib.SHA256_Init(ctypes.byref(self._ctx))
        self._ctx.h[:] = struct.unpack(">8I", state)
        bits = offset * 8
        self._ctx.Nl, self._ctx.Nh = bits & 0xFFFFFFFF, bits >> 32
        self.offset = offset

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = _PyBuffer()  # the buffer's address, read-only ones too (ctypes maps only
        _get_buffer(data, ctypes.byref(view), _PYBUF_SIMPLE)  # writable ones itself)
        try:
            if view.len:
                self._lib.SHA256_Update(ctypes.byref(self._ctx), view.buf, view.len)
            self.offset += view.len
        finally:
            _release_buffer(ctypes.byref(view))

    def state(self) -> bytes:
        """The chaining value so far; only at a block boundary (nothing buffered)."""
        if self.offset % BLOCK_BYTES or self._ctx.num:
            raise UsageError(
                f"no chaining value at byte {self.offset}: not a multiple of {BLOCK_BYTES}",
                code="sha256_chain_misaligned",
            )
        return struct.pack(">8I", *self._ctx.h)

    def digest(self) -> bytes:
        """The SHA-256 of everything hashed from the initial state (the hasher is spent)."""
        out = ctypes.create_string_buffer(STATE_BYTES)
        self._lib.SHA256_Final(out, ctypes.byref(self._ctx))
        return out.raw


def chain_states(chunks: Iterable[bytes | bytearray | memoryview]) -> tuple[bytes, ...]:
    """The chain of a message given as its chunks in order: the state after every chunk but
    the last (each a multiple of 64 bytes), then the message's SHA-256. A chunk is hashed
    when the next one is taken (to know which is last): it must not change until then."""
    h = ChainHasher()
    out: list[bytes] = []
    pending: bytes | bytearray | memoryview | None = None
    for chunk in chunks:
        if pending is not None:
            h.update(pending)
            out.append(h.state())
        pending = chunk
    if pending is None:
        raise UsageError("a chain needs at least one chunk", code="sha256_chain_misaligned")
    h.update(pending)
    out.append(h.digest())
    return tuple(out)


def start_of(chain: tuple[bytes, ...], index: int) -> bytes:
    """The state chunk ``index`` starts from: the initial value, or the link before it."""
    return INITIAL_STATE if index == 0 else chain[index - 1]


def check_chunk(
    chain: tuple[bytes, ...],
    index: int,
    offset: int,
    parts: Iterable[bytes | bytearray | memoryview],
    whole_sha256: bytes,
) -> bool:
    """Chunk ``index`` (starting at byte ``offset``) is right: from its start state it reaches
    the next link, or, the last chunk, the file's SHA-256 ``whole_sha256`` (the manifest's)."""
    h = ChainHasher(start_of(chain, index), offset)
    for part in parts:
        h.update(part)
    if index == len(chain) - 1:
        return h.digest() == whole_sha256
    return h.offset % BLOCK_BYTES == 0 and h.state() == chain[index]
