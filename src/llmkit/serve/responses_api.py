"""OpenAI's Responses API on the same engine: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

    ResponsesRequest ─► ChatAsk (routes.py) ─► Call ─► Reply / Pieces ─► a response object, or its stream events
          ▲                                                                       │
          └──────────── previous_response_id: the stored conversation ◄──────────┘ (store, default true)

`input` is a string or a list of items: messages (roles user, system, developer, assistant; `input_text` /
`output_text` parts), `function_call` items (an earlier reply's calls) and `function_call_output` items (their
results); earlier `reasoning` items are dropped, as chat templates drop old reasoning. `instructions` is a system
message for this response only (OpenAI's rule: it is not carried to the next). Tools are `{type: "function", name,
description, parameters}`; `tool_choice` none / auto / required / a named function; `text.format` text, json_object or
json_schema. The conversation is rendered with the checkpoint's chat template as /v1/chat/completions renders the same
turns.

The output items: `reasoning` (where the chat template has thinking blocks: its text as `reasoning_text` content),
`message` with one `output_text` part, then one `function_call` item per call. `status` is "completed", or
"incomplete" with `incomplete_details.reason` "max_output_tokens" when the limit ended it. Streams are the API's
typed events (`event: <type>`, each with its `sequence_number`): response.created, response.in_progress, each item's
output_item.added / content_part.added / output_text.delta (or reasoning_text.delta, function_call_arguments.delta) /
.done events, and response.completed (or response.incomplete; response.failed after a failure).

Stored responses (`store`, true by default) live in memory, least recently used dropped past `stored_responses`
(ServeOptions) or past `stored_characters` of conversation text, and are gone at a restart; a `previous_response_id`
that is not stored is a 404 saying so. Errors are OpenAI's shape, like the rest of the API.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from llmkit.serve.calls import APIError, Call, Piece, Reply, StreamError
from llmkit.serve.protocol import (
    INT64,
    MAX_INT,
    MAX_MESSAGES,
    MAX_PARTS,
    FunctionModel,
    JSONSchemaFormat,
    NamedFunction,
    Text,
    Unsupported,
)
from llmkit.serve.request import SamplingParams
from llmkit.serve.routes import ChatAsk, Context, constraint_of, start_chat
from llmkit.serve.structured import Constraint
from llmkit.serve.tools import Function, ToolCall

_OTHER_PARTS = ("input_image", "input_file", "input_audio")
_OTHER_ITEMS = (
    "item_reference", "file_search_call", "web_search_call", "computer_call", "computer_call_output",
    "image_generation_call", "code_interpreter_call", "local_shell_call", "mcp_call", "custom_tool_call",
)  # fmt: skip


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text", "refusal", "summary_text", "reasoning_text"]
    text: Text | None = None
    refusal: Text | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind in _OTHER_PARTS:
            raise ValueError(f"{kind!r} parts are not supported by llmkit serve; the models it serves read text")
        return data


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[InputText], Field(max_length=MAX_PARTS)]
    id: Text | None = None
    status: Text | None = None

    def turn(self) -> dict[str, Any]:
        parts = [self.content] if isinstance(self.content, str) else [p.text or "" for p in self.content]
        return {"role": "system" if self.role == "developer" else self.role, "content": "".join(parts)}


class FunctionCallItem(BaseModel):
    """An earlier reply's call, as the API returned it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionOutputItem(BaseModel):
    """A call's result."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | Annotated[list[InputText], Field(max_length=MAX_PARTS)]
    id: Text | None = None
    status: Text | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text or "" for p in self.output)


class ReasoningItem(BaseModel):
    """An earlier reply's reasoning, sent back: dropped."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[InputText] = []
    content: list[InputText] | None = None
    encrypted_content: Text | None = None
    status: Text | None = None


Item = Annotated[MessageItem | FunctionCallItem | FunctionOutputItem | ReasoningItem, Field(discriminator="type")]


def _typed(item: Any) -> Any:
    """An item without `type` is a message (the API's easy form); the API's other item kinds are refused by name."""
    if isinstance(item, dict) and "type" not in item and "role" in item:
        return {"type": "message", **item}
    kind = item.get("type") if isinstance(item, dict) else None
    if kind in _OTHER_ITEMS:
        raise ValueError(f"{kind!r} items are not supported by llmkit serve")
    return item


class FunctionTool(FunctionModel):
    """A function tool, flat as the Responses API has it ({type, name, description, parameters, strict}); the API's
    built-in tools are refused by name."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind != "function":
            raise ValueError(f"{kind!r} tools are not supported by llmkit serve; define functions (type 'function')")
        return data


class NamedFunctionChoice(NamedFunction):
    """tool_choice naming one function, flat as the Responses API has it."""

    type: Literal["function"]


class TextFormat(BaseModel):
    """text.format: plain text, any JSON object, or JSON valid for a schema (the Responses API's flat form)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _named_schema(self) -> TextFormat:
        if self.type == "json_schema":
            JSONSchemaFormat(name=self.name or "", schema=self.schema_)  # the same rules as chat's response_format
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "json_object":
            return Constraint.json_schema({"type": "object"})
        if self.type == "json_schema":
            return Constraint.json_schema(self.schema_ or {"type": "object"})
        return None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Unsupported = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="forbid")
    model: Text
    input: (
        Text | Annotated[list[Annotated[Item, BeforeValidator(_typed)]], Field(min_length=1, max_length=MAX_MESSAGES)]
    )
    instructions: Text | None = None
    previous_response_id: Text | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    metadata: dict[str, Text] | None = Field(None, max_length=16)
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None
    include: Annotated[list[str] | None, Field(max_length=0)] = None
    stream_options: dict[str, Any] | None = None
    background: Literal[False] | None = None
    reasoning: Unsupported = None
    max_tool_calls: Unsupported = None
    conversation: Unsupported = None
    prompt: Unsupported = None
    top_logprobs: Unsupported = None
    # the extensions the chat endpoint takes too
    top_k: int = Field(-1, ge=-1, le=MAX_INT)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=16)
    thinking_token_budget: int | None = Field(None, ge=1, le=MAX_INT)

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesRequest:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(choice, NamedFunctionChoice) and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not a function in tools")
        if self.tool_mode() not in ("none", "auto") and self.constraint() is not None:
            raise ValueError("a forced tool call and a text.format cannot both hold")
        taken = sorted(set(self.chat_template_kwargs or {}) & {"messages", "tools", "add_generation_prompt"})
        if taken:
            raise ValueError(f"chat_template_kwargs: {', '.join(taken)} set by the server")
        return self

    def turns(self) -> list[dict[str, Any]]:
        """This request's input as turns: consecutive calls join the assistant turn before them (or one of their
        own), results become tool turns."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        turns: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                turns.append(item.turn())
            elif isinstance(item, FunctionCallItem):
                if not turns or turns[-1]["role"] != "assistant":
                    turns.append({"role": "assistant", "content": ""})
                turns[-1].setdefault("tool_calls", []).append(ToolCall(item.name, item.arguments, item.call_id))
            elif isinstance(item, FunctionOutputItem):
                turns.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
        return turns

    def tool_mode(self) -> str:
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedFunctionChoice):
            return self.tool_choice.name
        return self.tool_choice or "auto"

    def functions(self) -> list[Function]:
        return [
            Function(t.name, t.description, t.parameters or {"type": "object", "properties": {}})
            for t in self.tools or []
        ]

    def constraint(self) -> Constraint | None:
        fmt = self.text.format if self.text is not None else None
        return fmt.constraint() if fmt is not None else None

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p if self.top_p < 1.0 else None,
            top_k=self.top_k if self.top_k > 0 else None,
            min_p=self.min_p if self.min_p > 0 else None,
            seed=self.seed,
            priority=self.priority,
            reasoning_budget=self.thinking_token_budget,
        )


@dataclass
class Stored:
    body: dict[str, Any]  # the response object, as GET returns it
    turns: list[dict[str, Any]]  # the conversation it ended (without its instructions), for previous_response_id
    chars: int


class ResponseStore:
    """Responses kept for previous_response_id and GET, least recently used dropped past `most` of them or past
    `most_chars` characters of conversation text."""

    def __init__(self, most: int, most_chars: int) -> None:
        self.most, self.most_chars = most, most_chars
        self.kept: OrderedDict[str, Stored] = OrderedDict()
        self.chars = 0

    def put(self, body: dict[str, Any], turns: list[dict[str, Any]]) -> None:
        chars = sum(len(t["content"]) + sum(len(c.arguments) for c in t.get("tool_calls", [])) for t in turns)
        self.drop(body["id"])
        self.kept[body["id"]] = Stored(body, turns, chars)
        self.chars += chars
        while self.kept and (len(self.kept) > self.most or self.chars > self.most_chars):
            self.drop(next(iter(self.kept)))

    def get(self, response_id: str) -> Stored | None:
        found = self.kept.get(response_id)
        if found is not None:
            self.kept.move_to_end(response_id)
        return found

    def drop(self, response_id: str) -> bool:
        gone = self.kept.pop(response_id, None)
        if gone is not None:
            self.chars -= gone.chars
        return gone is not None


def responses_routes(ctx: Context) -> APIRouter:
    router = APIRouter()
    store = ResponseStore(ctx.options.stored_responses, ctx.options.stored_characters)

    @router.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Response:
        adapter = ctx.check_model(body.model)
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            found = store.get(body.previous_response_id)
            if found is None:
                message = (
                    f"previous_response_id: no stored response has the id {body.previous_response_id!r} (responses "
                    "are kept in memory, the least recently used dropped past a bound, none across a restart)"
                )
                raise APIError(404, message, param="previous_response_id")
            earlier = found.turns
        own = earlier + body.turns()
        head = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        ask = ChatAsk(
            adapter=adapter,
            turns=ctx.text_limit.conversation_turns(head + own, "input"),
            functions=body.functions(),
            tool_mode=body.tool_mode(),
            several=body.parallel_tool_calls is not False,
            sampling=body.sampling,
            max_tokens=body.max_output_tokens,
            constraint=constraint_of(body.constraint, "text.format"),
            constraint_field="text.format",
            variables=body.chat_template_kwargs,
            field="input",
        )
        call = await start_chat(ctx, ask)
        shape = _Shape(call, body)

        def keep(reply: Reply, answer: dict[str, Any]) -> None:
            if body.store:
                turn = {"role": "assistant", "content": reply.text} | (
                    {"tool_calls": reply.calls} if reply.calls else {}
                )
                store.put(answer, [*own, turn])

        if body.stream:
            return _events(shape.events(keep))
        [reply] = await call.replies(request)
        answer = shape.response(reply)
        keep(reply, answer)
        return JSONResponse(answer)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        found = store.get(response_id)
        if found is None:
            raise APIError(404, f"no stored response has the id {response_id!r}", param="response_id")
        return found.body

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        if not store.drop(response_id):
            raise APIError(404, f"no stored response has the id {response_id!r}", param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    return router


class _Shape:
    """One request's response object and stream events."""

    def __init__(self, call: Call, body: ResponsesRequest) -> None:
        self.call, self.body = call, body
        self.id = f"resp_{call.id}"
        self.created = int(time.time())
        self.sequence = 0

    def head(self, status: str) -> dict[str, Any]:
        """The response object's fields but its output, usage and status's details."""
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        choice = b.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": b.model,
            "output": [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": b.store,
            "temperature": b.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "top_p": b.top_p,
            "truncation": "disabled",
            "metadata": b.metadata or {},
            "user": b.user,
            "usage": None,
        }

    def usage(self) -> dict[str, Any]:
        call = self.call
        return {
            "input_tokens": call.prompt_tokens,
            "input_tokens_details": {"cached_tokens": sum(call.cached)},
            "output_tokens": call.completion_tokens,
            "total_tokens": call.prompt_tokens + call.completion_tokens,
        }

    def finished(self, reply: Reply | Piece, output: list[dict[str, Any]]) -> dict[str, Any]:
        incomplete = reply.reason == "length"
        body = self.head("incomplete" if incomplete else "completed") | {"output": output, "usage": self.usage()}
        if incomplete:
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body

    def response(self, reply: Reply) -> dict[str, Any]:
        output = []
        if reply.thought is not None:
            output.append(_reasoning(self.id, reply.thought, "completed"))
        if reply.text or not reply.calls:
            output.append(_message(self.id, reply.text, "completed"))
        output += [_function_call(c, "completed") for c in reply.calls]
        return self.finished(reply, output)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    async def events(self, keep: Any) -> AsyncIterator[dict[str, Any]]:
        """The stream: an item is added where its first text arrives and done when the next begins."""
        yield self.event("response.created", response=self.head("in_progress"))
        yield self.event("response.in_progress", response=self.head("in_progress"))
        output: list[dict[str, Any]] = []
        texts: list[str] = []  # each item's text so far
        thought, answer = "", ""
        try:
            async for p in self.call.pieces():
                if p.thought:
                    for e in self._grow(output, texts, "reasoning", p.thought):
                        yield e
                    thought += p.thought
                if p.text:
                    for e in self._grow(output, texts, "message", p.text):
                        yield e
                    answer += p.text
                if p.reason is None:
                    continue
                if not output and not p.calls:
                    for e in self._grow(output, texts, "message", ""):
                        yield e
                for e in self._close(output, texts):
                    yield e
                for c in p.calls:
                    item = _function_call(c, "in_progress") | {"arguments": ""}
                    output.append(item)
                    at = len(output) - 1
                    yield self.event("response.output_item.added", output_index=at, item=item)
                    yield self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                     delta=c.arguments)  # fmt: skip
                    yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                     name=c.name, arguments=c.arguments)  # fmt: skip
                    output[at] = _function_call(c, "completed")
                    yield self.event("response.output_item.done", output_index=at, item=output[at])
                reply = Reply(answer, thought if self.call.reasoning else None, p.calls, p.reason, p.stop, [], [], [])
                final = self.finished(reply, output)
                keep(reply, final)
                kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                yield self.event(kind, response=final)
        except StreamError as e:
            failed = self.head("failed") | {
                "output": output,
                "error": {"code": "server_error", "message": e.error.message},
            }
            yield self.event("response.failed", response=failed)

    def _grow(self, output: list[dict[str, Any]], texts: list[str], kind: str, text: str) -> list[dict[str, Any]]:
        """Events adding `text` to the open item of `kind` (closing the one before it, opening it if need be)."""
        events = []
        if not output or output[-1]["type"] != kind:
            events += self._close(output, texts)
            item = (
                _reasoning(self.id, "", "in_progress") if kind == "reasoning" else _message(self.id, "", "in_progress")
            )
            item = item | {"content": []}
            output.append(item)
            texts.append("")
            at = len(output) - 1
            events.append(self.event("response.output_item.added", output_index=at, item=item))
            if kind == "message":
                events.append(self.event("response.content_part.added", item_id=item["id"], output_index=at,
                                         content_index=0, part=_text_part("")))  # fmt: skip
        at = len(output) - 1
        texts[at] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, item_id=output[at]["id"], output_index=at, content_index=0, delta=text, **extra))
        return events

    def _close(self, output: list[dict[str, Any]], texts: list[str]) -> list[dict[str, Any]]:
        """Events ending the open text item, if there is one."""
        if not output or output[-1]["type"] not in ("reasoning", "message") or output[-1].get("status") == "completed":
            return []
        at, item = len(output) - 1, output[-1]
        text = texts[at]
        if item["type"] == "reasoning":
            done = _reasoning(self.id, text, "completed")
            events = [self.event("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                                 text=text)]  # fmt: skip
        else:
            done = _message(self.id, text, "completed")
            events = [
                self.event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                           part=_text_part(text)),
            ]  # fmt: skip
        done = done | {"id": item["id"]}
        output[at] = done
        events.append(self.event("response.output_item.done", output_index=at, item=done))
        return events


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(response_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + response_id.removeprefix("resp_"), "status": status,
            "role": "assistant", "content": [_text_part(text)]}  # fmt: skip


def _reasoning(response_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": "rs_" + response_id.removeprefix("resp_"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}  # fmt: skip


def _function_call(call: ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}  # fmt: skip


def _events(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
