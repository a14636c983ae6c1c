"""Which HTTP status an error of ours is (pure).

A client error is a 4xx only when it is explicitly one: an ``ApiError`` (it carries its
status), or an error whose code is in ``CLIENT_CODES`` (the prompt guard, token ids, chat
templates, the serving core's prompt checks). The split not being ready is 503 (with
``Retry-After`` while it forms), a full queue 429 (with ``Retry-After``), a failed generation
503. **Anything else is a fault of ours: 500**, never a 400: a new error code from the
serving core is a server error until it is listed here as the client's.

One condition, one code: a prompt that does not fit the context is ``context_length_exceeded``
(OpenAI's code) whether the API, the prompt guard (``prompt_too_long``) or the serving core
found it.
"""

from __future__ import annotations

from typing import Final

from mesh_node.serving.pipeline import GenerationFailed, ServerBusy, SplitNotReady
from skippy.errors import SkippyError
from skippy.serving.openai import ApiError

RETRY_AFTER_BUSY_S: Final = 1  # a slot frees when a request ends
RETRY_AFTER_FORMING_S: Final = 5  # stages are fetching or loading their layers
CONTEXT_CODE: Final = "context_length_exceeded"
# code -> the code the API answers with (400)
CLIENT_CODES: Final[dict[str, str]] = {
    "empty_prompt": "empty_prompt",
    "prompt_too_long": CONTEXT_CODE,
    CONTEXT_CODE: CONTEXT_CODE,
    "prompt_too_large": "prompt_too_large",
    "invalid_prompt_text": "invalid_prompt_text",
    "prompt_not_encodable": "prompt_not_encodable",
    "token_out_of_range": "token_out_of_range",
    "chat_template_missing": "chat_template_missing",
    "chat_template_error": "chat_template_error",
    "unsupported_parameter": "unsupported_parameter",  # e.g. a control an older node lacks
}
# SplitNotReady codes that mean "forming": worth retrying soon
FORMING_CODES: Final = frozenset({"split_not_ready"})


def as_api_error(err: SkippyError) -> ApiError:
    if isinstance(err, ApiError):
        return err
    if err.code in CLIENT_CODES:
        return ApiError(err.message, code=CLIENT_CODES[err.code], status=400)
    if isinstance(err, SplitNotReady):
        retry = {"retry-after": str(RETRY_AFTER_FORMING_S)} if err.code in FORMING_CODES else {}
        return ApiError(
            err.message, code=err.code, status=503, kind="service_unavailable", headers=retry
        )
    if isinstance(err, ServerBusy):
        return ApiError(
            err.message,
            code=err.code,
            status=429,
            kind="rate_limit_exceeded",
            headers={"retry-after": str(RETRY_AFTER_BUSY_S)},
        )
    if isinstance(err, GenerationFailed):
        return ApiError(err.message, code=err.code, status=503, kind="service_unavailable")
    return ApiError(err.message, code=err.code, status=500, kind="server_error")
