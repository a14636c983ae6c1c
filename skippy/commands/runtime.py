"""Runtime commands: ``run REF --prompt TEXT`` loads a verified stage and generates greedily.

The order is: resolve REF to a local package, parse the manifest, refuse a stage shape the
runtime cannot run (before spending time on checksums), run consumer validation (manifest
rules, selection, path gate, presence, sizes, SHA-256 unless SKIPPY_VERIFY_PACKAGE_SHA is
off), then load the selected parts in place and generate.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from skippy.cli import CommandResult, add_json_flag
from skippy.constants import ENV_VERIFY_PACKAGE_SHA, MANIFEST_NAME
from skippy.errors import InputUnreadable, UsageError
from skippy.hashing import sha256_file
from skippy.inspect import read_manifest
from skippy.ranges import LayerRange, parse_layer_range
from skippy.runtime import verify_local_stage

HF_SCHEME = "hf://"
DEFAULT_MAX_TOKENS = 32
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="load a package stage with llama.cpp and generate greedily")
    p.add_argument("ref", help="a local package directory (hf:// references: not yet)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS})",
    )
    p.add_argument(
        "--layers",
        metavar="A..B",
        help="half-open layer range to load (default: every layer)",
    )
    add_json_flag(p)
    p.set_defaults(handler=cmd_run)


def resolve_package_ref(ref: str) -> Path:
    """REF -> local package directory. The one place to swap in the hub resolver later."""
    if ref.startswith(HF_SCHEME):
        raise UsageError(
            f"{ref}: hf:// references are not wired into `run` yet",
            code="not_yet_supported",
            remediation="download the package with `fetch` and pass its local directory",
        )
    path = Path(ref)
    if not path.is_dir():
        raise InputUnreadable(
            f"{ref} is not a package directory (expected a folder holding {MANIFEST_NAME})",
            path=ref,
        )
    return path


def verify_package_sha_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Spec "Consumer Validation": local packages MAY skip checksums behind
    SKIPPY_VERIFY_PACKAGE_SHA; verification is on unless it says 0/false/no/off."""
    return environ.get(ENV_VERIFY_PACKAGE_SHA, "").strip().lower() not in _FALSE_WORDS


def cmd_run(args: argparse.Namespace) -> CommandResult:
    from skippy.llama_runtime import LlamaStageRuntime

    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1", code="invalid_max_tokens")
    pkg = resolve_package_ref(args.ref)
    manifest = read_manifest(pkg)
    if args.layers is None:
        layers = LayerRange(0, manifest.layer_count, manifest.layer_count)
    else:
        layers = parse_layer_range(args.layers, manifest.layer_count)
    verify = verify_package_sha_enabled()
    with LlamaStageRuntime() as runtime:
        runtime.require_supported(layers)  # refuse before hashing hundreds of MB
        stage = verify_local_stage(
            pkg,
            manifest,
            layers,
            verify_sha256=verify,
            manifest_sha256=sha256_file(pkg / MANIFEST_NAME),
        )
        runtime.load(stage)
        prompt_ids = runtime.tokenize(args.prompt)
        gen = runtime.generate(prompt_ids, max_tokens=args.max_tokens)
        load_s = runtime.load_s
    data: dict[str, Any] = {
        "package": str(pkg),
        "model_id": stage.model_id,
        "manifest_sha256": stage.manifest_sha256,
        "layers": str(layers),
        "sha256_verified": stage.sha256_verified,
        "parts": len(stage.part_paths),
        "load_s": load_s,
        "prompt": args.prompt,
        **gen.to_dict(),
    }
    rate = gen.decode_tokens_per_s or gen.tokens_per_s
    stats = (
        f"[{len(gen.tokens)} tokens, stop: {gen.stop_reason}, "
        f"{rate:.1f} tok/s, load {load_s or 0:.2f}s, "
        f"{len(stage.part_paths)} parts, sha256 {'verified' if verify else 'NOT verified'}]"
        if rate
        else f"[{len(gen.tokens)} tokens, stop: {gen.stop_reason}]"
    )
    warnings = (
        []
        if verify
        else [f"SHA-256 of the selected parts was not verified ({ENV_VERIFY_PACKAGE_SHA} is off)"]
    )
    return CommandResult(data=data, text=f"{args.prompt}{gen.text}\n{stats}", warnings=warnings)
