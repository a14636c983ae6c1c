"""The OpenAI-compatible HTTP API of a serving coordinator (starlette routes).

``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, each with
``stream: true`` as server-sent events (``data: {chunk}`` ... ``data: [DONE]``). Requests are
checked by ``skippy.serving.openai`` (400 with OpenAI's error body); a split that is not
ready answers 503 with the reason, a full queue 429. The routes join the node's one app.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from mesh_node.metrics import NodeMetrics
from mesh_node.serving.pipeline import (
    GenerationFailed,
    GenerationParams,
    GenerationResult,
    ServerBusy,
    SplitNotReady,
    SplitServer,
)
from skippy.errors import SkippyError, UsageError
from skippy.serving.chat import ChatTemplate
from skippy.serving.openai import ApiError, CompletionRequest, parse_request
from skippy.serving.text import TextStream
from skippy.stage.transport import Sampling

MAX_BODY_BYTES: Final = 16 * 1024 * 1024 + 64 * 1024  # the prompt guard's 16 MiB, plus JSON
Write = Callable[[bytes], Awaitable[None]]


def _as_api(err: SkippyError) -> ApiError:
    """Any of our errors as an API error: 503 not ready or failed over, 429 busy, 400 for a
    refused prompt, 500 otherwise."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, SplitNotReady):
        api = ApiError(err.message, code=err.code, status=503, kind="service_unavailable")
    elif isinstance(err, ServerBusy):
        api = ApiError(err.message, code=err.code, status=429, kind="rate_limit_exceeded")
    elif isinstance(err, GenerationFailed):
        api = ApiError(err.message, code=err.code, status=503, kind="service_unavailable")
    elif isinstance(err, UsageError):  # the prompt guard, token ids, chat template
        api = ApiError(err.message, code=err.code, status=400)
    else:
        api = ApiError(err.message, code=err.code, status=500, kind="server_error")
    return api


def _error_response(err: SkippyError) -> JSONResponse:
    api = _as_api(err)
    return JSONResponse(api.body(), status_code=api.status)


class _EventStream(Response):
    """Server-sent events written as they are produced; a client that goes away cancels
    the producer (and so frees the request's session along the chain)."""

    def __init__(self, produce: Callable[[Write], Awaitable[None]]) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self.produce = produce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        gone = False

        async def write(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal gone
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await self.produce(write)
            nursery.cancel_scope.cancel()
        if not gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class OpenAIApi:
    """The routes; ``source`` gives the node's ``SplitServer`` (``None``: it serves no model,
    every route answers 503)."""

    def __init__(
        self, source: Callable[[], SplitServer | None], metrics: NodeMetrics | None = None
    ) -> None:
        self._source = source
        self._metrics = metrics
        self._template: tuple[ChatTemplate | None] | None = None  # read once, when first needed
        self.created = int(time.time())

    @property
    def server(self) -> SplitServer:
        server = self._source()
        if server is None:
            raise SplitNotReady(
                "this node serves no model (start it with mesh-node serve)", code="not_serving"
            )
        return server

    def template(self) -> ChatTemplate | None:
        """The chat template from stage 0's metadata part (a thread: reads the file)."""
        if self._template is None:
            route = self.server.route
            if route is None:
                raise SplitNotReady("the split is not ready")
            self._template = (ChatTemplate.from_metadata(route.stage0.load.part_paths[0]),)
        return self._template[0]

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ]

    async def models(self, request: Request) -> Response:
        try:
            name = self.server.model_name
        except SkippyError as err:
            return _error_response(err)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "skippy-mesh",
                    }
                ],
            }
        )

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    # --- one request ---------------------------------------------------------------------------
    async def _handle(self, request: Request, kind: Any) -> Response:
        try:
            body = await _json_body(request)
            route = self.server._check_ready()
            n_ctx = route.stage0.facts.n_ctx
            req = parse_request(body, kind, max_tokens_limit=n_ctx)
            if req.model is not None and req.model != self.server.model_name:
                raise ApiError(
                    f"the model {req.model!r} is not served here (this split serves "
                    f"{self.server.model_name!r})",
                    code="model_not_found",
                    status=404,
                    param="model",
                )
            ids = await trio.to_thread.run_sync(self._prompt_ids, req, n_ctx)
        except SkippyError as err:
            if self._metrics is not None:  # refused before it reached the split: counted too
                with self._metrics.request(0) as record:
                    record.outcome = "rejected"
            return _error_response(err)
        params = GenerationParams(
            max_tokens=req.max_tokens,
            sampling=Sampling(
                temperature=req.sampling.temperature,
                top_p=req.sampling.top_p,
                top_k=req.sampling.top_k,
                seed=(req.sampling.seed if req.sampling.seed is not None else secrets.randbits(62))
                % (1 << 63),
            ),
        )
        ident = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        if req.stream:
            return _EventStream(lambda write: self._stream(req, ids, params, ident, write))
        text = TextStream(req.stop)

        async def emit(token: int) -> bool:
            text.feed(self._piece(token))
            return text.stopped

        try:
            result = await self.server.generate(ids, params, emit)
        except SkippyError as err:
            return _error_response(err)
        text.finish()
        return JSONResponse(self._final(req, ident, text.text, result))

    def _prompt_ids(self, req: CompletionRequest, n_ctx: int) -> list[int]:
        tok = self.server.tokenizer
        if tok is None:
            raise SplitNotReady("the tokenizer is not loaded yet")
        if req.kind == "chat":
            template = self.template()
            if template is None:
                raise ApiError(
                    f"the model {self.server.model_name!r} has no chat template (it is a base "
                    "model); use /v1/completions with a plain prompt",
                    code="chat_template_missing",
                    param="messages",
                )
            assert req.messages is not None  # parse_request guarantees it (typing)
            prompt_text = template.render(req.messages)
            ids = tok.tokenize(prompt_text, add_special=False, max_tokens=n_ctx, parse_special=True)
        elif isinstance(req.prompt, str):
            ids = tok.tokenize(req.prompt, max_tokens=n_ctx)
        else:
            assert req.prompt is not None  # parse_request guarantees it (typing)
            ids = tok.check_ids(req.prompt)
        if len(ids) + 1 > n_ctx:
            raise ApiError(
                f"the prompt has {len(ids)} tokens; the context holds {n_ctx}",
                code="context_length_exceeded",
                param="messages" if req.kind == "chat" else "prompt",
            )
        return ids

    def _piece(self, token: int) -> bytes:
        tok = self.server.tokenizer
        return tok.piece(token) if tok is not None else b""

    def _usage(self, prompt: int, completion: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _final(
        self, req: CompletionRequest, ident: str, text: str, result: GenerationResult
    ) -> dict[str, Any]:
        finish = "stop" if result.stop_reason in ("eos", "stop") else "length"
        choice: dict[str, Any]
        if req.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {
            "id": ident,
            "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": self.server.model_name,
            "choices": [choice],
            "usage": self._usage(result.prompt_tokens, len(result.tokens)),
            # not OpenAI's (clients ignore it; llama.cpp's server adds the same kind of field)
            "timings": {
                "ttft_s": round(result.ttft_s, 6),
                "prefill_s": round(result.prefill_s, 6),
                "decode_s": round(result.decode_s, 6),
                "failovers": result.failovers,
            },
        }

    def _chunk(
        self, req: CompletionRequest, ident: str, delta: str | None, finish: str | None
    ) -> dict[str, Any]:
        choice: dict[str, Any]
        if req.kind == "chat":
            d: dict[str, Any] = {} if delta is None else {"content": delta}
            if delta == "" and finish is None:
                d = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": d, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        return {
            "id": ident,
            "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": self.server.model_name,
            "choices": [choice],
        }

    async def _stream(
        self,
        req: CompletionRequest,
        ids: list[int],
        params: GenerationParams,
        ident: str,
        write: Write,
    ) -> None:
        text = TextStream(req.stop)
        if req.kind == "chat":
            await write(_sse(self._chunk(req, ident, "", None)))

        async def emit(token: int) -> bool:
            out = text.feed(self._piece(token))
            if out:
                await write(_sse(self._chunk(req, ident, out, None)))
            return text.stopped

        try:
            result = await self.server.generate(ids, params, emit)
        except SkippyError as err:
            await write(_sse(_as_api(err).body()))
            await write(b"data: [DONE]\n\n")
            return
        tail = text.finish()
        if tail:
            await write(_sse(self._chunk(req, ident, tail, None)))
        finish = "stop" if result.stop_reason in ("eos", "stop") else "length"
        await write(_sse(self._chunk(req, ident, None, finish)))
        if req.include_usage:
            usage = {**self._chunk(req, ident, None, None), "choices": []}
            usage["usage"] = self._usage(result.prompt_tokens, len(result.tokens))
            await write(_sse(usage))
        await write(b"data: [DONE]\n\n")


async def _json_body(request: Request) -> Any:
    size = 0
    chunks = []
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(
                f"the request body is larger than {MAX_BODY_BYTES} bytes",
                code="request_too_large",
                status=413,
            )
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError):
        raise ApiError("the request body is not valid JSON", code="invalid_json") from None
