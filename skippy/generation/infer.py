"""Writer inference: the ``generation`` object ``write-package`` records, from GGUF evidence.

Spec "Generation Defaults" (writers SHOULD only emit a profile after validating the artifact
shape it requires; they must not infer a more specific policy than the artifact supports) and
"Speculative Decoding" (writers MUST NOT advertise a native MTP default unless the native
prediction tensors are in the package artifacts). Inconsistent NextN evidence fails the write;
absent evidence simply means no default. docs/generation.md lists the exact evidence.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping
from typing import Any

from skippy.generation import vocab as v
from skippy.generation.errors import GenerationEvidenceError
from skippy.generation.evidence import (
    as_int,
    glm_dsa_missing_evidence,
    holds_nextn,
    layer_base_names,
    nextn_parts,
)


def _nextn_layer(
    *, arch: str, metadata: Mapping[str, Any], per_layer: Mapping[int, set[str]], layer_count: int
) -> int | None:
    """The single NextN/MTP layer, None when there is no NextN evidence at all.

    Raises GenerationEvidenceError on inconsistent evidence: a key without tensors, tensors
    without a key, NextN tensors outside the last layer or spread over several layers, an
    incomplete NextN tensor set, a depth other than 1, or a non-integer key.
    """
    key = f"{arch}.{v.NEXTN_PREDICT_LAYERS_KEY}"
    raw = metadata.get(key)
    depth = as_int(raw)
    if raw is not None and (depth is None or depth < 0):
        raise GenerationEvidenceError(
            f"{key} must be a non-negative integer, got {raw!r}",
            code=v.C_INVALID_NEXTN_METADATA,
            path=key,
            actual=raw,
            remediation="fix the source GGUF metadata; the writer will not guess the NextN depth",
        )
    layers = sorted(i for i, names in per_layer.items() if nextn_parts(names))
    shown = ", ".join(f"blk.{i}.nextn.*" for i in layers)
    last = layer_count - 1
    if not depth:
        if layers:
            raise GenerationEvidenceError(
                f"the source holds NextN/MTP tensors ({shown}) but {key} is "
                f"{'missing' if raw is None else raw}; the writer cannot tell whether they are "
                "a usable native MTP head",
                code=v.C_INCONSISTENT_NEXTN,
                path=key,
                expected=1,
                actual=raw,
                remediation=f"set {key} = 1 in the source GGUF, or remove the nextn tensors",
            )
        return None
    if depth != v.SUPPORTED_PREDICTION_DEPTH:
        raise GenerationEvidenceError(
            f"{key} = {depth}: only a single NextN layer (prediction depth 1) is supported by "
            "the current native MTP runtime",
            code=v.C_UNSUPPORTED_NEXTN_DEPTH,
            path=key,
            expected=v.SUPPORTED_PREDICTION_DEPTH,
            actual=depth,
        )
    if not layers:
        raise GenerationEvidenceError(
            f"{key} = 1 but the source holds no blk.N.nextn.* tensors; a native MTP default "
            "cannot be advertised without them",
            code=v.C_INCONSISTENT_NEXTN,
            path=key,
            expected=f"blk.{last}.nextn.*",
            actual=None,
            remediation="use a source GGUF that preserves the NextN/MTP block",
        )
    if layers != [last]:
        raise GenerationEvidenceError(
            f"NextN/MTP tensors are in {shown}, but with {key} = 1 they must be in the last "
            f"layer only (blk.{last})",
            code=v.C_INCONSISTENT_NEXTN,
            path=key,
            expected=[last],
            actual=layers,
        )
    if not holds_nextn(per_layer[last]):
        missing = sorted(v.NEXTN_REQUIRED_PARTS - nextn_parts(per_layer[last]))
        raise GenerationEvidenceError(
            f"layer {last} holds an incomplete NextN set: missing "
            + ", ".join(f"blk.{last}.nextn.{m}" for m in missing),
            code=v.C_INCONSISTENT_NEXTN,
            path=key,
            expected=sorted(v.NEXTN_REQUIRED_PARTS),
            actual=sorted(nextn_parts(per_layer[last])),
        )
    return last


def infer_generation(
    *,
    arch: str,
    metadata: Mapping[str, Any],
    tensor_names: Collection[str],
    layer_count: int,
) -> dict[str, Any] | None:
    """The JSON-ready ``generation`` object for a package written from this source, or None.

    ``metadata`` is the source GGUF's KV decoded to Python values; ``tensor_names`` are all
    source tensor names; ``layer_count`` is the package's layer count (NextN block included).

    * ``speculative_decoding``: when ``<arch>.nextn_predict_layers`` = 1 and the last layer
      holds blk.N.nextn.{eh_proj,enorm,hnorm}: a native-mtp proposer ``mtp`` and strategy
      ``mtp`` (prediction_depth 1, that layer, fixed window 1) as the default.
    * ``policy`` + ``thresholds``: the glm-dsa-v1 profile with the spec's phase values and
      thresholds, only when the arch is GLM-DSA and every piece of evidence is present.

    Raises ``GenerationEvidenceError`` (a ModelError) with code ``inconsistent_nextn_evidence``,
    ``unsupported_nextn_depth`` or ``invalid_nextn_metadata`` on inconsistent NextN evidence.
    """
    if as_int(layer_count) is None or layer_count < 1:
        raise GenerationEvidenceError(
            f"layer_count must be a positive integer, got {layer_count!r}",
            code=v.C_INVALID_LAYER_COUNT,
            actual=layer_count,
        )
    per_layer = layer_base_names(tensor_names)
    out: dict[str, Any] = {}

    nextn = _nextn_layer(arch=arch, metadata=metadata, per_layer=per_layer, layer_count=layer_count)
    if arch in v.GLM_DSA_ARCHES and not glm_dsa_missing_evidence(
        per_layer=per_layer,
        layer_count=layer_count,
        nextn_layers=[nextn] if nextn is not None else [],
        indexer_top_k=metadata.get(f"{arch}.{v.INDEXER_TOP_K_KEY}"),
    ):
        out[v.POLICY] = copy.deepcopy(v.GLM_DSA_V1_POLICY)
        out[v.THRESHOLDS] = dict(v.GLM_DSA_V1_THRESHOLDS)
    if nextn is not None:
        out[v.SPECULATIVE] = {
            v.SD_DEFAULT: v.STRATEGY_MTP,
            v.SD_PROPOSERS: {
                v.STRATEGY_MTP: {
                    v.TYPE: v.NATIVE_MTP,
                    v.PREDICTION_DEPTH: v.SUPPORTED_PREDICTION_DEPTH,
                    v.LAYER_INDICES: [nextn],
                }
            },
            v.SD_STRATEGIES: {
                v.STRATEGY_MTP: {
                    v.TYPE: v.NATIVE_MTP,
                    v.PROPOSER: v.STRATEGY_MTP,
                    v.WINDOW_POLICY: {
                        v.WP_DEFAULT: v.WINDOW_FIXED,
                        v.WP_INITIAL: 1,
                        v.WP_MIN: 1,
                        v.WP_MAX: 1,
                        v.WP_PIPELINE_DEPTH: 1,
                    },
                }
            },
        }
    return out or None
