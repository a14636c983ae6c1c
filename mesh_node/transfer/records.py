"""What a node remembers about artifact transfers: the stage it is fetching, the transfers in
progress and the recent ones, and cumulative counters (shown by the status
document's ``transfers`` key and the operator page, counted by the node metrics).

Plain state, mutated only from the node's trio thread. Everything here is safe to show to an
operator: artifact paths are repository-relative, errors are stable codes, never messages
(an exception's text may name a local cache path). Memory is bounded: ``RECENT`` finished
records, one in-progress record per running transfer (the transfer code bounds those).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

Source = Literal["peer", "hub", "cache"]
Direction = Literal["fetch", "serve"]
StageState = Literal["fetching", "ready", "failed"]
SOURCES: Final[tuple[Source, ...]] = ("peer", "hub", "cache")
RECENT: Final = 64


@dataclass
class TransferRecord:
    """One artifact moving into (``fetch``) or out of (``serve``) this node."""

    id: int
    direction: Direction
    path: str  # repository-relative (the manifest's path)
    total: int | None  # bytes; None until known (a manifest's size comes with its response)
    started: float  # wall clock, unix seconds
    peer_id: str | None = None  # the peer it comes from (fetch) or goes to (serve)
    source: Source | None = None  # fetch: where the bytes came from
    bytes_done: int = 0  # bytes of the artifact in place so far (a resumed prefix included)
    resumed_from: int = 0  # the offset this transfer started at
    finished: float | None = None
    verified: bool = False  # fetch: size and SHA-256 proven; serve: the file served was verified
    error: str | None = None  # a stable code
    fallback: str | None = None  # fetch from the hub: why not from the peer (a code or answer)
    revision: str | None = None  # fetch from the cache: the other revision it was linked from
    # Fetch from peers: the bytes each node served (several in a swarm fetch), and
    # the sources dropped (node id -> the code of what they did wrong).
    served_by: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    # End-game copies: chunks asked from a second source while the first was still sending
    # (only the first verified copy counts in ``served_by``; the other's bytes are waste).
    endgame_chunks: int = 0
    _clock_start: float = field(default_factory=time.monotonic, repr=False)
    _clock_end: float | None = field(default=None, repr=False)

    def restart(self, source: Source, *, peer_id: str | None = None, offset: int = 0) -> None:
        """A new attempt (another source, or a resume): the rate counts from here."""
        self.source, self.peer_id = source, peer_id
        self.resumed_from = self.bytes_done = offset
        self.error = None
        self._clock_start = time.monotonic()

    def duration_s(self) -> float:
        """Seconds of the latest attempt (to now while it runs)."""
        end = self._clock_end if self._clock_end is not None else time.monotonic()
        return max(0.0, end - self._clock_start)

    def mb_per_s(self) -> float | None:
        moved = self.bytes_done - self.resumed_from
        end = self._clock_end if self._clock_end is not None else time.monotonic()
        elapsed = end - self._clock_start
        if moved <= 0 or elapsed <= 0:
            return None
        return moved / elapsed / 1e6

    def to_dict(self) -> dict[str, Any]:
        rate = self.mb_per_s()
        return {
            "direction": self.direction,
            "path": self.path,
            "bytes_done": self.bytes_done,
            "total": self.total,
            "source": self.source,
            "peer_id": self.peer_id,
            "resumed_from": self.resumed_from,
            "started": round(self.started, 3),
            "finished": None if self.finished is None else round(self.finished, 3),
            "verified": self.verified,
            "mb_per_s": None if rate is None else round(rate, 2),
            "error": self.error,
            "fallback": self.fallback,
            "revision": self.revision,
            "served_by": [
                {"node_id": k, "bytes": v} for k, v in sorted(self.served_by.items())
            ],
            "dropped_sources": [
                {"node_id": k, "code": v} for k, v in sorted(self.dropped.items())
            ],
            "endgame_chunks": self.endgame_chunks,
        }


@dataclass
class TransferCounters:
    """Cumulative counters since the node started: the object a metrics collector reads
    (``mesh_node_artifact_bytes_served_total``, ``..._fetched_total{source}``,
    ``..._verification_failures_total``, ``..._transfer_refusals_total{reason}``)."""

    served_bytes: int = 0  # artifact bytes this node sent to peers
    served_requests: int = 0  # requests it accepted
    fetched_bytes: Counter[str] = field(default_factory=Counter)  # by source: peer, hub, cache
    verification_failures: int = 0  # received bytes (peer or hub) that failed size or SHA-256
    refusals: Counter[str] = field(default_factory=Counter)  # this node's refusals, by reason
    refusals_received: Counter[str] = field(default_factory=Counter)  # peers' refusals, by answer
    serving_now: int = 0  # requests being served at this moment (a gauge)
    serving_peak: int = 0  # the most served at once since start
    chunk_failures: int = 0  # chunks that failed their signed digest
    dropped_sources: int = 0  # sources a swarm fetch stopped asking

    def snapshot(self) -> dict[str, Any]:
        return {
            "served_bytes": self.served_bytes,
            "served_requests": self.served_requests,
            "fetched_bytes": {s: self.fetched_bytes.get(s, 0) for s in SOURCES},
            "verification_failures": self.verification_failures,
            "refusals": dict(sorted(self.refusals.items())),
            "refusals_received": dict(sorted(self.refusals_received.items())),
            "serving_now": self.serving_now,
            "serving_peak": self.serving_peak,
            "chunk_failures": self.chunk_failures,
            "dropped_sources": self.dropped_sources,
        }


@dataclass
class StageFetch:
    """The stage this node is bringing in for its active topology."""

    topology_id: str
    stage_id: str
    stage_index: int
    layer_start: int
    layer_end: int
    coordinator_id: str
    started: float
    state: StageState = "fetching"
    required: tuple[str, ...] = ()  # the stage's required artifacts (repo-relative paths)
    bytes_required: int = 0
    error: str | None = None
    finished: float | None = None
    report: str | None = None  # the coordinator's answer to the ready report: accepted | code

    def to_dict(self) -> dict[str, Any]:
        return {
            "topology_id": self.topology_id,
            "stage_id": self.stage_id,
            "stage_index": self.stage_index,
            "layer_start": self.layer_start,
            "layer_end": self.layer_end,
            "coordinator_id": self.coordinator_id,
            "state": self.state,
            "required": list(self.required),
            "bytes_required": self.bytes_required,
            "error": self.error,
            "started": round(self.started, 3),
            "finished": None if self.finished is None else round(self.finished, 3),
            "report": self.report,
        }


class TransferLog:
    """The node's transfer state; ``status()`` is the status document's ``transfers``."""

    def __init__(
        self,
        *,
        wall_clock: Callable[[], float] = time.time,
        on_finish: Callable[[TransferRecord], None] | None = None,
    ) -> None:
        self.wall_clock = wall_clock
        # Told of every finished transfer (the node's metrics observe its duration there).
        self.on_finish = on_finish
        self.counters = TransferCounters()
        self.stage: StageFetch | None = None
        self.active: dict[int, TransferRecord] = {}
        self.recent: deque[TransferRecord] = deque(maxlen=RECENT)
        self._next_id = 0

    def start(
        self,
        direction: Direction,
        path: str,
        *,
        total: int | None,
        peer_id: str | None = None,
        source: Source | None = None,
        offset: int = 0,
    ) -> TransferRecord:
        self._next_id += 1
        rec = TransferRecord(
            self._next_id,
            direction,
            path,
            total,
            self.wall_clock(),
            peer_id=peer_id,
            source=source,
            bytes_done=offset,
            resumed_from=offset,
        )
        self.active[rec.id] = rec
        return rec

    def finish(self, rec: TransferRecord, *, verified: bool, error: str | None = None) -> None:
        rec.verified, rec.error = verified, error
        rec.finished = self.wall_clock()
        rec._clock_end = time.monotonic()
        if self.active.pop(rec.id, None) is not None:
            self.recent.append(rec)
            if self.on_finish is not None:
                self.on_finish(rec)

    def found_in_cache(self, path: str, size: int, revision: str | None = None) -> None:
        """An artifact already present and verified: a finished ``cache`` record;
        ``revision`` (short) when it was linked from another revision (a delta)."""
        rec = self.start("fetch", path, total=size, source="cache", offset=size)
        rec.revision = revision
        self.counters.fetched_bytes["cache"] += size
        self.finish(rec, verified=True)

    def status(self) -> dict[str, Any]:
        return {
            "stage": None if self.stage is None else self.stage.to_dict(),
            "active": [r.to_dict() for r in self.active.values()],
            "recent": [r.to_dict() for r in reversed(self.recent)],
            "counters": self.counters.snapshot(),
        }
