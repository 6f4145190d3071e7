"""The HTTP routes, by concern: each a FastAPI router over a Context that holds what every route may use (the engine
client, the tokenizer, the server's options, the thread pool for tokenizing). api.py puts them under the key checks.

    status_routes      GET  /health (open), /metrics (the API key or the metrics key)
    model_routes       GET  /v1/models[/{id}], /tokenizer_info; POST /tokenize, /detokenize
    generation_routes  POST /v1/completions, /v1/chat/completions
    embedding_routes   POST /v1/embeddings

No route reaches past the engine client (engine_loop.EngineClient): a request is checked once by pydantic
(protocol.py) for its shape and once by the engine (through the client's submit) for what the model can run.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from llmkit.errors import ConfigError, InputError
from llmkit.serve.calls import APIError, Call, sse
from llmkit.serve.config import ServeOptions
from llmkit.serve.engine_loop import EngineClient
from llmkit.serve.logprobs import TokenNames
from llmkit.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadAdapter,
    Message,
    TokenizeRequest,
    UnloadAdapter,
)
from llmkit.serve.reasoning import THINK, Reasoning, tags_of
from llmkit.serve.request import Refused, SamplingParams
from llmkit.serve.structured import Constraint
from llmkit.serve.tools import Function, ToolUse, call_constraint, conversation, template_format
from llmkit.tokenizer import Tokenizer, render_chat

T = TypeVar("T")


def error_response(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> Any:
    """An error in OpenAI's shape, {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class Gate:
    """Whether the server takes new requests (it stops when shutting down)."""

    def __init__(self) -> None:
        self.closed = False

    async def admitting(self) -> None:
        """A dependency of the routes that start work: 503 once the gate is closed."""
        if self.closed:
            raise APIError(503, "the server is shutting down; send the request to another one", "server_error")


@dataclass(frozen=True)
class KeyCheck:
    """A dependency: 401 unless the request carries one of `keys` as a Bearer token, or in an `x-api-key` header as
    Anthropic's clients send it (no keys: open)."""

    keys: tuple[str, ...]
    message: str

    async def __call__(self, request: Request) -> None:
        if not self.keys:
            return
        bearer = request.headers.get("authorization", "")
        if bearer not in [f"Bearer {k}" for k in self.keys] and request.headers.get("x-api-key") not in self.keys:
            raise APIError(401, self.message, "authentication_error")


@dataclass(frozen=True)
class Context:
    """What the routes share. `workers`: tokenizing and chat templates run there, off the event loop (the engine has
    its own thread; two workers keep one long body from holding up every other request's tokenizing)."""

    client: EngineClient
    tokenizer: Tokenizer | None
    options: ServeOptions
    gate: Gate
    workers: ThreadPoolExecutor
    text_limit: TextLimit  # text that cannot fit the context is refused untokenized
    names: TokenNames  # the text tokens are reported under in log-probabilities
    created: int  # when the server started (the model card's "created")

    @classmethod
    def of(cls, client: EngineClient, tokenizer: Tokenizer | None, options: ServeOptions, gate: Gate) -> Context:
        workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llmkit-tokenize")
        limit = TextLimit.of(tokenizer, client.max_len)
        return cls(client, tokenizer, options, gate, workers, limit, TokenNames(tokenizer), int(time.time()))

    async def off_loop(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn)

    def reasoning(self, prompt: list[int]) -> Reasoning | None:
        """How a reply to `prompt` is split into reasoning and answer (serve/reasoning.py), by the server's
        reasoning_parser: None where replies are not split."""
        choice, tok = self.options.reasoning_parser, self.tokenizer
        tags = THINK if choice == "think" else tags_of(tok.chat_template) if choice == "auto" and tok else None
        if tags is None or tok is None:
            return None
        inside = tok.decode(prompt[-8:]).rstrip().endswith(tags[0])  # the template opened the block
        return Reasoning(*tags, inside=inside)

    def check_model(self, name: str) -> str | None:
        """The adapter a request's `model` names (None: the base model); a 404 for a model the server lacks."""
        if name == self.options.model_name:
            return None
        if name in self.client.adapter_names():
            return name
        served = ", ".join(repr(n) for n in [self.options.model_name, *self.client.adapter_names()])
        raise APIError(404, f"the model {name!r} does not exist; this server has {served}", param="model")

    def needs_tokenizer(self, field: str) -> Tokenizer:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param=field)
        return self.tokenizer


# ---- status


def status_routes(ctx: Context) -> APIRouter:
    router = APIRouter()
    keys = tuple(k for k in (ctx.options.api_key, ctx.options.metrics_key) if k is not None)
    metrics_key = KeyCheck(keys, "/metrics needs the API key or the metrics key (Authorization: Bearer ...)")
    metrics = ctx.client.metrics

    @router.get("/health")
    async def health() -> Response:
        if not ctx.client.alive:
            return error_response(503, "the engine has stopped", "server_error")
        if ctx.gate.closed:
            return error_response(503, "the server is shutting down", "server_error")
        return JSONResponse({"status": "ok"})

    @router.get("/metrics", dependencies=[Depends(metrics_key)])
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @router.get("/metrics.json", dependencies=[Depends(metrics_key)])
    async def snapshot() -> JSONResponse:  # the same samples for the web page, and the recent steps
        return JSONResponse(metrics.snapshot(), headers={"cache-control": "no-store"})

    return router


# ---- the model and its tokenizer


def model_routes(ctx: Context) -> APIRouter:
    router = APIRouter()
    max_len = ctx.client.max_len
    card = {"id": ctx.options.model_name, "object": "model", "created": ctx.created, "owned_by": "llmkit",
            "max_model_len": max_len}  # fmt: skip

    def cards() -> list[dict[str, Any]]:
        base = ctx.options.model_name
        adapters = [card | {"id": name, "parent": base, "root": path} for name, path in ctx.client.adapters()]
        return [card, *adapters]

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": cards()}

    @router.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        ctx.check_model(name)
        return next(c for c in cards() if c["id"] == name)

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return ctx.needs_tokenizer("model").config() | {"model_max_length": max_len}

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            ctx.check_model(body.model)
        tok = ctx.needs_tokenizer("prompt")
        if body.messages is not None:
            turns = ctx.text_limit.conversation(body.messages)
            ids = await ctx.off_loop(lambda: render_prompt(tok, turns, None, body.add_generation_prompt))
        else:
            prompt = body.prompt or ""
            ctx.text_limit.check(len(prompt), "prompt")
            ids = await ctx.off_loop(lambda: tok.encode(prompt, add_bos=None if body.add_special_tokens else False))
        return {"count": len(ids), "max_model_len": max_len, "tokens": ids}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            ctx.check_model(body.model)
        tok = ctx.needs_tokenizer("tokens")
        V = ctx.client.vocab_size
        if any(not 0 <= t < V for t in body.tokens):
            raise APIError(400, f"tokens: token ids must be in [0, {V})", param="tokens")
        return {"prompt": await ctx.off_loop(lambda: tok.decode(body.tokens, skip_special=False))}

    return router


# ---- completions and chat


def generation_routes(ctx: Context) -> APIRouter:
    router = APIRouter()
    max_len, timeout = ctx.client.max_len, ctx.options.request_timeout

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        adapter = ctx.check_model(body.model)
        limit = ctx.text_limit
        prompts = await ctx.off_loop(lambda: [_encode(ctx.tokenizer, p, "prompt", limit) for p in body.prompts()])
        if not prompts:
            raise APIError(400, "prompt: give at least one prompt", param="prompt")
        most = body.max_tokens if body.max_tokens is not None else max(max_len - max(len(p) for p in prompts), 1)
        logprobs = body.logprobs is not None
        texts = None
        if body.echo or logprobs:  # the prompts' text: echoed, and where the completion's text offsets start
            texts = await ctx.off_loop(lambda: [p if isinstance(p, str) else ctx.names.text(p) for p in body.prompts()])
        params = replace(_params(body, most), adapter=adapter)
        await _compiled(ctx, params.constraint, body.constraint_field)
        call = Call(ctx.client, prompts, params, timeout, "prompt", ctx.names, texts, bool(body.echo), logprobs)
        call.start()  # before any response: a refused request is an HTTP error, not a broken stream
        if body.stream:
            return sse(call.completion_chunks(body.model, _usage_wanted(body)))
        return JSONResponse(await call.completion(body.model, request))

    @router.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        ask = ChatAsk(
            adapter=ctx.check_model(body.model),
            turns=ctx.text_limit.conversation(body.messages),
            functions=body.offered(),
            tool_mode=body.tool_mode(),
            several=body.parallel_tool_calls is not False,
            sampling=body.sampling,
            max_tokens=body.limit(),
            constraint=constraint_of(body.constraint, body.constraint_field),
            constraint_field=body.constraint_field,
            variables=body.chat_template_kwargs,
            logprobs=bool(body.logprobs),
        )
        call = await start_chat(ctx, ask)
        if body.stream:
            return sse(call.chat_chunks(body.model, _usage_wanted(body)))
        return JSONResponse(await call.chat(body.model, request))

    return router


@dataclass(frozen=True)
class ChatAsk:
    """A chat request in the terms of whichever API it came by (chat completions, Responses, Messages), as the
    engine runs it.

    turns: the conversation as serve/tools.py takes it; tool_mode: 'none', 'auto', 'required' or the name of the
    function to call; sampling: the request's parameters given how many tokens it may generate; max_tokens: its
    limit (None: what the context leaves); constraint: what the reply must be (a forced call's grammar takes its
    place); variables: more for the chat template; field: the request's field that holds the conversation."""

    adapter: str | None  # the LoRA adapter its `model` named (None: the base model)
    turns: list[dict[str, Any]]
    functions: list[Function]
    tool_mode: str
    several: bool
    sampling: Callable[[int], SamplingParams]
    max_tokens: int | None
    constraint: Constraint | None = None
    constraint_field: str = "response_format"
    variables: dict[str, Any] | None = None
    logprobs: bool = False
    field: str = "messages"
    budget_field: str = "thinking_token_budget"


async def start_chat(ctx: Context, ask: ChatAsk) -> Call:
    """The chat's prompt rendered, its constraint and tools compiled, its reply's reading (tools, thinking) chosen,
    and its engine request submitted: a request the engine refuses is an HTTP error here, before any response."""
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot chat", param=ask.field)
    functions = ask.functions if ask.tool_mode != "none" else []
    ids = await ctx.off_loop(
        lambda: render_prompt(tokenizer, ask.turns, functions, variables=ask.variables, field=ask.field)
    )
    most = ask.max_tokens if ask.max_tokens is not None else max(ctx.client.max_len - len(ids), 1)
    try:
        params = replace(ask.sampling(most), constraint=ask.constraint, adapter=ask.adapter)
    except InputError as e:
        raise APIError(400, str(e)) from e
    await _compiled(ctx, params.constraint, ask.constraint_field)
    use = await _tool_use(ctx, functions, ask.tool_mode, ask.several)
    if use is not None and use.constraint is not None:
        params = replace(params, constraint=use.constraint)
    reasoning = await ctx.off_loop(lambda: ctx.reasoning(ids))
    if params.reasoning_budget is not None:
        if reasoning is None:
            message = "a thinking budget needs a chat template with thinking blocks (or --reasoning-parser think)"
            raise APIError(400, message, param=ask.budget_field)
        if params.constraint is not None:
            raise APIError(400, "a thinking budget and a structured output cannot both hold", param=ask.budget_field)
        params = replace(params, reasoning=reasoning)
    timeout = ctx.options.request_timeout
    call = Call(
        ctx.client, [ids], params, timeout, ask.field, ctx.names, logprobs=ask.logprobs, tools=use, reasoning=reasoning
    )
    call.start()
    return call


def constraint_of(make: Callable[[], Constraint | None], field: str) -> Constraint | None:
    """A request's constraint, or a 400 naming `field` (a schema that is not JSON, a pattern that does not parse)."""
    try:
        return make()
    except InputError as e:
        raise APIError(400, f"{field}: {e}", param=field) from e


async def _compiled(ctx: Context, constraint: Constraint | None, field: str) -> None:
    """A request's constraint compiled now, off the event loop (a large grammar can take a second); the engine finds
    it in its cache. A 400 naming the field when it cannot be used."""
    if constraint is None:
        return
    try:
        await ctx.off_loop(lambda: ctx.client.compile(constraint))
    except InputError as e:
        raise APIError(400, f"{field}: {e}", param=field) from e


async def _tool_use(ctx: Context, functions: list[Function], mode: str, several: bool) -> ToolUse | None:
    """How the reply's calls are read and, for a forced call, constrained; every function's parameters compiled as a
    schema (a 400 naming `tools` when one is not a usable JSON schema)."""
    if not functions or ctx.tokenizer is None or not ctx.client.structured:
        return None
    fmt = template_format(ctx.tokenizer.chat_template)[1]
    constraint: Constraint | None = None
    try:
        await ctx.off_loop(lambda: ctx.client.compile(call_constraint(functions, fmt, several)))
        if mode != "auto":
            forced = [f for f in functions if mode == "required" or f.name == mode]
            constraint = call_constraint(forced, fmt, several and mode == "required")
            await ctx.off_loop(lambda: ctx.client.compile(constraint))
    except InputError as e:
        raise APIError(400, f"tools: a function's parameters are not a usable JSON schema: {e}", param="tools") from e
    return ToolUse(fmt, {f.name for f in functions}, mode, several, constraint)


def _usage_wanted(body: CompletionRequest | ChatRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _params(body: CompletionRequest, max_tokens: int) -> SamplingParams:
    constraint = constraint_of(body.constraint, body.constraint_field)
    try:
        return replace(body.sampling(max_tokens), constraint=constraint)
    except InputError as e:
        raise APIError(400, str(e)) from e


# ---- adapters loaded and unloaded at run time (vLLM's endpoints)


def adapter_routes(ctx: Context) -> APIRouter:
    """POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter {lora_name}: only on a server
    with an API key (they read the server's disk), and only where it serves adapters (--max-adapters)."""
    router = APIRouter()

    def allowed() -> None:
        if ctx.options.api_key is None:
            raise APIError(403, "loading adapters at run time needs a server started with --api-key")
        if not ctx.client.serves_adapters:
            raise APIError(400, "this server serves no adapters: start it with --max-adapters N (or --adapter)")

    @router.post("/v1/load_lora_adapter")
    async def load(body: LoadAdapter) -> dict[str, Any]:
        allowed()
        if body.lora_name == ctx.options.model_name:
            raise APIError(400, "lora_name: that is the base model's name", param="lora_name")
        try:
            await asyncio.wrap_future(ctx.client.load_adapter(body.lora_name, body.lora_path))
        except InputError as e:
            raise APIError(400, str(e), param="lora_path") from e
        return {"object": "adapter", "id": body.lora_name, "loaded": True}

    @router.post("/v1/unload_lora_adapter")
    async def unload(body: UnloadAdapter) -> dict[str, Any]:
        allowed()
        try:
            await asyncio.wrap_future(ctx.client.unload_adapter(body.lora_name))
        except InputError as e:
            raise APIError(400, str(e), param="lora_name") from e
        return {"object": "adapter", "id": body.lora_name, "loaded": False}

    return router


# ---- embeddings


def embedding_routes(ctx: Context) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        if ctx.check_model(body.model) is not None:
            message = f"embeddings are the base model's: ask for {ctx.options.model_name!r}, not an adapter"
            raise APIError(400, message, param="model")
        limit = ctx.text_limit
        prompts = await ctx.off_loop(lambda: [_encode(ctx.tokenizer, p, "input", limit) for p in body.inputs()])
        data = []
        for i, ids in enumerate(prompts):  # one at a time, between two engine steps: decoding goes on between them
            try:
                vector = await asyncio.wrap_future(ctx.client.embed(ids))
            except Refused as e:
                raise APIError(400, f"input: {e}", param="input") from e
            data.append({"object": "embedding", "index": i, "embedding": _encoded(vector, body.encoding_format)})
        tokens = sum(len(p) for p in prompts)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": body.model, "usage": usage}

    return router


def _encoded(vector: Any, encoding: str) -> list[float] | str:
    """An embedding as OpenAI sends it: a list of floats, or base64 of its little-endian float32 bytes."""
    if encoding == "base64":
        return base64.b64encode(vector.cpu().numpy().astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector.tolist()]


# ---- text in


# how many characters of input one token can stand for, at most, per character of its own text: normalizers that
# compose characters (NFC, NFKC: "e" + U+0301 -> "é", three Hangul jamo -> one syllable) make it more than one
_CHARS_PER_TOKEN_CHAR = 4


@dataclass(frozen=True)
class TextLimit:
    """Characters beyond which a text cannot fit the context's `max_len` tokens: the context times the longest
    token's text (with a margin for normalizers). A 5 MB prompt is then a 400 in microseconds, not seconds of
    tokenizing and hundreds of MB of token objects."""

    max_chars: int
    max_len: int

    @classmethod
    def of(cls, tokenizer: Tokenizer | None, max_len: int) -> TextLimit:
        longest = max((len(t) for t in tokenizer.backend.get_vocab()), default=1) if tokenizer is not None else 1
        return cls(max_len * max(longest, 1) * _CHARS_PER_TOKEN_CHAR, max_len)

    def conversation(self, messages: list[Message]) -> list[dict[str, Any]]:
        """The messages as serve/tools.py takes them, refused untokenized when their text cannot fit."""
        return self.conversation_turns([m.turn() for m in messages], "messages")

    def conversation_turns(self, turns: list[dict[str, Any]], field: str) -> list[dict[str, Any]]:
        """The turns (serve/tools.py's form), refused untokenized when their text cannot fit."""
        calls = (c for m in turns for c in m.get("tool_calls", []))
        self.check(sum(len(m["content"]) for m in turns) + sum(len(c.arguments) for c in calls), field)
        return turns

    def check(self, chars: int, field: str) -> None:
        if chars > self.max_chars:
            message = f"{field}: {chars:,} characters cannot fit the model's context of {self.max_len:,} tokens"
            raise APIError(400, message, param=field)


def _encode(tokenizer: Tokenizer | None, prompt: str | list[int], field: str, limit: TextLimit) -> list[int]:
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


def render_prompt(
    tokenizer: Tokenizer,
    turns: list[dict[str, Any]],
    functions: list[Function] | None = None,
    add_generation_prompt: bool = True,
    variables: dict[str, Any] | None = None,
    field: str = "messages",
) -> list[int]:
    """The prompt's token ids for a conversation and the functions offered (serve/tools.py); variables: more for
    the chat template (a request's chat_template_kwargs); field: the request's field a template error names."""
    takes_tools, _ = template_format(tokenizer.chat_template)
    messages, context = conversation(turns, functions, takes_tools)
    try:
        text = render_chat(tokenizer, messages, add_generation_prompt, variables=variables, **context)
        return tokenizer.encode(text, add_bos=False)
    except (ConfigError, InputError) as e:
        raise APIError(400, f"{field}: {e}", param=field) from e
