"""validate-package: recompute a package from its source and report every difference.

Spec "Publishing Rules" (run validation against the source before publishing) and "Manifest
Schema". Every byte of the source and of the package is read once: a source pass and a
package pass run on the two cores, each hashing its files, and every tensor chunk is compared
with its counterpart as the second pass reaches it (``skippy.produce.byte_compare``).
Findings carry stable codes; nothing here raises for a bad package.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skippy.constants import ROLE_EMBEDDINGS, ROLE_LAYER, ROLE_METADATA, ROLE_PROJECTOR
from skippy.errors import GGUFFormatError, InputUnreadable, SkippyError
from skippy.findings import Finding, errors_only, summarize
from skippy.generation import check_generation
from skippy.gguf.reader import TensorInfo, open_gguf
from skippy.hashing import CHUNK_BYTES, DEFAULT_WORKERS, sha256_file
from skippy.package.artifacts import check_artifact_file, header_findings
from skippy.package.artifacts import stat_artifact as stat_artifact  # moved; old importers
from skippy.package.manifest import ArtifactRef, Manifest, load_manifest_findings
from skippy.package.ownership import has_tied_embeddings, owner_of
from skippy.package.quantization import QUANTIZATION_KEY
from skippy.paths import require_dir, require_file
from skippy.produce.byte_compare import (
    PARK_BUDGET_BYTES,
    Rendezvous,
    package_chunk,
    source_chunk,
    walk_file,
)
from skippy.produce.source import SourceModelFiles, shard_paths
from skippy.progress import OnBytes, byte_bar


@dataclass
class ValidationReport:
    package: str
    source: str | None
    findings: list[Finding] = field(default_factory=list)
    artifacts_checked: int = 0
    tensors_checked: int = 0
    bytes_hashed: int = 0
    bytes_reread: int = 0
    seconds: float = 0.0
    manifest: Manifest | None = None

    @property
    def valid(self) -> bool:
        return not errors_only(self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "valid": self.valid,
            "package": self.package,
            "source": self.source,
            "artifacts_checked": self.artifacts_checked,
            "tensors_checked": self.tensors_checked,
            "bytes_hashed": self.bytes_hashed,
            "bytes_reread": self.bytes_reread,
            "seconds": round(self.seconds, 3),
            "summary": summarize(self.findings),
            "findings": [f.to_dict() for f in self.findings],
        }


@dataclass
class ArtifactScan:
    """What one pass over an artifact found."""

    sha256: str
    size: int
    tensors: tuple[TensorInfo, ...]
    differing: list[str] = field(default_factory=list)
    kv_records: dict[str, bytes] = field(default_factory=dict)  # raw KV records, by key


# --- quantized packages (skippy-quantize): the expected bytes are the quantization redone ----
@dataclass(frozen=True)
class _SourceTensorRef:
    """What a package tensor must be: the source bytes at ``fd``, or, for a quantized package
    (``skippy.produce.quant_validate``), the bytes a reader from ``open_reader`` streams;
    with ``compare_bytes`` False only the type and shape are checked."""

    info: TensorInfo
    fd: int
    open_reader: Callable[[], Any] | None = None
    compare_bytes: bool = True


def _scan_against(
    path: Path, source_lookup: Callable[[str], _SourceTensorRef | None] | None = None
) -> ArtifactScan:
    """Hash ``path`` in one sequential pass; where a tensor matches an expected tensor's name,
    type and shape, compare its bytes with the expected ones in the same pass (the quantized
    path: the expected bytes are produced, not read from the source)."""
    with open_gguf(path) as g:
        fd, size = g.fileno(), g.file_size
        h = hashlib.sha256()
        buf, other = bytearray(CHUNK_BYTES), bytearray(CHUNK_BYTES)
        view, oview = memoryview(buf), memoryview(other)
        differing: list[str] = []

        def hash_span(start: int, stop: int, src: _SourceTensorRef | None, name: str) -> None:
            pos, src_pos, same = start, src.info.data_start if src else 0, True
            if src is not None and not src.compare_bytes:
                src = None
            reader = src.open_reader() if src is not None and src.open_reader else None
            try:
                while pos < stop:
                    want = min(len(buf), stop - pos)
                    got = os.preadv(fd, [view[:want]], pos)
                    if got <= 0:
                        raise InputUnreadable(f"{path} shrank while being read", path=str(path))
                    chunk = view[:got]
                    h.update(chunk)
                    if src is not None and same:
                        if reader is not None:
                            n = reader.read(oview[:got])
                        else:
                            n = os.preadv(src.fd, [oview[:got]], src_pos)
                        # bytearray == bytearray is a memcmp; memoryview == is per element (40x)
                        if got == len(buf):
                            same = n == got and buf == other
                        else:
                            same = n == got and buf[:got] == other[:got]
                        src_pos += got
                    pos += got
            finally:
                if reader is not None:
                    reader.close()
            if src is not None and not same:
                differing.append(name)

        pos = 0
        for t in sorted(g.tensors, key=lambda t: t.data_start):
            hash_span(pos, t.data_start, None, "")
            src = source_lookup(t.name) if source_lookup else None
            if src is not None and (src.info.shape, src.info.ggml_type, src.info.nbytes) != (
                t.shape,
                t.ggml_type,
                t.nbytes,
            ):
                src = None  # reported as tensor_metadata_differs by the caller
            hash_span(t.data_start, t.data_end, src, t.name)
            pos = t.data_end
        hash_span(pos, size, None, "")
        records = {k: g.raw_field(k) for k in g.fields}
        return ArtifactScan(h.hexdigest(), size, g.tensors, differing, records)


def _artifact_findings(ref: ArtifactRef, scan: ArtifactScan) -> list[Finding]:
    a, out = ref.artifact, []
    if scan.sha256.lower() != a.sha256.lower():
        out.append(
            Finding(
                "artifact_sha256_mismatch",
                f"{a.path} has SHA-256 {scan.sha256}, manifest says {a.sha256}",
                path=a.path,
            )
        )
    return out + header_findings(ref, scan.tensors)


Job = tuple[ArtifactRef, Path]


class _Jobs:
    """The artifacts to scan, shared by the two passes. The package pass takes them from the
    front in the source's tensor order (so both passes reach each chunk close together); the
    source pass, once the source is hashed, takes the rest from the back, so neither core
    idles at the end."""

    def __init__(self, jobs: list[Job]) -> None:
        self._lock = threading.Lock()
        self._ordered = threading.Event()
        # The embeddings go first, before the source order is known: they are usually at the
        # start of the source and hold most bytes of a small model. The metadata fragment (no
        # tensors; its vocabulary is parsed cheaply once the source's is known) goes last.
        self.first = [j for j in jobs if j[0].role == ROLE_EMBEDDINGS]
        self._rest = [j for j in jobs if j[0].role != ROLE_EMBEDDINGS]
        self._queue: deque[Job] = deque()

    def order(self, positions: dict[str, tuple[int, int]]) -> None:
        first_at = _first_positions(positions)

        def key(job: Job) -> tuple[int, tuple[int, int]]:
            ref = job[0]
            if ref.role == ROLE_METADATA:
                return 2, _LAST
            return 0 if ref.role != ROLE_PROJECTOR else 1, first_at.get(
                (ref.role, ref.layer_index), _LAST
            )

        with self._lock:
            self._queue.extend(sorted(self._rest, key=key))
        self._ordered.set()

    def close(self) -> None:
        """No more ordering will come (the package pass ended, maybe on an error)."""
        self._ordered.set()

    def front(self) -> Job | None:
        with self._lock:
            return self._queue.popleft() if self._queue else None

    def back(self) -> Job | None:
        self._ordered.wait()
        with self._lock:
            return self._queue.pop() if self._queue else None


_LAST = (1 << 62, 0)  # artifacts holding no source tensor come last


def _first_positions(
    positions: dict[str, tuple[int, int]],
) -> dict[tuple[str, int | None], tuple[int, int]]:
    """Where each artifact's first tensor lies in the source, by its owner (role, layer): the
    ownership rule (``skippy.package.ownership``) says which fragment holds which tensor."""
    first: dict[tuple[str, int | None], tuple[int, int]] = {}
    for name, pos in positions.items():
        owner = owner_of(name)
        key = (owner.role, owner.layer_index)
        if key not in first or pos < first[key]:
            first[key] = pos
    return first


class _Scanner:
    """Scans artifacts for either pass (results and findings collected under a lock)."""

    def __init__(self, rdv: Rendezvous, on_bytes: OnBytes, cancel: threading.Event) -> None:
        self.rdv, self.on_bytes, self.cancel = rdv, on_bytes, cancel
        self.results: list[tuple[ArtifactRef, ArtifactScan]] = []
        self.findings: list[Finding] = []
        self._lock = threading.Lock()
        self.known_records: dict[str, bytes] = {}  # the source's big arrays (the vocabulary)

    def scan(self, job: Job) -> None:
        ref, path = job
        meet = package_chunk(self.rdv)
        known = self.known_records if ref.role == ROLE_METADATA else None
        try:
            with open_gguf(path, known_records=known) as g:
                digest = walk_file(
                    g.fileno(),
                    g.file_size,
                    g.tensors,
                    None if ref.role == ROLE_PROJECTOR else meet,
                    what=ref.path,
                    on_bytes=self.on_bytes,
                    cancel=self.cancel,
                )
                records = {k: g.raw_field(k) for k in g.fields}
                scan = ArtifactScan(digest, g.file_size, g.tensors, [], records)
            with self._lock:
                self.results.append((ref, scan))
        except (GGUFFormatError, InputUnreadable) as exc:
            with self._lock:
                self.findings.append(Finding("invalid_artifact_gguf", exc.message, path=ref.path))


@dataclass
class _SourcePass:
    """The source pass's results: the open source and its shard digests."""

    src: SourceModelFiles
    digests: list[str]


def _source_pass(
    source: Path, rdv: Rendezvous, scanner: _Scanner, jobs: _Jobs, *, help_after: bool
) -> _SourcePass:
    """Hash the source shards in file order, meeting the package pass at every tensor chunk;
    then (``help_after``) scan artifacts from the back of the queue."""
    src: SourceModelFiles | None = None
    try:
        src = SourceModelFiles(source)
        scanner.known_records = {
            f.key: src.head.raw_field(f.key) for f in src.kv_fields() if f.count > 4096
        }
        rdv.publish_positions({t.info.name: (t.shard, t.info.data_start) for t in src.tensors})
        digests = []
        for g in src.shards:
            digests.append(
                walk_file(
                    g.fileno(),
                    g.file_size,
                    g.tensors,
                    source_chunk(rdv, g.fileno()),
                    what=f"source {g.path.name}",
                    on_bytes=scanner.on_bytes,
                    cancel=scanner.cancel,
                )
            )
    except BaseException:
        scanner.cancel.set()  # the package pass stops at its next chunk; our error is raised
        if src is not None:
            src.close()
        raise
    finally:
        rdv.source_finished()
    if help_after:
        while (job := jobs.back()) is not None:
            scanner.scan(job)
    return _SourcePass(src, digests)


def _package_pass(jobs: _Jobs, rdv: Rendezvous, scanner: _Scanner) -> None:
    try:
        for first in jobs.first:
            scanner.scan(first)
        jobs.order(rdv.wait_positions() or {})
        while (job := jobs.front()) is not None:
            scanner.scan(job)
    finally:
        jobs.close()  # a source pass waiting for work must never wait forever


def validate_package(
    source: Path,
    pkg: Path,
    *,
    workers: int = DEFAULT_WORKERS,
    park_budget_bytes: int = PARK_BUDGET_BYTES,
) -> ValidationReport:
    """Recompute the package from its source (spec "Publishing Rules"). The source and the
    package are each read once, on two cores (``skippy.produce.byte_compare``); with
    ``workers=1`` the passes run one after the other, and source chunks that found no room in
    ``park_budget_bytes`` are read again (``bytes_reread``)."""
    t0 = time.perf_counter()
    report = ValidationReport(package=str(pkg), source=str(source))
    require_dir(pkg, "package directory")
    require_file(source, "source model")
    shards = shard_paths(source)
    m_any, _, findings = load_manifest_findings(pkg)
    report.findings.extend(findings)
    if m_any is not None and not isinstance(m_any, Manifest):
        report.findings.append(
            Finding(
                "unsupported_schema_version",
                f"{pkg} is a schema-version-2 package; validate-package checks schema 1",
                path="schema_version",
                remediation=f"run verify-package-v2 {pkg} --source {source}",
            )
        )
        report.seconds = time.perf_counter() - t0
        return report
    m = m_any
    report.manifest = m
    found: list[Job] = []
    if m is not None:
        for ref in m.artifacts():
            p, problem = check_artifact_file(pkg, ref)
            if problem is not None:
                report.findings.append(problem)
            elif p is not None:
                found.append((ref, p))
    if m is not None and QUANTIZATION_KEY in m.extra:
        _validate_quantized(report, m, source, shards, found, workers)
        report.seconds = time.perf_counter() - t0
        return report
    total = sum(p.stat().st_size for p in shards) + sum(r.artifact.artifact_bytes for r, _ in found)
    rdv = Rendezvous(budget_bytes=park_budget_bytes)
    jobs = _Jobs(found)
    with byte_bar(total, "validate-package") as on_bytes:
        scanner = _Scanner(rdv, on_bytes, threading.Event())
        if workers <= 1:
            sp = _source_pass(source, rdv, scanner, jobs, help_after=False)
            _package_pass(jobs, rdv, scanner)
        else:
            with ThreadPoolExecutor(max_workers=1) as pool:
                fut = pool.submit(_source_pass, source, rdv, scanner, jobs, help_after=True)
                try:
                    _package_pass(jobs, rdv, scanner)
                except CancelledError:
                    fut.result()  # the source pass failed and cancelled us: raise its error
                    raise
                except BaseException:
                    scanner.cancel.set()
                    with contextlib.suppress(BaseException):
                        fut.result().src.close()
                    raise
                sp = fut.result()
    order = {ref.path: i for i, (ref, _) in enumerate(found)}
    results = sorted(scanner.results, key=lambda r: order[r[0].path])
    report.findings.extend(scanner.findings)
    with sp.src as src:
        source_tensors = {t.info.name: t.info for t in src.tensors}
        for _, scan in results:
            scan.differing = [
                t.name
                for t in scan.tensors
                if t.name in rdv.differing and _same_layout(t, source_tensors.get(t.name))
            ]
        _source_findings(report, m, src, sp.digests)
        if m is not None:
            _tensor_findings(report, results, source_tensors)
            report.findings.extend(_metadata_findings(m, results, src))
            report.findings.extend(_generation_findings(m, results, src))
    report.bytes_hashed = total
    report.bytes_reread = rdv.reread_bytes
    report.artifacts_checked = len(results)
    report.seconds = time.perf_counter() - t0
    return report


def _validate_quantized(
    report: ValidationReport,
    m: Manifest,
    source: Path,
    shards: list[Path],
    found: list[Job],
    workers: int,
) -> ValidationReport:
    """A quantized package (``quantization`` in the manifest): its tensors are the recorded
    quantization of the source, redone (``skippy.produce.quant_validate``), so each artifact
    is compared with produced bytes, not source bytes; the source is hashed alongside."""
    from skippy.produce.quant_validate import quantized_expectation

    cancel = threading.Event()
    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    results: list[tuple[ArtifactRef, ArtifactScan]] = []
    try:
        shard_futs = [pool.submit(sha256_file, p, cancel=cancel) for p in shards]
        with SourceModelFiles(source) as src, contextlib.ExitStack() as stack:
            lookup = {
                t.info.name: _SourceTensorRef(t.info, src.shards[t.shard].fileno())
                for t in src.tensors
            }
            exp = stack.enter_context(quantized_expectation(m, src, workers=workers))
            report.findings.extend(exp.findings)
            for name, e in exp.tensors.items():
                lookup[name] = _SourceTensorRef(e.info, e.fd, e.open_reader, e.compare_bytes)
            jobs = sorted(found, key=lambda j: -j[0].artifact.artifact_bytes)
            scans = [
                (
                    ref,
                    pool.submit(
                        _scan_against, p, None if ref.role == ROLE_PROJECTOR else lookup.get
                    ),
                )
                for ref, p in jobs
            ]
            digests = [f.result() for f in shard_futs]
            for ref, fut in scans:
                try:
                    results.append((ref, fut.result()))
                except (GGUFFormatError, InputUnreadable) as exc:
                    report.findings.append(
                        Finding("invalid_artifact_gguf", exc.message, path=ref.path)
                    )
            order = {ref.path: i for i, (ref, _) in enumerate(found)}
            results.sort(key=lambda r: order[r[0].path])
            _source_findings(report, m, src, digests)
            expected = {name: ref.info for name, ref in lookup.items()}
            _tensor_findings(report, results, expected)
            report.findings.extend(_metadata_findings(m, results, src, exp.kv))
            report.findings.extend(_generation_findings(m, results, src))
    except BaseException:
        cancel.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    report.bytes_hashed = sum(s.size for _, s in results) + sum(p.stat().st_size for p in shards)
    report.artifacts_checked = len(results)
    return report


def _same_layout(t: TensorInfo, src: TensorInfo | None) -> bool:
    """Byte differences count only where name, type and shape agree (otherwise the tensor is
    reported as ``tensor_metadata_differs``)."""
    return src is not None and (src.shape, src.ggml_type, src.nbytes) == (
        t.shape,
        t.ggml_type,
        t.nbytes,
    )


def _source_findings(
    report: ValidationReport, m: Manifest | None, src: SourceModelFiles, digests: list[str]
) -> None:
    if m is None:
        return
    if digests[0].lower() != m.source_model.sha256.lower():
        report.findings.append(
            Finding(
                "source_sha256_mismatch",
                f"source {src.paths[0].name} has SHA-256 {digests[0]}, the package was built "
                f"from {m.source_model.sha256}",
                remediation="validate against the exact source file the package names",
            )
        )
    declared = {f.path.rsplit("/", 1)[-1]: f for f in m.source_model.files}
    for p, d in zip(src.paths, digests, strict=True):
        f = declared.get(p.name)
        if f is not None and (f.sha256.lower() != d or f.size_bytes != p.stat().st_size):
            report.findings.append(
                Finding("source_file_mismatch", f"source shard {p.name} differs from files[]")
            )
    try:
        block_count = src.arch_value("block_count")
    except SkippyError:
        block_count = None
    if block_count != m.layer_count:
        report.findings.append(
            Finding(
                "layer_count_mismatch",
                f"manifest layer_count {m.layer_count} but the source declares {block_count}",
            )
        )


def _metadata_findings(
    m: Manifest,
    results: list[tuple[ArtifactRef, ArtifactScan]],
    src: SourceModelFiles,
    expected_kv: dict[str, bytes] | None = None,
) -> list[Finding]:
    """Spec "Repository Layout": shared/metadata.gguf carries the source's metadata and
    tokenizer state; every source KV record must be there byte for byte (``expected_kv``: the
    records a quantized package must hold instead). And the additive ``tied_embeddings``
    flag, which drives selection, must tell the truth about the source."""
    out: list[Finding] = []
    tied = has_tied_embeddings(t.info.name for t in src.tensors)
    if m.tied_embeddings != tied:
        out.append(
            Finding(
                "tied_embeddings_mismatch",
                f"manifest says tied_embeddings={str(m.tied_embeddings).lower()}, but the source "
                f"{'has no' if tied else 'has an'} output.weight",
                remediation="rewrite the package: a final stage would miss its output weights",
            )
        )
    meta = next((scan for ref, scan in results if ref.role == ROLE_METADATA), None)
    if meta is None:
        return out  # missing or unreadable: already reported
    if expected_kv is None:
        expected_kv = {f.key: src.head.raw_field(f.key) for f in src.kv_fields()}
    for key, record in expected_kv.items():
        have = meta.kv_records.get(key)
        if have is None:
            out.append(
                Finding(
                    "metadata_kv_missing",
                    f"{m.shared.metadata.path} lacks the source's {key}",
                    path=m.shared.metadata.path,
                )
            )
        elif have != record:
            out.append(
                Finding(
                    "metadata_kv_differs",
                    f"{m.shared.metadata.path} has a different {key} from the source",
                    path=m.shared.metadata.path,
                )
            )
    return out


def _generation_findings(
    m: Manifest, results: list[tuple[ArtifactRef, ArtifactScan]], src: SourceModelFiles
) -> list[Finding]:
    """Spec "Generation Defaults": a declared block must match what the artifacts hold (e.g.
    MTP layer indices really hold NextN tensors)."""
    if m.generation is None:
        return []
    names: dict[int, set[str]] = {}
    for ref, scan in results:
        if ref.role == ROLE_LAYER and ref.layer_index is not None:
            names[ref.layer_index] = {t.name for t in scan.tensors}
    return check_generation(
        m.generation,
        layer_count=m.layer_count,
        layer_tensor_names=lambda i: names.get(i, set()),
        metadata=src.metadata(),
        arch=src.architecture,
    )


def _tensor_findings(
    report: ValidationReport,
    results: list[tuple[ArtifactRef, ArtifactScan]],
    lookup: dict[str, TensorInfo],
) -> None:
    seen: Counter[str] = Counter()
    for ref, scan in results:
        report.findings.extend(_artifact_findings(ref, scan))
        if ref.role == ROLE_PROJECTOR:
            continue  # projectors are companions, never owned layer tensors (spec)
        for t in scan.tensors:
            report.tensors_checked += 1
            seen[t.name] += 1
            src = lookup.get(t.name)
            if src is None:
                report.findings.append(
                    Finding(
                        "tensor_unexpected",
                        f"{ref.path} holds {t.name}, which the source does not have",
                        path=ref.path,
                    )
                )
                continue
            if (src.shape, src.ggml_type) != (t.shape, t.ggml_type):
                report.findings.append(
                    Finding(
                        "tensor_metadata_differs",
                        f"{t.name} in {ref.path} has type/shape {t.ggml_type}/{t.shape}, the "
                        f"source has {src.ggml_type}/{src.shape}",
                        path=ref.path,
                    )
                )
            owner = owner_of(t.name)
            if (owner.role, owner.layer_index) != (ref.role, ref.layer_index):
                report.findings.append(
                    Finding(
                        "tensor_misplaced",
                        f"{t.name} belongs to {owner.role}"
                        f"{'' if owner.layer_index is None else f' {owner.layer_index}'} but is "
                        f"in {ref.path}",
                        path=ref.path,
                    )
                )
        for name in scan.differing:
            report.findings.append(
                Finding(
                    "tensor_bytes_differ",
                    f"{name} in {ref.path} differs from the source bytes",
                    path=ref.path,
                )
            )
    for name in lookup:
        if seen[name] == 0:
            report.findings.append(
                Finding("tensor_missing", f"source tensor {name} is in no artifact")
            )
        elif seen[name] > 1:
            report.findings.append(
                Finding("tensor_duplicated", f"source tensor {name} is in {seen[name]} artifacts")
            )
