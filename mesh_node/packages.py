"""A package a coordinator plans: its pinned reference and the facts a topology needs."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mesh_node.settings import NodeSettings
from skippy.config import read_environment

if TYPE_CHECKING:
    from skippy.generation import SpeculativeOverrides, SpeculativePlan
    from skippy.package.manifest import PackageManifest
    from skippy.serving.engine_choice import EngineChoice


def package_identity(settings: NodeSettings, text: str) -> tuple[str, str, Any, str]:
    """(pinned package ref, manifest SHA-256, per-artifact sizes, model id)."""
    from skippy.consume.resolve import open_package
    from skippy.package.refs import HfPackageRef, parse_package_ref
    from skippy.produce.sizes import sizes_from_package

    ref = parse_package_ref(text)
    env = replace(read_environment(), hf_cache_dir=settings.hub_cache_dir)
    pkg = open_package(ref, env)
    # A hub package is pinned to the commit resolved now (snapshots/<commit>/): every worker
    # then names exactly the same bytes; a local directory is named by its absolute path.
    pinned = (
        f"hf://{ref.repo_id}@{pkg.root.name}"
        if isinstance(ref, HfPackageRef)
        else str(pkg.root.resolve())
    )
    # A mixture of experts' active bytes come from its headers when they are here (a local
    # package, a fetched hub snapshot); otherwise the plan counts every byte as read.
    sizes = sizes_from_package(pkg.root, pkg.manifest, containment_root=pkg.containment_root)
    return pinned, pkg.manifest_sha256, sizes, pkg.manifest.model_id


def package_speculation(
    settings: NodeSettings,
    pinned: str,
    overrides: SpeculativeOverrides | None,
    strategy: str | None,
) -> SpeculativePlan:
    """The speculation plan for serving the package at ``pinned`` (``manifest_speculation``)."""
    from skippy.consume.resolve import open_package
    from skippy.package.refs import parse_package_ref

    env = replace(read_environment(), hf_cache_dir=settings.hub_cache_dir)
    m = open_package(parse_package_ref(pinned), env).manifest
    return manifest_speculation(m, overrides, strategy)


def manifest_speculation(
    manifest: PackageManifest, overrides: SpeculativeOverrides | None, strategy: str | None
) -> SpeculativePlan:
    """The speculation plan for serving the package of ``manifest`` (spec "Speculative
    Decoding"): ``--speculative-strategy``, then the config's model entry, then its global
    ``[speculative]`` table, resolved against the package's declared strategies; ngram-cache
    and ngram-suffix need no declaration. A ``SpeculativeConfigError`` (exit 2) otherwise."""
    from skippy.generation import SpeculativeSettings, parse_generation, resolve_speculative_plan
    from skippy.package.v2_view import ManifestV2

    m = manifest
    package = parse_generation(
        m.speculative_block() if isinstance(m, ManifestV2) else m.generation,
        layer_count=m.layer_count,
    )
    cli = SpeculativeSettings(strategy=strategy) if strategy is not None else None
    return resolve_speculative_plan(package=package, overrides=overrides, model=m.model_id, cli=cli)


def package_engine(settings: NodeSettings, pinned: str) -> EngineChoice:
    """Which engine serves the package at ``pinned`` on this node, from its metadata part
    (brought to local disk first for an hf:// package: stage 0 needs it anyway), and whether
    it may be split (``skippy.serving.engine_choice``)."""
    from skippy.consume.resolve import fetch_selection, open_package
    from skippy.gguf.reader import open_gguf
    from skippy.package.ranges import LayerRange
    from skippy.package.refs import parse_package_ref
    from skippy.package.select import StageSelection
    from skippy.paths import resolve_under
    from skippy.runtime.weights import read_model_kv
    from skippy.serving.engine_choice import choose_engine, family_of, stage_runtime_problem

    env = replace(read_environment(), hf_cache_dir=settings.hub_cache_dir)
    ref = parse_package_ref(pinned)
    pkg = open_package(ref, env)
    m = pkg.manifest
    metadata = next(iter(m.artifacts()))  # the metadata part (v1) or carrier (v2) comes first
    everything = LayerRange(0, m.layer_count, m.layer_count)
    fetch_selection(pkg, ref, StageSelection(m, everything, (metadata,), None), env)
    path = resolve_under(pkg.root, metadata.path, containment_root=pkg.containment_root)
    with open_gguf(path, header_only=True) as g:
        kv = read_model_kv(g)
    return choose_engine(settings.serving.engine, family_of(kv), stage_runtime_problem(kv))
