"""Serving verified chunks of a partial (feature bit ``partial-serve``): the pure
decisions and the one wire piece, the have-report (no I/O, no keys).

The pure core of ``mesh_node.transfer.partials``, its shell.

Two counterparts (the same stage of two sibling replicas) need the same files. Brought up at
once, each fetches its stage's files *and* chunks in its own order (``fetch_order``: opposite
for two, rotated for more), handed to it by the coordinator in the signed source list (its
``rank`` of ``ranks``). Each tells the coordinator which chunks it has verified so far (a
*have-report*: per file of its stage, a bitmap of chunk indices, sent after the request on
the kind 0x04 stream it asks its list on, so nothing new is opened and nothing is gossiped:
the coordinator learns holdings only from the holders' own reports, spec "Peer Cache
Transfer"). The coordinator lists each as a holder of the chunks it reported, with the
bitmap, in the others' lists; a fetch asks a partial holder only for chunks it has, and the
coordinator only for chunks nobody else listed has, so the coordinator's uplink carries each
distinct byte about once.

A partial holder serves a range only when ``covered``: the range is a run of whole chunks,
each of which it checked against the coordinator-signed digest before writing it
(``skippy.transfer.chunk_sink``); nothing unverified ever moves, and the requester checks
every chunk again, and the whole file before its install.

Have-report frame (``skippy.transfer.wire`` framing): a msgpack map
``{gen: 1, have: {path: <bin: bitmap>}, busy: {path: <bin: bitmap>}}`` (``busy``: chunks
being fetched now, which a counterpart then waits for instead of asking the coordinator for
the same bytes; the coordinator lists them only from a fresh report); bit ``i`` (byte
``i // 8``, bit ``i % 8``) is chunk ``i``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import msgpack

from skippy.transfer.chunks import ChunkSpan, chunk_count
from skippy.transfer.errors import ArtifactWireError
from skippy.transfer.wire import frame, no_duplicate_keys

HAVE_GEN: Final = 1
MAX_HAVE_BYTES: Final = 64 * 1024  # a stage's bitmaps: far below this for any real package
MAX_HAVE_FILES: Final = 4096


def fetch_order(count: int, rank: int, ranks: int) -> list[int]:
    """The order in which counterpart ``rank`` of ``ranks`` fetches ``count`` items (a
    stage's files, or a file's chunks): rank 0 from the front; for two, rank 1 from the
    back (they meet in the middle, and whichever finishes its half first takes the items
    the other reaches last); for more, each starts at its share of the items, rotated."""
    items = list(range(count))
    if ranks <= 1 or count <= 1 or not 0 <= rank < ranks:
        return items
    if ranks == 2:
        return items[::-1] if rank == 1 else items
    start = rank * count // ranks
    return items[start:] + items[:start]


def stage_file_order(
    paths: Iterable[str],
    *,
    big: Iterable[str],
    shared: Mapping[str, bool],
    rank: int,
    ranks: int,
) -> tuple[list[str], set[str]]:
    """The order in which counterpart ``rank`` of ``ranks`` fetches its stage's files, and
    which of them it starts only once the others' first reports are in (``deferred``).

    ``big``: files of several chunks, first and never deferred (their chunks are fetched
    in opposite orders). The one-chunk files are split into shares (by path): this node's
    share first, in its own order, then the others' (deferred: by then the coordinator
    lists what the others fetch, and this node waits for it instead of asking the
    coordinator for the same bytes). ``shared``: files other stages need too (the
    metadata), path -> whether this node is the one that fetches it first (they go
    with its share; for every other node they come last, deferred)."""
    items = list(paths)
    heavy = [p for p in items if p in set(big)]
    owned = [p for p in items if p in shared and shared[p] and p not in heavy]
    later = [p for p in items if p in shared and not shared[p] and p not in heavy]
    small = sorted(p for p in items if p not in shared and p not in heavy)
    n = len(small)
    order = [small[k] for k in fetch_order(n, rank, ranks)]
    mine = [p for p in order if (small.index(p) * ranks // n if n else 0) == rank]
    theirs = [p for p in order if p not in mine]
    if ranks <= 1:
        return [*heavy, *owned, *order, *later], set()
    return [*heavy, *owned, *mine, *theirs, *later], set(theirs) | set(later)


def pack_bitmap(indices: Iterable[int], count: int) -> bytes:
    out = bytearray((count + 7) // 8)
    for i in indices:
        if 0 <= i < count:
            out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def unpack_bitmap(blob: bytes, count: int) -> frozenset[int]:
    """A bitmap of ``count`` chunks; anything else (a wrong length, a bit past the end) is an
    ``ArtifactWireError``."""
    if len(blob) != (count + 7) // 8:
        raise _bad(f"a bitmap of {len(blob)} bytes is not {count} chunks")
    got = frozenset(i for i in range(len(blob) * 8) if blob[i // 8] >> (i % 8) & 1)
    if any(i >= count for i in got):
        raise _bad(f"a bitmap names a chunk past {count}")
    return got


def covered(verified: Iterable[int], spans: Sequence[ChunkSpan], start: int, stop: int) -> bool:
    """``[start, stop)`` is exactly a run of whole chunks, every one of them in ``verified``:
    the only ranges a partial holder serves."""
    if not spans or not 0 <= start < stop:
        return False
    size = spans[0].stop  # every chunk but the last is this long
    if start % size:
        return False
    first = start // size
    have = set(verified)
    index = first
    while index < len(spans) and spans[index].stop <= stop:
        if index not in have:
            return False
        if spans[index].stop == stop:
            return True
        index += 1
    return False


# --- the have-report ----------------------------------------------------------------------
def _bad(message: str) -> ArtifactWireError:
    return ArtifactWireError(message, code="have_report_malformed")


def encode_have(have: Mapping[str, bytes], busy: Mapping[str, bytes] | None = None) -> bytes:
    """The report frame: path -> bitmap (``pack_bitmap``) of the chunks verified, and of
    those being fetched now (``busy``: a counterpart waits for them rather than asking the
    coordinator for the same bytes)."""
    body = {"gen": HAVE_GEN, "have": dict(have), "busy": dict(busy or {})}
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return frame(packed, MAX_HAVE_BYTES)


def decode_have(payload: bytes) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """A report frame's payload -> (have, busy): path -> bitmap (shape only; ``check_have``
    binds each). A key given twice is refused, as by every other wire map (``wire``)."""
    if len(payload) > MAX_HAVE_BYTES:
        raise _bad(f"a have-report of {len(payload)} bytes is over {MAX_HAVE_BYTES}")
    try:
        data = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            object_pairs_hook=no_duplicate_keys,
            max_str_len=MAX_HAVE_BYTES,
            max_bin_len=MAX_HAVE_BYTES,
            max_array_len=0,
            max_map_len=MAX_HAVE_FILES,
            max_ext_len=0,
        )
    except ArtifactWireError as exc:  # the wire's own map checks (a key given twice)
        raise _bad(f"a have-report: {exc.message}") from None
    except (ValueError, TypeError, OverflowError) as exc:
        raise _bad(f"a have-report is not valid msgpack: {exc}") from None
    if (
        not isinstance(data, dict)
        or set(data) != {"gen", "have", "busy"}
        or data["gen"] != HAVE_GEN
    ):
        raise _bad("a have-report must be a map of gen (1), have and busy")
    for key in ("have", "busy"):
        part = data[key]
        if not isinstance(part, dict) or not all(
            isinstance(k, str) and isinstance(v, bytes) for k, v in part.items()
        ):
            raise _bad(f"a have-report's {key} must map paths to bitmaps")
    return data["have"], data["busy"]


def check_have(
    have: Mapping[str, bytes], required: Mapping[str, tuple[str, int]], chunk_bytes: int
) -> dict[str, frozenset[int]]:
    """The reporter's verified chunks, kept only for files of its own stage (``required``:
    path -> (SHA-256, size), ``skippy.transfer.sources.required_set``), in the coordinator's
    chunk size; a file it has no chunk of is left out. Raises ``ArtifactWireError`` for a
    file outside the stage or a bitmap of the wrong size (the whole report is ignored)."""
    out: dict[str, frozenset[int]] = {}
    for path, blob in have.items():
        declared = required.get(path)
        if declared is None:
            raise _bad("a have-report names a file outside the reporter's stage")
        chunks = unpack_bitmap(blob, chunk_count(declared[1], chunk_bytes))
        if chunks:
            out[path] = chunks
    return out
