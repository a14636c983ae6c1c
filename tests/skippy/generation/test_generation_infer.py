"""Writer inference on synthetic models (tensor-name sets and metadata dicts, no GGUF files).

Expectations come from the spec: the glm-dsa-v1 phase values and thresholds of "Policy
Resolution" / the manifest example, the native MTP strategy shape of "Speculative Decoding",
and "writers MUST NOT advertise a native MTP default unless validation has found the required
native prediction tensors".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from skippy.errors import ModelError
from skippy.generation import (
    check_generation,
    infer_generation,
    parse_generation,
    resolve_speculative_plan,
)

# "For glm-dsa-v1, the current phase intent is" (Policy Resolution) and the manifest example.
SPEC_GLM_DSA_V1_POLICY = {
    "profile": "glm-dsa-v1",
    "decode": "compact-flash",
    "short_prefill": "dense",
    "long_prefill": "sparse-chunked",
    "verify": "auto",
    "indexshare": "required",
    "experimental": {
        "selected_row_flash": "evidence-gated",
        "moe_weighted_down": "evidence-gated",
        "moe_merged_shared_gate_up": "evidence-gated",
    },
}
SPEC_GLM_DSA_V1_THRESHOLDS = {
    "short_prefill_max_tokens": 2048,
    "compact_flash_min_kv": 1,
    "dense_mask_max_bytes": 268435456,
}
# "The current native MTP strategy shape" with a fixed window of 1.
SPEC_FIXED_WINDOW = {
    "default": "fixed",
    "initial_window": 1,
    "min_window": 1,
    "max_window": 1,
    "pipeline_depth": 1,
}

NEXTN = ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")
ATTN = ("attn_kv_a_mqa", "attn_k_b", "attn_v_b")
ROUTED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
INDEXER = ("indexer.k_norm", "indexer.proj", "indexer.attn_k", "indexer.attn_q_b")


def blk(i: int, names: Iterable[str]) -> list[str]:
    return [f"blk.{i}.{n}.weight" for n in names]


def dense_model(layers: int) -> set[str]:
    """A plain llama-style model: no MLA, no experts, no NextN."""
    names = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(layers):
        names |= set(blk(i, ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down")))
    return names


def glm_dsa_model(
    layers: int,
    *,
    nextn_layer: int | None = None,
    dense_first: int = 1,
    index_every: int = 2,
    drop: frozenset[tuple[int, str]] = frozenset(),
    routed: tuple[str, ...] = ROUTED,
) -> set[str]:
    """A GLM-DSA-shaped model: split MLA attention everywhere, ``dense_first`` dense-FFN
    layers then routed + shared experts, lightning-indexer tensors on Full layers (every
    ``index_every``-th; the others are IndexShare Shared layers), optional NextN block."""
    names = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(layers):
        layer = list(ATTN)
        layer += ["ffn_up", "ffn_gate", "ffn_down"] if i < dense_first else [*routed, *SHARED]
        if i % index_every == 0:
            layer += INDEXER
        if i == nextn_layer:
            layer += [f"nextn.{p}" for p in NEXTN]
        names |= {
            n for n in blk(i, layer) if (i, n.split(".", 2)[2][: -len(".weight")]) not in drop
        }
    return names


def glm_md(**extra: Any) -> dict[str, Any]:
    md: dict[str, Any] = {"general.architecture": "glm-dsa", "glm-dsa.attention.indexer.top_k": 768}
    md.update(extra)
    return md


def layer_view(names: set[str]) -> Any:
    """Per-layer artifacts as the package writer splits them (blk.N.* into layer N)."""
    return lambda i: {n for n in names if n.startswith(f"blk.{i}.")}


# --- no evidence, no generation block -------------------------------------------------------------
def test_plain_model_gets_no_generation_block() -> None:
    assert (
        infer_generation(arch="llama", metadata={}, tensor_names=dense_model(4), layer_count=4)
        is None
    )


def test_nextn_key_zero_without_tensors_is_no_evidence() -> None:
    md = {"glm4moe.nextn_predict_layers": 0}
    assert (
        infer_generation(arch="glm4moe", metadata=md, tensor_names=dense_model(4), layer_count=4)
        is None
    )


# --- native MTP -----------------------------------------------------------------------------------
def test_nextn_in_last_layer_writes_a_native_mtp_default() -> None:
    layers = 6
    names = dense_model(layers) | set(blk(layers - 1, [f"nextn.{p}" for p in NEXTN]))
    gen = infer_generation(
        arch="glm4moe",
        metadata={"glm4moe.nextn_predict_layers": 1},
        tensor_names=names,
        layer_count=layers,
    )
    assert gen is not None and set(gen) == {"speculative_decoding"}  # no GLM-DSA evidence
    sd = gen["speculative_decoding"]
    assert sd["default"] == "mtp"
    assert sd["proposers"]["mtp"] == {
        "type": "native-mtp",
        "prediction_depth": 1,
        "layer_indices": [layers - 1],
    }
    assert sd["strategies"]["mtp"]["type"] == "native-mtp"
    assert sd["strategies"]["mtp"]["window_policy"] == SPEC_FIXED_WINDOW
    # validate-package / preflight accept what the writer wrote, against the written artifacts
    assert check_generation(gen, layer_count=layers, layer_tensor_names=layer_view(names)) == []
    plan = resolve_speculative_plan(package=parse_generation(gen, layer_count=layers))
    assert plan.mode == "native-mtp"
    assert plan.native_mtp is not None and plan.native_mtp.layer_indices == (layers - 1,)


def test_only_the_required_nextn_tensors_are_needed() -> None:
    # llama.cpp creates embed_tokens / shared_head_* as TENSOR_NOT_REQUIRED
    names = dense_model(3) | set(blk(2, ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm")))
    gen = infer_generation(
        arch="glm4moe",
        metadata={"glm4moe.nextn_predict_layers": 1},
        tensor_names=names,
        layer_count=3,
    )
    assert gen is not None and gen["speculative_decoding"]["proposers"]["mtp"]["layer_indices"] == [
        2
    ]


def _nextn(layer: int, parts: Iterable[str] = NEXTN) -> set[str]:
    return set(blk(layer, [f"nextn.{p}" for p in parts]))


INCONSISTENT: list[tuple[str, Any, set[str], str]] = [
    # (case, nextn_predict_layers, extra tensors, code); layer_count 6, last layer 5
    ("key-without-tensors", 1, set(), "inconsistent_nextn_evidence"),
    ("tensors-without-key", None, _nextn(5), "inconsistent_nextn_evidence"),
    ("tensors-with-key-0", 0, _nextn(5), "inconsistent_nextn_evidence"),
    ("wrong-layer", 1, _nextn(3), "inconsistent_nextn_evidence"),
    ("two-layers", 1, _nextn(4) | _nextn(5), "inconsistent_nextn_evidence"),
    ("beyond-layer-count", 1, _nextn(6), "inconsistent_nextn_evidence"),
    (
        "incomplete-set",
        1,
        _nextn(5, ("eh_proj", "shared_head_norm")),
        "inconsistent_nextn_evidence",
    ),
    ("depth-2", 2, _nextn(4) | _nextn(5), "unsupported_nextn_depth"),
    ("depth-2-one-layer", 2, _nextn(5), "unsupported_nextn_depth"),
    ("key-string", "1", _nextn(5), "invalid_nextn_metadata"),
    ("key-float", 1.0, _nextn(5), "invalid_nextn_metadata"),
    ("key-bool", True, _nextn(5), "invalid_nextn_metadata"),
    ("key-list", [1], _nextn(5), "invalid_nextn_metadata"),
    ("key-negative", -1, set(), "invalid_nextn_metadata"),
]


@pytest.mark.parametrize(
    ("key", "extra", "code"), [r[1:] for r in INCONSISTENT], ids=[r[0] for r in INCONSISTENT]
)
def test_inconsistent_nextn_evidence_fails_the_write(key: Any, extra: set[str], code: str) -> None:
    md = {} if key is None else {"glm4moe.nextn_predict_layers": key}
    with pytest.raises(ModelError) as info:
        infer_generation(
            arch="glm4moe", metadata=md, tensor_names=dense_model(6) | extra, layer_count=6
        )
    assert info.value.code == code
    assert info.value.path == "glm4moe.nextn_predict_layers"
    assert info.value.message  # a clear message, not a bare code


def test_the_nextn_key_is_read_for_the_sources_own_arch() -> None:
    md = {"llama.nextn_predict_layers": 1}  # another arch's key is not evidence
    with pytest.raises(ModelError) as info:
        infer_generation(
            arch="glm4moe", metadata=md, tensor_names=dense_model(6) | _nextn(5), layer_count=6
        )
    assert info.value.code == "inconsistent_nextn_evidence"


@pytest.mark.parametrize("layer_count", [0, -3])
def test_layer_count_must_be_positive(layer_count: int) -> None:
    with pytest.raises(ModelError) as info:
        infer_generation(arch="llama", metadata={}, tensor_names=set(), layer_count=layer_count)
    assert info.value.code == "invalid_layer_count"


# --- glm-dsa-v1 -----------------------------------------------------------------------------------
def test_full_glm_dsa_evidence_writes_the_spec_profile_and_thresholds() -> None:
    layers = 8
    names = glm_dsa_model(layers, nextn_layer=layers - 1)
    gen = infer_generation(
        arch="glm-dsa",
        metadata=glm_md(**{"glm-dsa.nextn_predict_layers": 1}),
        tensor_names=names,
        layer_count=layers,
    )
    assert gen is not None
    assert gen["policy"] == SPEC_GLM_DSA_V1_POLICY
    assert gen["thresholds"] == SPEC_GLM_DSA_V1_THRESHOLDS
    assert gen["speculative_decoding"]["proposers"]["mtp"]["layer_indices"] == [layers - 1]
    findings = check_generation(
        gen,
        layer_count=layers,
        layer_tensor_names=layer_view(names),
        metadata=glm_md(),
        arch="glm-dsa",
    )
    assert findings == []


def test_glm_dsa_without_nextn_writes_policy_only() -> None:
    gen = infer_generation(
        arch="glm-dsa", metadata=glm_md(), tensor_names=glm_dsa_model(4), layer_count=4
    )
    assert gen == {"policy": SPEC_GLM_DSA_V1_POLICY, "thresholds": SPEC_GLM_DSA_V1_THRESHOLDS}


def test_written_policy_is_a_fresh_copy() -> None:
    a = infer_generation(
        arch="glm-dsa", metadata=glm_md(), tensor_names=glm_dsa_model(4), layer_count=4
    )
    assert a is not None
    a["policy"]["experimental"]["moe_weighted_down"] = "changed"
    b = infer_generation(
        arch="glm-dsa", metadata=glm_md(), tensor_names=glm_dsa_model(4), layer_count=4
    )
    assert b is not None and b["policy"] == SPEC_GLM_DSA_V1_POLICY


def test_merged_routed_gate_up_counts_as_routed_experts() -> None:
    names = glm_dsa_model(4, routed=("ffn_gate_up_exps", "ffn_down_exps"))
    gen = infer_generation(arch="glm-dsa", metadata=glm_md(), tensor_names=names, layer_count=4)
    assert gen is not None and gen["policy"]["profile"] == "glm-dsa-v1"


MISSING_EVIDENCE: list[tuple[str, str, dict[str, Any], set[str]]] = [
    # (case, arch, metadata, tensor names) -- each lacks exactly one piece of evidence
    (
        "attn_k_b-missing-in-one-layer",
        "glm-dsa",
        glm_md(),
        glm_dsa_model(4, drop=frozenset({(2, "attn_k_b")})),
    ),
    (
        "attn_kv_a_mqa-missing",
        "glm-dsa",
        glm_md(),
        glm_dsa_model(4, drop=frozenset({(0, "attn_kv_a_mqa")})),
    ),
    ("no-routed-experts", "glm-dsa", glm_md(), glm_dsa_model(4, routed=())),
    (
        "no-shared-expert",
        "glm-dsa",
        glm_md(),
        glm_dsa_model(4, drop=frozenset((i, "ffn_up_shexp") for i in range(4))),
    ),
    (
        "no-indexer-tensors",
        "glm-dsa",
        glm_md(),
        glm_dsa_model(4, drop=frozenset((i, "indexer.proj") for i in range(4))),
    ),
    ("no-indexer-top_k", "glm-dsa", {"general.architecture": "glm-dsa"}, glm_dsa_model(4)),
    ("top_k-zero", "glm-dsa", glm_md(**{"glm-dsa.attention.indexer.top_k": 0}), glm_dsa_model(4)),
    (
        "top_k-string",
        "glm-dsa",
        glm_md(**{"glm-dsa.attention.indexer.top_k": "768"}),
        glm_dsa_model(4),
    ),
    # other families use their own profile names ("Execution Policy")
    ("other-arch", "deepseek2", {"deepseek2.attention.indexer.top_k": 768}, glm_dsa_model(4)),
]


@pytest.mark.parametrize(
    ("arch", "metadata", "names"),
    [r[1:] for r in MISSING_EVIDENCE],
    ids=[r[0] for r in MISSING_EVIDENCE],
)
def test_incomplete_glm_dsa_evidence_writes_no_profile(
    arch: str, metadata: dict[str, Any], names: set[str]
) -> None:
    assert infer_generation(arch=arch, metadata=metadata, tensor_names=names, layer_count=4) is None


def test_incomplete_glm_dsa_evidence_keeps_a_valid_mtp_default() -> None:
    names = glm_dsa_model(5, nextn_layer=4, routed=())
    gen = infer_generation(
        arch="glm-dsa",
        metadata=glm_md(**{"glm-dsa.nextn_predict_layers": 1}),
        tensor_names=names,
        layer_count=5,
    )
    assert gen is not None and set(gen) == {"speculative_decoding"}


def test_glm_dsa_with_inconsistent_nextn_still_fails() -> None:
    names = glm_dsa_model(5, nextn_layer=2)  # NextN not in the last layer
    with pytest.raises(ModelError) as info:
        infer_generation(
            arch="glm-dsa",
            metadata=glm_md(**{"glm-dsa.nextn_predict_layers": 1}),
            tensor_names=names,
            layer_count=5,
        )
    assert info.value.code == "inconsistent_nextn_evidence"
