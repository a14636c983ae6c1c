"""Reading GGUF tensor names and metadata as evidence for generation defaults.

Shared by the writer (``infer_generation``) and the checker (``check_generation``) so that what
the writer requires before advertising a default is exactly what validation re-checks against
the package artifacts ("Generation Defaults": writers SHOULD only emit a profile after they have
validated the artifact shape that profile requires).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from numbers import Integral

from skippy.generation import vocab as v


def as_int(value: object) -> int | None:
    """``value`` as an int when it is an integer (bool is not), else None."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        return None
    return int(value)


def layer_base_names(names: Iterable[str]) -> dict[int, set[str]]:
    """``{layer: {"attn_k_b", "indexer.k_norm", "nextn.eh_proj", ...}}`` from GGUF names.

    ``blk.3.attn_k_b.weight`` becomes ``(3, "attn_k_b")``; names outside ``blk.N.`` are skipped.
    """
    out: dict[int, set[str]] = {}
    for name in names:
        m = v.LAYER_TENSOR_RE.match(name)
        if m is not None:
            out.setdefault(int(m.group(1)), set()).add(m.group(2))
    return out


def nextn_parts(base_names: Collection[str]) -> set[str]:
    """The ``nextn.<part>`` tensors among one layer's base names."""
    prefix = "nextn."
    return {n[len(prefix) :] for n in base_names if n.startswith(prefix)}


def holds_nextn(base_names: Collection[str]) -> bool:
    """True when the layer holds the NextN tensors llama.cpp requires (eh_proj, enorm, hnorm)."""
    return nextn_parts(base_names) >= v.NEXTN_REQUIRED_PARTS


def glm_dsa_missing_evidence(
    *,
    per_layer: Mapping[int, Collection[str]],
    layer_count: int,
    nextn_layers: Collection[int],
    indexer_top_k: object = None,
    check_top_k: bool = True,
) -> list[str]:
    """What is missing for ``glm-dsa-v1``; an empty list means every piece of evidence is there.

    Required ("Generation Defaults", "Policy Resolution"; docs/generation.md lists the same):
      * GLM-DSA attention: every non-NextN layer holds attn_kv_a_mqa, attn_k_b and attn_v_b;
      * routed + shared MoE: some layer holds the routed experts (ffn_gate_exps/ffn_up_exps or
        ffn_gate_up_exps, plus ffn_down_exps) together with ffn_gate/up/down_shexp;
      * IndexShare: ``<arch>.attention.indexer.top_k`` is a positive integer (the top-k width
        Shared layers reuse) and some GLM-DSA attention layer owns the four lightning-indexer
        tensors (a Full layer that produces the shared top-k).
    """
    missing: list[str] = []
    main_layers = [i for i in range(layer_count) if i not in set(nextn_layers)]
    no_attention = [
        i for i in main_layers if not set(per_layer.get(i, ())) >= v.GLM_DSA_ATTENTION_TENSORS
    ]
    if not main_layers or no_attention:
        shown = ", ".join(str(i) for i in no_attention[:8]) or "none"
        missing.append(
            "GLM-DSA split attention tensors "
            f"({', '.join(sorted(v.GLM_DSA_ATTENTION_TENSORS))}) in every layer "
            f"(missing in layer(s) {shown}{' ...' if len(no_attention) > 8 else ''})"
        )

    def has_moe(names: Collection[str]) -> bool:
        s = set(names)
        routed = s >= v.ROUTED_MOE_TENSORS or s >= v.ROUTED_MOE_MERGED_TENSORS
        return routed and s >= v.SHARED_MOE_TENSORS

    if not any(has_moe(per_layer.get(i, ())) for i in main_layers):
        missing.append(
            "a layer with routed experts (ffn_gate_exps, ffn_up_exps, ffn_down_exps) and a "
            "shared expert (ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp)"
        )

    full_layers = [
        i
        for i in main_layers
        if set(per_layer.get(i, ())) >= v.INDEXER_TENSORS
        and set(per_layer.get(i, ())) >= v.GLM_DSA_ATTENTION_TENSORS
    ]
    if not full_layers:
        missing.append(
            "an IndexShare Full layer owning the lightning-indexer tensors "
            f"({', '.join(sorted(v.INDEXER_TENSORS))})"
        )
    if check_top_k:
        top_k = as_int(indexer_top_k)
        if top_k is None or top_k < 1:
            missing.append(
                f"IndexShare metadata <arch>.{v.INDEXER_TOP_K_KEY} as a positive integer "
                f"(found {indexer_top_k!r})"
            )
    return missing
