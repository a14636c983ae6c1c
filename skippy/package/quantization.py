"""The additive manifest block ``quantization`` (skippy-quantize).

A package written by ``skippy-quantize quantize-layer-package`` records how its tensors were
made from the high-precision source, so a consumer can tell what it runs and a publisher's
recipe travels with the package::

    "quantization": {
      "type": "Q4_K_M",          llama-quantize preset (aliases resolved: Q4_K -> Q4_K_M)
      "ftype": 15,               its llama_ftype, also written as general.file_type
      "pure": false,             llama-quantize --pure: no per-tensor mixture rules
      "recipe": "...",           the --tensor-types file's text, or null
      "recipe_sha256": "...",    SHA-256 of the recipe's UTF-8 bytes, or null
      "imatrix_sha256": "...",   only when --imatrix was given
      "tool_version": "...",     skippy and ggml versions that quantized
      "requantized_from": {...}  only when the source was a package quantized before: its
                                 block (the bytes then cannot be redone from source_model)
    }

Parsing and the consistency checks are pure; consumers call ``quantization_findings`` (via
``check_manifest``) and, with the metadata fragment at hand, ``file_type_findings``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from skippy.constants import FRAGMENT_KEY_PREFIX, SHA256_HEX_RE
from skippy.errors import ManifestError
from skippy.findings import Finding
from skippy.gguf.constants import ValueType
from skippy.gguf.writer import encode_kv

QUANTIZATION_KEY: Final = "quantization"
KEY_FILE_TYPE: Final = "general.file_type"
KEY_QUANTIZATION_VERSION: Final = "general.quantization_version"
GGML_QNT_VERSION: Final = 2  # ggml.h: what llama.cpp writes as general.quantization_version


@dataclass(frozen=True)
class QuantizationBlock:
    type: str
    ftype: int
    pure: bool
    recipe: str | None
    recipe_sha256: str | None
    tool_version: str
    imatrix_sha256: str | None = None
    requantized_from: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": self.type,
            "ftype": self.ftype,
            "pure": self.pure,
            "recipe": self.recipe,
            "recipe_sha256": self.recipe_sha256,
            "tool_version": self.tool_version,
        }
        if self.imatrix_sha256 is not None:
            out["imatrix_sha256"] = self.imatrix_sha256
        if self.requantized_from is not None:
            out["requantized_from"] = self.requantized_from
        return out


def quantized_kv_records(
    records: Sequence[tuple[str, bytes]], ftype: int
) -> list[tuple[str, bytes]]:
    """llama_model_quantize_impl: copy the KV set, then set quantization_version and
    file_type (gguf_set_val_u32 removes the key and appends it). A package source's own
    per-fragment keys (skippy.fragment.*) are dropped: write-package writes new ones."""
    set_keys = (KEY_QUANTIZATION_VERSION, KEY_FILE_TYPE)
    out = [
        (k, r)
        for k, r in records
        if k not in set_keys and not k.startswith(FRAGMENT_KEY_PREFIX)
    ]
    out.append(
        (
            KEY_QUANTIZATION_VERSION,
            encode_kv(KEY_QUANTIZATION_VERSION, ValueType.UINT32, GGML_QNT_VERSION),
        )
    )
    out.append((KEY_FILE_TYPE, encode_kv(KEY_FILE_TYPE, ValueType.UINT32, ftype)))
    return out


def recipe_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _bad(field: str, want: str, got: Any) -> ManifestError:
    return ManifestError(
        f"{QUANTIZATION_KEY}.{field} must be {want}, got {json.dumps(got)[:60]}",
        code="invalid_quantization_block",
        path=f"{QUANTIZATION_KEY}.{field}",
    )


def parse_quantization(raw: Any) -> QuantizationBlock:
    """The block's field types; raises ``ManifestError`` (code invalid_quantization_block)."""
    if not isinstance(raw, dict):
        raise _bad("", "a JSON object", raw)

    def text(name: str, *, nullable: bool = False) -> str | None:
        v = raw.get(name)
        if v is None and nullable:
            return None
        if not isinstance(v, str) or not v:
            raise _bad(name, "a non-empty string" + (" or null" if nullable else ""), v)
        return v

    ftype = raw.get("ftype")
    if isinstance(ftype, bool) or not isinstance(ftype, int) or ftype < 0:
        raise _bad("ftype", "a non-negative integer", ftype)
    pure = raw.get("pure", False)
    if not isinstance(pure, bool):
        raise _bad("pure", "a boolean", pure)
    recipe = raw.get("recipe")
    if recipe is not None and not isinstance(recipe, str):
        raise _bad("recipe", "a string or null", recipe)
    earlier = raw.get("requantized_from")
    if earlier is not None and not isinstance(earlier, dict):
        raise _bad("requantized_from", "a JSON object", earlier)
    return QuantizationBlock(
        type=str(text("type")),
        ftype=ftype,
        pure=pure,
        recipe=recipe,
        recipe_sha256=text("recipe_sha256", nullable=True),
        tool_version=str(text("tool_version")),
        imatrix_sha256=text("imatrix_sha256", nullable=True),
        requantized_from=earlier,
    )


def quantization_findings(extra: Mapping[str, Any]) -> list[Finding]:
    """The block in a manifest's extra fields, if present: types, digests, recipe hash."""
    if QUANTIZATION_KEY not in extra:
        return []
    try:
        q = parse_quantization(extra[QUANTIZATION_KEY])
    except ManifestError as exc:
        return [Finding.from_error(exc)]
    out: list[Finding] = []
    for name in ("recipe_sha256", "imatrix_sha256"):
        digest = getattr(q, name)
        if digest is not None and not SHA256_HEX_RE.match(digest):
            out.append(
                Finding(
                    "invalid_quantization_block",
                    f"{QUANTIZATION_KEY}.{name} is not a 64-character hex digest",
                )
            )
    if (q.recipe is None) != (q.recipe_sha256 is None):
        out.append(
            Finding(
                "invalid_quantization_block",
                f"{QUANTIZATION_KEY}.recipe and recipe_sha256 must both be set or both be null",
            )
        )
    elif q.recipe is not None and recipe_digest(q.recipe) != str(q.recipe_sha256).lower():
        out.append(
            Finding(
                "quantization_recipe_mismatch",
                f"{QUANTIZATION_KEY}.recipe does not hash to its recipe_sha256: the recipe "
                "published with the package is not the one recorded",
            )
        )
    return out


def file_type_findings(extra: Mapping[str, Any], metadata: Mapping[str, Any]) -> list[Finding]:
    """The block against the metadata fragment's KV: llama.cpp writes the preset's ftype as
    ``general.file_type``; a mismatch means the block does not describe these tensors."""
    if QUANTIZATION_KEY not in extra:
        return []
    try:
        q = parse_quantization(extra[QUANTIZATION_KEY])
    except ManifestError:
        return []  # already a finding of quantization_findings
    have = metadata.get(KEY_FILE_TYPE)
    if have != q.ftype:
        return [
            Finding(
                "quantization_file_type_mismatch",
                f"{QUANTIZATION_KEY}.ftype is {q.ftype} ({q.type}) but the metadata fragment's "
                f"{KEY_FILE_TYPE} is {have}",
            )
        ]
    return []
