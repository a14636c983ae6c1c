"""``policy``: which execution path the phase resolver picks for one request, and why.

Spec "Policy Resolution": the decision record (profile, phase, backend, request shape,
estimated dense-mask bytes, the threshold that applied, the selected path, the package path
that was overridden or rejected, the fallback reason) is printed, or emitted as ``--json``.
Metadata-only: it reads the manifest, and the architecture (``general.architecture``, which
picks the runtime's built-in default) from ``shared/metadata.gguf`` when that file is already on
local disk; it never downloads an artifact, so an unfetched hub package's architecture is
``unknown``.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from skippy.commands.output import CommandResult, field_text
from skippy.errors import UsageError

if TYPE_CHECKING:
    from skippy.consume.preflight import LoadedPackage

PHASE_CHOICES = ("decode", "short_prefill", "long_prefill", "verify", "prefill")
# What this project's own runtime executes: llama.cpp on the CPU runs dense attention only.
DEFAULT_BACKEND = "cpu"
DEFAULT_PATHS = "dense"
UNKNOWN_ARCH = "unknown"  # the shared metadata is not on local disk (an unfetched hub package)


def register(sub: Any) -> None:
    p = sub.add_parser("policy")
    p.add_argument("ref", metavar="REF", help="a package directory, or hf://namespace/repo[@rev]")
    p.add_argument(
        "--phase", required=True, choices=PHASE_CHOICES, help="the request phase to decide for"
    )
    p.add_argument("--n-tokens", type=int, required=True, help="tokens in this step")
    p.add_argument("--n-kv", type=int, required=True, help="visible KV rows")
    p.add_argument("--top-k", type=int, help="IndexShare top-k, when the model has one")
    p.add_argument("--backend", default=DEFAULT_BACKEND, help="backend name for the record")
    p.add_argument(
        "--paths",
        default=DEFAULT_PATHS,
        help="comma-separated paths the backend executes (e.g. dense,compact-flash)",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="PHASE=PATH",
        help="an explicit experiment override (repeatable)",
    )
    p.set_defaults(handler=cmd_policy)


def _override(items: list[str]) -> Any:
    from skippy.generation import PhaseOverride

    if not items:
        return None
    paths: dict[str, str] = {}
    for item in items:
        phase, sep, path = item.partition("=")
        if not sep or phase not in PHASE_CHOICES[:4]:
            raise UsageError(
                f"--override {item!r} is not PHASE=PATH with PHASE one of "
                f"{', '.join(PHASE_CHOICES[:4])}",
                code="usage",
            )
        paths[phase] = path
    return PhaseOverride(source="cli", **paths)


def package_architecture(pkg: LoadedPackage) -> str:
    """``general.architecture`` of the package's shared metadata when it is on local disk (a
    package directory, or a hub snapshot that already holds it), else ``unknown``. Nothing is
    downloaded. A metadata file that is present but unreadable is an error, not "unknown"."""
    from skippy.constants import KEY_ARCHITECTURE
    from skippy.gguf.reader import open_gguf
    from skippy.paths import resolve_under

    path = resolve_under(
        pkg.root, pkg.manifest.metadata_ref().path, containment_root=pkg.containment_root
    )
    if not path.is_file():
        return UNKNOWN_ARCH
    with open_gguf(path, header_only=True) as g:
        arch = g.get(KEY_ARCHITECTURE)
    return arch if isinstance(arch, str) and arch else UNKNOWN_ARCH


def cmd_policy(args: argparse.Namespace) -> CommandResult:
    from skippy.config import read_environment
    from skippy.consume.resolve import open_ref
    from skippy.generation import (
        BackendCapabilities,
        RequestShape,
        RuntimeDefaults,
        parse_generation,
        resolve_phase,
    )

    pkg = open_ref(args.ref, read_environment())
    spec = parse_generation(pkg.manifest.generation, layer_count=pkg.manifest.layer_count)
    paths = frozenset(p.strip() for p in args.paths.split(",") if p.strip())
    decision = resolve_phase(
        args.phase,
        RequestShape(args.n_tokens, args.n_kv, args.top_k),
        capabilities=BackendCapabilities(args.backend, paths),
        runtime_default=RuntimeDefaults(arch=package_architecture(pkg)),
        policy=spec.policy,
        thresholds=spec.thresholds,
        override=_override(args.override),
    )
    d = {"package": pkg.display, **decision.to_dict()}
    lines = [
        f"{field_text(pkg.manifest.model_id)}: {d['phase']} on {d['backend']} -> "
        f"{d['selected_path']} (from {d['selected_source']})",
        f"  profile: {d['profile'] or 'none declared'}; package path: {d['package_path']} "
        f"({d['package_path_status']}); runtime default for {d['arch']}: "
        f"{d['runtime_default_path']}",
        f"  n_tokens {d['n_tokens']}, n_kv {d['n_kv']}, dense mask {d['dense_mask_bytes']} bytes",
    ]
    if d.get("fallback_reason"):
        lines.append(f"  fallback: {d['fallback_reason']}")
    return CommandResult(data=d, text="\n".join(lines))
