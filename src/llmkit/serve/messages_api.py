"""Anthropic's Messages API on the same engine: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

    MessagesRequest ─► ChatAsk (routes.py: the turns, the tools, the sampling) ─► Call ─► Reply / Pieces
                                                                                  └─► a Message, or its stream events

The request's shape is Anthropic's: a `system` beside the messages, content as a string or blocks (`text`,
`tool_use` in an assistant turn, `tool_result` in a user turn; earlier `thinking` blocks are dropped, as chat templates
drop old reasoning), tools as `{name, description, input_schema}`, `tool_choice` `auto` / `any` / `tool` / `none`,
structured output as `output_config.format` (a JSON schema). A conversation is rendered with the checkpoint's chat
template exactly as the same turns sent to /v1/chat/completions are, so both APIs give the same tokens.

The answer's content blocks: `thinking` (the thinking block, where the chat template has one; its `signature` is empty:
nothing here signs), `text`, then one `tool_use` block per call. stop_reason: `tool_use` when the reply calls,
`max_tokens` at the limit, `stop_sequence` (with the string) when one of `stop_sequences` ended it, `end_turn`
otherwise. usage: `input_tokens` the prompt's tokens the prefix cache did not hold, `cache_read_input_tokens` those it
did (Anthropic's split; the cache here is automatic, so `cache_control` is accepted and changes nothing).

Streams are Anthropic's server-sent events (`event: <type>` lines): message_start, the content blocks' start / delta /
stop (text_delta, thinking_delta, and each tool call's input as one input_json_delta), message_delta with the stop
reason and output tokens, message_stop. Errors are in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}` (api.py chooses the shape by path); a failure after a stream began is an `error` event.

What is refused with a 400 naming the field: images, documents and the server-side tools (web search, code execution:
nothing here runs them), a conversation that ends with an assistant turn (Anthropic's prefill), and every field that
would change the answer in a way llmkit does not implement (`output_config.effort`, `container`, `mcp_servers`...).
`thinking` `{"type": "enabled"}` or `"adaptive"` passes `enable_thinking: true` to the chat template and `"disabled"`
passes false (Qwen3's switch; a template without it is unchanged); `budget_tokens` ends the thinking block after that
many tokens (the reasoning budget of serve/reasoning.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmkit.serve.calls import APIError, Call, Piece, Reply, StreamError
from llmkit.serve.protocol import MAX_INT, MAX_MESSAGES, MAX_PARTS, Text, Unsupported, check_function_schema
from llmkit.serve.request import SamplingParams
from llmkit.serve.routes import ChatAsk, Context, constraint_of, render_prompt, start_chat
from llmkit.serve.structured import Constraint
from llmkit.serve.tools import Function, ToolCall

MAX_STOP_SEQUENCES = 16
# content blocks and tools Anthropic defines that llmkit cannot honour: refused by name
_OTHER_BLOCKS = ("image", "document", "search_result", "server_tool_use", "web_search_tool_result", "container_upload")


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text
    cache_control: dict[str, Any] | None = None  # a caching hint: the prefix cache here is automatic
    citations: Annotated[list[Any] | None, Field(max_length=0)] = None


class ToolUseBlock(BaseModel):
    """An assistant turn's call, as the API returned it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(BaseModel):
    """A user turn's result of one call: text, or text blocks."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | Annotated[list[TextBlock], Field(max_length=MAX_PARTS)] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(BaseModel):
    """An earlier reply's thinking, sent back: dropped (chat templates drop earlier turns' reasoning)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["thinking", "redacted_thinking"]
    thinking: Text | None = None
    signature: Text | None = None
    data: Text | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[Block], Field(max_length=MAX_PARTS)]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        blocks = data.get("content") if isinstance(data, dict) else None
        for block in blocks if isinstance(blocks, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in _OTHER_BLOCKS:
                raise ValueError(f"{kind!r} blocks are not supported by llmkit serve; the models it serves read text")
        return data

    @model_validator(mode="after")
    def _blocks_in_their_turns(self) -> AnthropicMessage:
        blocks = [] if isinstance(self.content, str) else self.content
        if self.role == "user" and any(isinstance(b, ToolUseBlock | ThinkingBlock) for b in blocks):
            raise ValueError("tool_use and thinking blocks belong to assistant turns")
        if self.role == "assistant" and any(isinstance(b, ToolResultBlock) for b in blocks):
            raise ValueError("tool_result blocks belong to user turns")
        return self

    def turns(self) -> list[dict[str, Any]]:
        """The turns serve/tools.py takes: a user turn's tool results become tool turns (first, as Anthropic
        orders them), its text a user turn; an assistant turn's calls its tool_calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
        if self.role == "assistant":
            calls = [ToolCall(b.name, json.dumps(b.input), b.id) for b in self.content if isinstance(b, ToolUseBlock)]
            return [{"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})]
        results = [b for b in self.content if isinstance(b, ToolResultBlock)]
        out = [{"role": "tool", "content": r.text(), "tool_call_id": r.tool_use_id} for r in results]
        if text or not results:
            out.append({"role": "user", "content": text})
        return out


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # the input of a forced call always validates; that of a free one is parsed

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(
                f"server tools ({kind!r}) are not supported by llmkit serve; define the tool's input_schema"
            )
        return data

    @model_validator(mode="after")
    def _an_object(self) -> AnthropicTool:
        check_function_schema(self.input_schema)
        return self


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is given with type 'tool', and only then")
        return self


class Thinking(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("budget_tokens is required with type 'enabled'")
        if self.type != "enabled" and self.budget_tokens is not None:
            raise ValueError("budget_tokens goes with type 'enabled'")
        return self


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: OutputFormat | None = None
    effort: Unsupported = None


class _Conversation(BaseModel):
    """What count_tokens and create share: the conversation and what is rendered with it."""

    model_config = ConfigDict(extra="forbid")
    model: Text
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | Annotated[list[TextBlock], Field(max_length=MAX_PARTS)] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None
    container: Unsupported = None
    mcp_servers: Unsupported = None
    context_management: Unsupported = None

    @model_validator(mode="after")
    def _consistent(self) -> _Conversation:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: names must be unique")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not a tool in tools")
        if choice is not None and choice.type == "any" and not names:
            raise ValueError("tool_choice 'any' needs tools")
        if self.messages[-1].role != "user":
            raise ValueError(
                "messages: the last turn must be the user's; continuing an assistant turn (prefill) is not supported"
            )
        forced = self.tool_mode() not in ("none", "auto")
        if forced and self.output_config is not None and self.output_config.format is not None:
            raise ValueError("a forced tool call and output_config.format cannot both hold")
        return self

    def turns(self) -> list[dict[str, Any]]:
        system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system or [])
        head = [{"role": "system", "content": system}] if self.system is not None else []
        return head + [t for m in self.messages for t in m.turns()]

    def tool_mode(self) -> str:
        choice = self.tool_choice
        if not self.tools or (choice is not None and choice.type == "none"):
            return "none"
        if choice is None or choice.type == "auto":
            return "auto"
        return "required" if choice.type == "any" else str(choice.name)

    def functions(self) -> list[Function]:
        return [Function(t.name, t.description, t.input_schema) for t in self.tools or []]

    def variables(self) -> dict[str, Any] | None:
        """For the chat template: thinking on or off (Qwen3's `enable_thinking`)."""
        return None if self.thinking is None else {"enable_thinking": self.thinking.type != "disabled"}

    def constraint(self) -> Constraint | None:
        fmt = self.output_config.format if self.output_config is not None else None
        return Constraint.json_schema(fmt.schema_) if fmt is not None else None


class MessagesRequest(_Conversation):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1, le=MAX_INT)
    stop_sequences: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=MAX_STOP_SEQUENCES)] = []
    stream: bool = False
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, le=MAX_INT)
    metadata: dict[str, Text | None] | None = Field(None, max_length=16)  # user_id: a label, not shown to the model
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard"] | None = None
    inference_geo: Unsupported = None

    def sampling(self, max_tokens: int) -> SamplingParams:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p if self.top_p is not None and self.top_p < 1.0 else None,
            top_k=self.top_k,
            stop=tuple(self.stop_sequences),
            reasoning_budget=budget,
        )


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: the prompt create would run, counted."""


def messages_routes(ctx: Context) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages")
    async def create(body: MessagesRequest, request: Request) -> Response:
        ask = ChatAsk(
            adapter=ctx.check_model(body.model),
            turns=ctx.text_limit.conversation_turns(body.turns(), "messages"),
            functions=body.functions(),
            tool_mode=body.tool_mode(),
            several=not (body.tool_choice and body.tool_choice.disable_parallel_tool_use),
            sampling=body.sampling,
            max_tokens=body.max_tokens,
            constraint=constraint_of(body.constraint, "output_config"),
            constraint_field="output_config",
            variables=body.variables(),
            budget_field="thinking",
        )
        call = await start_chat(ctx, ask)
        if body.stream:
            return _events(_message_events(call, body.model))
        [reply] = await call.replies(request)
        return JSONResponse(_message(call, body.model, reply))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        tokenizer = ctx.needs_tokenizer("messages")
        turns = ctx.text_limit.conversation_turns(body.turns(), "messages")
        functions = body.functions() if body.tool_mode() != "none" else []
        variables = body.variables()
        ids = await ctx.off_loop(lambda: render_prompt(tokenizer, turns, functions, variables=variables))
        return {"input_tokens": len(ids)}

    return router


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape; its type from the HTTP status, as Anthropic's API names them."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def _stop_reason(reply: Reply | Piece) -> str:
    if reply.calls:
        return "tool_use"
    if reply.reason == "length":
        return "max_tokens"
    return "stop_sequence" if reply.stop is not None else "end_turn"


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": _tool_id(call), "name": call.name, "input": json.loads(call.arguments)}


def _tool_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _usage(call: Call, output_tokens: int) -> dict[str, Any]:
    cached = sum(call.cached)
    return {
        "input_tokens": call.prompt_tokens - cached,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def _message(call: Call, model: str, reply: Reply) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if reply.thought is not None:
        content.append({"type": "thinking", "thinking": reply.thought, "signature": ""})
    if reply.text or not reply.calls:
        content.append({"type": "text", "text": reply.text})
    content += [_tool_use(c) for c in reply.calls]
    return {
        "id": f"msg_{call.id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _stop_reason(reply),
        "stop_sequence": reply.stop,
        "usage": _usage(call, call.completion_tokens),
    }


async def _message_events(call: Call, model: str) -> AsyncIterator[dict[str, Any]]:
    """The stream's events: each content block opened where its first text arrives and closed when the next
    begins (thinking, then text), the calls as whole blocks at the end."""
    start: dict[str, Any] = {
        "id": f"msg_{call.id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(call, 0),
    }
    yield {"type": "message_start", "message": start}
    blocks: list[str] = []  # the kinds of the blocks opened so far; the last one is open

    def opened(kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        """Events that make `kind` the open block (closing the one before)."""
        if blocks and blocks[-1] == kind:
            return []
        events = [{"type": "content_block_stop", "index": len(blocks) - 1}] if blocks else []
        blocks.append(kind)
        return [*events, {"type": "content_block_start", "index": len(blocks) - 1, "content_block": block}]

    async for p in call.pieces():
        if p.thought:
            for event in opened("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                yield event
            yield {"type": "content_block_delta", "index": len(blocks) - 1,
                   "delta": {"type": "thinking_delta", "thinking": p.thought}}  # fmt: skip
        if p.text:
            for event in opened("text", {"type": "text", "text": ""}):
                yield event
            yield {
                "type": "content_block_delta",
                "index": len(blocks) - 1,
                "delta": {"type": "text_delta", "text": p.text},
            }
        if p.reason is None:
            continue
        if not blocks and not p.calls:  # an empty reply is one empty text block, as the whole answer has
            for event in opened("text", {"type": "text", "text": ""}):
                yield event
        for c in p.calls:
            block = {"type": "tool_use", "id": _tool_id(c), "name": c.name, "input": {}}
            for event in opened(f"tool_use {len(blocks)}", block):
                yield event
            yield {"type": "content_block_delta", "index": len(blocks) - 1,
                   "delta": {"type": "input_json_delta", "partial_json": c.arguments}}  # fmt: skip
        if blocks:
            yield {"type": "content_block_stop", "index": len(blocks) - 1}
        yield {"type": "message_delta", "delta": {"stop_reason": _stop_reason(p), "stop_sequence": p.stop},
               "usage": _usage(call, call.completion_tokens)}  # fmt: skip
    yield {"type": "message_stop"}


def _events(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events as Anthropic sends them: `event: <type>` and the JSON; a failure is an error event."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
        except StreamError as e:
            yield f"event: error\ndata: {json.dumps(error_body(e.error.status, e.error.message))}\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


__all__ = ["APIError", "MessagesRequest", "error_body", "messages_routes"]
