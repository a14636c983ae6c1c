"""Artifact checks shared by every consumer and by validate-package (spec "Consumer
Validation"): one file's path gate, presence, type and size, and its GGUF header against its
manifest entry. Typed errors for code that must stop, findings for reports.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from skippy.errors import ArtifactMissing, InputUnreadable, IntegrityError, UnsafePath
from skippy.findings import Finding
from skippy.gguf.reader import TensorInfo
from skippy.package.manifest import ArtifactRef
from skippy.paths import resolve_under


def stat_artifact(
    root: Path, ref: ArtifactRef, *, containment_root: Path | None = None
) -> tuple[Path, os.stat_result]:
    """Spec "Consumer Validation" for one file: path gate, presence, regular file, size.
    Raises a typed error; ``check_artifact_file`` is the same check as a finding.
    ``containment_root`` is the repo cache folder for hub snapshots (see ``skippy.paths``)."""
    a = ref.artifact
    p = resolve_under(root, a.path, containment_root=containment_root)
    try:
        st = p.stat()  # resolve_under proved any symlink stays inside the root
    except FileNotFoundError as exc:
        raise ArtifactMissing(f"{a.path} is declared but missing", path=a.path) from exc
    except OSError as exc:
        raise InputUnreadable(
            f"cannot stat {a.path}: {exc.strerror}", code="unreadable_artifact", path=a.path
        ) from exc
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactMissing(
            f"{a.path} is not a regular file", path=a.path, code="artifact_not_file"
        )
    if st.st_size != a.artifact_bytes:
        raise IntegrityError(
            f"{a.path} is {st.st_size} bytes, the manifest declares {a.artifact_bytes}",
            code="artifact_size_mismatch",
            path=a.path,
            expected=a.artifact_bytes,
            actual=st.st_size,
            remediation="the file is truncated or replaced: fetch or write the package again",
        )
    return p, st


def check_artifact_file(
    root: Path, ref: ArtifactRef, *, containment_root: Path | None = None
) -> tuple[Path | None, Finding | None]:
    """``stat_artifact`` as (path, None) or (None, finding)."""
    try:
        return stat_artifact(root, ref, containment_root=containment_root)[0], None
    except (UnsafePath, ArtifactMissing, IntegrityError, InputUnreadable) as exc:
        return None, Finding.from_error(exc)


def header_findings(ref: ArtifactRef, tensors: Sequence[TensorInfo]) -> list[Finding]:
    """An artifact's GGUF header against its manifest entry: tensor count and tensor bytes."""
    a, out = ref.artifact, []
    if len(tensors) != a.tensor_count:
        out.append(
            Finding(
                "tensor_count_mismatch",
                f"{a.path} holds {len(tensors)} tensors, the manifest says {a.tensor_count}",
                path=a.path,
            )
        )
    tensor_bytes = sum(t.nbytes for t in tensors)
    if tensor_bytes != a.tensor_bytes:
        out.append(
            Finding(
                "tensor_bytes_mismatch",
                f"{a.path} holds {tensor_bytes} tensor bytes, the manifest says {a.tensor_bytes}",
                path=a.path,
            )
        )
    return out
