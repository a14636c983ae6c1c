"""The package README (spec "Publishing Rules": what a published repository SHOULD say)."""

from __future__ import annotations

import json

from skippy.constants import MANIFEST_NAME
from skippy.package.manifest import Manifest


def render_readme(manifest: Manifest, manifest_sha256: str, *, validation_note: str | None) -> str:
    m, src = manifest, manifest.source_model
    lines = [
        f"# {m.model_id} — layer package",
        "",
        "A layer package: one GGUF fragment per transformer layer plus shared metadata,",
        "embeddings and output fragments, described by `model-package.json`.",
        "",
        "## Source",
        "",
        f"- Model coordinate: `{m.model_id}`",
        f"- Source repository: `{src.repo}` at revision `{src.revision}`",
        f"- Source file: `{src.primary_file}`",
        f"- Source SHA-256: `{src.sha256}`",
    ]
    if len(src.files) > 1:
        lines.append("- Source shards:")
        lines += [f"  - `{f.path}` ({f.size_bytes} bytes, SHA-256 `{f.sha256}`)" for f in src.files]
    lines += [
        "",
        "## Package",
        "",
        f"- Manifest: `{MANIFEST_NAME}`, SHA-256 `{manifest_sha256}`",
        f"- Layer count: {m.layer_count}",
        f"- Activation width: {m.activation_width}",
        f"- Tied embeddings: {'yes' if m.tied_embeddings else 'no'}",
        f"- Skippy ABI version: {m.skippy_abi_version}",
        f"- Artifacts: {3 + len(m.layers)} fragments, {m.total_artifact_bytes()} bytes in all",
    ]
    if m.projectors:
        lines += ["", "## Projectors", ""]
        lines += [
            f"- `{p.path}` (kind `{p.kind}`, {p.artifact_bytes} bytes, SHA-256 `{p.sha256}`)"
            for p in m.projectors
        ]
    lines += ["", "## Generation defaults", ""]
    if m.generation:
        lines += ["```json", json.dumps(m.generation, indent=2, sort_keys=True), "```"]
    else:
        lines.append("None declared.")
    lines += [
        "",
        "## Validation",
        "",
        "```",
        f"skippy-model-package validate-package {src.primary_file.rsplit('/', 1)[-1]} .",
        "```",
        "",
        validation_note
        or "Result: not run at write time (run the command above against the "
        "source before publishing).",
        "",
    ]
    return "\n".join(lines)
