"""model-package.json: frozen value objects, a strict parser, semantic checks, canonical bytes.

Spec "Manifest Schema". Parsing (``parse_manifest``) rejects what cannot be read as schema 1
at all: bad JSON, an unknown ``schema_version`` or ``format``, wrong field types; each error
names the field path. Semantic rules (identity, ABI, layer coverage, path safety, byte and
digest fields) are findings from ``check_manifest`` so tools can report all of them at once.
Unknown top-level fields are kept (the schema is additive) and written back unchanged.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skippy.constants import (
    FORMAT,
    MANIFEST_MAX_BYTES,
    MANIFEST_NAME,
    MAX_ACTIVATION_WIDTH,
    MAX_ARTIFACT_BYTES,
    MAX_ARTIFACT_TENSORS,
    MAX_INT_DIGITS,
    MAX_LAYER_COUNT,
    MAX_UNIX_SECS,
    PROJECTOR_KINDS,
    ROLE_EMBEDDINGS,
    ROLE_LAYER,
    ROLE_METADATA,
    ROLE_OUTPUT,
    ROLE_PROJECTOR,
    RUNTIME_ABI_VERSION,
    SCHEMA_VERSION,
    SCHEMA_VERSION_V2,
    SHA256_HEX_RE,
    SHARED_ROLES,
)
from skippy.errors import InputUnreadable, ManifestError, UnsafePath
from skippy.findings import Finding
from skippy.package.artifact_ref import Artifact as Artifact  # re-exported
from skippy.package.artifact_ref import ArtifactRef as ArtifactRef
from skippy.package.artifact_ref import LayerArtifact as LayerArtifact
from skippy.package.artifact_ref import ProjectorArtifact as ProjectorArtifact
from skippy.package.quantization import quantization_findings
from skippy.package.v2_view import ManifestV2, check_manifest_v2, manifest_v2_from_data
from skippy.paths import is_safe_relative_path, resolve_under
from skippy.progress import human_bytes
from skippy.text import unsafe_char

MAX_MISSING_LAYER_FINDINGS = 20  # beyond this, one summary finding (a hostile count stays cheap)


# --- value objects ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SourceFile:
    path: str
    size_bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size_bytes": self.size_bytes, "sha256": self.sha256}


@dataclass(frozen=True, kw_only=True)
class SourceModel:
    sha256: str
    path: str = ""
    repo: str = ""
    revision: str = ""
    primary_file: str = ""
    canonical_ref: str = ""
    distribution_id: str = ""
    files: tuple[SourceFile, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "sha256": self.sha256,
            "repo": self.repo,
            "revision": self.revision,
            "primary_file": self.primary_file,
            "canonical_ref": self.canonical_ref,
            "distribution_id": self.distribution_id,
            "files": [f.to_dict() for f in self.files],
        }


@dataclass(frozen=True)
class SharedArtifacts:
    metadata: Artifact
    embeddings: Artifact
    output: Artifact

    def to_dict(self) -> dict[str, Any]:
        return {
            ROLE_METADATA: self.metadata.to_dict(),
            ROLE_EMBEDDINGS: self.embeddings.to_dict(),
            ROLE_OUTPUT: self.output.to_dict(),
        }


@dataclass(frozen=True, kw_only=True)
class Manifest:
    model_id: str
    source_model: SourceModel
    layer_count: int
    shared: SharedArtifacts
    layers: tuple[LayerArtifact, ...]
    skippy_abi_version: str
    schema_version: int = SCHEMA_VERSION
    format: str = FORMAT
    activation_width: int | None = None
    projectors: tuple[ProjectorArtifact, ...] = ()
    generation: Mapping[str, Any] | None = None
    created_at_unix_secs: int | None = None
    tied_embeddings: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    def layer(self, index: int) -> LayerArtifact:
        """The entry for one layer index (first one if a broken manifest repeats it)."""
        for entry in self.layers:
            if entry.layer_index == index:
                return entry
        raise KeyError(index)

    def metadata_ref(self) -> ArtifactRef:
        return ArtifactRef(ROLE_METADATA, self.shared.metadata)

    def artifacts(self) -> Iterator[ArtifactRef]:
        """Every artifact in canonical load order: metadata, embeddings, layers, output,
        then projectors (which are never part of a stage's split set)."""
        yield ArtifactRef(ROLE_METADATA, self.shared.metadata)
        yield ArtifactRef(ROLE_EMBEDDINGS, self.shared.embeddings)
        for entry in sorted(self.layers, key=lambda e: e.layer_index):
            yield ArtifactRef(ROLE_LAYER, entry, entry.layer_index)
        yield ArtifactRef(ROLE_OUTPUT, self.shared.output)
        for proj in self.projectors:
            yield ArtifactRef(ROLE_PROJECTOR, proj)

    def total_artifact_bytes(self) -> int:
        return sum(a.artifact.artifact_bytes for a in self.artifacts())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out.update(
            {
                "schema_version": self.schema_version,
                "model_id": self.model_id,
                "source_model": self.source_model.to_dict(),
                "format": self.format,
                "layer_count": self.layer_count,
                "shared": self.shared.to_dict(),
                "layers": [e.to_dict() for e in self.layers],
                "projectors": [p.to_dict() for p in self.projectors],
                "skippy_abi_version": self.skippy_abi_version,
                "tied_embeddings": self.tied_embeddings,
            }
        )
        if self.activation_width is not None:
            out["activation_width"] = self.activation_width
        if self.generation is not None:
            out["generation"] = self.generation
        if self.created_at_unix_secs is not None:
            out["created_at_unix_secs"] = self.created_at_unix_secs
        return out


# Either schema version, as the consumers and peer transfer hold it.
PackageManifest = Manifest | ManifestV2


def dump_manifest(manifest: Manifest) -> bytes:
    """Canonical bytes: sorted keys, two-space indent, UTF-8, trailing newline. The same
    package always yields the same bytes apart from ``created_at_unix_secs``."""
    text = json.dumps(manifest.to_dict(), sort_keys=True, indent=2, ensure_ascii=False)
    return (text + "\n").encode("utf-8")


# --- parsing --------------------------------------------------------------------------------------
_KNOWN_TOP = frozenset(
    {
        "schema_version",
        "model_id",
        "source_model",
        "format",
        "layer_count",
        "activation_width",
        "generation",
        "shared",
        "layers",
        "projectors",
        "skippy_abi_version",
        "created_at_unix_secs",
        "tied_embeddings",
    }
)


class _Obj:
    """Typed access to one JSON object; every failure names the field path."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ManifestError(
                f"{where or 'manifest'} must be a JSON object, got {type(data).__name__}",
                path=where or None,
            )
        self.data: dict[str, Any] = data
        self.where = where

    def _path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _bad(self, key: str, want: str) -> ManifestError:
        got = self.data.get(key)
        return ManifestError(
            f"{self._path(key)} must be {want}, got {json.dumps(got)[:60]}", path=self._path(key)
        )

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def req(self, key: str) -> Any:
        if key not in self.data:
            raise ManifestError(f"{self._path(key)} is required", path=self._path(key))
        return self.data[key]

    def str_(self, key: str, *, required: bool = True) -> str:
        if not required and not self.has(key):
            return ""
        v = self.req(key)
        if not isinstance(v, str):
            raise self._bad(key, "a string")
        return v

    def int_(self, key: str, lo: int, hi: int) -> int:
        """A required integer in ``lo..hi`` (inclusive)."""
        v = self.req(key)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self._bad(key, f"an integer in {lo}..{hi}")
        return v

    def opt_int(self, key: str, lo: int, hi: int) -> int | None:
        return self.int_(key, lo, hi) if self.has(key) else None

    def nonneg(self, key: str, hi: int) -> int:
        return self.int_(key, 0, hi)

    def obj(self, key: str) -> _Obj:
        return _Obj(self.req(key), self._path(key))

    def list_(self, key: str, *, required: bool = True) -> list[Any]:
        if not required and not self.has(key):
            return []
        v = self.req(key)
        if not isinstance(v, list):
            raise self._bad(key, "a list")
        return v


def _artifact_fields(o: _Obj) -> dict[str, Any]:
    return {
        "path": o.str_("path"),
        "tensor_count": o.nonneg("tensor_count", MAX_ARTIFACT_TENSORS),
        "tensor_bytes": o.nonneg("tensor_bytes", MAX_ARTIFACT_BYTES),
        "artifact_bytes": o.nonneg("artifact_bytes", MAX_ARTIFACT_BYTES),
        "sha256": o.str_("sha256"),
    }


def _parse_source(o: _Obj) -> SourceModel:
    files = []
    for i, raw in enumerate(o.list_("files", required=False)):
        fo = _Obj(raw, f"{o.where}.files[{i}]")
        files.append(
            SourceFile(
                fo.str_("path"), fo.nonneg("size_bytes", MAX_ARTIFACT_BYTES), fo.str_("sha256")
            )
        )
    return SourceModel(
        sha256=o.str_("sha256"),
        path=o.str_("path", required=False),
        repo=o.str_("repo", required=False),
        revision=o.str_("revision", required=False),
        primary_file=o.str_("primary_file", required=False),
        canonical_ref=o.str_("canonical_ref", required=False),
        distribution_id=o.str_("distribution_id", required=False),
        files=tuple(files),
    )


def read_manifest_bytes(package_dir: Path, *, containment_root: Path | None = None) -> bytes:
    """The one reader of ``model-package.json``: through the path gate, a regular file only
    (a FIFO would block forever), and never more than the cap plus one byte."""
    path = resolve_under(package_dir, MANIFEST_NAME, containment_root=containment_root)
    try:
        st = path.stat()
    except FileNotFoundError as exc:
        raise ManifestError(
            f"{package_dir} has no {MANIFEST_NAME}: not a layer package",
            code="missing_manifest",
            path=MANIFEST_NAME,
            remediation="point at the package root (the folder holding model-package.json)",
        ) from exc
    except OSError as exc:
        raise InputUnreadable(f"cannot read {path}: {exc.strerror or exc}", path=str(path)) from exc
    if not stat.S_ISREG(st.st_mode):
        raise InputUnreadable(
            f"{path} is not a regular file", code="manifest_not_file", path=str(path)
        )
    if st.st_size > MANIFEST_MAX_BYTES:
        raise ManifestError(
            f"{MANIFEST_NAME} is {human_bytes(st.st_size)} ({st.st_size} bytes), over the "
            f"{human_bytes(MANIFEST_MAX_BYTES)} cap",
            code="manifest_too_large",
            path=MANIFEST_NAME,
        )
    try:
        with open(path, "rb") as f:
            return f.read(MANIFEST_MAX_BYTES + 1)  # parse_manifest rejects anything longer
    except OSError as exc:
        raise InputUnreadable(f"cannot read {path}: {exc.strerror or exc}", path=str(path)) from exc


def load_manifest_findings(
    package_dir: Path, *, containment_root: Path | None = None
) -> tuple[PackageManifest | None, bytes | None, list[Finding]]:
    """Read, parse and check once: (manifest, the exact bytes parsed, findings). A manifest
    that cannot be read as schema 1 comes back as None with its finding."""
    try:
        raw = read_manifest_bytes(package_dir, containment_root=containment_root)
        m = parse_manifest(raw)
    except (ManifestError, UnsafePath) as exc:
        return None, None, [Finding.from_error(exc)]
    return m, raw, check_manifest(m)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ManifestError(
                f"key {key!r} appears twice in one object: the manifest is ambiguous",
                code="duplicate_manifest_key",
                path=key,
            )
        out[key] = value
    return out


def _parse_int(literal: str) -> int:
    """JSON integers, refused past MAX_INT_DIGITS before Python converts them (a 100k-digit
    literal would otherwise cost quadratic time or hit Python's own digit limit)."""
    digits = len(literal.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ManifestError(
            f"model-package.json holds an integer of {digits} digits; no manifest field needs "
            f"more than {MAX_INT_DIGITS}",
            code="invalid_manifest_json",
        )
    return int(literal)


def parse_manifest(raw: bytes) -> PackageManifest:
    """Parse manifest bytes strictly into a ``Manifest`` (schema 1) or a ``ManifestV2``
    (schema 2, its carrier not yet resolved); raise ``ManifestError`` with a code."""
    if len(raw) > MANIFEST_MAX_BYTES:
        raise ManifestError(
            f"manifest is over the {human_bytes(MANIFEST_MAX_BYTES)} cap",
            code="manifest_too_large",
        )
    try:
        data = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys, parse_int=_parse_int
        )
    except ManifestError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ManifestError(
            f"model-package.json is not valid UTF-8 JSON: {exc}", code="invalid_manifest_json"
        ) from exc
    top = _Obj(data, "")
    version = data.get("schema_version")
    if isinstance(data, dict) and version == SCHEMA_VERSION_V2 and not isinstance(version, bool):
        return manifest_v2_from_data(data)
    if isinstance(version, bool) or version != SCHEMA_VERSION:
        raise ManifestError(
            f"schema_version {json.dumps(version)} is not supported (this runtime reads "
            f"{SCHEMA_VERSION} and {SCHEMA_VERSION_V2}); upgrade the runtime or republish the "
            "package",
            code="unsupported_schema_version",
            path="schema_version",
            expected=SCHEMA_VERSION,
            actual=version,
        )
    fmt = data.get("format")
    if fmt != FORMAT:
        raise ManifestError(
            f"format {json.dumps(fmt)} is not {FORMAT!r}",
            code="invalid_format",
            path="format",
            expected=FORMAT,
            actual=fmt,
        )
    layer_count = top.nonneg("layer_count", 1 << 62)
    if layer_count > MAX_LAYER_COUNT:
        raise ManifestError(
            f"layer_count {layer_count} is over the {MAX_LAYER_COUNT} this runtime supports "
            "(llama.cpp split sets count fragments in 16 bits)",
            code="layer_count_too_large",
            path="layer_count",
        )
    shared = top.obj("shared")
    layers = []
    for i, raw_layer in enumerate(top.list_("layers")):
        lo = _Obj(raw_layer, f"layers[{i}]")
        layers.append(
            LayerArtifact(layer_index=lo.nonneg("layer_index", 1 << 62), **_artifact_fields(lo))
        )
    projectors = []
    for i, raw_proj in enumerate(top.list_("projectors", required=False)):
        po = _Obj(raw_proj, f"projectors[{i}]")
        projectors.append(ProjectorArtifact(kind=po.str_("kind"), **_artifact_fields(po)))
    generation = data.get("generation")
    if generation is not None and not isinstance(generation, dict):
        raise ManifestError("generation must be a JSON object", path="generation")
    tied = data.get("tied_embeddings", False)
    if not isinstance(tied, bool):
        raise ManifestError("tied_embeddings must be a boolean", path="tied_embeddings")
    return Manifest(
        schema_version=SCHEMA_VERSION,
        format=FORMAT,
        model_id=top.str_("model_id"),
        source_model=_parse_source(top.obj("source_model")),
        layer_count=layer_count,
        activation_width=top.opt_int("activation_width", 1, MAX_ACTIVATION_WIDTH),
        shared=SharedArtifacts(
            metadata=Artifact(**_artifact_fields(shared.obj(ROLE_METADATA))),
            embeddings=Artifact(**_artifact_fields(shared.obj(ROLE_EMBEDDINGS))),
            output=Artifact(**_artifact_fields(shared.obj(ROLE_OUTPUT))),
        ),
        layers=tuple(layers),
        projectors=tuple(projectors),
        generation=generation,
        skippy_abi_version=top.str_("skippy_abi_version", required=False),
        created_at_unix_secs=top.opt_int("created_at_unix_secs", 0, MAX_UNIX_SECS),
        tied_embeddings=tied,
        extra={k: v for k, v in data.items() if k not in _KNOWN_TOP},
    )


# --- ABI ------------------------------------------------------------------------------------------
def parse_abi(version: str) -> tuple[int, int, int] | None:
    parts = version.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


def abi_compatible(package: str, runtime: str = RUNTIME_ABI_VERSION) -> bool:
    """Spec "Compatibility": same major, package minor <= runtime minor."""
    p, r = parse_abi(package), parse_abi(runtime)
    return p is not None and r is not None and p[0] == r[0] and p[1] <= r[1]


# --- semantic checks ---------------------------------------------------------------------
def _artifact_findings(ref: ArtifactRef, where: str) -> Iterator[Finding]:
    a = ref.artifact
    if not is_safe_relative_path(a.path):
        yield Finding(
            "unsafe_artifact_path",
            f"{where}.path {a.path!r} is not a safe relative path",
            path=a.path,
            remediation="use a relative POSIX path inside the package (no '..', no absolute)",
        )
    if a.artifact_bytes <= 0:
        yield Finding("empty_artifact", f"{where}.artifact_bytes must be > 0", path=a.path)
    if (a.tensor_count == 0) != (a.tensor_bytes == 0):
        yield Finding(
            "invalid_tensor_bytes",
            f"{where}: tensor_bytes {a.tensor_bytes} is inconsistent with tensor_count "
            f"{a.tensor_count} (zero exactly when there are no tensors)",
            path=a.path,
        )
    if a.tensor_bytes > a.artifact_bytes > 0:
        yield Finding(
            "invalid_tensor_bytes",
            f"{where}: tensor_bytes {a.tensor_bytes} exceeds artifact_bytes {a.artifact_bytes}",
            path=a.path,
        )
    if not SHA256_HEX_RE.match(a.sha256):
        yield Finding(
            "invalid_artifact_sha256",
            f"{where}.sha256 is not a 64-character hex digest",
            path=a.path,
        )


def check_manifest(
    m: PackageManifest, *, runtime_abi: str = RUNTIME_ABI_VERSION
) -> list[Finding]:
    """Every schema-1 rule that is not a parse error (spec "Manifest Schema", "Consumer
    Validation"), as findings; an empty list means the manifest is consistent. A v2 root
    gets its own rules (``skippy.package.v2_root.check_root``)."""
    if isinstance(m, ManifestV2):
        return check_manifest_v2(m)
    out: list[Finding] = []
    if not m.model_id.strip():
        out.append(Finding("empty_model_id", "model_id must be a non-empty model coordinate"))
    src = m.source_model
    if not SHA256_HEX_RE.match(src.sha256):
        out.append(
            Finding(
                "invalid_source_model_sha256",
                "source_model.sha256 is not a 64-character hex digest",
            )
        )
    out.extend(_identity_text_findings(m))
    for name in ("repo", "revision", "primary_file"):
        if not getattr(src, name).strip():
            out.append(
                Finding(
                    "empty_source_identity",
                    f"source_model.{name} must be non-empty: the package must name its source",
                )
            )
    if not m.skippy_abi_version:
        out.append(
            Finding("missing_skippy_abi_version", "skippy_abi_version is required but missing")
        )
    elif not abi_compatible(m.skippy_abi_version, runtime_abi):
        out.append(
            Finding(
                "incompatible_skippy_abi_version",
                f"package ABI {m.skippy_abi_version} is not compatible with runtime ABI "
                f"{runtime_abi} (same major and package minor <= runtime minor required)",
                remediation="use a runtime built for this ABI or republish the package",
            )
        )
    if m.layer_count < 1:
        out.append(Finding("invalid_layer_count", "layer_count must be at least 1"))

    seen: dict[int, int] = {}
    for i, entry in enumerate(m.layers):
        if not 0 <= entry.layer_index < m.layer_count:
            out.append(
                Finding(
                    "layer_index_out_of_range",
                    f"layers[{i}].layer_index {entry.layer_index} is outside 0..{m.layer_count}",
                    path=entry.path,
                )
            )
        elif entry.layer_index in seen:
            out.append(
                Finding(
                    "duplicate_layer",
                    f"layer {entry.layer_index} appears in layers[{seen[entry.layer_index]}] "
                    f"and layers[{i}]",
                    path=entry.path,
                )
            )
        else:
            seen[entry.layer_index] = i
    missing = [index for index in range(m.layer_count) if index not in seen]
    for index in missing[:MAX_MISSING_LAYER_FINDINGS]:
        out.append(Finding("missing_layer", f"layer {index} has no entry in layers[]"))
    if len(missing) > MAX_MISSING_LAYER_FINDINGS:
        out.append(
            Finding(
                "missing_layer",
                f"{len(missing) - MAX_MISSING_LAYER_FINDINGS} more layers have no entry in "
                f"layers[] ({len(missing)} in all)",
            )
        )

    paths: dict[str, str] = {}
    for where, ref in _located_artifacts(m):
        out.extend(_artifact_findings(ref, where))
        if ref.path in paths:
            out.append(
                Finding(
                    "duplicate_artifact_path",
                    f"{where} and {paths[ref.path]} name the same file",
                    path=ref.path,
                )
            )
        paths.setdefault(ref.path, where)
    for i, proj in enumerate(m.projectors):
        if proj.kind not in PROJECTOR_KINDS:
            out.append(
                Finding(
                    "unsupported_projector_kind",
                    f"projectors[{i}].kind {proj.kind!r} is not supported "
                    f"(supported: {', '.join(sorted(PROJECTOR_KINDS))})",
                    path=proj.path,
                )
            )
    out.extend(quantization_findings(m.extra))  # the additive skippy-quantize block
    return out


def _identity_text_findings(m: Manifest) -> Iterator[Finding]:
    """The rule write-package applies to provenance, applied to what a manifest
    says: no control or bidi character in an identity string, and the source file names are
    paths inside the source repository. (``source_model.path`` may be a local absolute path,
    as in the spec's example, so only the character rule applies to it.)"""
    src = m.source_model
    texts = [("model_id", m.model_id)]
    texts += [
        (f"source_model.{name}", getattr(src, name))
        for name in ("path", "repo", "revision", "primary_file", "canonical_ref", "distribution_id")
    ]
    texts += [(f"source_model.files[{i}].path", f.path) for i, f in enumerate(src.files)]
    for where, value in texts:
        bad = unsafe_char(value)
        if bad is not None:
            yield Finding(
                "unsafe_manifest_text",
                f"{where} contains the control or bidi character {bad}",
                path=where,
                remediation="republish the package: identity strings are plain text",
            )
    paths = [("source_model.primary_file", src.primary_file)]
    paths += [(f"source_model.files[{i}].path", f.path) for i, f in enumerate(src.files)]
    for where, value in paths:
        if value and unsafe_char(value) is None and not is_safe_relative_path(value):
            yield Finding(
                "unsafe_source_path",
                f"{where} {value!r} is not a path inside the source repository",
                path=where,
                remediation="republish the package naming the source file as its repo lists it",
            )


def _located_artifacts(m: Manifest) -> Iterator[tuple[str, ArtifactRef]]:
    """Every artifact with its JSON location (``layers[3]``), in manifest order."""
    for role in SHARED_ROLES:
        yield f"shared.{role}", ArtifactRef(role, getattr(m.shared, role))
    for i, entry in enumerate(m.layers):
        yield f"layers[{i}]", ArtifactRef(ROLE_LAYER, entry, entry.layer_index)
    for i, proj in enumerate(m.projectors):
        yield f"projectors[{i}]", ArtifactRef(ROLE_PROJECTOR, proj)
