"""A package a coordinator plans: its pinned reference and the facts a topology needs."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from skippy.config import NodeSettings, read_environment

if TYPE_CHECKING:
    from skippy.generation import SpeculativeOverrides, SpeculativePlan
    from skippy.package.manifest import PackageManifest


def package_identity(settings: NodeSettings, text: str) -> tuple[str, str, Any, str]:
    """(pinned package ref, manifest SHA-256, per-artifact sizes, model id)."""
    from skippy.consume.resolve import open_package
    from skippy.package.refs import HfPackageRef, parse_package_ref
    from skippy.produce.sizes import sizes_from_manifest

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
    return pinned, pkg.manifest_sha256, sizes_from_manifest(pkg.manifest), pkg.manifest.model_id


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
