"""The OpenAI-compatible HTTP API over an engine runner (FastAPI).

    POST /v1/completions, /v1/chat/completions   whole JSON, or server-sent events ending with `data: [DONE]`
    GET  /v1/models, /health, /metrics

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a malformed body, a wrong type,
an unknown parameter or a request that cannot fit the context; 401 for a missing or wrong API key; 404 for an
unknown model; 429 when the queue is full; 504 when a request runs past its time limit. A client that goes away
aborts its request, and its cache blocks return to the pool at the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from llmkit.errors import ConfigError, InputError
from llmkit.serve.engine import QueueFull
from llmkit.serve.protocol import ChatRequest, CompletionRequest
from llmkit.serve.request import Delta, SamplingParams
from llmkit.serve.runner import EngineRunner
from llmkit.tokenizer import Tokenizer, render_chat


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def build_app(
    runner: EngineRunner,
    tokenizer: Tokenizer | None,
    model_name: str,
    api_key: str | None = None,
    request_timeout: float = 600.0,
) -> FastAPI:
    """The app serving `runner`'s engine under the name `model_name`."""
    app = FastAPI(title="llmkit", docs_url=None, redoc_url=None)
    created = int(time.time())
    max_len = runner.engine.max_len

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, "the body is not valid JSON", "invalid_request_error")
        param = ".".join(loc) or None
        return _error(400, f"{param or 'body'}: {first.get('msg')}", "invalid_request_error", param)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        code = "model_not_found" if exc.status == 404 else None
        return _error(exc.status, exc.message, exc.kind, exc.param, code)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    async def authorized(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise APIError(401, "a valid API key is required (Authorization: Bearer ...)", "authentication_error")

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server has {model_name!r}", param="model")

    @app.get("/health")
    async def health() -> Response:
        if not runner.alive:
            return _error(503, "the engine has stopped", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(runner.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "llmkit"}],
        }

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prompts = [_encode(tokenizer, p) for p in body.prompts()]
        if not prompts:
            raise APIError(400, "prompt: give at least one prompt", param="prompt")
        limit = body.max_tokens if body.max_tokens is not None else max_len - max(len(p) for p in prompts)
        call = _Call(runner, prompts, _params(body, limit), request_timeout, "prompt")
        call.start()  # before any response: a refused request is an HTTP error, not a broken stream
        if body.stream:
            return _sse(call.completion_chunks(body.model, _usage_wanted(body)))
        return JSONResponse(await call.completion(body.model, request))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: ChatRequest, request: Request) -> Response:
        check_model(body.model)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot chat", param="messages")
        try:
            text = render_chat(tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages])
        except (ConfigError, InputError) as e:
            raise APIError(400, f"messages: {e}", param="messages") from e
        ids = tokenizer.encode(text, add_bos=False)
        limit = body.limit() if body.limit() is not None else max_len - len(ids)
        call = _Call(runner, [ids], _params(body, max(limit or 0, 1)), request_timeout, "messages")
        call.start()
        if body.stream:
            return _sse(call.chat_chunks(body.model, _usage_wanted(body)))
        return JSONResponse(await call.chat(body.model, request))

    return app


def _usage_wanted(body: CompletionRequest | ChatRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _params(body: CompletionRequest | ChatRequest, max_tokens: int) -> SamplingParams:
    try:
        return body.sampling(max_tokens)
    except InputError as e:
        raise APIError(400, str(e)) from e


def _encode(tokenizer: Tokenizer | None, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "prompt: a token list is empty", param="prompt")
        return prompt
    if not prompt:
        raise APIError(400, "prompt: the prompt is empty", param="prompt")
    if tokenizer is None:
        raise APIError(400, "prompt: this model has no tokenizer; send token ids", param="prompt")
    return tokenizer.encode(prompt)


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except _StreamError as e:  # the status line is sent already: the failure becomes an error event
            error = {"message": e.error.message, "type": e.error.kind, "param": None, "code": None}
            yield f"data: {json.dumps({'error': error})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _Call:
    """The engine requests of one HTTP request (one per prompt, each with n sequences) and their deltas."""

    def __init__(
        self, runner: EngineRunner, prompts: list[list[int]], params: SamplingParams, timeout: float, field: str
    ) -> None:
        self.runner, self.prompts, self.params, self.timeout, self.field = runner, prompts, params, timeout, field
        self.id = uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.ids: list[str] = []
        self.queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        self.pending = len(prompts) * params.n
        self.completion_tokens = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            for i, prompt in enumerate(self.prompts):

                def deliver(d: Delta, i: int = i) -> None:
                    loop.call_soon_threadsafe(self.queue.put_nowait, (i, d))

                self.ids.append(self.runner.submit(prompt, self.params, deliver, self.timeout))
        except InputError as e:
            self.abort()
            param = "max_tokens" if "max_tokens" in str(e) else self.field
            raise APIError(400, str(e), param=param) from e
        except QueueFull as e:
            self.abort()
            raise APIError(429, str(e), "rate_limit_error") from e

    def abort(self) -> None:
        for request_id in self.ids:
            self.runner.abort(request_id)

    async def deltas(self, request: Request | None = None) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) until every sequence finished; aborts everything if the consumer stops early."""
        try:
            while self.pending:
                try:
                    i, d = await asyncio.wait_for(self.queue.get(), 1.0)
                except TimeoutError:
                    if request is not None and await request.is_disconnected():
                        return
                    continue
                if d.finish_reason is not None:
                    self.pending -= 1
                    if d.finish_reason in ("error", "timeout"):
                        raise APIError(
                            504 if d.finish_reason == "timeout" else 500, _FAILED[d.finish_reason], "server_error"
                        )
                self.completion_tokens += len(d.token_ids)
                yield i * self.params.n + d.index, d
        finally:
            if self.pending:
                self.abort()

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
        }

    async def _collect(self, request: Request) -> tuple[list[str], list[str | None]]:
        count = len(self.prompts) * self.params.n
        texts, reasons = [""] * count, [None] * count  # type: list[str], list[str | None]
        async for k, d in self.deltas(request):
            texts[k] += d.text
            reasons[k] = d.finish_reason or reasons[k]
        return texts, reasons

    async def completion(self, model: str, request: Request) -> dict[str, Any]:
        texts, reasons = await self._collect(request)
        choices = [
            {"index": k, "text": t, "logprobs": None, "finish_reason": r}
            for k, (t, r) in enumerate(zip(texts, reasons, strict=True))
        ]
        return self._body("text_completion", model, choices) | {"usage": self.usage()}

    async def chat(self, model: str, request: Request) -> dict[str, Any]:
        texts, reasons = await self._collect(request)
        choices = [
            {"index": k, "message": {"role": "assistant", "content": t}, "logprobs": None, "finish_reason": r}
            for k, (t, r) in enumerate(zip(texts, reasons, strict=True))
        ]
        return self._body("chat.completion", model, choices) | {"usage": self.usage()}

    async def completion_chunks(self, model: str, usage: bool) -> AsyncIterator[dict[str, Any]]:
        async for k, d in self._guarded():
            choice = {"index": k, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
            yield self._body("text_completion", model, [choice])
        if usage:
            yield self._body("text_completion", model, []) | {"usage": self.usage()}

    async def chat_chunks(self, model: str, usage: bool) -> AsyncIterator[dict[str, Any]]:
        for k in range(len(self.prompts) * self.params.n):
            first = {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield self._body("chat.completion.chunk", model, [first])
        async for k, d in self._guarded():
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            choice = {"index": k, "delta": delta, "logprobs": None, "finish_reason": d.finish_reason}
            yield self._body("chat.completion.chunk", model, [choice])
        if usage:
            yield self._body("chat.completion.chunk", model, []) | {"usage": self.usage()}

    async def _guarded(self) -> AsyncIterator[tuple[int, Delta]]:
        """Deltas for a stream: the status line is sent already, so a failure becomes an error event."""
        try:
            async for item in self.deltas():
                yield item
        except APIError as e:
            raise _StreamError(e) from e

    def _body(self, kind: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
        return {
            "id": f"{prefix}-{self.id}",
            "object": kind,
            "created": self.created,
            "model": model,
            "choices": choices,
        }


class _StreamError(Exception):
    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


_FAILED = {"timeout": "the request ran past the server's time limit", "error": "the engine failed on this request"}
