"""The OpenAI-compatible HTTP API over an engine runner (FastAPI).

    POST /v1/completions, /v1/chat/completions   whole JSON, or server-sent events ending with `data: [DONE]`
    POST /v1/embeddings                          pooled final hidden states
    POST /tokenize, /detokenize                  the server's tokenizer (vLLM's shapes), and GET /tokenizer_info
    GET  /v1/models[/{id}], /metrics, /openapi.json   behind the API key when one is set (/metrics: or --metrics-key)
    GET  /health                                 open: 200, or 503 while shutting down or when the engine stopped

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a malformed body, a wrong type,
a value out of range (the message gives the range), an unknown parameter or a request that cannot fit the context;
401 for a missing or wrong API key; 404 for an unknown model; 408 / 413 for a body too slow or too large
(serve/limits.py); 429 when the queue is full; 503 while the server shuts down; 504 when a request runs past its
time limit. Nothing a client sends reaches a traceback: an unexpected failure is a 500 in the same shape.

The event loop only routes. Tokenizing and rendering chat templates (milliseconds to seconds for a large body) run
in a small thread pool of their own, and the engine steps in its own thread (serve/runner.py), so one heavy request
never stalls /health or another client's stream. A client that goes away, streamed or not, aborts its request; its
cache blocks return to the pool at the next step (serve/calls.py).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from llmkit.errors import ConfigError, InputError
from llmkit.serve.calls import APIError, Call, sse
from llmkit.serve.embeddings import check_input, pooled_embedding
from llmkit.serve.engine import Engine, Refused
from llmkit.serve.limits import BodyLimits
from llmkit.serve.lockstep import embed_step
from llmkit.serve.logprobs import TokenNames
from llmkit.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    Message,
    TokenizeRequest,
)
from llmkit.serve.request import SamplingParams
from llmkit.serve.runner import EngineRunner
from llmkit.serve.tools import Function, ToolUse, call_constraint, conversation, template_format
from llmkit.tokenizer import Tokenizer, render_chat

log = logging.getLogger("llmkit.serve")
T = TypeVar("T")


@dataclass(frozen=True)
class ServeOptions:
    """model_name: the name clients ask for; api_key: required as a Bearer token when given (for everything but
    /health); metrics_key: a second key that opens /metrics only (for a scraper); request_timeout: seconds a
    request may take before it is ended; max_body_size: bytes of request body at most; body_timeout /
    header_timeout: seconds a client has to send its body / its request line and headers; shutdown_timeout:
    seconds in-flight requests get to finish after SIGTERM or SIGINT before they are ended."""

    model_name: str
    api_key: str | None = None
    metrics_key: str | None = None
    request_timeout: float = 600.0
    max_body_size: int = 8 << 20
    body_timeout: float = 30.0
    header_timeout: float = 30.0
    shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in ("request_timeout", "body_timeout", "header_timeout"):
            if not getattr(self, name) > 0:
                raise InputError(f"{name}={getattr(self, name)} must be a positive number of seconds")
        if not self.shutdown_timeout >= 0:
            raise InputError(f"shutdown_timeout={self.shutdown_timeout} must be >= 0 seconds")
        if self.max_body_size < 1024:
            raise InputError(f"max_body_size={self.max_body_size} must be at least 1 KiB")


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class Gate:
    """Whether the server takes new requests (it stops when shutting down)."""

    def __init__(self) -> None:
        self.closed = False


def build_app(
    runner: EngineRunner, tokenizer: Tokenizer | None, options: ServeOptions, gate: Gate | None = None
) -> Any:
    """The ASGI app serving `runner`'s engine under `options.model_name` (FastAPI inside the body limits)."""
    app = FastAPI(title="llmkit", docs_url=None, redoc_url=None, openapi_url=None)
    gate = gate or Gate()
    created = int(time.time())
    max_len = runner.engine.max_len
    model_name, api_key = options.model_name, options.api_key
    # off the event loop: tokenizing and chat templates (the engine has its own thread; two workers keep one long
    # body from holding up every other request's tokenizing)
    workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llmkit-tokenize")

    async def off_loop(fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(workers, fn)

    async def compiled(body: CompletionRequest | ChatRequest, params: SamplingParams) -> None:
        """The request's constraint compiled now, off the event loop (a large grammar can take a second); the
        engine finds it in its cache. A 400 naming the field when it cannot be used."""
        if params.constraint is None:
            return
        field, grammars = body.constraint_field, runner.engine.grammars
        if grammars is None:
            raise APIError(400, f"{field}: structured outputs need a tokenizer, and this model has none", param=field)
        try:
            await off_loop(lambda: grammars.compile(params.constraint))  # type: ignore[arg-type]
        except InputError as e:
            raise APIError(400, f"{field}: {e}", param=field) from e

    async def tool_use(body: ChatRequest, functions: list[Function]) -> ToolUse | None:
        """How the reply's calls are read and, for a forced call, constrained; every function's parameters
        compiled as a schema (a 400 naming `tools` when one is not a usable JSON schema)."""
        if not functions or tokenizer is None or runner.engine.grammars is None:
            return None
        grammars, fmt = runner.engine.grammars, template_format(tokenizer.chat_template)[1]
        mode = body.tool_mode()
        several = body.parallel_tool_calls is not False
        try:
            await off_loop(lambda: grammars.compile(call_constraint(functions, fmt, several)))
            constraint = None
            if mode != "auto":
                forced = [f for f in functions if mode == "required" or f.name == mode]
                constraint = call_constraint(forced, fmt, several and mode == "required")
                await off_loop(lambda: grammars.compile(constraint))
        except InputError as e:
            raise APIError(
                400, f"tools: a function's parameters are not a usable JSON schema: {e}", param="tools"
            ) from e
        return ToolUse(fmt, {f.name for f in functions}, mode, several, constraint)

    text_limit = _TextLimit.of(tokenizer, max_len)  # text that cannot fit the context is refused untokenized
    names = TokenNames(tokenizer)  # the text tokens are reported under in log-probabilities

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        param, message, malformed = _explain(exc.errors())
        if malformed:
            return _error(400, "the body is not valid JSON", "invalid_request_error")
        return _error(400, f"{param or 'body'}: {message}", "invalid_request_error", param)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        code = "model_not_found" if exc.status == 404 else None
        return _error(exc.status, exc.message, exc.kind, exc.param, code)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        response = _error(exc.status_code, str(exc.detail), "invalid_request_error")
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug: logged, answered in shape
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc, exc_info=exc)
        return _error(500, "the server failed on this request", "server_error")

    def bearer(request: Request) -> str:
        return request.headers.get("authorization", "")

    async def authorized(request: Request) -> None:
        if api_key is not None and bearer(request) != f"Bearer {api_key}":
            raise APIError(401, "a valid API key is required (Authorization: Bearer ...)", "authentication_error")

    async def metrics_authorized(request: Request) -> None:
        keys = [k for k in (api_key, options.metrics_key) if k is not None]
        if keys and bearer(request) not in [f"Bearer {k}" for k in keys]:
            message = "/metrics needs the API key or the metrics key (Authorization: Bearer ...)"
            raise APIError(401, message, "authentication_error")

    async def admitting() -> None:
        if gate.closed:
            raise APIError(503, "the server is shutting down; send the request to another one", "server_error")

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server has {model_name!r}", param="model")

    @app.get("/health")
    async def health() -> Response:
        if not runner.alive:
            return _error(503, "the engine has stopped", "server_error")
        if gate.closed:
            return _error(503, "the server is shutting down", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=[Depends(metrics_authorized)])
    async def metrics() -> Response:
        return Response(runner.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/openapi.json", dependencies=[Depends(authorized)], include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "llmkit", "max_model_len": max_len}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorized)])
    async def model(name: str) -> dict[str, Any]:
        check_model(name)
        return card

    def needs_tokenizer(field: str) -> Tokenizer:
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param=field)
        return tokenizer

    @app.get("/tokenizer_info", dependencies=[Depends(authorized)])
    async def tokenizer_info() -> dict[str, Any]:
        return needs_tokenizer("model").config() | {"model_max_length": max_len}

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            check_model(body.model)
        tok = needs_tokenizer("prompt")
        if body.messages is not None:
            turns = text_limit.conversation(body.messages)
            ids = await off_loop(lambda: _render(tok, turns, None, body.add_generation_prompt))
        else:
            prompt = body.prompt or ""
            text_limit.check(len(prompt), "prompt")
            ids = await off_loop(lambda: tok.encode(prompt, add_bos=None if body.add_special_tokens else False))
        return {"count": len(ids), "max_model_len": max_len, "tokens": ids}

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            check_model(body.model)
        tok = needs_tokenizer("tokens")
        V = runner.engine.model.cfg.vocab_size
        if any(not 0 <= t < V for t in body.tokens):
            raise APIError(400, f"tokens: token ids must be in [0, {V})", param="tokens")
        return {"prompt": await off_loop(lambda: tok.decode(body.tokens, skip_special=False))}

    @app.post("/v1/completions", dependencies=[Depends(authorized), Depends(admitting)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prompts = await off_loop(lambda: [_encode(tokenizer, p, "prompt", text_limit) for p in body.prompts()])
        if not prompts:
            raise APIError(400, "prompt: give at least one prompt", param="prompt")
        limit = body.max_tokens if body.max_tokens is not None else max(max_len - max(len(p) for p in prompts), 1)
        logprobs = body.logprobs is not None
        texts = None
        if body.echo or logprobs:  # the prompts' text: echoed, and where the completion's text offsets start
            texts = await off_loop(lambda: [p if isinstance(p, str) else names.text(p) for p in body.prompts()])
        params = _params(body, limit)
        await compiled(body, params)
        call = Call(runner, prompts, params, options.request_timeout, "prompt", names, texts, bool(body.echo), logprobs)
        call.start()  # before any response: a refused request is an HTTP error, not a broken stream
        if body.stream:
            return sse(call.completion_chunks(body.model, _usage_wanted(body)))
        return JSONResponse(await call.completion(body.model, request))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized), Depends(admitting)])
    async def chat(body: ChatRequest, request: Request) -> Response:
        check_model(body.model)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot chat", param="messages")
        turns, functions = text_limit.conversation(body.messages), body.offered()
        ids = await off_loop(lambda: _render(tokenizer, turns, functions))
        limit = body.limit()
        params = _params(body, limit if limit is not None else max(max_len - len(ids), 1))
        await compiled(body, params)
        use = await tool_use(body, functions)
        if use is not None and use.constraint is not None:
            params = replace(params, constraint=use.constraint)
        call = Call(
            runner, [ids], params, options.request_timeout, "messages", names, logprobs=bool(body.logprobs), tools=use
        )
        call.start()
        if body.stream:
            return sse(call.chat_chunks(body.model, _usage_wanted(body)))
        return JSONResponse(await call.chat(body.model, request))

    @app.post("/v1/embeddings", dependencies=[Depends(authorized), Depends(admitting)])
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        check_model(body.model)
        prompts = await off_loop(lambda: [_encode(tokenizer, p, "input", text_limit) for p in body.inputs()])
        data = []
        for i, ids in enumerate(prompts):  # one at a time: decoding steps run between them
            embed = functools.partial(_embed, prompt=ids)
            try:  # between two engine steps, on the engine's thread
                vector = await asyncio.wrap_future(runner.call(embed))
            except Refused as e:
                raise APIError(400, f"input: {e}", param="input") from e
            data.append({"object": "embedding", "index": i, "embedding": _encoded(vector, body.encoding_format)})
        tokens = sum(len(p) for p in prompts)
        return {
            "object": "list",
            "data": data,
            "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    return BodyLimits(app, options.max_body_size, options.body_timeout)


def _embed(engine: Engine, prompt: list[int]) -> Any:
    if engine.lockstep is None:
        return pooled_embedding(engine.model, prompt)
    check_input(engine.model, prompt)  # a refusal before any rank starts the forward
    return engine.lockstep.run(embed_step, engine, prompt)


def _encoded(vector: Any, encoding: str) -> list[float] | str:
    """An embedding as OpenAI sends it: a list of floats, or base64 of its little-endian float32 bytes."""
    if encoding == "base64":
        return base64.b64encode(vector.cpu().numpy().astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector.tolist()]


def _explain(errors: Any) -> tuple[str | None, str, bool]:
    """pydantic's errors -> (the field, what is wrong with it, whether the body was not JSON at all).

    A field that may take several shapes (a prompt: a string, strings, token ids) fails once per shape; the error
    that says most is the one whose type is not merely "not this shape" (a value out of range, a list too long, a
    lone surrogate), and the field is named without pydantic's tags for the shapes."""
    errors = list(errors) or [{"loc": (), "msg": "invalid request", "type": "value_error"}]
    if any(e.get("type") == "json_invalid" for e in errors):
        return None, "", True
    telling = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    first = (telling or errors)[0]
    parts = [str(x) for x in first.get("loc", ()) if x != "body" and not (isinstance(x, str) and "[" in x)]
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return ".".join(parts) or None, message, False


def _usage_wanted(body: CompletionRequest | ChatRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _params(body: CompletionRequest | ChatRequest, max_tokens: int) -> SamplingParams:
    field = body.constraint_field
    try:
        constraint = body.constraint()
    except InputError as e:
        raise APIError(400, f"{field}: {e}", param=field) from e
    try:
        return replace(body.sampling(max_tokens), constraint=constraint)
    except InputError as e:
        raise APIError(400, str(e)) from e


# how many characters of input one token can stand for, at most, per character of its own text: normalizers that
# compose characters (NFC, NFKC: "e" + U+0301 -> "é", three Hangul jamo -> one syllable) make it more than one
_CHARS_PER_TOKEN_CHAR = 4


@dataclass(frozen=True)
class _TextLimit:
    """Characters beyond which a text cannot fit the context's `max_len` tokens: the context times the longest
    token's text (with a margin for normalizers). A 5 MB prompt is then a 400 in microseconds, not seconds of
    tokenizing and hundreds of MB of token objects."""

    max_chars: int
    max_len: int

    @classmethod
    def of(cls, tokenizer: Tokenizer | None, max_len: int) -> _TextLimit:
        longest = max((len(t) for t in tokenizer.backend.get_vocab()), default=1) if tokenizer is not None else 1
        return cls(max_len * max(longest, 1) * _CHARS_PER_TOKEN_CHAR, max_len)

    def conversation(self, messages: list[Message]) -> list[dict[str, Any]]:
        """The messages as serve/tools.py takes them, refused untokenized when their text cannot fit."""
        turns = [m.turn() for m in messages]
        calls = (c for m in turns for c in m.get("tool_calls", []))
        self.check(sum(len(m["content"]) for m in turns) + sum(len(c.arguments) for c in calls), "messages")
        return turns

    def check(self, chars: int, field: str) -> None:
        if chars > self.max_chars:
            message = f"{field}: {chars:,} characters cannot fit the model's context of {self.max_len:,} tokens"
            raise APIError(400, message, param=field)


def _encode(tokenizer: Tokenizer | None, prompt: str | list[int], field: str, limit: _TextLimit) -> list[int]:
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, f"{field}: a token list is empty", param=field)
        return prompt
    if not prompt:
        raise APIError(400, f"{field}: the prompt is empty", param=field)
    if tokenizer is None:
        raise APIError(400, f"{field}: this model has no tokenizer; send token ids", param=field)
    limit.check(len(prompt), field)
    try:
        return tokenizer.encode(prompt)
    except InputError as e:
        raise APIError(400, f"{field}: {e}", param=field) from e


def _render(
    tokenizer: Tokenizer,
    turns: list[dict[str, Any]],
    functions: list[Function] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The prompt's token ids for a conversation and the functions offered (serve/tools.py)."""
    takes_tools, _ = template_format(tokenizer.chat_template)
    messages, context = conversation(turns, functions, takes_tools)
    try:
        text = render_chat(tokenizer, messages, add_generation_prompt, **context)
        return tokenizer.encode(text, add_bos=False)
    except (ConfigError, InputError) as e:
        raise APIError(400, f"messages: {e}", param="messages") from e
