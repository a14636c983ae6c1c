"""The lab's package: a directory published on the lab hub, and a package imported into a
node's hub cache (what a coordinator serves from).

A directory becomes ``hf://lab/<name>@<40-hex commit>``; an ``hf://``
reference is pinned to the commit it names now. Importing downloads the manifest and every
artifact it declares through ``huggingface_hub`` into the standard hub cache layout, then
proves every SHA-256 (recording it in the node's verification cache, so serving starts
without hashing again).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from mesh_node.lab.hub_server import FakeHub
from skippy.constants import MANIFEST_NAME, ROLE_LAYER
from skippy.consume import hub
from skippy.consume.cache_layout import repo_cache_root
from skippy.consume.preflight import load_package
from skippy.consume.verify import VerifyCache, check_refs
from skippy.package.manifest import PackageManifest
from skippy.package.refs import parse_hf_package_ref

LAB_NAMESPACE: Final = "lab"
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class LabPackage:
    """A package pinned to one commit, as a node's hub cache holds it."""

    ref: str  # hf://ns/repo@<commit>
    manifest_sha256: str
    manifest: PackageManifest


def repo_name_for(directory: Path) -> str:
    """A hub repository name from a directory name (``[A-Za-z0-9._-]``, at most 96 chars)."""
    name = _UNSAFE.sub("-", directory.resolve().name).strip("-.")[:96]
    return name or "package"


def publish_directory(lab_hub: FakeHub, directory: Path) -> str:
    """Check ``directory`` is a valid package and publish it; return its pinned reference."""
    load_package(directory, origin=str(directory))  # PackageInvalid: exit 1, before serving
    repo_id = f"{LAB_NAMESPACE}/{repo_name_for(directory)}"
    commit = lab_hub.add_revision(repo_id, directory)
    return f"hf://{repo_id}@{commit}"


def import_package(
    ref_text: str,
    cache_dir: Path,
    *,
    endpoint: str | None,
    verify_cache: VerifyCache | None = None,
) -> LabPackage:
    """Download the whole package named by ``ref_text`` into the hub cache at ``cache_dir``
    and verify it; return it pinned."""
    ref = parse_hf_package_ref(ref_text)
    commit = hub.resolve_revision(ref, endpoint=endpoint, cache_dir=cache_dir)
    manifest_file = hub.download_file(
        ref, commit, MANIFEST_NAME, endpoint=endpoint, cache_dir=cache_dir
    )
    root = repo_cache_root(cache_dir, ref.repo_id)
    pinned = str(ref.at(commit))
    pkg = load_package(manifest_file.parent, containment_root=root, origin=pinned, from_hub=True)
    artifacts = list(pkg.manifest.artifacts())
    hub.download_many(
        ref, commit, [r.path for r in artifacts], endpoint=endpoint, cache_dir=cache_dir
    )
    check_refs(
        manifest_file.parent,
        artifacts,
        manifest_sha256=pkg.manifest_sha256,
        cache=verify_cache,
        containment_root=root,
    ).raise_for_mismatch()
    return LabPackage(pinned, pkg.manifest_sha256, pkg.manifest)


def revise_directory(directory: Path, out: Path, *, layer: int) -> Path:
    """A copy of the package ``directory`` at ``out`` whose layer ``layer`` differs in one
    tensor byte (the lowest bit of a byte in the middle of its tensor data, so the file stays
    a valid GGUF of the same shape) and whose manifest declares the new SHA-256: a second
    revision for showing delta transfers. Every other file is byte-identical."""
    manifest = load_package(directory, origin=str(directory)).manifest
    refs = [r for r in manifest.artifacts() if r.role == ROLE_LAYER and r.layer_index == layer]
    if not refs:
        raise ValueError(f"the package has no layer {layer} (it has {manifest.layer_count})")
    art = refs[0].artifact
    shutil.copytree(directory, out)
    target = out / art.path
    data = bytearray(target.read_bytes())
    data[len(data) - 1 - art.tensor_bytes // 2] ^= 1
    target.write_bytes(bytes(data))
    doc = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
    for entry in doc.get("layers", ()):  # schema 1 (what the lab publishes)
        if entry.get("path") == art.path:
            entry["sha256"] = hashlib.sha256(data).hexdigest()
    (out / MANIFEST_NAME).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    load_package(out, origin=str(out))  # still a valid package
    return out
