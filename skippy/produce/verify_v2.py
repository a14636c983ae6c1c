"""verify-package-v2: prove a package-v2 package source-complete against its source
(spec "v2 verify").

Read-only. The root's rules, every artifact's size and SHA-256, the carrier resolved into the
catalog; then against an inventory built from the source files alone (never from the package):
the recorded source files, primary file, digest and layer count; the carrier's metadata equal
to the normalized source metadata (byte for byte, record by record); the catalog's tensor set
equal to the source's, each with the same type, dims and stored length; every payload part's
own directory equal to the carrier's locators, its KV equal to the normalized source KV, each
tensor's bytes equal to the source's; projectors equal to ``--source-projector`` files; no
unaccounted artifact. Every failure is a finding; any error finding fails the verification.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skippy.constants import V2_CARRIER_KEYS
from skippy.errors import ManifestError, UsageError
from skippy.findings import Finding, errors_only, raise_for_findings
from skippy.gguf.reader import GGUFFile, open_gguf
from skippy.hashing import sha256_file
from skippy.package.artifact_ref import ArtifactRef
from skippy.package.artifacts import check_artifact_file
from skippy.package.catalog import TensorCatalog, part_directory_findings
from skippy.package.manifest import load_manifest_findings
from skippy.package.ownership import owner_of
from skippy.package.v2_carrier import layer_ordinal, read_catalog
from skippy.package.v2_view import ManifestV2
from skippy.paths import is_within, require_dir, require_file
from skippy.produce.source import SourceModelFiles, shard_paths
from skippy.produce.write_package import _shard_names
from skippy.produce.write_package_v2 import normalized_kv_records

_CHUNK = 4 * 1024 * 1024


@dataclass
class VerificationReport:
    package_id: str = ""
    checked_source_files: int = 0
    checked_artifacts: int = 0
    checked_tensors: int = 0
    checked_projectors: int = 0
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Upstream's ``VerificationReport`` (spec "v2 verify"), exactly these keys."""
        return {
            "package_id": self.package_id,
            "source_completeness_verified": not errors_only(self.findings),
            "checked_source_files": self.checked_source_files,
            "checked_artifacts": self.checked_artifacts,
            "checked_tensors": self.checked_tensors,
            "checked_projectors": self.checked_projectors,
        }


def _same_bytes(a: GGUFFile, a_off: int, b: GGUFFile, b_off: int, n: int) -> bool:
    done = 0
    while done < n:
        k = min(_CHUNK, n - done)
        if os.pread(a.fileno(), k, a_off + done) != os.pread(b.fileno(), k, b_off + done):
            return False
        done += k
    return True


def _kv_records(g: GGUFFile) -> list[bytes]:
    return [g.raw_field(k) for k in g.fields if k not in V2_CARRIER_KEYS]


def verify_package_v2(
    package: Path,
    source: Path,
    *,
    source_file: str | None = None,
    source_projectors: tuple[Path, ...] = (),
) -> VerificationReport:
    """Raise ``PackageInvalid`` (every finding attached) unless the package is source-complete."""
    require_dir(package, "package directory")
    require_file(source, "source model")
    if is_within(source.resolve(), package.resolve()):
        raise UsageError(
            f"--source {source} lies inside the package: the inventory must be independent",
            code="source_inside_package",
        )
    report = VerificationReport()
    m, _, findings = load_manifest_findings(package)
    if m is None:
        raise_for_findings(findings, f"package {package}")
        raise ManifestError(f"{package}: no usable manifest")  # unreachable
    if not isinstance(m, ManifestV2):
        raise ManifestError(
            "read v2 manifest (v1 input is not supported): use validate-package for schema 1",
            code="unsupported_schema_version",
            path="schema_version",
        )
    report.package_id = m.package_id
    report.findings.extend(findings)
    raise_for_findings(report.findings, f"package {package}")
    root = m.root
    files: dict[str, Path] = {}
    for a in root.artifacts:
        ref = ArtifactRef("artifact", m._artifact(a))
        p, problem = check_artifact_file(package, ref)
        if problem is not None or p is None:
            report.findings.extend([problem] if problem else [])
            continue
        got = sha256_file(p)
        if got != a.sha256:
            report.findings.append(
                Finding(
                    "artifact_sha256_mismatch",
                    f"package-v2 artifact {a.path} SHA-256 differs from manifest",
                    path=a.path,
                )
            )
            continue
        files[a.id] = p
        report.checked_artifacts += 1
    raise_for_findings(report.findings, f"package {package}")
    meta = m.metadata_ref()
    catalog = read_catalog(root, files[root.source_model.metadata_artifact_id])
    with SourceModelFiles(source) as src:
        report.findings.extend(_source_identity(m, src, source, source_file, report))
        with open_gguf(files[root.source_model.metadata_artifact_id], header_only=True) as c:
            if _kv_records(c) != normalized_kv_records(src):
                report.findings.append(
                    Finding(
                        "source_identity_mismatch",
                        "carrier metadata differs from the normalized source metadata",
                        path=meta.path,
                    )
                )
        report.findings.extend(_payload_findings(m, catalog, files, src, report))
    report.findings.extend(_projector_findings(m, files, source_projectors, report))
    accounted = {root.source_model.metadata_artifact_id}
    accounted |= {a.id for a in root.payload_artifacts()}
    accounted |= {s.artifact_id for s in root.sidecars}
    accounted |= {p.artifact_id for p in root.publisher_metadata}
    if {a.id for a in root.artifacts} - accounted:
        report.findings.append(
            Finding("unaccounted_artifact", "artifact catalog contains unaccounted artifacts")
        )
    raise_for_findings(report.findings, f"package {package}")
    return report


def _source_identity(
    m: ManifestV2,
    src: SourceModelFiles,
    source: Path,
    source_file: str | None,
    report: VerificationReport,
) -> list[Finding]:
    root = m.root
    out: list[Finding] = []
    paths = shard_paths(source)
    primary = source_file or root.source_model.primary_file or source.name
    names = _shard_names(primary, len(paths))
    got = [(n, p.stat().st_size, sha256_file(p)) for n, p in zip(names, paths, strict=True)]
    want = sorted((f.path, f.byte_size, f.sha256) for f in root.source_model.files)
    report.checked_source_files = len(got)
    if sorted(got) != want:
        out.append(
            Finding(
                "source_identity_mismatch",
                "source_model.files differ from the source files given "
                f"({[g[0] for g in got]} against {[w[0] for w in want]})",
                path="source_model.files",
            )
        )
    if root.source_model.sha256 != got[0][2]:
        out.append(
            Finding(
                "source_identity_mismatch",
                "source model digest does not match the primary source file",
                path="source_model.sha256",
            )
        )
    block = src.arch_value("block_count")
    if block != root.layer_count:
        out.append(
            Finding(
                "source_identity_mismatch",
                f"layer_count {root.layer_count} is not the source's block_count {block}",
                path="layer_count",
            )
        )
    return out


def _payload_findings(
    m: ManifestV2,
    catalog: TensorCatalog,
    files: dict[str, Path],
    src: SourceModelFiles,
    report: VerificationReport,
) -> list[Finding]:
    out: list[Finding] = []
    inventory = {t.info.name: t for t in src.tensors}
    if catalog.names() != set(inventory):
        missing = sorted(set(inventory) - catalog.names())[:5]
        extra = sorted(catalog.names() - set(inventory))[:5]
        out.append(
            Finding(
                "source_completeness_failed",
                f"the catalog's tensor set differs from the source's (missing {missing}, "
                f"unexpected {extra})",
            )
        )
    kv = normalized_kv_records(src)
    for a in m.root.payload_artifacts():
        path = files[a.id]
        with open_gguf(path) as g:
            out.extend(part_directory_findings(catalog, a.id, a.path, g.tensors))
            if _kv_records(g) != kv:
                out.append(
                    Finding(
                        "source_identity_mismatch",
                        f"{a.path} KV differs from the normalized source metadata",
                        path=a.path,
                    )
                )
            ordinal = layer_ordinal(a.path)
            for c in catalog.in_artifact(a.id):
                s = inventory.get(c.name)
                if s is None:
                    continue
                if owner_of(c.name).layer_index != ordinal:
                    out.append(
                        Finding(
                            "layer_out_of_bounds",
                            f"{a.path} holds {c.name}, which is not a tensor of its layer",
                            path=a.path,
                        )
                    )
                if (s.info.shape, s.info.ggml_type, s.info.nbytes) != (
                    c.shape,
                    c.ggml_type,
                    c.nbytes,
                ):
                    out.append(
                        Finding(
                            "package_storage_mismatch",
                            f"{c.name}: type, dims or length differ from the source",
                            path=a.path,
                        )
                    )
                    continue
                if not _same_bytes(g, c.offset, src.shards[s.shard], s.info.data_start, c.nbytes):
                    out.append(
                        Finding(
                            "tensor_bytes_differ",
                            f"{c.name} in {a.path} is not byte-identical to the source",
                            path=a.path,
                        )
                    )
                    continue
                report.checked_tensors += 1
    return out


def _projector_findings(
    m: ManifestV2,
    files: dict[str, Path],
    source_projectors: tuple[Path, ...],
    report: VerificationReport,
) -> list[Finding]:
    sidecars = m.root.sidecars
    if len(source_projectors) != len(sidecars):
        return [
            Finding(
                "missing_value",
                f"the package declares {len(sidecars)} projectors; pass one --source-projector "
                f"for each (got {len(source_projectors)})",
            )
        ]
    out: list[Finding] = []
    wanted = {sha256_file(p): p for p in source_projectors}
    for s in sidecars:
        a = m.root.artifact(s.artifact_id)
        if a.sha256 not in wanted or a.id not in files:
            out.append(
                Finding(
                    "source_identity_mismatch",
                    f"projector {a.path} equals none of the --source-projector files",
                    path=a.path,
                )
            )
        else:
            report.checked_projectors += 1
    return out


__all__ = ["VerificationReport", "verify_package_v2"]
