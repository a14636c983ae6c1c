"""A model's experts, read from a source GGUF or a local package: the thin I/O shell over
``skippy.package.experts`` (pure). Only headers are read (the bounded reader, no ``import
gguf``): a v1 package's metadata part and fragments, a v2 package's metadata carrier."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from skippy.constants import ROLE_PROJECTOR
from skippy.errors import ArtifactMissing
from skippy.package.experts import ExpertSummary, metadata_from, summarize
from skippy.produce.source import SourceModelFiles

if TYPE_CHECKING:
    from skippy.package.manifest import PackageManifest


def source_experts(src: SourceModelFiles) -> ExpertSummary:
    """The experts of an open source model (every shard's tensors); checked."""
    return summarize(metadata_from(src.head.get), [t.info for t in src.tensors])


def package_experts(
    package_dir: Path, m: PackageManifest, *, containment_root: Path | None = None
) -> ExpertSummary | None:
    """The experts of a package in ``package_dir``, checked; ``None`` when a file they are
    read from is not there (a package not fully fetched: its manifest alone does not say).
    ``containment_root``: a hub snapshot's repo cache folder (``stat_artifact``)."""
    from skippy.gguf.reader import open_gguf
    from skippy.package.artifacts import stat_artifact
    from skippy.package.catalog import catalog_from_fragments
    from skippy.package.v2_carrier import open_carrier, resolve_carrier
    from skippy.package.v2_view import ManifestV2

    try:
        if isinstance(m, ManifestV2):
            if m.root.metadata_artifact is None:
                return None
            carrier, _ = stat_artifact(
                package_dir, m.metadata_ref(), containment_root=containment_root
            )
            with open_carrier(carrier) as g:
                catalog = resolve_carrier(m.root, g)
                kv = metadata_from(g.get)
            return summarize(kv, catalog)
        refs = [r for r in m.artifacts() if r.role != ROLE_PROJECTOR]  # not the model's
        files = [
            (r.path, stat_artifact(package_dir, r, containment_root=containment_root)[0])
            for r in refs
        ]
    except ArtifactMissing as exc:
        if exc.code != "missing_artifact":
            raise
        return None
    with open_gguf(files[0][1]) as g:  # the metadata part comes first
        kv = metadata_from(g.get)
    return summarize(kv, catalog_from_fragments(files))
