"""The OpenAI-compatible request schema (pure): a JSON body in, a checked request out.

``/v1/completions`` and ``/v1/chat/completions`` with ``max_tokens`` (chat also
``max_completion_tokens``), ``temperature``, ``top_p``, ``top_k`` (an extension, as in
llama.cpp's server and vLLM), ``seed``, ``stop`` (a string or up to 4), ``stream``. Values
are checked and a violation is an ``ApiError`` naming the parameter (HTTP 400, OpenAI's error
body). Parameters this server does not implement are refused when set to anything but their
neutral value (``n`` > 1, ``logprobs``, ``echo``, penalties, tools...), never silently
ignored; unknown keys are ignored, as OpenAI's clients send new ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from skippy.errors import SkippyError

MAX_STOP: Final = 4
MAX_STOP_CHARS: Final = 256
MAX_MESSAGES: Final = 1024
DEFAULT_COMPLETION_TOKENS: Final = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS: Final = 512  # OpenAI has none (until the context fills); ours is bounded
MAX_SEED: Final = (1 << 63) - 1
ROLES: Final = frozenset({"system", "user", "assistant", "developer"})
# Parameters we do not implement, with the value that means "off".
_NEUTRAL: Final[dict[str, Any]] = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": None,
    "top_logprobs": None,
    "suffix": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "tools": None,
    "functions": None,
    "response_format": None,
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
class SamplingRequest:
    temperature: float
    top_p: float
    top_k: int
    seed: int | None


@dataclass(frozen=True)
class CompletionRequest:
    kind: Literal["completion", "chat"]
    model: str | None
    prompt: str | tuple[int, ...] | None  # completion: text or token ids
    messages: tuple[dict[str, str], ...] | None  # chat
    max_tokens: int
    sampling: SamplingRequest
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


def _unsupported(body: Mapping[str, Any]) -> None:
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        if value is not None and value != neutral and not (neutral is None and value is False):
            raise ApiError(
                f"{key}={value!r} is not supported by this server",
                code="unsupported_parameter",
                param=key,
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
    body: object, kind: Literal["completion", "chat"], *, max_tokens_limit: int
) -> CompletionRequest:
    """Check a decoded JSON body; ``max_tokens_limit`` is the context (prompt + completion)."""
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object", "body", "invalid_json")
    _unsupported(body)
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
    sampling = SamplingRequest(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        top_k=_integer(body, "top_k", 0, 0, 1 << 20) or 0,
        seed=_integer(body, "seed", None, -(1 << 63), MAX_SEED),
    )
    return CompletionRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stop(body),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )
