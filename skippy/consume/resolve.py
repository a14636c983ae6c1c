"""From a package reference to a validated, verified stage on local disk.

The one place a reference (a local directory or ``hf://ns/repo[@rev]``) becomes a package:

    parse_package_ref -> open_package (hf: resolve the revision, download model-package.json
    only) -> select_stage -> fetch_selection (hf: download exactly the selected artifacts into
    the standard hub cache) -> prepare_stage (consumer validation, SHA-256 with the
    verification cache; always for hf://, spec "Consumer Validation").

Downloads go through huggingface_hub (``skippy.consume.hub``), so ``hf`` tooling sees the cache and
``HF_HUB_OFFLINE=1`` serves a stage from it or lists what is missing.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skippy.config import Environment
from skippy.constants import MANIFEST_NAME
from skippy.consume.cache_layout import repo_cache_root
from skippy.consume.preflight import LoadedPackage, PreparedStage, load_package, prepare_stage
from skippy.consume.verify import VerifyCache
from skippy.errors import InputUnreadable, IntegrityError, PackageInvalid, UnsafePath
from skippy.findings import Finding, raise_for_findings
from skippy.package.ranges import LayerRange, parse_layer_range
from skippy.package.refs import HfPackageRef, LocalPackageRef, PackageRef, parse_package_ref
from skippy.package.select import StageSelection, select_stage
from skippy.paths import is_within, resolve_under

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedFile:
    path: str
    artifact_bytes: int
    downloaded: bool  # False: already in the cache (or a local package)


@dataclass
class FetchReport:
    files: list[FetchedFile] = field(default_factory=list)
    package_bytes: int = 0
    seconds: float = 0.0

    @property
    def bytes_selected(self) -> int:
        return sum(f.artifact_bytes for f in self.files)

    @property
    def bytes_downloaded(self) -> int:
        return sum(f.artifact_bytes for f in self.files if f.downloaded)

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": [f.__dict__ for f in self.files],
            "bytes_selected": self.bytes_selected,
            "bytes_downloaded": self.bytes_downloaded,
            "package_bytes": self.package_bytes,
            "seconds": round(self.seconds, 3),
        }


def _hub_kwargs(env: Environment) -> dict[str, Any]:
    return {
        "endpoint": env.hf_endpoint,
        "cache_dir": env.hf_cache_dir,
        "offline": env.hf_offline,
        "policy": env.hub_policy,
    }


def open_package(ref: PackageRef, env: Environment) -> LoadedPackage:
    """Read and check the manifest; for hf:// that is the only file downloaded here."""
    if isinstance(ref, LocalPackageRef):
        if not ref.path.is_dir():
            raise InputUnreadable(
                f"package directory {ref.path} does not exist", path=str(ref.path)
            )
        return load_package(ref.path, origin=str(ref.path))
    from skippy.consume import hub  # huggingface_hub: ~0.5 s to import, only for hf:// refs

    commit = hub.resolve_revision(ref, **_hub_kwargs(env))
    manifest_file = hub.download_file(ref, commit, MANIFEST_NAME, **_hub_kwargs(env))
    carrier = _v2_carrier_path(
        manifest_file.parent, repo_cache_root(env.hf_cache_dir, ref.repo_id)
    )
    if carrier is not None:  # package v2: the root and the carrier first (spec "v2 fetching")
        hub.download_file(ref, commit, carrier, **_hub_kwargs(env))
    return load_package(
        manifest_file.parent,
        containment_root=repo_cache_root(env.hf_cache_dir, ref.repo_id),
        origin=str(ref.at(commit)),
        from_hub=True,
    )


def _v2_carrier_path(snapshot: Path, containment_root: Path) -> str | None:
    """The metadata carrier's path when the snapshot's manifest is a v2 root (None for v1 or
    an unreadable manifest: load_package reports that)."""
    from skippy.errors import ManifestError
    from skippy.package.manifest import parse_manifest, read_manifest_bytes
    from skippy.package.v2_view import ManifestV2

    try:
        m = parse_manifest(read_manifest_bytes(snapshot, containment_root=containment_root))
    except (ManifestError, InputUnreadable, UnsafePath):
        return None
    if not isinstance(m, ManifestV2) or m.root.metadata_artifact is None:
        return None
    return m.root.metadata_artifact.path


def fetch_selection(
    pkg: LoadedPackage, ref: PackageRef, selection: StageSelection, env: Environment
) -> FetchReport:
    """Bring exactly the selected artifacts to local disk (nothing to do for a directory)."""
    t0 = time.perf_counter()
    report = FetchReport(package_bytes=pkg.manifest.total_artifact_bytes())
    refs = selection.all_refs
    if isinstance(ref, HfPackageRef):
        from skippy.consume import hub

        commit = pkg.root.name  # the hub cache layout: snapshots/<commit>/model-package.json
        present = {r.path for r in refs if (pkg.root / r.path).exists()}
        hub.download_many(ref, commit, [r.path for r in refs], **_hub_kwargs(env))
    else:
        present = {r.path for r in refs}
    report.files = [
        FetchedFile(r.path, r.artifact.artifact_bytes, r.path not in present) for r in refs
    ]
    report.seconds = time.perf_counter() - t0
    return report


@dataclass(frozen=True)
class ResolvedStage:
    ref: PackageRef
    stage: PreparedStage
    fetch: FetchReport

    def files(self) -> dict[str, Path]:
        """Manifest path -> local file for every selected artifact."""
        sel = self.stage.selection
        out = {r.path: p for r, p in zip(sel.parts, self.stage.part_paths, strict=True)}
        if sel.projector is not None and self.stage.projector_path is not None:
            out[sel.projector.path] = self.stage.projector_path
        return out


def resolve_stage(
    ref_text: str,
    env: Environment,
    *,
    layers_text: str | None = None,
    projector_path: str | None = None,
    text_only: bool = False,
) -> ResolvedStage:
    """REF + layer range -> a validated stage whose selected files are local and verified
    (hf:// always; local directories unless SKIPPY_VERIFY_PACKAGE_SHA turns it off)."""
    ref = parse_package_ref(ref_text)
    pkg = open_package(ref, env)
    n = pkg.manifest.layer_count
    layers = parse_layer_range(layers_text, n) if layers_text is not None else LayerRange(0, n, n)
    selection = select_stage(
        pkg.manifest, layers, projector_path=projector_path, text_only=text_only
    )
    fetched = fetch_selection(pkg, ref, selection, env)
    if isinstance(ref, HfPackageRef):
        _check_remote_projectors(pkg, ref, selection, env)
    verify = pkg.from_hub or env.verify_local_sha256
    try:
        stage = prepare_stage(
            pkg,
            layers,
            projector_path=projector_path,
            verify=verify,
            cache=VerifyCache.under(env.skippy_cache_dir) if verify else None,
            text_only=text_only,
        )
    except (IntegrityError, PackageInvalid) as exc:
        bad = _corrupt_paths(exc)
        if pkg.from_hub and bad:
            for rel in bad:
                _evict_from_hub_cache(pkg, rel)
            exc.remediation = "the corrupt copy was removed from the hub cache; fetch again"
        raise
    return ResolvedStage(ref, stage, fetched)


_CORRUPT_CODES = frozenset({"artifact_sha256_mismatch", "artifact_size_mismatch"})


def _corrupt_paths(exc: IntegrityError | PackageInvalid) -> list[str]:
    """Artifacts whose bytes are wrong (not missing, not unsafe): those may be evicted."""
    if isinstance(exc, IntegrityError):
        return list(exc.paths) if exc.code in _CORRUPT_CODES else []
    return [f.path for f in exc.findings if f.code in _CORRUPT_CODES and f.path]


def _check_remote_projectors(
    pkg: LoadedPackage, ref: HfPackageRef, selection: StageSelection, env: Environment
) -> None:
    """Spec "Consumer Validation": declared projector paths are files of the declared size.
    A hub stage must not download projectors it does not use, so it asks the hub for their
    size instead (one HEAD each); offline, that check is impossible and is logged as skipped."""
    selected = {r.path for r in selection.all_refs}
    others = [p for p in pkg.manifest.projectors if p.path not in selected]
    if not others:
        return
    if env.hf_offline:
        log.warning(
            "offline: declared projectors not checked on the hub: %s",
            ", ".join(p.path for p in others),
        )
        return
    from skippy.consume import hub

    commit = pkg.root.name
    findings = []
    for proj in others:
        try:
            size = hub.remote_size(
                ref, commit, proj.path, endpoint=env.hf_endpoint, policy=env.hub_policy
            )
        except hub.HubError as exc:  # the stage itself is verified; an unused file must not
            log.warning("declared projector %s not checked: %s", proj.path, exc.message)
            continue
        if size is not None and size != proj.artifact_bytes:
            findings.append(
                Finding(
                    "artifact_size_mismatch",
                    f"{proj.path} is {size} bytes on the hub, the manifest declares "
                    f"{proj.artifact_bytes}",
                    path=proj.path,
                )
            )
    raise_for_findings(findings, f"declared projectors of {pkg.display}")


def _evict_from_hub_cache(pkg: LoadedPackage, rel: str) -> None:
    """huggingface_hub checks sizes only (runtime-facts.md) and would serve a corrupt blob forever:
    drop the snapshot link and its blob so the next fetch downloads it again."""
    link = pkg.root / rel
    with contextlib.suppress(OSError, UnsafePath):
        blob = resolve_under(pkg.root, rel, containment_root=pkg.containment_root).resolve()
        link.unlink(missing_ok=True)
        if pkg.containment_root and is_within(blob, pkg.containment_root):
            blob.unlink(missing_ok=True)


def open_ref(ref_text: str, env: Environment) -> LoadedPackage:
    """Metadata-only: resolve and read the manifest (spec: no layer range needed)."""
    return open_package(parse_package_ref(ref_text), env)


__all__ = [
    "FetchReport",
    "FetchedFile",
    "ResolvedStage",
    "fetch_selection",
    "open_package",
    "open_ref",
    "resolve_stage",
]
