"""The node's metrics, exposed by ``/metrics`` through prometheus_client: every
family's name and meaning in one module; the node core and each service pick theirs.

Two sources, so that other components need no metrics code where state already tells:

- **State, read at scrape time**: ``node_families(doc)`` turns the core of the status document
  (``mesh_node.peers.status_document``) into metric families (peers by trust status, link
  bytes in/out, uptime); a service's ``SectionCollector`` does the same for its own status
  section: ``topology_families`` (stages ready), ``transfer_families`` (the counters:
  artifact bytes served and fetched by source, verification failures, refusals by reason,
  transfers in progress, the stage's readiness), ``cache_families``, ``replica_families``.
  Pure; nothing to increment.
- **Events that leave no state behind**, observed where they happen: ``TransferDurations``
  (the artifact transfer service's: the transfer log calls ``transfer_finished``) and
  ``ServingMetrics`` (serving's: the requests, tokens and latencies, ``request()``).
  ``serving_status()`` renders the serving counts for the status document, so the page and
  ``/metrics`` read one count.

Names follow Prometheus conventions: ``mesh_node_`` prefix, base units in the name
(``_bytes``, ``_seconds``), ``_total`` on counters. Every labelled family is emitted with all
its known label values (zeros included) so dashboards and alerts see it from the first scrape.
"""

from __future__ import annotations

import bisect
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import trio
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from mesh_node.transfer.records import SOURCES, Direction, TransferRecord
from skippy.transfer.authorize import REFUSAL_REASONS

PREFIX = "mesh_node"
DIRECTIONS: tuple[str, ...] = get_args(Direction)
RequestOutcome = Literal["ok", "error", "cancelled", "rejected"]
REQUEST_OUTCOMES: tuple[RequestOutcome, ...] = ("ok", "error", "cancelled", "rejected")
SPECULATIVE_COUNTERS: tuple[str, ...] = ("proposed", "accepted", "verify_passes")
OTHER_REASON = "other"  # a refusal reason outside authorize.REFUSAL_REASONS (keeps labels bounded)
OWNER_STATUSES = ("verified", "unverified", "invalid")
# Time to first token and whole-request latency: from a few ms (a warm short prompt) to a
# minute (a long prompt through a slow split).
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# One artifact transfer: a small fragment over loopback (ms) to a GiB over a slow uplink.
TRANSFER_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
RATE_WINDOW_S = 10.0  # tokens/s on the status page: completion tokens over this window
RECENT_TTFT = 64  # time-to-first-token values kept for the page's median


class _Histogram:
    """Bucket counts for one latency (rendered through prometheus_client's family type)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def _buckets(self) -> list[tuple[str, float]]:
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        return buckets

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        return HistogramMetricFamily(
            name, documentation, buckets=self._buckets(), sum_value=self.sum
        )

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        family.add_metric(labels, self._buckets(), self.sum)


@dataclass
class RequestRecord:
    """One request being served (``ServingMetrics.request``): the serving code reports the
    prompt size, each generated token and the outcome; timing is taken here."""

    started_s: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_s: float | None = None
    outcome: RequestOutcome = "ok"
    _clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _on_token: Callable[[int], None] = field(default=lambda n: None, repr=False)

    def tokens(self, n: int = 1) -> None:
        """``n`` completion tokens were produced (the first call marks time to first token)."""
        if self.first_token_s is None:
            self.first_token_s = self._clock() - self.started_s
        self.completion_tokens += n
        self._on_token(n)


class TransferDurations(Collector):
    """How long each verified artifact transfer took, by direction. Thread-safe (a
    transfer's file work runs in threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.transfer_seconds = {d: _Histogram(TRANSFER_BUCKETS_S) for d in DIRECTIONS}

    def transfer_finished(self, record: TransferRecord) -> None:
        """A transfer ended (``TransferLog.on_finish``): its duration, when bytes moved and
        were verified (a file found installed is not a transfer)."""
        if record.source == "cache" or not record.verified:
            return
        with self._lock:
            self.transfer_seconds[record.direction].observe(record.duration_s())

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            family = HistogramMetricFamily(
                f"{PREFIX}_artifact_transfer_duration_seconds",
                "Time one verified artifact transfer took (fetch: from a peer or the hub, "
                "verified and installed; serve: sent to a peer), by direction",
                labels=["direction"],
            )
            for direction, hist in self.transfer_seconds.items():
                hist.add_to(family, [direction])
        return [family]


class ServingMetrics(Collector):
    """Requests a serving coordinator ran: outcomes, tokens, latencies, speculation."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.requests: dict[str, int] = dict.fromkeys(REQUEST_OUTCOMES, 0)
        self.requests_in_flight = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft_seconds = _Histogram(LATENCY_BUCKETS_S)
        self.request_seconds = _Histogram(LATENCY_BUCKETS_S)
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self._recent_ttft: deque[float] = deque(maxlen=RECENT_TTFT)
        # speculative decoding: drafted tokens proposed / accepted, verify windows
        self.speculative: dict[str, int] = dict.fromkeys(SPECULATIVE_COUNTERS, 0)

    @contextmanager
    def request(self, prompt_tokens: int = 0) -> Iterator[RequestRecord]:
        """Count one request from start to end: in flight while inside; on exit its outcome
        (``record.outcome``; unless set otherwise, ``cancelled`` on cancellation and ``error``
        on an exception), tokens, time to first token and duration are recorded."""
        record = RequestRecord(
            self._clock(), prompt_tokens, _clock=self._clock, _on_token=self._token_produced
        )
        with self._lock:
            self.requests_in_flight += 1
        try:
            yield record
        except BaseException as exc:
            if record.outcome == "ok":  # a "rejected" set before the raise stays rejected
                record.outcome = "cancelled" if _is_cancellation(exc) else "error"
            raise
        finally:
            duration = self._clock() - record.started_s
            with self._lock:
                self.requests_in_flight -= 1
                self.requests[record.outcome] += 1
                self.prompt_tokens += record.prompt_tokens
                self.request_seconds.observe(duration)
                if record.first_token_s is not None:
                    self.ttft_seconds.observe(record.first_token_s)
                    self._recent_ttft.append(record.first_token_s)

    def speculation(self, proposed: int, accepted: int, verify_passes: int) -> None:
        """One request's speculative decoding: drafted tokens proposed and accepted, windows."""
        with self._lock:
            self.speculative["proposed"] += proposed
            self.speculative["accepted"] += accepted
            self.speculative["verify_passes"] += verify_passes

    def _token_produced(self, n: int) -> None:
        now = self._clock()
        with self._lock:
            self.completion_tokens += n
            self._recent_tokens.append((now, n))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent_tokens and self._recent_tokens[0][0] < now - RATE_WINDOW_S:
            self._recent_tokens.popleft()

    def serving_status(self) -> dict[str, Any]:
        """What the status page shows for a serving coordinator (the document's ``serving``)."""
        now = self._clock()
        with self._lock:
            self._trim(now)
            recent = sum(n for _, n in self._recent_tokens)
            return {
                "requests_in_flight": self.requests_in_flight,
                "requests": dict(self.requests),
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "tokens_per_s": round(recent / RATE_WINDOW_S, 3),
                "ttft_ms_median": (
                    round(statistics.median(self._recent_ttft) * 1000, 3)
                    if self._recent_ttft
                    else None
                ),
                "speculative": dict(self.speculative),
            }

    # --- prometheus_client Collector -------------------------------------------------------------
    def collect(self) -> Iterable[Metric]:
        with self._lock:
            requests = _by_label(
                CounterMetricFamily,
                f"{PREFIX}_requests",
                "Completion requests served, by outcome",
                "outcome",
                self.requests,
            )
            in_flight = GaugeMetricFamily(
                f"{PREFIX}_requests_in_flight",
                "Completion requests being served now",
                value=self.requests_in_flight,
            )
            tokens = _by_label(
                CounterMetricFamily,
                f"{PREFIX}_tokens",
                "Tokens processed by served requests, by kind",
                "kind",
                {"prompt": self.prompt_tokens, "completion": self.completion_tokens},
            )
            ttft = self.ttft_seconds.family(
                f"{PREFIX}_time_to_first_token_seconds",
                "Time from a request's arrival to its first generated token",
            )
            duration = self.request_seconds.family(
                f"{PREFIX}_request_duration_seconds",
                "Time from a request's arrival to its end",
            )
            spec = self.speculative
            drafted = _by_label(
                CounterMetricFamily,
                f"{PREFIX}_speculative_tokens",
                "Speculative decoding: drafted tokens verified, by outcome (proposed, accepted)",
                "kind",
                {"proposed": spec["proposed"], "accepted": spec["accepted"]},
            )
            windows = CounterMetricFamily(
                f"{PREFIX}_speculative_verify_windows",
                "Speculative decoding: verify windows sent through the split",
                value=spec["verify_passes"],
            )
        return [
            drafted,
            windows,
            requests,
            in_flight,
            tokens,
            ttft,
            duration,
        ]


def _is_cancellation(exc: BaseException) -> bool:
    """A cancellation, also as it leaves a nursery (an exception group of cancellations):
    a client that went away is ``cancelled``, not an ``error`` of ours."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_cancellation(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled | GeneratorExit | KeyboardInterrupt)


def _by_label(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    documentation: str,
    label: str,
    values: Mapping[str, float],
) -> Metric:
    family = kind(name, documentation, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


# --- state, read at scrape time ------------------------------------------------------------------
def node_families(doc: Mapping[str, Any]) -> list[Metric]:
    """Metric families from the core of a status document (pure)."""
    info = InfoMetricFamily(
        PREFIX,
        "This node's identity and owner status",
        value={
            "node_id": doc["node_id"],
            "owner_id": doc.get("owner_id") or "",
            "owner_status": doc["owner_status"],
            "artifact_transfer": doc["artifact_transfer"],
        },
    )
    uptime = GaugeMetricFamily(
        f"{PREFIX}_uptime_seconds", "Seconds since this node started", value=doc["uptime_s"]
    )
    budget = GaugeMetricFamily(
        f"{PREFIX}_memory_budget_bytes",
        "Bytes this node offers for a stage",
        value=doc["memory_budget"],
    )
    peers = GaugeMetricFamily(
        f"{PREFIX}_peers",
        "Authenticated peers known to this node, by trust, owner status and connection",
        labels=["trust", "owner_status", "connected"],
    )
    counts: dict[tuple[str, str, str], int] = {}
    for trusted in ("trusted", "untrusted"):
        for status in OWNER_STATUSES:
            if trusted == "trusted" and status != "verified":
                continue  # only a verified owner can be trusted
            for connected in ("true", "false"):
                counts[(trusted, status, connected)] = 0
    received = CounterMetricFamily(
        f"{PREFIX}_link_received_bytes",
        "Bytes received on links to a peer (encrypted records, after the handshake)",
        labels=["peer"],
    )
    sent = CounterMetricFamily(
        f"{PREFIX}_link_sent_bytes",
        "Bytes sent on links to a peer (encrypted records, after the handshake)",
        labels=["peer"],
    )
    rtt = GaugeMetricFamily(
        f"{PREFIX}_peer_rtt_seconds", "Latest heartbeat round trip to a peer", labels=["peer"]
    )
    link = GaugeMetricFamily(
        f"{PREFIX}_peer_link",
        "A connected peer's link: direct, or relayed (and through which relay)",
        labels=["peer", "link", "relay"],
    )
    for p in doc["peers"]:
        if p["connected"]:
            relay = p.get("relay") or ""
            link.add_metric([p["node_id"], "relayed" if relay else "direct", relay], 1)
        key = (
            "trusted" if p["trusted"] else "untrusted",
            p["owner_status"],
            "true" if p["connected"] else "false",
        )
        counts[key] = counts.get(key, 0) + 1
        received.add_metric([p["node_id"]], p["bytes_received"])
        sent.add_metric([p["node_id"]], p["bytes_sent"])
        if p["connected"] and p["rtt_ms"] is not None:
            rtt.add_metric([p["node_id"]], p["rtt_ms"] / 1000)
    for key, count in sorted(counts.items()):
        peers.add_metric(list(key), count)
    return [info, uptime, budget, peers, received, sent, rtt, link, *device_families(doc)]


def device_families(doc: Mapping[str, Any]) -> list[Metric]:
    """This node's devices as it advertises them (the status document's ``devices``): free
    and total memory per device (the CPU's: the machine's RAM)."""
    labels = ["device", "type"]
    free = GaugeMetricFamily(
        f"{PREFIX}_device_free_bytes", "Free memory of a device, as ggml reports it", labels=labels
    )
    total = GaugeMetricFamily(
        f"{PREFIX}_device_total_bytes",
        "Total memory of a device, as ggml reports it",
        labels=labels,
    )
    devices = doc.get("devices") or {}
    for d in devices.get("list", []):
        free.add_metric([d["name"], d["type"]], d["free_bytes"])
        total.add_metric([d["name"], d["type"]], d["total_bytes"])
    return [free, total]


def stage_families(stage: Mapping[str, Any] | None) -> list[Metric]:
    """This node's loaded stage (the ``stage`` status section): where it runs and what it
    holds in its device's memory (0 on the CPU, or with no stage)."""
    memory = GaugeMetricFamily(
        f"{PREFIX}_stage_device_memory_bytes",
        "Bytes the loaded stage holds in its device's memory (weights and KV caches)",
        value=0 if stage is None else stage.get("device_memory_bytes", 0),
    )
    placement = GaugeMetricFamily(
        f"{PREFIX}_stage_placement",
        "1 for the loaded stage's device and placement (device, experts on CPU, cpu, mixed)",
        labels=["device", "placement"],
    )
    if stage is not None:
        placement.add_metric([stage.get("device", "CPU"), stage.get("placement", "cpu")], 1)
    return [memory, placement]


def topology_families(topo: Mapping[str, Any] | None) -> list[Metric]:
    """The active topology (``TopologyService.status()``; ``None``: none)."""
    stage_status = topo["stage_status"] if topo else []
    stages = GaugeMetricFamily(
        f"{PREFIX}_topology_stages", "Stages of the active topology", value=len(stage_status)
    )
    ready = GaugeMetricFamily(
        f"{PREFIX}_topology_stages_ready",
        "Stages of the active topology known to be ready",
        value=sum(1 for s in stage_status if s["ready"] is True),
    )
    topo_info = InfoMetricFamily(
        f"{PREFIX}_topology",
        "The active topology: its id, this node's role and the topology's state",
    )
    if topo:
        topo_info.add_metric(
            [],
            {"topology_id": topo["topology_id"], "role": topo["role"], "state": topo["state"]},
        )
    return [stages, ready, topo_info]


def replica_families(serving: Mapping[str, Any]) -> list[Metric]:
    """Each replica of a serving coordinator, labelled ``replica``."""
    replicas = serving.get("replicas") or []
    if not replicas:
        return []
    ready = GaugeMetricFamily(
        f"{PREFIX}_replica_ready", "Whether a replica's route is ready (1) or not (0)",
        labels=["replica"],
    )
    in_flight = GaugeMetricFamily(
        f"{PREFIX}_replica_requests_in_flight", "Requests running on a replica",
        labels=["replica"],
    )
    outstanding = GaugeMetricFamily(
        f"{PREFIX}_replica_outstanding_tokens",
        "Tokens a replica's requests in flight still have to process (the balancing load)",
        labels=["replica"],
    )
    total = CounterMetricFamily(
        f"{PREFIX}_replica_requests", "Requests a replica was chosen for", labels=["replica"]
    )
    for r in replicas:
        label = [str(r["replica"])]
        ready.add_metric(label, 1 if r["state"] == "ready" else 0)
        in_flight.add_metric(label, r["requests_in_flight"])
        outstanding.add_metric(label, r["outstanding_tokens"])
        total.add_metric(label, r["requests_total"])
    return [ready, in_flight, outstanding, total]


def cache_families(cache: Mapping[str, Any]) -> list[Metric]:
    """The hub cache budget (``mesh_node.transfer.cache_budget``)."""
    return [
        GaugeMetricFamily(
            f"{PREFIX}_cache_used_bytes",
            "Bytes in this node's hub cache blobs (partials included), as last measured",
            value=cache.get("used_bytes") or 0,
        ),
        GaugeMetricFamily(
            f"{PREFIX}_cache_budget_bytes",
            "This node's hub cache budget (0: none, only the disk's free space)",
            value=cache.get("budget_bytes") or 0,
        ),
        CounterMetricFamily(
            f"{PREFIX}_cache_evicted_blobs",
            "Blobs evicted, least recently used first, to keep the hub cache in its budget",
            value=cache.get("evicted_blobs", 0),
        ),
        CounterMetricFamily(
            f"{PREFIX}_cache_evicted_bytes",
            "Bytes evicted to keep the hub cache in its budget",
            value=cache.get("evicted_bytes", 0),
        ),
        CounterMetricFamily(
            f"{PREFIX}_cache_budget_refusals",
            "Stage fetches refused because eviction could not make room in the cache budget",
            value=cache.get("refusals", 0),
        ),
    ]


def transfer_families(transfers: Mapping[str, Any]) -> list[Metric]:
    """The ``transfers`` (``mesh_node.transfer.records.TransferLog.status()``): its
    cumulative counters, the transfers running now and this node's stage."""
    c = transfers.get("counters") or {}
    served = CounterMetricFamily(
        f"{PREFIX}_artifact_served_bytes",
        "Artifact bytes this node sent to peers",
        value=c.get("served_bytes", 0),
    )
    served_requests = CounterMetricFamily(
        f"{PREFIX}_artifact_served_requests",
        "Artifact requests this node accepted and served",
        value=c.get("served_requests", 0),
    )
    fetched = _by_label(
        CounterMetricFamily,
        f"{PREFIX}_artifact_fetched_bytes",
        "Artifact bytes in place verified on this node, by source (cache: already installed, "
        "nothing moved)",
        "source",
        {**dict.fromkeys(SOURCES, 0), **(c.get("fetched_bytes") or {})},
    )
    failures = CounterMetricFamily(
        f"{PREFIX}_artifact_verification_failures",
        "Received artifact bytes (peer or hub) that failed the manifest's size or SHA-256",
        value=c.get("verification_failures", 0),
    )
    refused: dict[str, int] = dict.fromkeys(sorted(REFUSAL_REASONS | {OTHER_REASON}), 0)
    for reason, n in (c.get("refusals") or {}).items():
        refused[reason if reason in refused else OTHER_REASON] += n
    refusals = _by_label(
        CounterMetricFamily,
        f"{PREFIX}_artifact_transfer_refusals",
        "Artifact requests this node refused, by reason",
        "reason",
        refused,
    )
    received = _by_label(
        CounterMetricFamily,
        f"{PREFIX}_artifact_refusals_received",
        "Refusals this node's artifact requests got from peers, by the peer's answer",
        "answer",
        c.get("refusals_received") or {},
    )
    running: dict[str, int] = dict.fromkeys(DIRECTIONS, 0)
    for record in transfers.get("active") or ():
        running[record["direction"]] = running.get(record["direction"], 0) + 1
    in_progress = _by_label(
        GaugeMetricFamily,
        f"{PREFIX}_artifact_transfers_in_progress",
        "Artifact transfers running now, by direction",
        "direction",
        running,
    )
    stage = transfers.get("stage")
    stage_ready = GaugeMetricFamily(
        f"{PREFIX}_stage_ready",
        "1 when this node holds its stage's artifacts, verified, for the active topology",
        value=1 if stage is not None and stage.get("state") == "ready" else 0,
    )
    return [
        served,
        served_requests,
        fetched,
        failures,
        refusals,
        received,
        in_progress,
        stage_ready,
    ]


class SectionCollector(Collector):
    """Families read at scrape time from state (no counters to keep in step): ``families``
    of what ``read`` returns now (a status document or one of its sections)."""

    def __init__(
        self,
        read: Callable[[], Any],
        families: Callable[[Any], Sequence[Metric]],
    ) -> None:
        self._read = read
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families(self._read())


def node_registry(
    status: Callable[[], Mapping[str, Any]], collectors: Iterable[Collector] = ()
) -> CollectorRegistry:
    """One registry per node (several nodes may share a process in tests and the lab): the
    core's families from ``status`` and the services' ``collectors``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SectionCollector(status, node_families))
    for collector in collectors:
        registry.register(collector)
    return registry
