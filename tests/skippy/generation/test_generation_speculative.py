"""Operator overrides and the speculative plan ("Speculative Decoding", operator paragraphs).

"auto uses the package/runtime default, mtp forces the direct native-MTP control, and disabled
disables speculation. A named package strategy such as mtp-cache is accepted only when the
selected package declares it. Precedence is CLI invocation, selected model entry, then global
defaults. These layers may bound N-gram proposal size, extension depth, cooldown, and
VerifyWindow depth." -- each sentence has a test below.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from skippy.errors import UsageError
from skippy.generation import (
    GenerationSpec,
    NativeMtpSource,
    NgramSource,
    SpeculativeOverrides,
    SpeculativePlan,
    SpeculativeSettings,
    load_speculative_overrides,
    parse_generation,
    resolve_speculative_plan,
)

LAYERS = 48

# The spec's proposers example (default mtp-cache; "mtp" exists only as a proposer).
SPEC_PROPOSERS_EXAMPLE: dict[str, Any] = {
    "default": "mtp-cache",
    "proposers": {
        "mtp": {"type": "native-mtp", "prediction_depth": 1, "layer_indices": [47]},
        "cache": {
            "type": "ngram-cache",
            "ngram_min": 2,
            "ngram_max": 4,
            "max_proposal_tokens": 10,
            "history_scope": "request",
        },
    },
    "strategies": {
        "mtp-cache": {
            "type": "composite",
            "primary": "mtp",
            "extender": "cache",
            "extension_policy": {"max_tokens": 8},
        }
    },
}


def package(
    sd: dict[str, Any] | None = None, strategies: dict[str, Any] | None = None
) -> GenerationSpec:
    body = json.loads(json.dumps(sd if sd is not None else SPEC_PROPOSERS_EXAMPLE))
    body["strategies"].update(strategies or {})
    return parse_generation({"speculative_decoding": body}, layer_count=LAYERS)


PKG = package()
NO_SPEC_PACKAGE = parse_generation(None, layer_count=LAYERS)  # a package with no generation
MENU = package(
    strategies={
        "mtp": {
            "type": "native-mtp",
            "proposer": "mtp",
            "window_policy": {"default": "fixed", "max_window": 1, "pipeline_depth": 1},
        },
        "ngram-cache": {
            "type": "ngram-cache",
            "proposer": "cache",
            "window_policy": {
                "default": "adaptive",
                "min_window": 1,
                "max_window": 6,
                "pipeline_depth": 2,
            },
        },
        "mtp-cache-cool": {
            "type": "composite",
            "primary": "mtp",
            "extender": "cache",
            "extension_policy": {"initial_tokens": 4, "max_tokens": 8, "tail_backoff_proposals": 3},
        },
        "draft": {"type": "draft-model", "draft_model": "org/small-draft:Q8_0"},
        "eagle": {"type": "eagle3"},
    }
)


def settings(**kw: Any) -> SpeculativeSettings:
    return SpeculativeSettings(**kw)


def plan(
    pkg: GenerationSpec | None = PKG,
    *,
    cli: SpeculativeSettings | None = None,
    config: dict[str, Any] | None = None,
    model: str | None = None,
) -> SpeculativePlan:
    overrides = load_speculative_overrides(config or {})
    return resolve_speculative_plan(package=pkg, overrides=overrides, model=model, cli=cli)


# --- strategy values ------------------------------------------------------------------------------
def test_auto_uses_the_package_default() -> None:
    p = plan()
    assert (p.mode, p.strategy_id, p.requested, p.requested_source) == (
        "composite",
        "mtp-cache",
        "auto",
        "default",
    )
    assert p.native_mtp == NativeMtpSource(layer_indices=(47,))
    assert p.ngram == NgramSource("ngram-cache", 2, 4, 10)
    assert p.extension is not None and p.extension.max_tokens == 8
    assert p.window is not None and p.window.pipeline_depth == 1  # legacy depth when omitted


@pytest.mark.parametrize(
    "pkg", [NO_SPEC_PACKAGE, None], ids=["package-without-speculation", "plain-gguf"]
)
def test_auto_without_a_package_default_disables_speculation(pkg: GenerationSpec | None) -> None:
    p = plan(pkg)
    assert p.mode == "disabled" and not p.enabled and p.notes


def test_mtp_forces_the_native_mtp_control() -> None:
    # The example package's default is the composite; mtp forces the MTP source alone.
    p = plan(cli=settings(strategy="mtp"))
    assert (p.mode, p.strategy_id, p.requested_source) == ("native-mtp", "mtp", "cli")
    assert p.native_mtp == NativeMtpSource(layer_indices=(47,))
    assert p.ngram is None and p.extension is None
    assert p.window is not None and p.window.max_window == 1  # "fixed to 1"
    assert p.package_default == "mtp-cache"


def test_mtp_prefers_the_packages_native_mtp_strategy() -> None:
    p = plan(MENU, cli=settings(strategy="mtp"))
    assert p.strategy_id == "mtp" and p.window is not None and p.window.mode == "fixed"


def test_mtp_without_a_native_source_is_an_error() -> None:
    ngram_only = {
        "default": "c",
        "proposers": {"cache": SPEC_PROPOSERS_EXAMPLE["proposers"]["cache"]},
        "strategies": {"c": {"type": "ngram-cache", "proposer": "cache"}},
    }
    for pkg in (package(ngram_only), NO_SPEC_PACKAGE, None):
        with pytest.raises(UsageError) as info:
            plan(pkg, cli=settings(strategy="mtp"))
        assert info.value.code == "native_mtp_unavailable"


def test_disabled_disables_and_notes_ignored_bounds() -> None:
    p = plan(cli=settings(strategy="disabled"), config={"speculative": {"ngram_max": 3}})
    assert p.mode == "disabled" and p.to_dict()["native_mtp"] is None
    assert any("ngram_max" in n for n in p.notes)


def test_declared_named_strategy_is_accepted() -> None:
    p = plan(MENU, cli=settings(strategy="ngram-cache"))
    assert (p.mode, p.strategy_id) == ("ngram-cache", "ngram-cache")
    assert p.ngram == NgramSource("ngram-cache", 2, 4, 10)
    assert p.window is not None and (p.window.max_window, p.window.pipeline_depth) == (6, 2)


def test_draft_model_strategy_is_planned() -> None:
    p = plan(MENU, cli=settings(strategy="draft"))
    assert (p.mode, p.draft_model) == ("draft-model", "org/small-draft:Q8_0")


@pytest.mark.parametrize(
    ("pkg", "name"),
    [
        (PKG, "mtp-suffix"),  # "A named package strategy cannot be invented outside its package"
        (PKG, "ngram"),  # not a stable id: the package would have to declare it
        (NO_SPEC_PACKAGE, "mtp-cache"),
        (None, "mtp-cache"),  # plain GGUF: no package strategies at all
    ],
)
def test_undeclared_named_strategy_is_an_error(pkg: GenerationSpec | None, name: str) -> None:
    with pytest.raises(UsageError) as info:
        plan(pkg, cli=settings(strategy=name))
    assert info.value.code == "undeclared_speculative_strategy"
    assert name in info.value.message


# --- N-gram strategies chosen at serve time for any package -------------------------------------
@pytest.mark.parametrize(
    ("pkg", "kind", "bounds"),
    [
        (NO_SPEC_PACKAGE, "ngram-suffix", (3, 16, 8)),
        (NO_SPEC_PACKAGE, "ngram-cache", (2, 4, 8)),
        (PKG, "ngram-suffix", (3, 16, 8)),  # declares other strategies, not this one
        (MENU, "ngram-suffix", (3, 16, 8)),
    ],
    ids=["no-speculation-suffix", "no-speculation-cache", "declares-others", "menu-suffix"],
)
def test_a_package_that_does_not_declare_an_ngram_strategy_is_served_the_runtimes(
    pkg: GenerationSpec, kind: str, bounds: tuple[int, int, int]
) -> None:
    """An N-gram proposer reads only the request's tokens: any package may be served with
    one; bounds the operator does not set are the runtime's, the window adaptive 4 (1..8)."""
    p = plan(pkg, cli=settings(strategy=kind))
    assert (p.mode, p.strategy_id, p.requested_source) == (kind, kind, "cli")
    assert p.ngram == NgramSource(kind, *bounds)
    assert p.ngram.history_scope == "request"
    assert p.window is not None
    assert (p.window.mode, p.window.initial_window, p.window.min_window) == ("adaptive", 4, 1)
    assert (p.window.max_window, p.window.pipeline_depth) == (8, 1)
    assert any(f"declares no {kind} strategy" in n and "runtime's" in n for n in p.notes)


def test_operator_bounds_replace_the_runtimes_for_an_undeclared_ngram_strategy() -> None:
    config = {"speculative": {"strategy": "ngram-suffix", "ngram_max": 32, "max_window": 2}}
    p = plan(NO_SPEC_PACKAGE, config=config)
    assert p.requested_source == "global" and p.ngram == NgramSource("ngram-suffix", 3, 32, 8)
    assert p.window is not None and (p.window.initial_window, p.window.max_window) == (2, 2)
    given = settings(strategy="ngram-cache", ngram_min=1, ngram_max=3, max_proposal_tokens=5)
    p = plan(NO_SPEC_PACKAGE, cli=given)
    assert p.ngram == NgramSource("ngram-cache", 1, 3, 5)
    assert not any("runtime's" in n for n in p.notes)  # nothing was filled in


@pytest.mark.parametrize(
    ("bounds", "hint"),
    [
        ({"strategy": "ngram-cache", "ngram_max": 5}, "ngram_min 2"),  # llama.cpp's window is 4
        ({"strategy": "ngram-suffix", "ngram_min": 20}, "ngram_max 16"),
        ({"strategy": "ngram-suffix", "ngram_min": 2, "ngram_max": 8}, "max_proposal_tokens 8"),
    ],
)
def test_bad_operator_bounds_for_an_undeclared_ngram_strategy_say_which_were_defaults(
    bounds: dict[str, Any], hint: str
) -> None:
    with pytest.raises(UsageError) as info:
        plan(NO_SPEC_PACKAGE, cli=settings(**bounds))
    assert info.value.code == "invalid_speculative_bound"
    assert f"the runtime's defaults: {hint}" in info.value.message


def test_a_declared_ngram_strategy_wins_over_the_runtimes_and_is_only_tightened() -> None:
    p = plan(MENU, cli=settings(strategy="ngram-cache"))
    assert p.ngram == NgramSource("ngram-cache", 2, 4, 10)  # the package's, not (2, 4, 8)
    assert p.window is not None and (p.window.max_window, p.window.pipeline_depth) == (6, 2)
    assert not any("declares no" in n for n in p.notes)
    assert plan(MENU, cli=settings(strategy="ngram-cache", max_proposal_tokens=6)).ngram == (
        NgramSource("ngram-cache", 2, 4, 6)
    )
    with pytest.raises(UsageError) as info:  # the conflict: wider than the declaration
        plan(MENU, cli=settings(strategy="ngram-cache", max_proposal_tokens=16))
    assert info.value.code == "speculative_bound_widened"


def test_selecting_an_unrecognised_strategy_type_is_an_error() -> None:
    with pytest.raises(UsageError) as info:
        plan(MENU, cli=settings(strategy="eagle"))
    assert info.value.code == "unsupported_speculative_strategy_type"


def test_an_unrecognised_default_is_refused_only_when_it_is_served() -> None:
    """ "Consumers that do not recognize a strategy type MUST ignore it unless it is the
    declared default for a request they are trying to serve": the package parses; auto (which
    serves the default) is refused; disabled and the other declared strategies still work."""
    body = json.loads(json.dumps(SPEC_PROPOSERS_EXAMPLE))
    body["default"] = "eagle"
    body["strategies"]["eagle"] = {"type": "eagle3"}
    pkg = parse_generation({"speculative_decoding": body}, layer_count=LAYERS)
    with pytest.raises(UsageError) as info:
        plan(pkg)
    assert info.value.code == "unsupported_speculative_strategy_type"
    assert "eagle" in info.value.message
    p = plan(pkg, cli=settings(strategy="disabled"))
    assert (p.mode, p.package_default) == ("disabled", "eagle")
    assert plan(pkg, cli=settings(strategy="mtp-cache")).mode == "composite"
    assert plan(pkg, cli=settings(strategy="mtp")).mode == "native-mtp"


def test_legacy_native_mtp_n1_is_normalized_to_mtp_with_a_deprecation_note() -> None:
    p = plan(config={"speculative": {"strategy": "native-mtp-n1"}})
    assert (p.mode, p.requested, p.requested_source) == ("native-mtp", "mtp", "global")
    assert replace(p, notes=()) == plan(config={"speculative": {"strategy": "mtp"}})
    (note,) = p.notes
    assert "native-mtp-n1" in note and "deprecated" in note and '"mtp"' in note


# --- precedence: CLI, model entry, global ---------------------------------------------------------
CONFIG = {
    "speculative": {"strategy": "disabled"},
    "models": [
        {"name": "glm", "speculative": {"strategy": "mtp-cache"}},
        {"name": "other", "path": "/models/other.gguf"},
    ],
}


@pytest.mark.parametrize(
    ("cli", "model", "mode", "source", "matched"),
    [
        (settings(strategy="mtp"), "glm", "native-mtp", "cli", True),
        (None, "glm", "composite", "model:glm", True),
        (None, "other", "disabled", "global", False),  # entry without speculative options
        (None, "unknown", "disabled", "global", False),
        (None, None, "disabled", "global", False),
        (settings(max_window=1), "glm", "composite", "model:glm", True),  # CLI, no strategy
    ],
)
def test_precedence(
    cli: SpeculativeSettings | None, model: str | None, mode: str, source: str, matched: bool
) -> None:
    p = plan(cli=cli, config=CONFIG, model=model)
    assert (p.mode, p.requested_source) == (mode, source)
    # An entry that does not match falls through to the global layer, but never silently.
    unmatched = [n for n in p.notes if "no model entry" in n]
    assert bool(unmatched) is not matched


def test_model_entries_that_match_nothing_are_noted() -> None:
    """Entries are selected by the package's model_id; a name that is not it (a family name,
    a typo, an old id) leaves the settings unused, and the plan says so."""
    config = {"models": [{"name": "glm-5.2", "speculative": {"strategy": "disabled"}}]}
    p = plan(config=config, model="acme/glm-5.2-GGUF:Q4_K_M")
    assert (p.mode, p.requested_source) == ("composite", "default")  # the entry did not apply
    (note,) = p.notes
    assert "'glm-5.2'" in note and "'acme/glm-5.2-GGUF:Q4_K_M'" in note and "model_id" in note
    assert plan(config=config, model="glm-5.2").notes == ()  # the same entry, matched
    assert plan(config={"speculative": {"strategy": "auto"}}, model="x").notes == ()  # no entries


def test_named_model_tables_are_accepted_too() -> None:
    config = {"models": {"glm": {"speculative": {"strategy": "mtp"}}}}
    assert plan(config=config, model="glm").requested_source == "model:glm"


def test_bounds_merge_per_field_across_layers() -> None:
    config = {
        "speculative": {"ngram_max": 3, "max_proposal_tokens": 6},
        "models": [{"name": "glm", "speculative": {"max_proposal_tokens": 5}}],
    }
    p = plan(cli=settings(extension_max_tokens=4), config=config, model="glm")
    assert p.ngram == NgramSource("ngram-cache", 2, 3, 5)  # global ngram_max, model tokens
    assert p.extension is not None and p.extension.max_tokens == 4  # CLI


# --- tightening, never widening -------------------------------------------------------------------
TIGHTEN_OK = [
    ({"ngram_max": 3}, lambda p: p.ngram.ngram_max == 3),
    ({"ngram_min": 3}, lambda p: p.ngram.ngram_min == 3),
    ({"ngram_min": 4, "ngram_max": 4}, lambda p: (p.ngram.ngram_min, p.ngram.ngram_max) == (4, 4)),
    ({"max_proposal_tokens": 1}, lambda p: p.ngram.max_proposal_tokens == 1),
    ({"extension_max_tokens": 2}, lambda p: p.extension.max_tokens == 2),
    ({"extension_initial_tokens": 2}, lambda p: p.extension.initial_tokens == 2),
    ({"max_window": 1, "pipeline_depth": 1}, lambda p: p.window.max_window == 1),
]


@pytest.mark.parametrize(("bounds", "check"), TIGHTEN_OK)
def test_operators_may_tighten(bounds: dict[str, int], check: Any) -> None:
    p = plan(config={"speculative": bounds})
    assert check(p)
    assert not p.notes


WIDEN = [
    {"ngram_max": 5},  # package 4
    {"ngram_min": 1},  # package 2: a wider match range
    {"max_proposal_tokens": 11},  # package 10
    {"extension_max_tokens": 9},  # package 8
    {"max_window": 2},  # package/legacy window 1
    {"pipeline_depth": 2},  # "Omission preserves the legacy depth of 1"
]


@pytest.mark.parametrize("bounds", WIDEN)
def test_operators_may_not_widen(bounds: dict[str, int]) -> None:
    with pytest.raises(UsageError) as info:
        plan(config={"speculative": bounds})
    assert info.value.code == "speculative_bound_widened"
    (name,) = bounds
    assert info.value.path == name and "global" in info.value.message


def test_tightened_ngram_range_must_not_be_empty() -> None:
    with pytest.raises(UsageError) as info:
        plan(config={"speculative": {"ngram_min": 4, "ngram_max": 3}})
    assert info.value.code == "invalid_speculative_bound"


def test_window_and_extension_tightening_on_declared_values() -> None:
    p = plan(MENU, cli=settings(strategy="ngram-cache", max_window=3, pipeline_depth=1))
    assert p.window is not None
    assert (p.window.max_window, p.window.pipeline_depth, p.window.min_window) == (3, 1, 1)
    with pytest.raises(UsageError):
        plan(MENU, cli=settings(strategy="ngram-cache", max_window=7))
    p = plan(MENU, cli=settings(strategy="mtp-cache-cool", extension_max_tokens=3))
    # tightening max_tokens below initial_tokens pulls initial_tokens down with it
    assert p.extension is not None and (p.extension.max_tokens, p.extension.initial_tokens) == (
        3,
        3,
    )
    with pytest.raises(UsageError):
        plan(MENU, cli=settings(strategy="mtp-cache-cool", extension_initial_tokens=5))


def test_cooldown_may_only_grow() -> None:
    p = plan(MENU, cli=settings(strategy="mtp-cache-cool", tail_backoff_proposals=6))
    assert p.extension is not None and p.extension.tail_backoff_proposals == 6
    with pytest.raises(UsageError) as info:
        plan(MENU, cli=settings(strategy="mtp-cache-cool", tail_backoff_proposals=1))
    assert info.value.code == "speculative_bound_widened"


def test_bounds_that_do_not_apply_are_noted() -> None:
    p = plan(cli=settings(strategy="mtp", ngram_max=3))
    assert p.mode == "native-mtp" and any("ngram_max" in n for n in p.notes)


# --- plain GGUF: request-local N-gram proposers ---------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "bounds"),
    [
        ("ngram-cache", {"ngram_min": 1, "ngram_max": 4, "max_proposal_tokens": 8}),
        ("ngram-suffix", {"ngram_min": 3, "ngram_max": 64, "max_proposal_tokens": 16}),
    ],
)
def test_plain_gguf_may_select_a_request_local_ngram_proposer(
    kind: str, bounds: dict[str, int]
) -> None:
    p = plan(None, cli=settings(strategy=kind, **bounds))
    assert p.mode == kind and p.ngram is not None
    assert (p.ngram.ngram_min, p.ngram.ngram_max, p.ngram.max_proposal_tokens) == tuple(
        bounds.values()
    )
    assert p.ngram.history_scope == "request"


@pytest.mark.parametrize(
    ("kind", "bounds", "code"),
    [
        ("ngram-cache", {"ngram_min": 1, "ngram_max": 4}, "ngram_bounds_required"),
        ("ngram-suffix", {}, "ngram_bounds_required"),
        (
            "ngram-cache",
            {"ngram_min": 1, "ngram_max": 5, "max_proposal_tokens": 8},
            "invalid_speculative_bound",
        ),
        (
            "ngram-suffix",
            {"ngram_min": 2, "ngram_max": 8, "max_proposal_tokens": 8},
            "invalid_speculative_bound",
        ),
        (
            "ngram-suffix",
            {"ngram_min": 3, "ngram_max": 65, "max_proposal_tokens": 8},
            "invalid_speculative_bound",
        ),
        (
            "ngram-cache",
            {"ngram_min": 3, "ngram_max": 2, "max_proposal_tokens": 8},
            "invalid_speculative_bound",
        ),
        (
            "ngram-cache",
            {"ngram_min": 1, "ngram_max": 2, "max_proposal_tokens": 8, "max_window": 2},
            "speculative_bound_widened",
        ),
    ],
)
def test_plain_gguf_ngram_bounds_are_validated(
    kind: str, bounds: dict[str, int], code: str
) -> None:
    with pytest.raises(UsageError) as info:
        plan(None, config={"speculative": {"strategy": kind, **bounds}})
    assert info.value.code == code


# --- config loading -------------------------------------------------------------------------------
def test_empty_config_gives_empty_overrides() -> None:
    overrides = load_speculative_overrides({"listen": "0.0.0.0:9000"})
    assert overrides == SpeculativeOverrides()


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"speculative": {"strategy": ""}}, "speculative.strategy"),
        ({"speculative": {"strategy": 1}}, "speculative.strategy"),
        ({"speculative": {"ngram_max": 0}}, "speculative.ngram_max"),
        ({"speculative": {"ngram_max": True}}, "speculative.ngram_max"),
        ({"speculative": {"ngram_max": "4"}}, "speculative.ngram_max"),
        ({"speculative": {"ngram_maxx": 4}}, "speculative.ngram_maxx"),
        ({"speculative": "mtp"}, "speculative"),
        ({"models": [{"speculative": {"strategy": "mtp"}}]}, "models[0].name"),
        (
            {"models": [{"name": "a", "speculative": {"pipeline_depth": -1}}]},
            "models[0].speculative.pipeline_depth",
        ),
        ({"models": {"a": {"speculative": {"bogus": 1}}}}, "models.a.speculative.bogus"),
        ({"models": "glm"}, "models"),
        ({"models": ["glm"]}, "models[0]"),
        (
            {"models": [{"name": "a", "speculative": {}}, {"name": "a", "speculative": {}}]},
            "models[1]",
        ),
    ],
)
def test_malformed_config_is_a_usage_error_naming_the_key(
    config: dict[str, Any], path: str
) -> None:
    with pytest.raises(UsageError) as info:
        load_speculative_overrides(config)
    assert info.value.path == path


def test_plan_is_typed_validated_and_json_ready() -> None:
    p = plan(config=CONFIG, model="glm")
    assert json.loads(json.dumps(p.to_dict())) == p.to_dict()
    assert p.to_dict()["ngram"]["history_scope"] == "request"
    with pytest.raises(ValueError):
        SpeculativePlan(mode="disabled", requested="x", requested_source="cli", ngram=p.ngram)
    with pytest.raises(ValueError):
        SpeculativePlan(mode="native-mtp", requested="x", requested_source="cli")
