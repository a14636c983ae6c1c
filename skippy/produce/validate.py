"""validate-package: recompute a package from its source and report every difference.

Spec "Publishing Rules" (run validation against the source before publishing) and "Manifest
Schema". One pass per file: each artifact is read once, hashed, and its tensor regions are
compared byte-for-byte with the source in the same pass, while the source shards are hashed
on the other core. Findings carry stable codes; nothing here raises for a bad package.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skippy.constants import ROLE_LAYER, ROLE_METADATA, ROLE_PROJECTOR
from skippy.errors import (
    GGUFFormatError,
    InputUnreadable,
    SkippyError,
)
from skippy.findings import Finding, errors_only, summarize
from skippy.generation import check_generation
from skippy.gguf.reader import TensorInfo, open_gguf
from skippy.hashing import CHUNK_BYTES, DEFAULT_WORKERS, sha256_file
from skippy.package.artifacts import check_artifact_file, header_findings
from skippy.package.manifest import ArtifactRef, Manifest, load_manifest_findings
from skippy.package.ownership import has_tied_embeddings, owner_of
from skippy.paths import require_dir, require_file
from skippy.produce.source import SourceModelFiles, shard_paths


@dataclass
class ValidationReport:
    package: str
    source: str | None
    findings: list[Finding] = field(default_factory=list)
    artifacts_checked: int = 0
    tensors_checked: int = 0
    bytes_hashed: int = 0
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
            "seconds": round(self.seconds, 3),
            "summary": summarize(self.findings),
            "findings": [f.to_dict() for f in self.findings],
        }


@dataclass(frozen=True)
class _SourceTensorRef:
    info: TensorInfo
    fd: int


@dataclass
class ArtifactScan:
    """What one pass over an artifact found."""

    sha256: str
    size: int
    tensors: tuple[TensorInfo, ...]
    differing: list[str] = field(default_factory=list)
    kv_records: dict[str, bytes] = field(default_factory=dict)  # raw KV records, by key


def scan_artifact(
    path: Path, source_lookup: Callable[[str], _SourceTensorRef | None] | None = None
) -> ArtifactScan:
    """Hash ``path`` in one sequential pass; where a tensor matches a source tensor's name,
    type and shape, compare its bytes with the source in the same pass."""
    with open_gguf(path) as g:
        fd, size = g.fileno(), g.file_size
        h = hashlib.sha256()
        buf, other = bytearray(CHUNK_BYTES), bytearray(CHUNK_BYTES)
        view, oview = memoryview(buf), memoryview(other)
        differing: list[str] = []

        def hash_span(start: int, stop: int, src: _SourceTensorRef | None, name: str) -> None:
            pos, src_pos, same = start, src.info.data_start if src else 0, True
            while pos < stop:
                want = min(len(buf), stop - pos)
                got = os.preadv(fd, [view[:want]], pos)
                if got <= 0:
                    raise InputUnreadable(f"{path} shrank while being read", path=str(path))
                chunk = view[:got]
                h.update(chunk)
                if src is not None and same:
                    n = os.preadv(src.fd, [oview[:got]], src_pos)
                    # bytearray == bytearray is a memcmp; memoryview == is per element (40x).
                    if got == len(buf):
                        same = n == got and buf == other
                    else:
                        same = n == got and buf[:got] == other[:got]
                    src_pos += got
                pos += got
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


def validate_package(
    source: Path, pkg: Path, *, workers: int = DEFAULT_WORKERS
) -> ValidationReport:
    t0 = time.perf_counter()
    report = ValidationReport(package=str(pkg), source=str(source))
    require_dir(pkg, "package directory")
    require_file(source, "source model")
    shards = shard_paths(source)
    cancel = threading.Event()
    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    try:
        # The source digests need no parsing: start them before anything else.
        shard_futs = [pool.submit(sha256_file, p, cancel=cancel) for p in shards]
        m, _, findings = load_manifest_findings(pkg)
        report.findings.extend(findings)
        report.manifest = m
        with SourceModelFiles(source) as src:
            lookup = {
                t.info.name: _SourceTensorRef(t.info, src.shards[t.shard].fileno())
                for t in src.tensors
            }
            scans: list[tuple[ArtifactRef, Future[ArtifactScan]]] = []
            if m is not None:
                jobs = []
                for ref in m.artifacts():
                    p, problem = check_artifact_file(pkg, ref)
                    if problem is not None:
                        report.findings.append(problem)
                    elif p is not None:
                        jobs.append((ref, p))
                jobs.sort(key=lambda j: -j[0].artifact.artifact_bytes)
                for ref, p in jobs:
                    look = None if ref.role == ROLE_PROJECTOR else lookup.get
                    scans.append((ref, pool.submit(scan_artifact, p, look)))
            digests = [f.result() for f in shard_futs]
            results: list[tuple[ArtifactRef, ArtifactScan]] = []
            for ref, fut in scans:
                try:
                    results.append((ref, fut.result()))
                except (GGUFFormatError, InputUnreadable) as exc:
                    report.findings.append(
                        Finding("invalid_artifact_gguf", exc.message, path=ref.path)
                    )
            _source_findings(report, m, src, digests)
            if m is not None:
                _tensor_findings(report, results, lookup)
                report.findings.extend(_metadata_findings(m, results, src))
                report.findings.extend(_generation_findings(m, results, src))
    except BaseException:
        cancel.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    report.bytes_hashed = sum(s.size for _, s in results) + sum(p.stat().st_size for p in shards)
    report.artifacts_checked = len(results)
    report.seconds = time.perf_counter() - t0
    return report


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
    m: Manifest, results: list[tuple[ArtifactRef, ArtifactScan]], src: SourceModelFiles
) -> list[Finding]:
    """Spec "Repository Layout": shared/metadata.gguf carries the source's metadata and
    tokenizer state; every source KV record must be there byte for byte. And the additive
    ``tied_embeddings`` flag, which drives selection, must tell the truth about the source."""
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
    for f in src.kv_fields():
        have = meta.kv_records.get(f.key)
        if have is None:
            out.append(
                Finding(
                    "metadata_kv_missing",
                    f"{m.shared.metadata.path} lacks the source's {f.key}",
                    path=m.shared.metadata.path,
                )
            )
        elif have != src.head.raw_field(f.key):
            out.append(
                Finding(
                    "metadata_kv_differs",
                    f"{m.shared.metadata.path} has a different {f.key} from the source",
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
    lookup: dict[str, _SourceTensorRef],
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
            if (src.info.shape, src.info.ggml_type) != (t.shape, t.ggml_type):
                report.findings.append(
                    Finding(
                        "tensor_metadata_differs",
                        f"{t.name} in {ref.path} has type/shape {t.ggml_type}/{t.shape}, the "
                        f"source has {src.info.ggml_type}/{src.info.shape}",
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
