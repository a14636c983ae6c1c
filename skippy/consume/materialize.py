"""materialize: compose a stage's selected parts into ONE GGUF, as derived cache.

Spec "Layer Selection": a runtime that composes the selected parts into a per-stage GGUF makes
"derived cache" that "MUST NOT become the published repository format"; spec "Repository
Layout": projectors "MUST NOT be merged into per-stage GGUF materializations". So the output
must live outside the package (``materialize_inside_package``), holds only the stage's parts,
and says what it is in its own KV section.

The output is: the KV records of ``shared/metadata.gguf`` copied raw (minus the ``split.*``
keys, which would make llama.cpp look for sibling shards, and minus the ``skippy.fragment.*``
keys, which describe one fragment), plus ``skippy.materialized.*`` keys recording the cache key,
the manifest digest and the layer range; then every part's tensors in load order, streamed
raw through ``skippy.gguf.writer`` (nothing decoded) and installed with ``skippy.atomic``.

Idempotent: the cache key is the SHA-256 of the manifest digest and the selection identity
(layer range and each part's role, layer, path and SHA-256). An existing output carrying the
same key is kept; an ``fcntl.flock`` on a hidden lock file next to the output makes concurrent
callers build it once (the lock only saves work: the atomic rename is what makes it correct).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from skippy.atomic import atomic_write_bytes, exclusive_lock
from skippy.constants import (
    FRAGMENT_KEY_PREFIX,
    KEY_MATERIALIZED_CACHE_KEY,
    KEY_MATERIALIZED_LAYER_COUNT,
    KEY_MATERIALIZED_LAYER_START,
    KEY_MATERIALIZED_LAYER_STOP,
    KEY_MATERIALIZED_MANIFEST_SHA256,
    MANIFEST_NAME,
    MATERIALIZED_KEY_PREFIX,
    ROLE_METADATA,
    SPLIT_KEYS,
    V2_CARRIER_KEYS,
)
from skippy.errors import (
    GGUFFormatError,
    IntegrityError,
    ManifestError,
    OutputExists,
    SkippyError,
    UsageError,
)
from skippy.gguf.constants import ValueType
from skippy.gguf.reader import GGUFFile, open_gguf
from skippy.gguf.writer import TensorSource, encode_kv, write_fragment
from skippy.hashing import sha256_file
from skippy.package.select import StageSelection
from skippy.paths import is_within, resolve_under
from skippy.progress import byte_bar


@dataclass(frozen=True)
class MaterializeResult:
    path: Path
    cache_key: str
    built: bool  # False: an existing output with the same cache key was kept
    artifact_bytes: int
    tensor_count: int
    seconds: float
    sha256: str  # of the output, built or kept

    def to_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.path),
            "cache_key": self.cache_key,
            "built": self.built,
            "artifact_bytes": self.artifact_bytes,
            "tensor_count": self.tensor_count,
            "sha256": self.sha256,
            "seconds": round(self.seconds, 3),
        }


# Bump when the identity below changes shape, so old materializations miss the cache.
CACHE_KEY_VERSION: Final = 1


def materialization_key(manifest_sha256: str, selection: StageSelection) -> str:
    """Deterministic identity of one materialization (projectors are never part of it)."""
    identity = {
        "v": CACHE_KEY_VERSION,
        "manifest_sha256": manifest_sha256.lower(),
        "layer_start": selection.layers.start,
        "layer_stop": selection.layers.stop,
        "layer_count": selection.layers.layer_count,
        "parts": [
            [r.role, r.layer_index, r.path, r.artifact.sha256.lower()] for r in selection.parts
        ],
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def lock_path_for(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def _refuse_inside_package(root: Path, out: Path) -> None:
    """Spec "Layer Selection": a materialization is derived cache and must never sit in (and
    risk being published with) the package. Symlinked folders are resolved first."""
    if is_within(out, root):
        raise UsageError(
            f"--out {out} is inside the package {root}: a per-stage GGUF is derived cache and "
            "must not become part of the published package",
            code="materialize_inside_package",
            path=str(out),
            remediation="write it to a cache folder outside the package directory",
        )


def _existing_key(out: Path) -> str | None:
    """The cache key of an existing materialization at ``out``; None if there is no file.
    Anything else at ``out`` is not ours to replace."""
    if not out.exists():
        return None
    if not out.is_file():
        raise OutputExists(f"--out {out} exists and is not a file", path=str(out))
    try:
        with open_gguf(out) as g:
            key = g.get(KEY_MATERIALIZED_CACHE_KEY)
    except GGUFFormatError:
        key = None
    if not isinstance(key, str):
        raise OutputExists(
            f"--out {out} exists and is not a skippy materialization; refusing to replace it",
            path=str(out),
            remediation="remove it or choose another --out",
        )
    return key


def _sidecar(out: Path) -> Path:
    return out.parent / f".{out.name}.skippy.json"


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _record_build(out: Path, key: str, sha256: str) -> None:
    """What we built, next to it: the key alone (it sits in the GGUF header) proves nothing
    about the bytes, so a later hit checks the file's stamp, or failing that, its digest."""
    record = {"cache_key": key, "sha256": sha256, "stamp": _stamp(out.stat())}
    atomic_write_bytes(_sidecar(out), json.dumps(record).encode(), durable=False)


def _trusted_existing(out: Path, key: str) -> str | None:
    """The SHA-256 of ``out`` if it is our build for ``key`` and its bytes are the ones we
    wrote; None when it must be (re)built."""
    if _existing_key(out) != key:
        return None
    try:
        rec = json.loads(_sidecar(out).read_text())
    except (OSError, ValueError):
        return None  # no record: rebuild rather than trust
    if not isinstance(rec, dict) or rec.get("cache_key") != key:
        return None
    sha = rec.get("sha256")
    if not isinstance(sha, str):
        return None
    if rec.get("stamp") == _stamp(out.stat()):
        return sha
    if sha256_file(out) != sha:
        return None  # changed since we built it: rebuild
    _record_build(out, key, sha)
    return sha


def _v2_wanted(sel: StageSelection) -> set[str] | None:
    """The tensors a v2 stage holds: every one in its parts that the selection rule needs
    (``skippy.package.select.stage_tensor_names``); None without a catalog (all of them)."""
    from skippy.package.select import stage_tensor_names

    return stage_tensor_names(sel.manifest, sel.layers)


def _kv_records(meta: GGUFFile, key: str, manifest_sha256: str, sel: StageSelection) -> list[bytes]:
    records = [
        meta.raw_field(k)
        for k in meta.fields
        if k not in SPLIT_KEYS
        and k not in V2_CARRIER_KEYS
        and not k.startswith(FRAGMENT_KEY_PREFIX)
        and not k.startswith(MATERIALIZED_KEY_PREFIX)
    ]
    records += [
        encode_kv(KEY_MATERIALIZED_CACHE_KEY, ValueType.STRING, key),
        encode_kv(KEY_MATERIALIZED_MANIFEST_SHA256, ValueType.STRING, manifest_sha256.lower()),
        encode_kv(KEY_MATERIALIZED_LAYER_START, ValueType.UINT32, sel.layers.start),
        encode_kv(KEY_MATERIALIZED_LAYER_STOP, ValueType.UINT32, sel.layers.stop),
        encode_kv(KEY_MATERIALIZED_LAYER_COUNT, ValueType.UINT32, sel.layers.layer_count),
    ]
    return records


def _build(
    root: Path,
    sel: StageSelection,
    out: Path,
    key: str,
    manifest_sha256: str,
    containment_root: Path | None,
) -> tuple[str, int]:
    if not sel.parts or sel.parts[0].role != ROLE_METADATA:
        raise ManifestError(
            "a stage selection must start with shared metadata", code="bad_selection"
        )
    # Schema 2: the first part is the metadata carrier; its directory describes the payload
    # parts, so it is read header-only and contributes only its KV.
    v2 = sel.manifest.schema_version == 2
    with contextlib.ExitStack() as stack:
        files: list[GGUFFile] = []
        for i, ref in enumerate(sel.parts):
            p = resolve_under(root, ref.path, containment_root=containment_root)
            g = stack.enter_context(open_gguf(p, header_only=v2 and i == 0))
            if g.file_size != ref.artifact.artifact_bytes:
                raise IntegrityError(
                    f"{ref.path} is {g.file_size} bytes, the manifest declares "
                    f"{ref.artifact.artifact_bytes}",
                    code="artifact_size_mismatch",
                    path=ref.path,
                    expected=ref.artifact.artifact_bytes,
                    actual=g.file_size,
                )
            files.append(g)
        meta = files[0]
        tensors: list[TensorSource] = []
        seen: dict[str, str] = {}
        wanted = _v2_wanted(sel) if v2 else None
        for i, (ref, g) in enumerate(zip(sel.parts, files, strict=True)):
            if v2 and i == 0:
                continue
            for t in g.tensors:
                if wanted is not None and t.name not in wanted:
                    continue  # another stage's boundary tensor in a shared common part
                if t.name in seen:
                    raise GGUFFormatError(
                        f"tensor {t.name!r} is in both {seen[t.name]} and {ref.path}",
                        code="gguf_duplicate_tensor",
                        path=ref.path,
                    )
                seen[t.name] = ref.path
                tensors.append(TensorSource(t, g.fileno()))
        records = _kv_records(meta, key, manifest_sha256, sel)
        total = sum(ref.artifact.artifact_bytes for ref in sel.parts)
        with byte_bar(total, "materialize") as on_bytes:
            written = write_fragment(out, records, tensors, meta.alignment, on_bytes=on_bytes)
    return written.sha256, written.tensor_count


def materialize_stage(
    root: Path,
    selection: StageSelection,
    out: Path,
    *,
    manifest_sha256: str,
    containment_root: Path | None = None,
) -> MaterializeResult:
    """Compose ``selection``'s parts (read from package ``root``) into the GGUF ``out``, or
    keep ``out`` if it already holds this exact materialization. Checksums are the caller's
    job (``skippy.consume.preflight.prepare_stage`` with ``verify=True``) before calling this."""
    t0 = time.perf_counter()
    _refuse_inside_package(containment_root or root, out)  # a hub repo cache counts as inside
    if out.name == MANIFEST_NAME:
        raise UsageError(f"--out must be a .gguf file, not {MANIFEST_NAME}", path=str(out))
    key = materialization_key(manifest_sha256, selection)

    def kept(sha: str) -> MaterializeResult:
        with open_gguf(out) as g:
            n = len(g.tensors)
        seconds = time.perf_counter() - t0
        return MaterializeResult(out, key, False, out.stat().st_size, n, seconds, sha256=sha)

    if not out.parent.is_dir():  # never create folders the user did not ask for
        raise UsageError(
            f"--out {out}: the folder {out.parent} does not exist",
            code="output_parent_missing",
            path=str(out),
            remediation="create the folder first, or choose an --out in an existing folder",
        )
    if (sha := _trusted_existing(out, key)) is not None:
        return kept(sha)
    with exclusive_lock(lock_path_for(out), timeout_s=None):
        if (sha := _trusted_existing(out, key)) is not None:  # built while we waited
            return kept(sha)
        sha, n = _build(root, selection, out, key, manifest_sha256, containment_root)
        try:
            with open_gguf(out) as g:  # the writer's own output must read back cleanly
                ok = len(g.tensors) == n and g.get(KEY_MATERIALIZED_CACHE_KEY) == key
        except SkippyError:
            ok = False
        if not ok:
            out.unlink(missing_ok=True)
            raise GGUFFormatError(
                f"materialized {out} does not read back as written", code="materialize_failed"
            )
        _record_build(out, key, sha)
    return MaterializeResult(
        out, key, True, out.stat().st_size, n, time.perf_counter() - t0, sha256=sha
    )
