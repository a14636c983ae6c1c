"""The OpenAI-compatible HTTP API of a serving coordinator (starlette routes).

``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions``, each with ``stream: true`` as server-sent events
(``data: {chunk}`` ... ``data: [DONE]``). A request is admitted (split ready, queue space)
*before* its body is read; the body is read with bounds (``mesh_node.http.body``) and checked
by ``skippy.serving.openai`` (400 with OpenAI's error body). Statuses come from one table
(``mesh_node.serving.statuses``): 503 not ready, 429 busy, 5xx for any fault of ours. At
shutdown (``drain``) new requests get 503 and open streams end with a final SSE error event.
The routes join the node's one app.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Final

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from mesh_node.http.body import BodyReader, ClientGone
from mesh_node.http.guard import ACCESS_SCOPE_KEY, AccessRecord
from mesh_node.metrics import ServingMetrics
from mesh_node.serving.pipeline import (
    GenerationParams,
    GenerationResult,
    ServerBusy,
    SplitNotReady,
    SplitServer,
)
from mesh_node.serving.statuses import as_api_error
from mesh_node.settings import HttpSettings
from skippy.errors import SkippyError
from skippy.serving.chat import ChatTemplate
from skippy.serving.openai import ApiError, CompletionRequest, parse_request
from skippy.serving.text_stream import TextStream

log = logging.getLogger("mesh_node.serving.api")
DRAIN_FLUSH_S: Final = 1.0  # then the cancelled ones write their final event within this
Write = Callable[[bytes], Awaitable[None]]


def _error_response(err: SkippyError) -> JSONResponse:
    api = as_api_error(err)
    return JSONResponse(api.body(), status_code=api.status, headers=api.headers or None)


def _shutting_down() -> ApiError:
    return ApiError(
        "the node is shutting down",
        code="shutting_down",
        status=503,
        kind="service_unavailable",
    )


def _access(request: Request) -> AccessRecord | None:
    record = request.scope.get(ACCESS_SCOPE_KEY)
    return record if isinstance(record, AccessRecord) else None


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

        async with trio.open_nursery() as nursery:

            async def write(data: bytes) -> None:
                nonlocal gone
                try:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                except OSError:  # the connection broke under the write: the client left
                    gone = True
                    nursery.cancel_scope.cancel()
                    await trio.lowlevel.checkpoint()  # raises Cancelled: counted so

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
        self,
        source: Callable[[], SplitServer | None],
        metrics: ServingMetrics | None = None,
        http: HttpSettings | None = None,
    ) -> None:
        self._source = source
        self._metrics = metrics
        self.body = BodyReader(http or HttpSettings())
        self._template: tuple[ChatTemplate | None] | None = None  # read once, when first needed
        self.created = int(time.time())
        self.closing = False  # draining for shutdown: new requests get 503
        self._running: set[trio.CancelScope] = set()  # generations in flight

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
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ]

    def _model_doc(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "skippy-mesh"}

    async def models(self, request: Request) -> Response:
        try:
            name = self.server.model_name
        except SkippyError as err:
            return _error_response(err)
        return JSONResponse({"object": "list", "data": [self._model_doc(name)]})

    async def model(self, request: Request) -> Response:
        try:
            name = self.server.model_name
            if request.path_params["model_id"] != name:
                raise ApiError(
                    f"the model {request.path_params['model_id']!r} is not served here",
                    code="model_not_found",
                    status=404,
                    param="model",
                )
        except SkippyError as err:
            return _error_response(err)
        return JSONResponse(self._model_doc(name))

    async def completions(self, request: Request) -> Response:
        return await self._guarded(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self._guarded(request, "chat")

    # --- one request ---------------------------------------------------------------------------
    async def _guarded(self, request: Request, kind: Any) -> Response:
        """``_handle``, with a bug of ours answered as a 500 in OpenAI's shape (and logged),
        not starlette's plain text."""
        try:
            return await self._handle(request, kind)
        except Exception:
            log.exception("the API failed on a request")
            api = ApiError(
                "internal error (logged on the node)",
                code="internal_error",
                status=500,
                kind="server_error",
            )
            return JSONResponse(api.body(), status_code=500)

    def _rejected(self, outcome: str = "rejected") -> None:
        if self._metrics is not None:  # refused before it reached the split: counted too
            with self._metrics.request(0) as record:
                record.outcome = outcome  # type: ignore[assignment]

    def _admit_early(self) -> SplitServer:
        """Ready, and room in the queue: checked before a byte of the body is read (the
        serving core checks again when the request arrives there)."""
        if self.closing:
            raise _shutting_down()
        server = self.server
        server._check_ready()
        st, limits = server.stats, server.settings
        if st.in_flight + st.queued >= limits.max_sessions + limits.max_queue:
            raise ServerBusy(
                f"{st.in_flight} requests running and {st.queued} queued (the limit)",
                remediation="retry later",
            )
        return server

    async def _handle(self, request: Request, kind: Any) -> Response:
        access = _access(request)
        try:
            server = self._admit_early()
            data = await self.body.read(request)
            body = await self.body.parse_json(data)
            del data
            route = server._check_ready()
            n_ctx = route.stage0.facts.n_ctx
            tok = server.tokenizer
            req = parse_request(
                body,
                kind,
                max_tokens_limit=n_ctx,
                vocab=tok.n_vocab if tok is not None else route.stage0.facts.vocab or None,
            )
            if req.model is not None and req.model != server.model_name:
                raise ApiError(
                    f"the model {req.model!r} is not served here (this split serves "
                    f"{server.model_name!r})",
                    code="model_not_found",
                    status=404,
                    param="model",
                )
            ids = await trio.to_thread.run_sync(self._prompt_ids, req, n_ctx)
        except ClientGone:
            self._rejected("cancelled")
            return Response(status_code=400)  # nobody reads it
        except SkippyError as err:
            self._rejected()
            return _error_response(err)
        if access is not None:
            access.tokens_in = len(ids)
        seed = req.seed if req.seed is not None else secrets.randbits(62)
        params = GenerationParams(
            max_tokens=req.max_tokens,
            sampling=replace(req.sampling, seed=seed % (1 << 63)),
        )
        ident = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        if req.stream:
            return _EventStream(
                lambda write: self._stream(req, ids, params, ident, write, access)
            )
        text = TextStream(req.stop)

        async def emit(token: int) -> bool:
            text.feed(self._piece(token))
            return text.stopped

        done: list[GenerationResult | SkippyError] = []  # empty: the client left
        async with trio.open_nursery() as nursery:
            # a client that leaves cancels its generation (counted as cancelled)
            nursery.start_soon(_cancel_on_disconnect, request.receive, nursery.cancel_scope)
            try:
                done.append(await self._generate(ids, params, emit))
            except SkippyError as err:
                done.append(err)
            nursery.cancel_scope.cancel()
        if not done:
            return Response(status_code=499)  # nobody reads this
        outcome = done[0]
        if isinstance(outcome, SkippyError):
            return _error_response(outcome)
        text.finish()
        if access is not None:
            access.tokens_out = len(outcome.tokens)
        return JSONResponse(self._final(req, ident, text.text, outcome))

    async def _generate(
        self, ids: list[int], params: GenerationParams, emit: Callable[[int], Awaitable[bool]]
    ) -> GenerationResult:
        """``server.generate`` that ``drain`` can end: then ``shutting_down``."""
        scope = trio.CancelScope()
        self._running.add(scope)
        try:
            with scope:
                return await self.server.generate(ids, params, emit)
        finally:
            self._running.discard(scope)
        raise _shutting_down()  # only reached when drain cancelled the scope

    async def drain(self, flush_s: float = DRAIN_FLUSH_S) -> None:
        """Shutdown: refuse new requests, let running ones finish within
        ``[http] shutdown_grace_s``, then end the rest (a stream gets a final
        ``shutting_down`` event and ``[DONE]``)."""
        self.closing = True
        grace_s = self.body.settings.shutdown_grace_s
        with trio.move_on_after(grace_s):
            while self._running:
                await trio.sleep(0.05)
        for scope in list(self._running):
            scope.cancel()
        with trio.move_on_after(flush_s):
            while self._running:
                await trio.sleep(0.02)
            await trio.sleep(0.05)  # the final events' writes

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
        if not ids:
            raise ApiError(
                "the prompt has no tokens",
                code="empty_prompt",
                param="messages" if req.kind == "chat" else "prompt",
            )
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
        access: AccessRecord | None = None,
    ) -> None:
        text = TextStream(req.stop)
        if req.kind == "chat":
            await write(_sse(self._chunk(req, ident, "", None)))
        produced = 0

        async def emit(token: int) -> bool:
            nonlocal produced
            produced += 1
            out = text.feed(self._piece(token))
            if out:
                await write(_sse(self._chunk(req, ident, out, None)))
            return text.stopped

        try:
            result = await self._generate(ids, params, emit)
        except SkippyError as err:
            if access is not None:
                access.tokens_out = produced
            # the stream ends with an error event, never a bare connection error
            await write(_sse(as_api_error(err).body()))
            await write(b"data: [DONE]\n\n")
            return
        if access is not None:
            access.tokens_out = len(result.tokens)
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


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
