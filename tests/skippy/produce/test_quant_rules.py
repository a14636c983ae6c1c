"""The pure parts of skippy-quantize: presets, llama.cpp's tensor rules, recipes, the block.

The rules are also checked end to end against llama.cpp itself
(tests/skippy/produce/test_quantize.py);
these tests pin the pieces a reviewer reads against the C++ one by one.
"""

from __future__ import annotations

import pytest

from skippy.errors import UsageError
from skippy.package.quantization import (
    QuantizationBlock,
    file_type_findings,
    parse_quantization,
    quantization_findings,
    recipe_digest,
)
from skippy.produce.quant_rules import (
    FILE_TYPES,
    QUANTIZE_TARGETS,
    ModelFacts,
    T,
    TensorFacts,
    allows_quantization,
    fallback_type,
    llama_order,
    model_facts,
    parse_file_type,
    plan_types,
    recorded_type_findings,
)
from skippy.produce.recipe import MAX_LINE_CHARS, MAX_RECIPE_BYTES, RecipeError, parse_recipe

LLAMA8 = ModelFacts(arch="llama", n_layer_all=8, n_layer=8, n_expert=0, n_head=4, n_head_kv=2)


def _recipe(text: str) -> object:
    return parse_recipe(text.encode(), allowed_types=QUANTIZE_TARGETS)


def _model(
    width: int = 256, ff: int = 640, layers: int = 8, tied: bool = False
) -> list[TensorFacts]:
    out = [TensorFacts("token_embd.weight", (width, 512), T["F32"])]
    out.append(TensorFacts("output_norm.weight", (width,), T["F32"]))
    if not tied:
        out.append(TensorFacts("output.weight", (width, 512), T["F32"]))
    for i in range(layers):
        p = f"blk.{i}."
        out += [
            TensorFacts(p + "attn_norm.weight", (width,), T["F32"]),
            TensorFacts(p + "attn_q.weight", (width, width), T["F32"]),
            TensorFacts(p + "attn_v.weight", (width, 128), T["F32"]),
            TensorFacts(p + "ffn_down.weight", (ff, width), T["F32"]),
        ]
    return out


# --- presets -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "name", "ftype", "canonical"),
    [
        ("Q8_0", "Q8_0", 7, "Q8_0"),
        ("q4_k_m", "Q4_K_M", 15, "Q4_K_M"),
        ("Q4_K", "Q4_K", 15, "Q4_K_M"),  # llama-quantize's alias
        ("iq4_xs", "IQ4_XS", 30, "IQ4_XS"),
        (" BF16 ", "BF16", 32, "BF16"),
    ],
)
def test_presets_follow_llama_quantize_names(text, name, ftype, canonical):
    ft = parse_file_type(text)
    assert (ft.name, ft.ftype, ft.canonical) == (name, ftype, canonical)


@pytest.mark.parametrize("text", ["Q9_0", "Q4_K_XL", "COPY", "q8_1", ""])
def test_unknown_preset_is_a_coded_usage_error(text):
    with pytest.raises(UsageError) as err:
        parse_file_type(text)
    assert err.value.code == "unknown_quant_type" and err.value.exit_code == 2


# --- the rules, piece by piece ------------------------------------------------------------------
def test_iteration_order_is_llama_cpps_weights_map():
    names = ["blk.10.a", "output.weight", "blk.2.b", "blk.2.a", "token_embd.weight", "blk.1.z"]
    ordered = [names[i] for i in llama_order(names)]
    assert ordered == [
        "output.weight",
        "token_embd.weight",
        "blk.1.z",
        "blk.2.a",
        "blk.2.b",
        "blk.10.a",
    ]


@pytest.mark.parametrize(
    ("name", "shape", "allowed"),
    [
        ("blk.0.attn_q.weight", (64, 64), True),
        ("blk.0.attn_norm.weight", (64, 64), False),  # norms never
        ("blk.0.attn_q.weight", (64,), False),  # 1-D never
        ("blk.0.attn_q.weight", (64, 1), False),  # ggml_n_dims ignores trailing 1s
        ("blk.0.attn_q.bias", (64, 64), False),  # only *weight
        ("blk.0.ffn_gate_inp.weight", (64, 8), False),  # expert router
        ("position_embd.weight", (64, 64), False),
        ("v.patch_embd.weight", (8, 8, 3, 64), False),
        ("blk.0.ffn_up_exps.weight", (64, 128, 8), True),
    ],
)
def test_which_tensors_llama_cpp_quantizes(name, shape, allowed):
    assert allows_quantization(TensorFacts(name, shape, T["F32"]), "llama") is allowed


@pytest.mark.parametrize(
    ("target", "ncols", "expected"),
    [
        ("Q4_K", 256, "Q4_K"),
        ("Q4_K", 640, "Q5_0"),
        ("Q6_K", 640, "Q8_0"),
        ("Q5_K", 640, "Q5_1"),
        ("Q2_K", 640, "Q4_0"),
        ("IQ4_XS", 640, "IQ4_NL"),
        ("Q4_K", 100, "F16"),  # not even a 32-block fits
        ("Q8_0", 100, "F16"),
    ],
)
def test_fallback_when_a_block_does_not_divide_the_rows(target, ncols, expected):
    t = TensorFacts("blk.0.ffn_down.weight", (ncols, 64), T["F32"])
    assert fallback_type(t, T[target]) == T[expected]


def test_model_facts_read_layer_zero_of_per_layer_arrays():
    facts = model_facts(
        {
            "general.architecture": "llama",
            "llama.block_count": 80,
            "llama.attention.head_count": [64] * 80,
            "llama.attention.head_count_kv": 8,
        }
    )
    assert (facts.n_head, facts.n_head_kv, facts.n_gqa, facts.is_70b) == (64, 8, 8, True)


def test_q4_k_m_gives_attn_v_and_ffn_down_more_bits_by_position():
    plan = plan_types(_model(ff=512), LLAMA8, FILE_TYPES["Q4_K_M"])
    types = {c.name: c.target_type for c in plan.choices}
    # use_more_bits(i, 8): i < 1, i >= 7, or (i - 1) % 3 == 2 -> layers 0, 3, 6, 7
    for i in range(8):
        want = T["Q6_K"] if i in (0, 3, 6, 7) else T["Q4_K"]
        assert types[f"blk.{i}.attn_v.weight"] == want
        assert types[f"blk.{i}.ffn_down.weight"] == want
    assert types["output.weight"] == T["Q6_K"]
    assert types["token_embd.weight"] == T["Q4_K"]  # untied: the preset's default
    assert types["blk.0.attn_norm.weight"] == T["F32"]


def test_tied_embeddings_take_the_output_rule():
    plan = plan_types(_model(tied=True), LLAMA8, FILE_TYPES["Q4_0"])
    assert {c.name: c.target_type for c in plan.choices}["token_embd.weight"] == T["Q6_K"]


# --- recipes -------------------------------------------------------------------------------------
def test_recipe_parses_comments_blank_lines_and_last_equals():
    r = _recipe("# mine\n\n  ffn_down=Q8_0  # keep it\n(?=blk)blk\\.0\\.attn_q=q4_k\n")
    assert [(x.line_no, x.pattern, x.type_name) for x in r.rules] == [
        (3, "ffn_down", "Q8_0"),
        (4, "(?=blk)blk\\.0\\.attn_q", "Q4_K"),
    ]
    assert r.sha256 == recipe_digest(r.text)


@pytest.mark.parametrize(
    ("data", "code", "line"),
    [
        (b"ffn_down=Q8_0\nattn_(q=Q8_0\n", "recipe_bad_regex", 2),
        (b"ffn_down=Q9_9\n", "recipe_unknown_type", 1),
        (b"ffn_down=Q8_K\n", "recipe_unknown_type", 1),  # a ggml type ggml cannot quantize to
        (b"ffn_down Q8_0\n", "recipe_malformed_line", 1),
        (b"=Q8_0\n", "recipe_malformed_line", 1),
        (b"ok=Q8_0\n" + b"a" * (MAX_LINE_CHARS + 1) + b"=Q8_0\n", "recipe_line_too_long", 2),
        (b"# " + b"x" * MAX_RECIPE_BYTES, "recipe_too_large", None),
        (b"ffn\xff=Q8_0\n", "recipe_not_utf8", None),
        (b"# only a comment\n\n", "recipe_empty", None),
    ],
)
def test_hostile_recipes_are_coded_errors_naming_the_line(data, code, line):
    with pytest.raises(RecipeError) as err:
        parse_recipe(data, allowed_types=QUANTIZE_TARGETS)
    assert err.value.code == code and err.value.exit_code == 2
    assert err.value.actual == line
    if line is not None:
        assert f"recipe line {line}:" in err.value.message


def test_recipe_first_match_wins_and_changes_exactly_what_it_names():
    base = plan_types(_model(), LLAMA8, FILE_TYPES["Q4_K_M"])
    rec = _recipe("blk\\.[0-3]\\.attn_v=Q8_0\nattn_v=Q2_K\nblk\\.0\\.attn_q=Q5_K\n")
    plan = plan_types(_model(), LLAMA8, FILE_TYPES["Q4_K_M"], recipe=rec)
    before, after = base.by_name(), plan.by_name()
    changed = {n for n in after if after[n].target_type != before[n].target_type}
    assert changed == {f"blk.{i}.attn_v.weight" for i in range(8)} | {"blk.0.attn_q.weight"}
    assert all(after[f"blk.{i}.attn_v.weight"].target_type == T["Q8_0"] for i in range(4))
    assert all(after[f"blk.{i}.attn_v.weight"].target_type == T["Q2_K"] for i in range(4, 8))
    assert after["blk.0.attn_v.weight"].reason == "recipe:1"
    assert plan.recipe_hits == (4, 4, 1)


def test_recipe_type_that_cannot_hold_a_tensor_is_an_error():
    with pytest.raises(UsageError) as err:  # ffn_down rows are 640 long: no 256-blocks
        plan_types(_model(), LLAMA8, FILE_TYPES["Q8_0"], recipe=_recipe("ffn_down=Q4_K\n"))
    assert err.value.code == "recipe_type_shape"
    assert "blk.0.ffn_down.weight" in err.value.message


# --- the manifest block --------------------------------------------------------------------------
BLOCK = QuantizationBlock(
    type="Q4_K_M",
    ftype=15,
    pure=False,
    recipe="attn_v=Q8_0\n",
    recipe_sha256=recipe_digest("attn_v=Q8_0\n"),
    tool_version="skippy-quantize test",
)


def test_block_round_trips_and_checks_its_recipe_digest():
    raw = BLOCK.to_dict()
    assert parse_quantization(raw) == BLOCK
    assert quantization_findings({"quantization": raw}) == []
    tampered = {**raw, "recipe": "attn_v=Q2_K\n"}
    assert [f.code for f in quantization_findings({"quantization": tampered})] == [
        "quantization_recipe_mismatch"
    ]
    bad = {**raw, "ftype": "15"}
    assert [f.code for f in quantization_findings({"quantization": bad})] == [
        "invalid_quantization_block"
    ]
    assert quantization_findings({}) == []  # absent: nothing to check


def test_block_against_metadata_and_tensor_types():
    extra = {"quantization": BLOCK.to_dict()}
    assert file_type_findings(extra, {"general.file_type": 15}) == []
    assert [f.code for f in file_type_findings(extra, {"general.file_type": 7})] == [
        "quantization_file_type_mismatch"
    ]
    meta = {
        "general.architecture": "llama",
        "llama.block_count": 8,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
    }
    plan = plan_types(_model(), LLAMA8, FILE_TYPES["Q4_K_M"], recipe=_recipe(BLOCK.recipe or ""))
    held = [
        TensorFacts(c.name, t.shape, c.target_type)
        for c, t in zip(plan.choices, _model(), strict=True)
    ]
    assert recorded_type_findings(BLOCK, meta, held) == []
    held[4] = TensorFacts(held[4].name, held[4].shape, T["Q8_0"])  # blk.0.attn_q
    findings = recorded_type_findings(BLOCK, meta, held)
    assert [f.code for f in findings] == ["quantization_type_mismatch"]
    assert "blk.0.attn_q.weight" in findings[0].message
