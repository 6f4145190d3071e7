"""The OpenAI-compatible HTTP API over an engine client (FastAPI; the routes are routes.py's).

    POST /v1/completions, /v1/chat/completions   whole JSON, or server-sent events ending with `data: [DONE]`
    POST /v1/embeddings                          pooled final hidden states
    POST /tokenize, /detokenize                  the server's tokenizer (vLLM's shapes), and GET /tokenizer_info
    GET  /v1/models[/{id}], /metrics, /openapi.json   behind the API key when one is set (/metrics: or --metrics-key)
    GET  /metrics.json                           /metrics' samples as JSON and the last steps (for the page)
    GET  /health                                 open: 200, or 503 while shutting down or when the engine stopped
    GET  /, /ui/{file}                           the web page (serve/webpage.py; not with --no-ui)

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a malformed body, a wrong type,
a value out of range (the message gives the range), an unknown parameter or a request that cannot fit the context;
401 for a missing or wrong API key; 404 for an unknown model; 408 / 413 for a body too slow or too large
(serve/limits.py); 429 when the queue is full; 503 while the server shuts down; 504 when a request runs past its
time limit. Nothing a client sends reaches a traceback: an unexpected failure is a 500 in the same shape.

The event loop only routes. Tokenizing and rendering chat templates (milliseconds to seconds for a large body) run
in a small thread pool of their own, and the engine steps in its own thread (serve/engine_loop.py), so one heavy
request never stalls /health or another client's stream. A client that goes away, streamed or not, aborts its
request; its cache blocks return to the pool at the next step (serve/calls.py).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from llmkit.serve.calls import APIError
from llmkit.serve.config import ServeOptions
from llmkit.serve.engine_loop import EngineClient
from llmkit.serve.limits import BodyLimits, openai_error
from llmkit.serve.messages_api import error_body, messages_routes
from llmkit.serve.responses_api import responses_routes
from llmkit.serve.routes import (
    Context,
    Gate,
    KeyCheck,
    adapter_routes,
    embedding_routes,
    error_response,
    generation_routes,
    model_routes,
    status_routes,
)
from llmkit.serve.webpage import page_routes
from llmkit.tokenizer import Tokenizer

__all__ = ["Gate", "ServeOptions", "build_app"]

log = logging.getLogger("llmkit.serve")


def build_app(
    client: EngineClient, tokenizer: Tokenizer | None, options: ServeOptions, gate: Gate | None = None
) -> Any:
    """The ASGI app serving `client`'s engine under `options.model_name` (FastAPI inside the body limits): the
    routes of routes.py, behind the API key (all but /health and /metrics, which has its own), the routes that start
    work behind the gate too, and every error in OpenAI's shape."""
    app = FastAPI(title="llmkit", docs_url=None, redoc_url=None, openapi_url=None)
    ctx = Context.of(client, tokenizer, options, gate or Gate())
    key = KeyCheck(() if options.api_key is None else (options.api_key,),
                   "a valid API key is required (Authorization: Bearer ..., or x-api-key)")  # fmt: skip
    _handle_errors(app)
    app.include_router(status_routes(ctx))
    app.include_router(model_routes(ctx), dependencies=[Depends(key)])
    for routes in (generation_routes, embedding_routes, responses_routes, messages_routes, adapter_routes):
        app.include_router(routes(ctx), dependencies=[Depends(key), Depends(ctx.gate.admitting)])

    if options.ui:
        app.include_router(page_routes())

    @app.get("/openapi.json", dependencies=[Depends(key)], include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    return BodyLimits(app, options.max_body_size, options.body_timeout, _body_error)


ANTHROPIC = ("/v1/messages",)  # the paths whose errors are in Anthropic's shape


def _body_error(path: str, status: int, message: str) -> dict[str, Any]:
    """A body refused by its limits, in its API's shape."""
    return error_body(status, message) if path.startswith(ANTHROPIC) else openai_error(path, status, message)


def _handle_errors(app: FastAPI) -> None:
    """Every error answered in its API's shape (Anthropic's under /v1/messages, OpenAI's elsewhere); nothing a client
    sends reaches a traceback."""

    def answer(request: Request, status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
        if request.url.path.startswith(ANTHROPIC):
            return JSONResponse(error_body(status, message), status_code=status)
        return error_response(
            status, message, kind, param, "model_not_found" if status == 404 and param == "model" else None
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        param, message, malformed = _explain(exc.errors())
        if malformed:
            return answer(request, 400, "the body is not valid JSON", "invalid_request_error")
        return answer(request, 400, f"{param or 'body'}: {message}", "invalid_request_error", param)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        response = answer(request, exc.status_code, str(exc.detail), "invalid_request_error")
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug: logged, answered in shape
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc, exc_info=exc)
        return answer(request, 500, "the server failed on this request", "server_error")


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
