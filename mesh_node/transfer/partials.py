"""This node's partials that others may be served from (``partial-serve``).

The shell of ``skippy.transfer.partials``, its pure core.

``PartialRegistry`` holds the chunk sinks of this node's running swarm fetches, by artifact
SHA-256. The serving handler asks it (``open_range``, on a worker thread, after the request
was authorized exactly as for an installed file: ``skippy.transfer.serve``) for a range of
chunks; it answers only with chunks the sink checked against their signed digests
(``ChunkSink.open_verified``). The fetcher takes a sink out (``remove``) before it finishes
or aborts it, under the same lock, so a descriptor is never taken from a closed partial.
``have`` is what this node reports to its coordinator: its verified chunks per file
(``skippy.transfer.partials``). Pure bookkeeping plus one ``os.dup`` per served range.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Final

from protocol import constants as pc
from skippy.package.manifest import ArtifactRef
from skippy.transfer.chunk_sink import ChunkSink
from skippy.transfer.chunks import chunk_count
from skippy.transfer.partials import pack_bitmap
from skippy.transfer.serve import FileBody

if TYPE_CHECKING:
    from mesh_node.node import MeshNode

PARTIAL_BITS: Final = frozenset(
    {pc.BIT_ARTIFACT_TRANSFER, pc.BIT_SWARM_TRANSFER, pc.BIT_SIBLING_SERVE, pc.BIT_PARTIAL_SERVE}
)
# How often a fetch that exchanges partials asks for its list (and so reports its chunks):
# a chunk another holder verified is seen within about two of these.
PARTIAL_REFRESH_S: Final = 0.25


def speaks_partials(node: MeshNode, node_id: str) -> bool:
    """This node and the linked ``node_id`` both serve verified chunks of partials (both
    advertise the bit: a node that does not serve sends no have-report, and a coordinator
    reads one only from a node that advertises it)."""
    if pc.BIT_PARTIAL_SERVE not in node.features.get(pc.FEATURE_SKIPPY_STAGE, ()):
        return False
    return node.speaks(node_id, PARTIAL_BITS)


class PartialRegistry:
    """Chunk sinks being received, by artifact SHA-256 (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sinks: dict[str, ChunkSink] = {}
        self._busy: dict[str, Callable[[], frozenset[int]]] = {}

    def add(self, sink: ChunkSink, busy: Callable[[], frozenset[int]] | None = None) -> None:
        """``busy``: the chunks its fetch has asked for and not verified yet."""
        with self._lock:
            sha = sink.item.sha256.lower()
            self._sinks[sha] = sink
            if busy is not None:
                self._busy[sha] = busy

    def remove(self, sink: ChunkSink) -> None:
        """Before the sink is finished or aborted: no range is opened from it afterwards."""
        with self._lock:
            sha = sink.item.sha256.lower()
            if self._sinks.get(sha) is sink:
                del self._sinks[sha]
                self._busy.pop(sha, None)

    def open_range(self, sha256: str, start: int, stop: int) -> FileBody | None:
        """The verified chunks ``[start, stop)`` of the partial of ``sha256``, or None."""
        with self._lock:
            sink = self._sinks.get(sha256)
            fd = sink.open_verified(start, stop) if sink is not None else None
        return FileBody(fd, start, stop) if fd is not None else None

    def have(
        self, refs: Iterable[ArtifactRef], whole: set[str], chunk_bytes: int
    ) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """The have-report for a stage's files: every chunk of those in ``whole`` (installed
        and verified), the verified chunks of those being received, nothing else; and the
        chunks being fetched now (trio thread: the fetches' schedulers are read here)."""
        out: dict[str, bytes] = {}
        busy: dict[str, bytes] = {}
        with self._lock:
            sinks = dict(self._sinks)
            fetching = dict(self._busy)
        for ref in refs:
            count = chunk_count(ref.artifact.artifact_bytes, chunk_bytes)
            if ref.path in whole:
                out[ref.path] = pack_bitmap(range(count), count)
                continue
            sink = sinks.get(ref.artifact.sha256.lower())
            if sink is not None and len(sink.spans) == count:
                verified = sink.verified_now()
                if verified:
                    out[ref.path] = pack_bitmap(verified, count)
                asked = fetching.get(ref.artifact.sha256.lower())
                now = asked() - verified if asked is not None else frozenset()
                if now:
                    busy[ref.path] = pack_bitmap(now, count)
        return out, busy
