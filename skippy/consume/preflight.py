"""preflight: the source-less consumer check of a package, and opening one stage of it.

Spec "Consumer Validation". ``preflight_package`` reports every problem as findings (severity,
code, message, path, remediation) without needing the source model: the manifest rules
(``skippy.package.manifest.check_manifest``), every artifact's presence, type and size
(``skippy.package.artifacts.check_artifact_file``), each artifact's GGUF header against its declared
tensor count and bytes, the package generation defaults (``skippy.generation``), optionally
SHA-256 (``skippy.consume.verify``) and a per-stage part list. ``metadata_only`` is the spec's
"Metadata-only inspection": the manifest and ``shared/metadata.gguf`` only, no layer range.

``load_package`` / ``prepare_stage`` are what a stage runs before it starts: they raise one
typed error (with every finding attached) instead of returning findings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from skippy.constants import (
    KEY_ARCHITECTURE,
    MAX_LAYER_COUNT,
    ROLE_COMMON,
    ROLE_LAYER,
    ROLE_METADATA,
    ROLE_PROJECTOR,
)
from skippy.consume.verify import VerifyCache, VerifyReport, check_refs, verify_selection
from skippy.errors import ManifestError, SkippyError, UsageError
from skippy.findings import Finding, errors_only, raise_for_findings, summarize
from skippy.gguf.reader import GGUFFile, TensorInfo, open_gguf
from skippy.package.artifacts import check_artifact_file, header_findings
from skippy.package.catalog import part_directory_findings
from skippy.package.manifest import ArtifactRef, Manifest, PackageManifest, load_manifest_findings
from skippy.package.plan import check_stage_count, even_ranges, tail_layers
from skippy.package.quantization import (
    QUANTIZATION_KEY,
    file_type_findings,
    parse_quantization,
)
from skippy.package.ranges import LayerRange
from skippy.package.select import StageSelection, select_stage
from skippy.package.v2_carrier import read_catalog
from skippy.package.v2_view import ManifestV2
from skippy.paths import is_safe_relative_path, require_dir
from skippy.produce.quant_rules import TensorFacts, recorded_type_findings

# Remediation for every code preflight can report that does not already carry one.
REMEDIATIONS: Final[Mapping[str, str]] = {
    "missing_manifest": "point at the package root (the folder holding model-package.json), "
    "or create the package with write-package",
    "invalid_manifest_json": "model-package.json must be UTF-8 JSON: fetch or write it again",
    "manifest_too_large": "a manifest over 16 MiB is rejected; republish the package",
    "invalid_manifest": "fix the named field, or rewrite the package with write-package",
    "unsupported_schema_version": "upgrade the runtime, or republish with schema_version 1",
    "invalid_format": 'a layer package declares format "layer-package"; this is not one',
    "empty_model_id": "set model_id to the source model coordinate ORG/REPO:DISTRIBUTION",
    "empty_source_identity": "record source_model.repo, revision and primary_file",
    "invalid_source_model_sha256": "record the source file's 64-hex SHA-256 in source_model.sha256",
    "missing_skippy_abi_version": "republish with a writer that records skippy_abi_version",
    "incompatible_skippy_abi_version": "use a runtime built for this ABI or republish",
    "invalid_layer_count": "layer_count must be the source model's transformer layer count",
    "unsupported_projector_kind": "remove the projector entry or use a runtime that supports "
    "its kind (this one supports mmproj)",
    "layer_index_out_of_range": "every layer_index must be in 0..layer_count-1: rewrite the "
    "package",
    "missing_layer": "layers[] needs exactly one entry per layer 0..layer_count-1: rewrite the "
    "package",
    "duplicate_layer": "layers[] needs exactly one entry per layer: rewrite the package",
    "duplicate_artifact_path": "each artifact needs its own file: rewrite the package",
    "unsafe_artifact_path": "artifact paths must be relative POSIX paths that stay inside the "
    "package root (no '..', no absolute paths, no symlinks leading out)",
    "artifact_not_file": "replace it with the artifact file itself",
    "missing_artifact": "fetch the missing file again, or rewrite the package",
    "unreadable_artifact": "check the file's permissions",
    "artifact_size_mismatch": "the file is truncated or replaced: fetch it again",
    "empty_artifact": "artifact_bytes must be the file's exact, positive size",
    "invalid_tensor_bytes": "tensor_bytes is 0 exactly when tensor_count is 0, and never more "
    "than artifact_bytes",
    "invalid_artifact_sha256": "sha256 must be the file's 64-hex SHA-256 digest",
    "artifact_sha256_mismatch": "the file is corrupt or was replaced: delete it and fetch it "
    "again; never load it as is",
    "invalid_artifact_gguf": "the file is not a readable GGUF fragment: fetch it again",
    "tensor_count_mismatch": "the fragment and the manifest disagree: rewrite the package",
    "tensor_bytes_mismatch": "the fragment and the manifest disagree: rewrite the package",
    # schema 2 (docs/cli.md "v2 validation codes")
    "unknown_field": "a schema-2 root is closed: republish it with a schema-2 writer",
    "package_identity_mismatch": "the root was edited after it was written: fetch it again",
    "carrier_has_payload": "shared/metadata.gguf must hold no tensor bytes: republish",
    "carrier_missing_marker": "this is not a package-v2 metadata carrier: republish",
    "unsupported_locator_schema": "this runtime reads locator schema 1: upgrade or republish",
    "carrier_part_count_mismatch": "the carrier and the root disagree: republish",
    "carrier_missing_array": "the carrier lacks a locator array: republish",
    "carrier_array_not_unsigned": "the carrier's locator arrays must be unsigned: republish",
    "carrier_locator_length_mismatch": "the carrier's locators and its tensors disagree: "
    "republish",
    "storage_out_of_bounds": "a tensor is placed past its artifact's end: republish",
    "overlapping_storage": "two tensors share bytes of one artifact: republish",
    "package_storage_mismatch": "a payload part and the carrier disagree: republish",
}


def with_remediation(f: Finding) -> Finding:
    if f.remediation is not None or f.code not in REMEDIATIONS:
        return f
    return dataclasses.replace(f, remediation=REMEDIATIONS[f.code])


# --- the package and its manifest -----------------------------------------------------------------
@dataclass(frozen=True)
class LoadedPackage:
    """A local package root with its parsed manifest and the SHA-256 of the manifest bytes
    (the identity verification records and materializations are keyed by)."""

    root: Path
    manifest: PackageManifest
    manifest_sha256: str
    # For hub snapshots: the repo cache folder every file must resolve inside (its files are
    # symlinks into blobs/, docs/runtime-facts.md); None for a plain local directory.
    containment_root: Path | None = None
    origin: str = ""  # what the user named: a directory or an hf:// reference
    from_hub: bool = False

    @property
    def display(self) -> str:
        return self.origin or str(self.root)


def read_package(
    root: Path, *, containment_root: Path | None = None, origin: str = "", from_hub: bool = False
) -> tuple[LoadedPackage | None, list[Finding]]:
    """Read and check ``model-package.json`` once (the bytes hashed are the bytes parsed).
    Raise ``InputUnreadable`` if ``root`` is not a readable directory."""
    require_dir(root, "package directory")
    m, raw, findings = load_manifest_findings(root, containment_root=containment_root)
    if m is None or raw is None:
        return None, [with_remediation(f) for f in findings]
    if isinstance(m, ManifestV2) and not errors_only(findings):
        m, problem = resolve_v2_catalog(root, m, containment_root=containment_root)
        findings = [*findings, *([problem] if problem else [])]
    pkg = LoadedPackage(
        root,
        m,
        hashlib.sha256(raw).hexdigest(),
        containment_root=containment_root,
        origin=origin,
        from_hub=from_hub,
    )
    return pkg, [with_remediation(f) for f in findings]


def load_package(
    root: Path, *, containment_root: Path | None = None, origin: str = "", from_hub: bool = False
) -> LoadedPackage:
    """``read_package`` for code that must stop: raise ``PackageInvalid`` on any error."""
    pkg, findings = read_package(
        root, containment_root=containment_root, origin=origin, from_hub=from_hub
    )
    raise_for_findings(findings, f"package {origin or root}")
    if pkg is None:  # unreachable: no manifest always comes with an error finding
        raise ManifestError(f"{root}: no usable manifest", path=str(root))
    return pkg


def resolve_v2_catalog(
    root: Path, m: ManifestV2, *, containment_root: Path | None = None
) -> tuple[ManifestV2, Finding | None]:
    """Read the v2 metadata carrier (path gate, presence, declared size) and attach the
    tensor catalog it resolves to (spec "v2 loading"); a problem comes back as a finding
    and the manifest without a catalog."""
    if m.root.metadata_artifact is None:  # invalid_metadata_artifact: a check_root finding
        return m, None
    ref = m.metadata_ref()
    p, problem = check_artifact_file(root, ref, containment_root=containment_root)
    if problem is not None and problem.code == "missing_artifact":
        # Not fetched yet (a hub snapshot holding only the root, a peer's bare manifest):
        # selection then takes the path-derived superset (skippy.package.select._select_v2);
        # preflight reports the missing file among every artifact's own checks.
        return m, None
    if problem is not None or p is None:
        return m, problem
    try:
        return m.with_catalog(read_catalog(m.root, p)), None
    except SkippyError as exc:
        return m, Finding.from_error(exc)


# --- one stage ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PreparedStage:
    """A stage's selection after consumer validation (and verification, when asked)."""

    package: LoadedPackage
    selection: StageSelection
    part_paths: tuple[Path, ...]
    projector_path: Path | None
    verification: VerifyReport | None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "package": self.package.display,
            "local_root": str(self.package.root),
            "manifest_sha256": self.package.manifest_sha256,
            **self.selection.to_dict(),
            "sha256_verified": self.verification is not None,
        }
        if self.verification is not None:
            out["verification"] = self.verification.to_dict()
        return out


def prepare_stage(
    pkg: LoadedPackage,
    layers: LayerRange,
    *,
    projector_path: str | None = None,
    verify: bool,
    cache: VerifyCache | None,
    text_only: bool = False,
) -> PreparedStage:
    """Spec "Consumer Validation" for one stage: select its parts (spec "Layer Selection"),
    check that they and every declared projector are safe, present, regular files of the
    declared size, and verify SHA-256 when ``verify`` (always for ``hf://``; behind
    ``SKIPPY_VERIFY_PACKAGE_SHA`` for local directories). Raise on any problem."""
    sel = select_stage(pkg.manifest, layers, projector_path=projector_path, text_only=text_only)
    # A local directory also checks every declared projector (spec "Consumer Validation"); a
    # hub stage holds only its selection and must not fetch more (a stage never
    # reads or downloads an artifact outside its selection).
    declared_projectors = (
        [] if pkg.from_hub else [r for r in pkg.manifest.artifacts() if r.role == ROLE_PROJECTOR]
    )
    # Spec "Consumer Validation": hf:// packages are always verified, cache hits included.
    verify = verify or pkg.from_hub
    findings: list[Finding] = []
    paths: dict[str, Path] = {}
    for ref in {r.path: r for r in [*sel.all_refs, *declared_projectors]}.values():
        p, problem = check_artifact_file(pkg.root, ref, containment_root=pkg.containment_root)
        if problem is not None:
            findings.append(with_remediation(problem))
        elif p is not None:
            paths[ref.path] = p
    # Other stages' layers are not this stage's business; every declared projector is.
    raise_for_findings(findings, f"stage {layers} of {pkg.display}")
    report = None
    if verify:
        report = verify_selection(
            pkg.root,
            sel,
            manifest_sha256=pkg.manifest_sha256,
            cache=cache,
            containment_root=pkg.containment_root,
        )
    return PreparedStage(
        package=pkg,
        selection=sel,
        part_paths=tuple(paths[r.path] for r in sel.parts),
        projector_path=paths[sel.projector.path] if sel.projector else None,
        verification=report,
    )


# --- the whole-package check ---------------------------------------------------------------------
@dataclass(frozen=True)
class StagePreflight:
    index: int
    layers: LayerRange
    selection: StageSelection | None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stage": self.index}
        if self.selection is not None:
            out.update(self.selection.to_dict())
            out.pop("package_bytes", None)
            out.pop("model_id", None)
        else:
            out.update({"layer_start": self.layers.start, "layer_end": self.layers.stop})
            out["error"] = self.error
        return out


@dataclass
class PreflightReport:
    package: str
    metadata_only: bool = False
    findings: list[Finding] = field(default_factory=list)
    manifest_sha256: str | None = None
    manifest: PackageManifest | None = None
    artifacts_checked: int = 0
    stages: list[StagePreflight] = field(default_factory=list)
    verification: VerifyReport | None = None
    seconds: float = 0.0

    @property
    def valid(self) -> bool:
        return not errors_only(self.findings)

    def codes(self) -> set[str]:
        return {f.code for f in self.findings}

    def to_dict(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "valid": self.valid,
            "package": self.package,
            "metadata_only": self.metadata_only,
            "model_id": m.model_id if m else None,
            "layer_count": m.layer_count if m else None,
            "manifest_sha256": self.manifest_sha256,
            "artifacts_checked": self.artifacts_checked,
            "sha256_verified": self.verification is not None,
            "verification": self.verification.to_dict() if self.verification else None,
            "stages": [s.to_dict() for s in self.stages],
            "summary": summarize(self.findings),
            "findings": [f.to_dict() for f in self.findings],
            "seconds": round(self.seconds, 3),
        }


class _GGUFMetadata(Mapping[str, Any]):
    """Read-only, lazily decoded view of a GGUF's KV section (no vocabulary decoding unless a
    caller asks for that key)."""

    def __init__(self, g: GGUFFile) -> None:
        self._g = g

    def __getitem__(self, key: str) -> Any:
        return self._g.value(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._g.fields)

    def __len__(self) -> int:
        return len(self._g.fields)


def _stage_findings(report: PreflightReport, m: PackageManifest, stages: int) -> Iterator[Finding]:
    # A bad --stages is a usage error (exit 2) like plan's, not a finding about the package.
    ranges = even_ranges(m.layer_count, stages, tail_layers(m.layer_count, m.generation))
    seen = report.codes()
    for i, r in enumerate(ranges):
        try:
            report.stages.append(StagePreflight(i, r, select_stage(m, r)))
        except SkippyError as exc:  # duplicate/missing layer: already a manifest finding
            report.stages.append(StagePreflight(i, r, None, exc.code))
            if exc.code not in seen:
                yield Finding.from_error(exc)


def _quantization_findings(
    m: Manifest, metadata_file: GGUFFile, tensors: list[TensorInfo], metadata_only: bool
) -> list[Finding]:
    """The additive ``quantization`` block (skippy-quantize) against what the package holds:
    the metadata's general.file_type and, with every fragment read, each tensor's type."""
    meta = _GGUFMetadata(metadata_file)
    out = file_type_findings(m.extra, meta)
    if metadata_only or out:
        return out
    try:
        block = parse_quantization(m.extra[QUANTIZATION_KEY])
    except ManifestError:
        return out  # a finding of check_manifest already
    facts = [TensorFacts(t.name, t.shape, t.ggml_type) for t in tensors]
    return recorded_type_findings(block, meta, facts)


def preflight_package(
    root: Path,
    *,
    stages: int | None = None,
    verify_sha256: bool = False,
    metadata_only: bool = False,
    cache: VerifyCache | None = None,
) -> PreflightReport:
    """Check a package without its source; see the module docstring. Never raises for a bad
    package (only ``InputUnreadable`` when ``root`` itself cannot be read)."""
    if metadata_only and stages is not None:
        raise UsageError(
            "--metadata-only checks no layer range; it cannot be combined with --stages",
            code="usage",
        )
    if stages is not None:
        check_stage_count(stages, MAX_LAYER_COUNT)  # the package's own count is checked below
    t0 = time.perf_counter()
    report = PreflightReport(package=str(root), metadata_only=metadata_only)
    pkg, findings = read_package(root)
    report.findings.extend(findings)
    if pkg is None:
        report.seconds = time.perf_counter() - t0
        return report
    m = report.manifest = pkg.manifest
    report.manifest_sha256 = pkg.manifest_sha256
    if stages is not None:  # before any artifact is read or hashed
        check_stage_count(stages, m.layer_count, tail_layers(m.layer_count, m.generation))

    # Metadata-only inspection validates the manifest and the shared metadata artifact only.
    refs = [next(m.artifacts())] if metadata_only else list(m.artifacts())
    good: list[ArtifactRef] = []
    layer_names: dict[int, tuple[str, ...]] = {}
    problems: list[Finding] = []
    metadata_file: GGUFFile | None = None
    checked: set[str] = set()
    tensors: list[TensorInfo] = []  # every checked fragment's, for the quantization block
    try:
        for ref in refs:
            # Lexically unsafe paths are already findings from check_manifest; symlinks that
            # lead out of the package are caught by check_artifact_file's resolve_under.
            if ref.path in checked or not is_safe_relative_path(ref.path):
                continue
            checked.add(ref.path)
            p, problem = check_artifact_file(root, ref)
            if problem is not None or p is None:
                problems.extend([problem] if problem else [])
                continue
            report.artifacts_checked += 1
            good.append(ref)
            try:
                g = open_gguf(
                    p, header_only=isinstance(m, ManifestV2) and ref.role == ROLE_METADATA
                )
            except SkippyError as exc:
                problems.append(Finding("invalid_artifact_gguf", exc.message, path=ref.path))
                continue
            if not isinstance(m, ManifestV2):
                problems.extend(header_findings(ref, g.tensors))
            elif m.catalog is not None and ref.role in (ROLE_COMMON, ROLE_LAYER):
                aid = m.artifact_id_of(ref.path)
                problems.extend(part_directory_findings(m.catalog, aid, ref.path, g.tensors))
            if ref.role != ROLE_PROJECTOR:
                tensors.extend(g.tensors)
            if ref.role == ROLE_LAYER and ref.layer_index is not None:
                # a v2 layer may span several -partNN files
                layer_names[ref.layer_index] = layer_names.get(ref.layer_index, ()) + tuple(
                    t.name for t in g.tensors
                )
            if ref.role == ROLE_METADATA and metadata_file is None:
                metadata_file = g
            else:
                g.close()

        def names_of(index: int) -> Collection[str]:
            return layer_names.get(index, ())

        # v2: its speculative_decoding block has v1's shape and rules (spec "v2 generation");
        # request_defaults is carried as given (its profile rules are not checked: docs/cli.md)
        generation = m.speculative_block() if isinstance(m, ManifestV2) else m.generation
        if generation is not None:
            from skippy.generation import check_generation

            arch = metadata_file.get(KEY_ARCHITECTURE) if metadata_file else None
            problems.extend(
                check_generation(
                    generation,
                    layer_count=m.layer_count,
                    layer_tensor_names=None if metadata_only else names_of,
                    metadata=_GGUFMetadata(metadata_file) if metadata_file else None,
                    arch=arch if isinstance(arch, str) else None,
                )
            )
        # Only over a complete, readable package: the rules count tensors as they meet them.
        if (
            isinstance(m, Manifest)
            and QUANTIZATION_KEY in m.extra
            and metadata_file is not None
            and not problems
        ):
            problems.extend(_quantization_findings(m, metadata_file, tensors, metadata_only))
    finally:
        if metadata_file is not None:
            metadata_file.close()

    if verify_sha256 and good:
        try:
            report.verification = check_refs(
                root, good, manifest_sha256=pkg.manifest_sha256, cache=cache
            )
        except SkippyError as exc:  # a file vanished or changed size since it was checked
            problems.append(Finding.from_error(exc))
        else:
            for bad in report.verification.mismatches:
                problems.append(
                    Finding(
                        "artifact_sha256_mismatch",
                        f"{bad.path} has SHA-256 {bad.actual_sha256}, the manifest declares "
                        f"{bad.expected_sha256}",
                        path=bad.path,
                    )
                )
    report.findings.extend(problems)
    if stages is not None:
        report.findings.extend(_stage_findings(report, m, stages))
    report.findings = [with_remediation(f) for f in report.findings]
    report.seconds = time.perf_counter() - t0
    return report
