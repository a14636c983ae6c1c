"""Small helpers shared by package tests (not fixtures: plain functions)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from skippy.produce.write_package import WriteOptions, WriteResult, local_provenance, write_package


def make_package(
    source: Path, out_dir: Path, *, model_id: str = "acme/tiny-GGUF:Q8_0", **opts: Any
) -> WriteResult:
    prov = local_provenance(
        model_id=model_id,
        source_repo=None,
        source_revision="0123abc",
        source_file=source.name,
    )
    return write_package(source, WriteOptions(out_dir=out_dir, provenance=prov, **opts))


def edit_manifest(pkg: Path, edit: Any) -> None:
    """Apply ``edit(dict)`` to model-package.json in place (for hostile-manifest tests)."""
    path = pkg / "model-package.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
