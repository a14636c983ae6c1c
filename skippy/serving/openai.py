"""The OpenAI-compatible request schema (pure): a JSON body in, a checked request out.

``/v1/completions`` and ``/v1/chat/completions`` with ``max_tokens`` (chat also
``max_completion_tokens``), the sampling controls (``temperature``, ``top_p``,
``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``seed``, and llama.cpp's
``top_k``, ``min_p``, ``typical_p``, ``repeat_penalty``, ``repeat_last_n``: see
``skippy.runtime.sampling`` for what each does, in llama.cpp's order), ``stop`` (a string or
up to 4), ``stream``, ``stream_options``, ``user``. Values are checked and a violation is an
``ApiError`` naming the parameter (HTTP 400, OpenAI's error body).

Every other key is refused (``unsupported_parameter``), never silently ignored: the ones this
server does not implement are accepted only at their neutral value (``NEUTRAL``: ``n: 1``,
``tools: []``, ``response_format: {"type": "text"}``, ``mirostat: 0``...), since clients send
those by default, and an unknown key is refused whatever its value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from skippy.errors import SkippyError
from skippy.runtime.sampling import (
    DEFAULT_REPEAT_LAST_N,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PRESENCE_FREQUENCY,
    MAX_REPEAT_LAST_N,
    MAX_REPEAT_PENALTY,
    SamplingParams,
)

MAX_STOP: Final = 4
MAX_STOP_CHARS: Final = 256
MAX_MESSAGES: Final = 1024
DEFAULT_COMPLETION_TOKENS: Final = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS: Final = 512  # OpenAI has none (until the context fills); ours is bounded
MAX_SEED: Final = (1 << 63) - 1
ROLES: Final = frozenset({"system", "user", "assistant", "developer"})
# The parameters this server honours, per endpoint.
HONOURED: Final = frozenset(
    {
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "typical_p",
        "repeat_penalty",
        "repeat_last_n",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "user",  # the end user's id: OpenAI's abuse-monitoring metadata, no effect on output
    }
)
ENDPOINT_KEYS: Final = {"completion": frozenset({"prompt"}), "chat": frozenset({"messages"})}
# Parameters we do not implement, with the values that mean "off" (null always does). Tool
# choices are neutral here because no tools can be given.
NEUTRAL: Final[dict[str, tuple[Any, ...]]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"},),
    "store": (False,),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    # llama.cpp's and vLLM's samplers we do not run, at their defaults
    "mirostat": (0,),
    "mirostat_tau": (5.0,),
    "mirostat_eta": (0.1,),
    "tfs_z": (1.0,),
    "dry_multiplier": (0.0,),
    "xtc_probability": (0.0,),
    "top_n_sigma": (-1.0,),
    "dynatemp_range": (0.0,),
    "n_probs": (0,),
    "ignore_eos": (False,),
    "repetition_penalty": (1.0,),  # vLLM's, over the whole context: ours is repeat_penalty
    "min_tokens": (0,),
}


class ApiError(SkippyError):
    """A request the API refuses; ``status`` is the HTTP status, ``param`` the field."""

    code = "invalid_request"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        status: int = 400,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.status = status
        self.param = param
        self.kind = kind
        self.headers: dict[str, str] = dict(headers or {})  # e.g. Retry-After

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def decode_json(data: bytes | bytearray, max_depth: int) -> Any:
    """A request body as JSON, nested at most ``max_depth`` arrays/objects deep; anything
    else is ``invalid_json`` (400), never a crash: a body of 100,000 nested arrays would
    otherwise end in ``RecursionError``."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ApiError("the request body is not valid JSON", code="invalid_json") from None
    except RecursionError:
        doc = None
    else:
        if _depth_within(doc, max_depth):
            return doc
    raise ApiError(
        f"the request body nests arrays or objects deeper than {max_depth} levels",
        code="invalid_json",
    )


def _depth_within(doc: Any, max_depth: int) -> bool:
    """Iteratively (no recursion): every array/object at most ``max_depth`` deep."""
    stack: list[tuple[Any, int]] = [(doc, 1)] if isinstance(doc, dict | list) else []
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            return False
        for child in value.values() if isinstance(value, dict) else value:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return True


@dataclass(frozen=True)
class CompletionRequest:
    kind: Literal["completion", "chat"]
    model: str | None
    prompt: str | tuple[int, ...] | None  # completion: text or token ids
    messages: tuple[dict[str, str], ...] | None  # chat
    max_tokens: int
    sampling: SamplingParams  # its seed is 0: ``seed`` is the request's
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(message, code=code, param=param)


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"{key} must be a number", key)
    if not lo <= value <= hi:
        raise _bad(f"{key} must be between {lo:g} and {hi:g}", key)
    return float(value)


def _integer(
    body: Mapping[str, Any], key: str, default: int | None, lo: int, hi: int
) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{key} must be an integer", key)
    if not lo <= value <= hi:
        raise _bad(f"{key} must be between {lo} and {hi}", key)
    return value


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP:
        raise _bad(f"stop must be a string or a list of at most {MAX_STOP} strings", "stop")
    for s in items:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
            raise _bad(f"each stop sequence is a string of 1..{MAX_STOP_CHARS} characters", "stop")
    return tuple(items)


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality that tells booleans from numbers (``n: true`` is not ``n: 1``)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return bool(value == neutral)


def _unsupported(body: Mapping[str, Any], kind: Literal["completion", "chat"]) -> None:
    """Refuse every key that is neither honoured nor at a neutral value."""
    known = HONOURED | ENDPOINT_KEYS[kind]
    for key, value in body.items():
        if key in known or value is None:
            continue
        neutral = NEUTRAL.get(key)
        if neutral is None:
            endpoint = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
            raise ApiError(
                f"{key!r} is not a parameter {endpoint} implements here; leave it out "
                "(docs/serving.md lists the parameters)",
                code="unsupported_parameter",
                param=key,
            )
        if not any(_same(value, n) for n in neutral):
            shown = " or ".join(json.dumps(n) for n in neutral)
            raise ApiError(
                f"{key}={json.dumps(value)[:80]} is not supported by this server; it accepts "
                f"only {shown} (the default) or leaving it out",
                code="unsupported_parameter",
                param=key,
            )


def _logit_bias(body: Mapping[str, Any], vocab: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` (-100..100), as (id, bias) pairs, ids ascending."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, Mapping) or len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise _bad(
            f"logit_bias must be an object of at most {MAX_LOGIT_BIAS_TOKENS} token ids "
            "(as strings) to biases",
            "logit_bias",
        )
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise _bad(f"logit_bias key {key!r} is not a token id", "logit_bias")
        token = int(key)
        if vocab is not None and token >= vocab:
            raise _bad(
                f"logit_bias names token {token}; the vocabulary has {vocab}",
                "logit_bias",
                "token_out_of_range",
            )
        if (
            isinstance(bias, bool)
            or not isinstance(bias, int | float)
            or not math.isfinite(bias)
            or abs(bias) > MAX_LOGIT_BIAS
        ):
            raise _bad(
                f"logit_bias for token {token} must be a number between -100 and 100",
                "logit_bias",
            )
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _sampling(body: Mapping[str, Any], n_ctx: int, vocab: int | None) -> SamplingParams:
    top_k = _integer(body, "top_k", 0, -1, 1 << 20) or 0
    repeat_penalty = _number(body, "repeat_penalty", 1.0, 0.0, MAX_REPEAT_PENALTY)
    if repeat_penalty == 0.0:
        raise _bad("repeat_penalty must be greater than 0 (1 is off)", "repeat_penalty")
    last_n = _integer(body, "repeat_last_n", None, -1, MAX_REPEAT_LAST_N)
    pf = MAX_PRESENCE_FREQUENCY
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        top_k=max(top_k, 0),  # -1 is off too (vLLM's)
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        typical_p=_number(body, "typical_p", 1.0, 0.0, 1.0),
        repeat_penalty=repeat_penalty,
        presence_penalty=_number(body, "presence_penalty", 0.0, -pf, pf),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -pf, pf),
        repeat_last_n=(
            DEFAULT_REPEAT_LAST_N if last_n is None else n_ctx if last_n == -1 else last_n
        ),  # -1: the whole context (llama.cpp's)
        logit_bias=_logit_bias(body, vocab),
    )


def _content(message: Mapping[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # the parts form: text parts only (no images here)
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ApiError(
                    "only text content parts are supported",
                    code="unsupported_parameter",
                    param=f"messages[{i}].content",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad("a text part has a string 'text'", f"messages[{i}].content")
            texts.append(text)
        return "".join(texts)
    raise _bad("content must be a string or a list of text parts", f"messages[{i}].content")


def parse_request(
    body: object,
    kind: Literal["completion", "chat"],
    *,
    max_tokens_limit: int,
    vocab: int | None = None,
) -> CompletionRequest:
    """Check a decoded JSON body; ``max_tokens_limit`` is the context (prompt + completion),
    ``vocab`` the vocabulary's size (``logit_bias`` names tokens below it)."""
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object", "body", "invalid_json")
    _unsupported(body, kind)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model must be a string", "model")
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[dict[str, str], ...] | None = None
    if kind == "completion":
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
            raw = raw[0]  # a batch of one
        if raw == "":
            raise _bad("the prompt is empty", "prompt", "empty_prompt")
        if isinstance(raw, str):
            prompt = raw
        elif isinstance(raw, list) and raw and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in raw
        ):
            prompt = tuple(raw)
        else:
            raise _bad(
                "prompt must be a string or a non-empty list of token ids (one prompt)",
                "prompt",
                "invalid_prompt",
            )
        default_tokens = DEFAULT_COMPLETION_TOKENS
    else:
        raw_messages = body.get("messages")
        if not isinstance(raw_messages, list) or not 0 < len(raw_messages) <= MAX_MESSAGES:
            raise _bad(f"messages must be a list of 1..{MAX_MESSAGES} messages", "messages")
        checked = []
        for i, m in enumerate(raw_messages):
            if not isinstance(m, Mapping) or m.get("role") not in ROLES:
                raise _bad(
                    f"each message has a role in {sorted(ROLES)}", f"messages[{i}].role"
                )
            role = "system" if m["role"] == "developer" else str(m["role"])
            checked.append({"role": role, "content": _content(m, i)})
        messages = tuple(checked)
        default_tokens = DEFAULT_CHAT_TOKENS
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, key, default_tokens, 1, max_tokens_limit)
    assert max_tokens is not None  # it has a default (typing only)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise _bad("stream_options must be an object", "stream_options")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user must be a string", "user")
    return CompletionRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        sampling=_sampling(body, max_tokens_limit, vocab),
        seed=_integer(body, "seed", None, -(1 << 63), MAX_SEED),
        stop=_stop(body),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )
