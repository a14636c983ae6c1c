"""The pure serving pieces: OpenAI request checks, streamed text with stop sequences, chat
templates in a sandbox, [serving] config, the admission descriptor, and topology placement
for serving (stage 0 pinned, a lost stage moved alone)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mesh_node.settings import ServingSettings, serving_settings
from skippy.errors import TopologyError, UsageError
from skippy.package.plan import ModelSizes
from skippy.package.ranges import LayerRange
from skippy.package.topology import NodeCapacity, plan_topology, replace_node
from skippy.runtime.admission import RuntimeFacts, runtime_problem
from skippy.runtime.sampling import SamplingParams
from skippy.serving.chat import ChatTemplate, ChatTemplateError
from skippy.serving.openai import ApiError, parse_request
from skippy.serving.replay import tokens_before
from skippy.serving.text_stream import TextStream
from skippy.stage.descriptor import StageDescriptor

A, B, C, D = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)
MESSAGES = [{"role": "user", "content": "hi"}]


# --- requests ------------------------------------------------------------------------------------
def test_completion_request_defaults_and_checks() -> None:
    r = parse_request({"prompt": "hi"}, "completion", max_tokens_limit=100)
    assert (r.max_tokens, r.sampling.temperature, r.sampling.top_p, r.stop) == (16, 1.0, 1.0, ())
    r = parse_request(
        {"prompt": [1, 2], "max_tokens": 5, "temperature": 0, "top_k": 3, "seed": 9, "stop": "x"},
        "completion",
        max_tokens_limit=100,
    )
    assert r.prompt == (1, 2) and r.sampling.top_k == 3 and r.stop == ("x",)
    for body, code, param in (
        ({"prompt": "hi", "max_tokens": 101}, "invalid_value", "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, "invalid_value", "temperature"),
        ({"prompt": "hi", "temperature": 3}, "invalid_value", "temperature"),
        ({"prompt": "hi", "stop": ["a"] * 5}, "invalid_value", "stop"),
        ({"prompt": "hi", "n": 2}, "unsupported_parameter", "n"),
        ({"prompt": "hi", "logprobs": 2}, "unsupported_parameter", "logprobs"),
        ({"prompt": []}, "invalid_prompt", "prompt"),
        ({"prompt": ["a", "b"]}, "invalid_prompt", "prompt"),
        ({"prompt": "hi", "stream": "yes"}, "invalid_value", "stream"),
    ):
        with pytest.raises(ApiError) as err:
            parse_request(body, "completion", max_tokens_limit=100)
        assert (err.value.code, err.value.param, err.value.status) == (code, param, 400)
        assert err.value.body()["error"]["code"] == code


def test_chat_request_checks_messages() -> None:
    r = parse_request(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 7,
        },
        "chat",
        max_tokens_limit=100,
    )
    assert r.messages == (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    )
    assert r.max_tokens == 7
    for messages in ([], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 3}]):
        with pytest.raises(ApiError):
            parse_request({"messages": messages}, "chat", max_tokens_limit=100)
    with pytest.raises(ApiError) as err:
        parse_request(
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "chat",
            max_tokens_limit=100,
        )
    assert err.value.code == "unsupported_parameter"


def test_every_sampling_field_is_parsed() -> None:
    """temperature, top_p, top_k, min_p, typical_p, the penalties, repeat_last_n, logit_bias
    and seed reach the sampler's parameters (the seed beside them: the API draws one when it
    is absent)."""
    body = {
        "prompt": "hi",
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.05,
        "typical_p": 0.8,
        "repeat_penalty": 1.2,
        "repeat_last_n": 16,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"50": -100, "3": 2.5},
        "seed": -4,
        "user": "someone",
    }
    r = parse_request(body, "completion", max_tokens_limit=100, vocab=64)
    assert r.sampling == SamplingParams(
        temperature=0.5,
        top_p=0.9,
        top_k=7,
        min_p=0.05,
        typical_p=0.8,
        repeat_penalty=1.2,
        repeat_last_n=16,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias=((3, 2.5), (50, -100.0)),
    )
    assert r.seed == -4
    # -1: llama.cpp's "the whole context"; top_k -1 is off (vLLM's); the defaults
    r = parse_request(
        {"prompt": "hi", "repeat_last_n": -1, "top_k": -1}, "completion", max_tokens_limit=100
    )
    assert (r.sampling.repeat_last_n, r.sampling.top_k, r.seed) == (100, 0, None)
    assert r.sampling == SamplingParams(temperature=1.0, repeat_last_n=100)


@pytest.mark.parametrize(
    "extra",
    [
        {"logit_bias": {}},
        {"response_format": {"type": "text"}},
        {"tools": []},
        {"tools": [], "tool_choice": "none", "parallel_tool_calls": True},
        {"functions": [], "function_call": "auto"},
        {"n": 1, "best_of": 1, "echo": False, "logprobs": False, "top_logprobs": 0},
        {"suffix": "", "store": False, "metadata": {}, "service_tier": "auto"},
        {"mirostat": 0, "mirostat_tau": 5, "mirostat_eta": 0.1, "tfs_z": 1},
        {"repetition_penalty": 1.0, "ignore_eos": False, "n_probs": 0, "min_tokens": 0},
        {"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None, "tools": None},
    ],
)
def test_fields_at_their_neutral_default_are_accepted(extra: dict[str, object]) -> None:
    for kind, base in (("completion", {"prompt": "hi"}), ("chat", {"messages": MESSAGES})):
        r = parse_request({**base, **extra}, kind, max_tokens_limit=100)  # type: ignore[arg-type]
        assert r.sampling == SamplingParams(temperature=1.0)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"mirostat": 2}, "mirostat"),
        ({"mirostat_tau": 3.0}, "mirostat_tau"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logprobs": True}, "logprobs"),
        ({"n": True}, "n"),  # a boolean is not the number 1
        ({"echo": 0}, "echo"),
        ({"ignore_eos": True}, "ignore_eos"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
        ({"dry_multiplier": 0.8}, "dry_multiplier"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"cache_prompt": True}, "cache_prompt"),
    ],
)
def test_unimplemented_and_unknown_fields_are_refused(extra: dict[str, object], param: str) -> None:
    for kind, base in (("completion", {"prompt": "hi"}), ("chat", {"messages": MESSAGES})):
        with pytest.raises(ApiError) as err:
            parse_request({**base, **extra}, kind, max_tokens_limit=100)  # type: ignore[arg-type]
        assert (err.value.code, err.value.param, err.value.status) == (
            "unsupported_parameter",
            param,
            400,
        )
    # a key of the other endpoint is unknown here
    with pytest.raises(ApiError) as err:
        parse_request({"messages": MESSAGES, "prompt": "x"}, "chat", max_tokens_limit=100)
    assert (err.value.code, err.value.param) == ("unsupported_parameter", "prompt")


@pytest.mark.parametrize(
    ("extra", "code", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "invalid_value", "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "invalid_value", "logit_bias"),
        ({"logit_bias": {"3": 101}}, "invalid_value", "logit_bias"),
        ({"logit_bias": {"3": True}}, "invalid_value", "logit_bias"),
        ({"logit_bias": {"3": "1"}}, "invalid_value", "logit_bias"),
        ({"logit_bias": [[3, 1]]}, "invalid_value", "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "invalid_value", "logit_bias"),
        ({"logit_bias": {"64": 1}}, "token_out_of_range", "logit_bias"),
        ({"repeat_penalty": 0}, "invalid_value", "repeat_penalty"),
        ({"repeat_penalty": 11}, "invalid_value", "repeat_penalty"),
        ({"presence_penalty": 2.5}, "invalid_value", "presence_penalty"),
        ({"frequency_penalty": "x"}, "invalid_value", "frequency_penalty"),
        ({"min_p": 1.5}, "invalid_value", "min_p"),
        ({"typical_p": -0.5}, "invalid_value", "typical_p"),
        ({"repeat_last_n": -2}, "invalid_value", "repeat_last_n"),
        ({"top_k": -2}, "invalid_value", "top_k"),
        ({"user": 3}, "invalid_value", "user"),
    ],
)
def test_bad_sampling_values_are_refused(extra: dict[str, object], code: str, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_request({"prompt": "hi", **extra}, "completion", max_tokens_limit=100, vocab=64)
    assert (err.value.code, err.value.param, err.value.status) == (code, param, 400)


@pytest.mark.parametrize("n", [0, 1, 3, 64])
def test_tokens_before_a_position_span_the_prompt_and_the_generated_tokens(n: int) -> None:
    prompt, generated = [10, 11, 12, 13], [20, 21, 22]
    sequence = prompt + generated
    for position in range(len(sequence) + 1):
        want = sequence[max(0, position - n) : position] if n else []
        assert tokens_before(prompt, generated, position, n) == want


# --- streamed text -------------------------------------------------------------------------------
@given(
    text=st.text(alphabet="abcXYZé🙂 ", max_size=40),
    stop=st.lists(st.text(alphabet="abXé🙂", min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(0, 200), max_size=10),
)
# a longer stop sequence that began earlier completes after a shorter one inside it
@example(text="X🙂X", stop=["🙂", "X🙂X"], cuts=[5])
@example(text="aXX", stop=["X", "aXX"], cuts=[1])
@example(text="aXX", stop=["X", "aXX"], cuts=[2])
def test_stream_equals_the_whole_text_cut_at_the_first_stop(
    text: str, stop: list[str], cuts: list[int]
) -> None:
    data = text.encode()
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    ts = TextStream(stop)
    out = "".join(ts.feed(data[a:b]) for a, b in itertools.pairwise(bounds))
    out += ts.finish()
    hits = [text.find(s) for s in stop if s and s in text]
    expected = text[: min(hits)] if hits else text
    assert out == expected == ts.text
    assert not any(s in out for s in stop)


# --- chat templates ------------------------------------------------------------------------------
def test_chat_template_renders_in_a_sandbox(tmp_path: Path) -> None:
    t = ChatTemplate(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}",
        "<s>",
        "</s>",
    )
    assert t.render([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"
    hostile = ChatTemplate("{{ messages.__class__.__mro__ }}", "", "")
    with pytest.raises(ChatTemplateError):
        hostile.render([{"role": "user", "content": "x"}])
    refusing = ChatTemplate("{{ raise_exception('no system role') }}", "", "")
    with pytest.raises(ChatTemplateError, match="no system role"):
        refusing.render([])


# --- config --------------------------------------------------------------------------------------
def test_serving_config() -> None:
    assert serving_settings(None) == ServingSettings()
    s = serving_settings({"n_ctx": 512, "token_timeout_s": 5, "max_frame_bytes": "1MiB"})
    assert (s.n_ctx, s.token_timeout_s, s.max_frame_bytes) == (512, 5.0, 1 << 20)
    for bad in ({"bogus": 1}, {"n_ctx": 0}, {"engine": "torch"}, {"token_timeout_s": -1}):
        with pytest.raises(UsageError):
            serving_settings(bad)
    assert serving_settings({"expect_serve": True}).expect_serve
    assert not ServingSettings().expect_serve
    with pytest.raises(UsageError, match=r"serving\.expect_serve"):
        serving_settings({"expect_serve": 1})


# --- admission descriptor ------------------------------------------------------------------------
FACTS = RuntimeFacts("acme/m", 640, "f32", "skippy-stage/1 ggml/0.25.3", "ggml", 512, 1000)


def test_admission_descriptor_round_trip_and_runtime_checks() -> None:
    d = StageDescriptor("hf://a/b@" + "0" * 40, "f" * 64, 1, LayerRange(2, 4, 6), 3, 100, FACTS)
    assert StageDescriptor.from_dict(d.to_dict()) == d
    assert runtime_problem(FACTS, FACTS) is None
    assert runtime_problem(None, FACTS) == (
        "stage_not_loaded",
        "the stage is fetched but not loaded in a runtime",
    )
    for change, code in (
        ({"width": 576}, "activation_mismatch"),
        ({"runtime_version": "skippy-stage/1 numpy-reference"}, "runtime_mismatch"),
        ({"model_id": "other"}, "model_mismatch"),
        ({"n_ctx": 256}, "context_too_small"),
    ):
        other = RuntimeFacts(**{**FACTS.to_dict(), **change})
        problem = runtime_problem(other, FACTS)
        assert problem is not None and problem[0] == code


# --- placement -----------------------------------------------------------------------------------
SIZES = ModelSizes(layer_bytes=(50,) * 6, metadata_bytes=10, embeddings_bytes=100, output_bytes=0)


def _plan(nodes: list[NodeCapacity], first: str | None = None) -> object:
    return plan_topology(
        SIZES,
        nodes,
        topology_id="t1",
        run_id="r1",
        package_ref="pkg",
        manifest_sha256="f" * 64,
        stages=3,
        first_node=first,
    )


def test_stage_zero_is_pinned_and_a_lost_stage_moves_alone() -> None:
    nodes = [NodeCapacity(A, 300), NodeCapacity(B, 900), NodeCapacity(C, 900)]
    topo = _plan(nodes, first=A)
    assert topo.stages[0].node_id == A  # type: ignore[attr-defined]
    lost = topo.stages[1].node_id  # type: ignore[attr-defined]
    new = replace_node(
        topo, lost, [*nodes, NodeCapacity(D, 900)], SIZES, topology_id="t2"  # type: ignore[arg-type]
    )
    assert new.stages[1].node_id == D and new.run_id == "r1"
    assert [s.node_id for i, s in enumerate(new.stages) if i != 1] == [
        s.node_id for i, s in enumerate(topo.stages) if i != 1  # type: ignore[attr-defined]
    ]
    with pytest.raises(TopologyError) as err:
        replace_node(topo, lost, [*nodes, NodeCapacity(D, 1)], SIZES, topology_id="t3")  # type: ignore[arg-type]
    assert err.value.code == "no_capable_peer"
