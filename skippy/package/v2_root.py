"""The package-v2 root (``model-package.json`` with ``schema_version: 2``): frozen value
objects, a strict parser that refuses unknown fields at every level, the semantic checks as
findings, and the canonical ``package_id``.

docs/layer-packages.md "v2 root" gives the closed shape (upstream's ``PackageRoot`` with
``deny_unknown_fields``), "v2 id" the identity rule and "v2 catalog" the validation
codes, whose names are reused here (``package_identity_mismatch``, ``duplicate_artifact``,
``invalid_identifier``, ...). Parsing raises ``ManifestError`` for what cannot be read as a v2
root at all (wrong types, unknown or missing fields); ``check_root`` reports every other rule.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from skippy.constants import (
    FORMAT_V2,
    MAX_ARTIFACT_BYTES,
    MAX_LAYER_COUNT,
    MAX_UNIX_SECS,
    PROJECTOR_KINDS,
    SCHEMA_VERSION_V2,
    V2_ARTIFACT_ID_RE,
    V2_PACKAGE_ID_RE,
    V2_SHA256_RE,
)
from skippy.errors import ManifestError
from skippy.findings import Finding
from skippy.paths import is_safe_relative_path
from skippy.text import unsafe_char

# Publisher metadata roles in upstream's enum declaration order (the sort order, spec "v2 id").
PUBLISHER_ROLES: Final = (
    "model_config",
    "generation_config",
    "tokenizer_config",
    "chat_template",
    "hf_quant_config",
)
PUBLISHER_DTYPES: Final = frozenset(
    {"f16", "bf16", "f32", "fp8", "fp8_e4m3", "fp8_e5m2", "q8_0", "q4_0"}
)


# --- value objects ------------------------------------------------------------------------------
@dataclass(frozen=True)
class V2SourceFile:
    path: str
    byte_size: int
    sha256: str

    def canonical(self) -> dict[str, Any]:
        return {"path": self.path, "byte_size": self.byte_size, "sha256": self.sha256}


@dataclass(frozen=True, kw_only=True)
class V2SourceModel:
    sha256: str
    metadata_artifact_id: str
    repo: str | None = None
    revision: str | None = None
    primary_file: str | None = None
    canonical_ref: str | None = None
    distribution_id: str | None = None
    files: tuple[V2SourceFile, ...] = ()

    def canonical(self, *, sort: bool) -> dict[str, Any]:
        """Struct order; ``None`` optionals and an empty ``files`` omitted (spec "v2 id")."""
        out: dict[str, Any] = {
            "sha256": self.sha256,
            "metadata_artifact_id": self.metadata_artifact_id,
        }
        for name in ("repo", "revision", "primary_file", "canonical_ref", "distribution_id"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        files = sorted(self.files, key=lambda f: f.path) if sort else self.files
        if files:
            out["files"] = [f.canonical() for f in files]
        return out


@dataclass(frozen=True)
class CatalogArtifact:
    """One file of a v2 package: ``{id, path, byte_size, sha256}`` (sha over the whole file)."""

    id: str
    path: str
    byte_size: int
    sha256: str

    def canonical(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "path": self.path,
            "byte_size": self.byte_size,
            "sha256": self.sha256,
        }


@dataclass(frozen=True)
class Sidecar:
    kind: str
    artifact_id: str
    name: str | None = None

    def canonical(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "artifact_id": self.artifact_id}
        if self.name is not None:
            out["name"] = self.name
        return out

    def sort_key(self) -> tuple[str, bool, str, str]:
        # (kind, name, artifact_id) with an absent name before a present one (Option order)
        return (self.kind, self.name is not None, self.name or "", self.artifact_id)


@dataclass(frozen=True)
class PublisherMetadata:
    role: str
    artifact_id: str
    source_repo: str
    source_revision: str
    source_path: str

    def canonical(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "artifact_id": self.artifact_id,
            "source_repo": self.source_repo,
            "source_revision": self.source_revision,
            "source_path": self.source_path,
        }

    def sort_key(self) -> tuple[int, str, str, str, str]:
        return (
            PUBLISHER_ROLES.index(self.role),
            self.artifact_id,
            self.source_repo,
            self.source_revision,
            self.source_path,
        )


@dataclass(frozen=True, kw_only=True)
class PackageRootV2:
    package_id: str
    model_id: str
    source_model: V2SourceModel
    layer_count: int
    artifacts: tuple[CatalogArtifact, ...]
    native_abi_version: str
    generator_version: str
    created_at_unix_secs: int
    format: str = FORMAT_V2
    schema_version: int = SCHEMA_VERSION_V2
    sidecars: tuple[Sidecar, ...] = ()
    publisher_metadata: tuple[PublisherMetadata, ...] = ()
    publisher_defaults: Mapping[str, Any] | None = None
    generation: Mapping[str, Any] | None = None

    def artifact(self, artifact_id: str) -> CatalogArtifact:
        for a in self.artifacts:
            if a.id == artifact_id:
                return a
        raise KeyError(artifact_id)

    @property
    def metadata_artifact(self) -> CatalogArtifact | None:
        try:
            return self.artifact(self.source_model.metadata_artifact_id)
        except KeyError:
            return None

    def payload_artifacts(self) -> list[CatalogArtifact]:
        """What the carrier's ``tensor_part`` indexes (spec "v2 carrier"): every catalog entry
        but the carrier, the sidecars and publisher metadata, sorted by id (byte-wise)."""
        skip = {self.source_model.metadata_artifact_id}
        skip |= {s.artifact_id for s in self.sidecars}
        skip |= {p.artifact_id for p in self.publisher_metadata}
        return sorted(
            (a for a in self.artifacts if a.id not in skip), key=lambda a: a.id.encode("utf-8")
        )

    def canonical(self, *, for_identity: bool) -> dict[str, Any]:
        """The root in struct order (spec "v2 root"); ``for_identity`` zeroes the id and the
        timestamp and sorts every list as upstream's ``computed_package_id`` does ("v2 id")."""
        entries = (
            sorted(self.artifacts, key=lambda a: a.id) if for_identity else list(self.artifacts)
        )
        sidecars = sorted(self.sidecars, key=Sidecar.sort_key) if for_identity else self.sidecars
        publisher = (
            sorted(self.publisher_metadata, key=PublisherMetadata.sort_key)
            if for_identity
            else self.publisher_metadata
        )
        out: dict[str, Any] = {
            "schema_version": self.schema_version,
            "package_id": "" if for_identity else self.package_id,
            "model_id": self.model_id,
            "source_model": self.source_model.canonical(sort=for_identity),
            "format": self.format,
            "layer_count": self.layer_count,
            "artifact_catalog": {"entries": [a.canonical() for a in entries]},
        }
        if sidecars:
            out["sidecars"] = [s.canonical() for s in sidecars]
        if publisher:
            out["publisher_metadata"] = [p.canonical() for p in publisher]
        if self.publisher_defaults is not None:
            out["publisher_defaults"] = canonical_publisher_defaults(self.publisher_defaults)
        if self.generation is not None:
            out["generation"] = canonical_generation(self.generation)
        out["native_abi_version"] = self.native_abi_version
        out["generator_version"] = self.generator_version
        out["created_at_unix_secs"] = 0 if for_identity else self.created_at_unix_secs
        return out

    def computed_package_id(self) -> str:
        return (
            "sha256:" + hashlib.sha256(compact_json(self.canonical(for_identity=True))).hexdigest()
        )

    def with_identity(self) -> PackageRootV2:
        return replace(self, package_id=self.computed_package_id())


# --- canonical JSON (serde_json's compact output) -------------------------------------------------
def _float_text(x: float) -> str:
    """serde_json (ryu) spelling of a float: like Python's repr for ordinary values, but an
    exponent has no ``+`` and no leading zeros (``1e-5``, not ``1e-05``; spec "v2 id")."""
    if not math.isfinite(x):
        raise ManifestError("generation holds a non-finite number", code="invalid_generation_value")
    text = repr(x)
    if "e" in text:
        mantissa, _, exp = text.partition("e")
        sign = "-" if exp.startswith("-") else ""
        text = f"{mantissa}e{sign}{exp.lstrip('+-').lstrip('0') or '0'}"
        if mantissa.endswith(".0"):
            text = text.replace(".0e", "e", 1)
    return text


def _encode(value: Any) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float_text(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ",".join(_encode(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{_encode(str(k))}:{_encode(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot encode {type(value).__name__}")


def compact_json(value: Any) -> bytes:
    """Compact JSON with keys in the order given, escaping only what JSON requires."""
    return _encode(value).encode("utf-8")


# Field order of the typed generation structures (spec "v2 generation"), for the canonical form.
# Maps (``proposers``, ``strategies``, ``profiles``) are BTreeMaps: sorted keys.
_GENERATION_ORDER: Final = ("request_defaults", "speculative_decoding")
_SPECULATIVE_ORDER: Final = ("default", "proposers", "strategies")
_STRATEGY_ORDER: Final = (
    "type",
    "proposer",
    "prediction_depth",
    "layer_indices",
    "primary",
    "extender",
    "extension_policy",
    "ngram_min",
    "ngram_max",
    "max_proposal_tokens",
    "history_scope",
    "window_policy",
)
_WINDOW_ORDER: Final = ("default", "initial_window", "min_window", "max_window", "pipeline_depth")
_EXTENSION_ORDER: Final = ("max_tokens", "initial_tokens", "tail_backoff_proposals")


def _ordered(obj: Mapping[str, Any], order: tuple[str, ...]) -> dict[str, Any]:
    out = {k: obj[k] for k in order if k in obj and obj[k] is not None}
    out.update({k: v for k, v in obj.items() if k not in out and v is not None})
    return out


def _strategy(entry: Any) -> Any:
    if not isinstance(entry, Mapping):
        return entry
    out = _ordered(entry, _STRATEGY_ORDER)
    if isinstance(out.get("window_policy"), Mapping):
        out["window_policy"] = _ordered(out["window_policy"], _WINDOW_ORDER)
    if isinstance(out.get("extension_policy"), Mapping):
        out["extension_policy"] = _ordered(out["extension_policy"], _EXTENSION_ORDER)
    if out.get("layer_indices") == []:
        del out["layer_indices"]
    return out


def canonical_generation(gen: Mapping[str, Any]) -> dict[str, Any]:
    """The generation block as upstream serializes it: struct order for the speculative
    structures this writer and reader know, sorted map keys, empty maps omitted. The request
    defaults' profiles keep the file's field order inside each profile (the upstream struct
    order of ``GenerationProfile`` is not in the notes; see docs/cli.md)."""
    out = _ordered(gen, _GENERATION_ORDER)
    spec = out.get("speculative_decoding")
    if isinstance(spec, Mapping):
        s = _ordered(spec, _SPECULATIVE_ORDER)
        for key in ("proposers", "strategies"):
            if key in s:
                if isinstance(s[key], Mapping) and s[key]:
                    s[key] = {k: _strategy(s[key][k]) for k in sorted(s[key])}
                elif s[key] == {}:
                    del s[key]
        out["speculative_decoding"] = s
    rd = out.get("request_defaults")
    if isinstance(rd, Mapping) and isinstance(rd.get("profiles"), Mapping):
        rd = dict(rd)
        rd["profiles"] = {k: rd["profiles"][k] for k in sorted(rd["profiles"])}
        out["request_defaults"] = rd
    return out


def canonical_publisher_defaults(d: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("compute_dtype", "kv_cache_dtype"):
        v = d.get(key)
        if isinstance(v, Mapping):
            out[key] = _ordered(v, ("dtype", "artifact_id", "json_path"))
    return out


# --- parsing ------------------------------------------------------------------------------------
class _Closed:
    """One JSON object of the closed v2 schema: every key must be known; every failure names
    the field path."""

    def __init__(self, data: Any, where: str, known: tuple[str, ...]) -> None:
        if not isinstance(data, dict):
            raise ManifestError(
                f"{where or 'manifest'} must be a JSON object, got {type(data).__name__}",
                code="invalid_manifest",
                path=where or None,
            )
        unknown = sorted(k for k in data if k not in known)
        if unknown:
            raise ManifestError(
                f"{where or 'the v2 root'} has unknown field {unknown[0]!r}: package v2 is a "
                "closed schema (unknown fields are refused at every level)",
                code="unknown_field",
                path=f"{where}.{unknown[0]}" if where else unknown[0],
                remediation="republish the package with a writer for schema version 2",
            )
        self.data = data
        self.where = where

    def _p(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def req(self, key: str) -> Any:
        if key not in self.data:
            raise ManifestError(
                f"{self._p(key)} is required", code="missing_value", path=self._p(key)
            )
        return self.data[key]

    def str_(self, key: str) -> str:
        v = self.req(key)
        if not isinstance(v, str):
            raise ManifestError(f"{self._p(key)} must be a string", path=self._p(key))
        return v

    def opt_str(self, key: str) -> str | None:
        if key not in self.data or self.data[key] is None:
            return None
        return self.str_(key)

    def int_(self, key: str, hi: int) -> int:
        v = self.req(key)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
            raise ManifestError(
                f"{self._p(key)} must be an integer in 0..{hi}, got {json.dumps(v)[:40]}",
                path=self._p(key),
            )
        return v

    def list_(self, key: str, *, required: bool) -> list[Any]:
        if key not in self.data and not required:
            return []
        v = self.req(key)
        if not isinstance(v, list):
            raise ManifestError(f"{self._p(key)} must be a list", path=self._p(key))
        return v

    def obj_(self, key: str) -> Mapping[str, Any] | None:
        if key not in self.data:
            return None
        v = self.data[key]
        if not isinstance(v, dict):  # never written as null (spec "v2 root")
            raise ManifestError(f"{self._p(key)} must be a JSON object", path=self._p(key))
        return v


_ROOT_FIELDS: Final = (
    "schema_version",
    "package_id",
    "model_id",
    "source_model",
    "format",
    "layer_count",
    "artifact_catalog",
    "sidecars",
    "publisher_metadata",
    "publisher_defaults",
    "generation",
    "native_abi_version",
    "generator_version",
    "created_at_unix_secs",
)
_SOURCE_FIELDS: Final = (
    "sha256",
    "metadata_artifact_id",
    "repo",
    "revision",
    "primary_file",
    "canonical_ref",
    "distribution_id",
    "files",
)


def parse_root(data: Mapping[str, Any]) -> PackageRootV2:
    """The decoded JSON object of a v2 manifest -> ``PackageRootV2`` (closed schema)."""
    top = _Closed(data, "", _ROOT_FIELDS)
    if top.req("schema_version") != SCHEMA_VERSION_V2 or isinstance(data["schema_version"], bool):
        raise ManifestError(
            f"expected schema version 2, got {json.dumps(data['schema_version'])}",
            code="unsupported_schema_version",
            path="schema_version",
        )
    so = _Closed(top.req("source_model"), "source_model", _SOURCE_FIELDS)
    files = []
    for i, raw in enumerate(so.list_("files", required=False)):
        fo = _Closed(raw, f"source_model.files[{i}]", ("path", "byte_size", "sha256"))
        files.append(
            V2SourceFile(
                fo.str_("path"), fo.int_("byte_size", MAX_ARTIFACT_BYTES), fo.str_("sha256")
            )
        )
    source = V2SourceModel(
        sha256=so.str_("sha256"),
        metadata_artifact_id=so.str_("metadata_artifact_id"),
        repo=so.opt_str("repo"),
        revision=so.opt_str("revision"),
        primary_file=so.opt_str("primary_file"),
        canonical_ref=so.opt_str("canonical_ref"),
        distribution_id=so.opt_str("distribution_id"),
        files=tuple(files),
    )
    cat = _Closed(top.req("artifact_catalog"), "artifact_catalog", ("entries",))
    artifacts = []
    for i, raw in enumerate(cat.list_("entries", required=True)):
        ao = _Closed(raw, f"artifact_catalog.entries[{i}]", ("id", "path", "byte_size", "sha256"))
        artifacts.append(
            CatalogArtifact(
                ao.str_("id"),
                ao.str_("path"),
                ao.int_("byte_size", MAX_ARTIFACT_BYTES),
                ao.str_("sha256"),
            )
        )
    sidecars = []
    for i, raw in enumerate(top.list_("sidecars", required=False)):
        sc = _Closed(raw, f"sidecars[{i}]", ("kind", "artifact_id", "name"))
        kind = sc.str_("kind")
        if kind not in PROJECTOR_KINDS:  # a closed enum upstream: unknown kinds fail to parse
            raise ManifestError(
                f"sidecars[{i}].kind {kind!r} is not a known sidecar kind (known: mmproj)",
                code="unsupported_projector_kind",
                path=f"sidecars[{i}].kind",
            )
        sidecars.append(Sidecar(kind, sc.str_("artifact_id"), sc.opt_str("name")))
    publisher = []
    for i, raw in enumerate(top.list_("publisher_metadata", required=False)):
        po = _Closed(
            raw,
            f"publisher_metadata[{i}]",
            ("role", "artifact_id", "source_repo", "source_revision", "source_path"),
        )
        role = po.str_("role")
        if role not in PUBLISHER_ROLES:
            raise ManifestError(
                f"publisher_metadata[{i}].role {role!r} is not one of {', '.join(PUBLISHER_ROLES)}",
                code="invalid_manifest",
                path=f"publisher_metadata[{i}].role",
            )
        publisher.append(
            PublisherMetadata(
                role,
                po.str_("artifact_id"),
                po.str_("source_repo"),
                po.str_("source_revision"),
                po.str_("source_path"),
            )
        )
    defaults = top.obj_("publisher_defaults")
    if defaults is not None:
        _parse_publisher_defaults(defaults)
    generation = top.obj_("generation")
    if generation is not None:
        _Closed(generation, "generation", _GENERATION_ORDER)  # refuses policy/thresholds
    fmt = top.str_("format")
    layer_count = top.int_("layer_count", 1 << 32)
    return PackageRootV2(
        package_id=top.str_("package_id"),
        model_id=top.str_("model_id"),
        source_model=source,
        format=fmt,
        layer_count=layer_count,
        artifacts=tuple(artifacts),
        sidecars=tuple(sidecars),
        publisher_metadata=tuple(publisher),
        publisher_defaults=defaults,
        generation=generation,
        native_abi_version=top.str_("native_abi_version"),
        generator_version=top.str_("generator_version"),
        created_at_unix_secs=top.int_("created_at_unix_secs", MAX_UNIX_SECS),
    )


def _parse_publisher_defaults(d: Mapping[str, Any]) -> None:
    o = _Closed(d, "publisher_defaults", ("compute_dtype", "kv_cache_dtype"))
    for key in ("compute_dtype", "kv_cache_dtype"):
        v = o.obj_(key)
        if v is None:
            continue
        vo = _Closed(v, f"publisher_defaults.{key}", ("dtype", "artifact_id", "json_path"))
        if vo.str_("dtype") not in PUBLISHER_DTYPES:
            raise ManifestError(
                f"publisher_defaults.{key}.dtype {v['dtype']!r} is not a known dtype",
                code="invalid_manifest",
                path=f"publisher_defaults.{key}.dtype",
            )
        vo.str_("artifact_id")
        vo.str_("json_path")


# --- semantic checks (spec "v2 root", "v2 catalog": upstream's ValidationCode names) ------
def check_root(root: PackageRootV2) -> list[Finding]:
    """Every rule of the v2 root that parsing does not enforce, as findings; the carrier's
    rules live in ``skippy.package.v2_carrier``."""
    return list(_root_findings(root))


def _root_findings(r: PackageRootV2) -> Iterator[Finding]:
    if r.format != FORMAT_V2:
        yield Finding("invalid_format", f'format {r.format!r} is not "{FORMAT_V2}"', path="format")
    if not V2_PACKAGE_ID_RE.match(r.package_id):
        yield Finding(
            "invalid_digest", "package_id is not sha256: + 64 lowercase hex", path="package_id"
        )
    elif r.package_id != r.computed_package_id():
        yield Finding(
            "package_identity_mismatch",
            f"package_id {r.package_id} does not match its content ({r.computed_package_id()})",
            path="package_id",
            remediation="the root was edited after it was written: fetch or write it again",
        )
    for name, value in (
        ("model_id", r.model_id),
        ("native_abi_version", r.native_abi_version),
        ("generator_version", r.generator_version),
    ):
        if not value.strip():
            yield Finding("missing_value", f"{name} must be non-empty", path=name)
        elif unsafe_char(value) is not None:
            yield Finding(
                "unsafe_manifest_text", f"{name} contains a control or bidi character", path=name
            )
    if not 1 <= r.layer_count <= MAX_LAYER_COUNT:
        yield Finding(
            "layer_out_of_bounds",
            f"layer_count {r.layer_count} is outside 1..{MAX_LAYER_COUNT}",
            path="layer_count",
        )
    yield from _source_findings(r)
    yield from _catalog_findings(r)


def _source_findings(r: PackageRootV2) -> Iterator[Finding]:
    src = r.source_model
    if not V2_SHA256_RE.match(src.sha256):
        yield Finding(
            "invalid_digest",
            "source_model.sha256 is not 64 lowercase hex",
            path="source_model.sha256",
        )
    if not src.files:
        yield Finding(
            "missing_value",
            "source_model.files must list the source files",
            path="source_model.files",
        )
    seen: set[str] = set()
    for i, f in enumerate(src.files):
        where = f"source_model.files[{i}]"
        if not is_safe_relative_path(f.path) or unsafe_char(f.path) is not None:
            yield Finding(
                "invalid_path", f"{where}.path {f.path!r} is not a safe relative path", path=where
            )
        if f.path in seen:
            yield Finding(
                "duplicate_artifact_path", f"{where}.path {f.path!r} is listed twice", path=where
            )
        seen.add(f.path)
        if not V2_SHA256_RE.match(f.sha256):
            yield Finding("invalid_digest", f"{where}.sha256 is not 64 lowercase hex", path=where)
    if not src.primary_file:
        yield Finding(
            "missing_value", "primary source file is required", path="source_model.primary_file"
        )
    else:
        primary = [f for f in src.files if f.path == src.primary_file]
        if not primary:
            yield Finding(
                "unknown_source_file",
                f"source_model.primary_file {src.primary_file!r} is not in source_model.files",
                path="source_model.primary_file",
            )
        elif primary[0].sha256 != src.sha256:
            yield Finding(
                "source_identity_mismatch",
                "source model digest does not match the primary source file",
                path="source_model.sha256",
            )
    for name in ("repo", "revision", "canonical_ref", "distribution_id"):
        value = getattr(src, name)
        if value is not None and unsafe_char(value) is not None:
            yield Finding(
                "unsafe_manifest_text", f"source_model.{name} contains a control or bidi character"
            )


def _catalog_findings(r: PackageRootV2) -> Iterator[Finding]:
    if not r.artifacts:
        yield Finding("missing_value", "artifact_catalog.entries is empty", path="artifact_catalog")
    ids: set[str] = set()
    paths: set[str] = set()
    for i, a in enumerate(r.artifacts):
        where = f"artifact_catalog.entries[{i}]"
        if not V2_ARTIFACT_ID_RE.match(a.id):
            yield Finding(
                "invalid_identifier", f"{where}.id {a.id!r} is not [A-Za-z0-9._-]+", path=where
            )
        if a.id in ids:
            yield Finding("duplicate_artifact", f"artifact id {a.id!r} appears twice", path=where)
        ids.add(a.id)
        if "//" in a.path or a.path.endswith("/") or not is_safe_relative_path(a.path):
            yield Finding(
                "invalid_path",
                f"{where}.path {a.path!r} is not a normalized relative package path",
                path=a.path,
            )
        if a.path in paths:
            yield Finding(
                "duplicate_artifact_path", f"{where}.path {a.path!r} appears twice", path=a.path
            )
        paths.add(a.path)
        if not V2_SHA256_RE.match(a.sha256):
            yield Finding("invalid_digest", f"{where}.sha256 is not 64 lowercase hex", path=a.path)
        if a.byte_size <= 0:
            yield Finding("invalid_stored_length", f"{where}.byte_size must be > 0", path=a.path)
    meta = r.metadata_artifact
    sidecar_ids = {s.artifact_id for s in r.sidecars}
    if meta is None or not meta.path.endswith(".gguf") or meta.id in sidecar_ids:
        yield Finding(
            "invalid_metadata_artifact",
            f"source_model.metadata_artifact_id {r.source_model.metadata_artifact_id!r} must name "
            "a catalog .gguf artifact that is not a sidecar",
            path="source_model.metadata_artifact_id",
        )
    pairs: set[tuple[str, str | None]] = set()
    for i, s in enumerate(r.sidecars):
        if s.artifact_id not in ids:
            yield Finding(
                "unknown_artifact",
                f"sidecars[{i}].artifact_id {s.artifact_id!r} is not in the catalog",
            )
        if (s.kind, s.name) in pairs:
            yield Finding("duplicate_sidecar", f"sidecars[{i}] repeats ({s.kind}, {s.name})")
        pairs.add((s.kind, s.name))
    for i, p in enumerate(r.publisher_metadata):
        if p.artifact_id not in ids:
            yield Finding(
                "unknown_artifact",
                f"publisher_metadata[{i}].artifact_id {p.artifact_id!r} is not in the catalog",
            )
    if meta is not None and not r.payload_artifacts():
        yield Finding(
            "missing_value", "package root has no payload artifacts", path="artifact_catalog"
        )
