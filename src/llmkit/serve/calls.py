"""One HTTP request's work in the engine, and the bodies it answers with.

A completions request becomes one engine request per prompt (each with n sequences), a chat request one; `Call`
submits them, gathers their deltas (aborting them all when the client goes away or the consumer stops early) and
shapes OpenAI's answer: whole JSON, or the chunks of a server-sent-events stream (`sse`), with log-probabilities
(serve/logprobs.py) when asked for. A failure after a stream's status line is sent becomes an error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from llmkit.errors import InputError
from llmkit.serve.engine import QueueFull, Refused
from llmkit.serve.engine_loop import EngineClient
from llmkit.serve.logprobs import CompletionLogprobs, TokenNames, chat_logprobs
from llmkit.serve.reasoning import Reasoning, ReasoningStream
from llmkit.serve.request import Delta, SamplingParams, TokenLogprob, Top
from llmkit.serve.tools import ToolCall, ToolUse

log = logging.getLogger("llmkit.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except StreamError as e:  # the status line is sent already: the failure becomes an error event
            error = {"message": e.error.message, "type": e.error.kind, "param": None, "code": None}
            yield f"data: {json.dumps({'error': error})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _disconnected(request: Request) -> None:
    """Returns when the client of `request` (whose body has been read) goes away."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # the connection is unusable: as good as gone
        log.debug("reading from a client failed; taking it as gone", exc_info=True)


@dataclass
class _Choice:
    """What the deltas of one sequence have added up to."""

    text: str = ""
    reason: str | None = None
    stop: str | None = None  # the stop string that ended it
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[Top] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # the text each token brought (a delta carries one token)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.reason = d.finish_reason or self.reason
        self.stop = d.stop or self.stop
        self.ids += d.token_ids
        self.logprobs += d.logprobs
        self.tops += d.top_logprobs
        self.pieces += [d.text] if d.token_ids else []
        self.prompt_logprobs = d.prompt_logprobs if d.prompt_logprobs is not None else self.prompt_logprobs


@dataclass
class Reply:
    """One sequence's chat reply, read: the answer's text (tool calls taken out), the thinking block's inside (None
    where replies are not split), the calls, the engine's finish reason and the stop string that ended it."""

    text: str
    thought: str | None
    calls: list[ToolCall]
    reason: str | None
    stop: str | None
    ids: list[int]
    logprobs: list[float]
    tops: list[Top]


@dataclass
class Piece:
    """What one delta adds to a streamed chat reply: answer text, thinking text, and with the last piece the
    tool calls, the finish reason and the stop string."""

    index: int  # the sequence's
    text: str
    thought: str
    calls: list[ToolCall]
    reason: str | None
    stop: str | None
    delta: Delta


class Call:
    """The engine requests of one HTTP request (one per prompt, each with n sequences) and their deltas.

    texts: the prompts' own text, for echo and for log-probabilities' text offsets (which count from the start
    of the prompt); logprobs: whether the answer reports log-probabilities; tools: how a chat reply's tool calls
    are read (serve/tools.py), when functions were offered; reasoning: how a chat reply's thinking block is told
    from its answer (serve/reasoning.py), for chat templates that have one."""

    def __init__(
        self,
        client: EngineClient,
        prompts: list[list[int]],
        params: SamplingParams,
        timeout: float,
        field: str,
        names: TokenNames,
        texts: list[str] | None = None,
        echo: bool = False,
        logprobs: bool = False,
        tools: ToolUse | None = None,
        reasoning: Reasoning | None = None,
    ) -> None:
        self.client, self.prompts, self.params, self.timeout, self.field = client, prompts, params, timeout, field
        self.names, self.texts, self.echo, self.logprobs, self.tools = names, texts, echo, logprobs, tools
        self.reasoning = reasoning
        self.id = uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.ids: list[str] = []
        self.queue: asyncio.Queue[tuple[int, Delta] | None] = asyncio.Queue()  # None: the client went away
        self.pending = len(prompts) * params.n
        self.completion_tokens = 0
        self.cached = [0] * len(prompts)  # each prompt's tokens the prefix cache held

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            for i, prompt in enumerate(self.prompts):

                def deliver(d: Delta, i: int = i) -> None:
                    loop.call_soon_threadsafe(self.queue.put_nowait, (i, d))

                self.ids.append(self.client.submit(prompt, self.params, deliver, self.timeout))
        except Refused as e:
            self.abort()
            raise APIError(400, str(e), param=e.param if e.param != "prompt" else self.field) from e
        except InputError as e:
            self.abort()
            raise APIError(400, str(e), param=self.field) from e
        except QueueFull as e:
            self.abort()
            raise APIError(429, str(e), "rate_limit_error") from e

    def abort(self) -> None:
        for request_id in self.ids:
            self.client.cancel(request_id)

    async def deltas(self, request: Request | None = None) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) until every sequence finished; aborts everything if the consumer stops early or,
        given the request, when its client goes away."""
        watcher = None
        if request is not None:

            def gone(future: asyncio.Future[None]) -> None:
                if not future.cancelled():
                    self.queue.put_nowait(None)

            watcher = asyncio.ensure_future(_disconnected(request))
            watcher.add_done_callback(gone)
        try:
            while self.pending:
                item = await self.queue.get()
                if item is None:  # the client went away: nobody is waiting for the rest
                    return
                i, d = item
                if d.finish_reason is not None:
                    self.pending -= 1
                    if d.error is not None:  # the request's own failure (its grammar, its sampling settings)
                        raise APIError(400, d.error)
                    if d.finish_reason in _FAILED:
                        status, message = _FAILED[d.finish_reason]
                        raise APIError(status, message, "server_error")
                self.completion_tokens += len(d.token_ids)
                self.cached[i] = max(self.cached[i], d.cached_tokens)
                yield i * self.params.n + d.index, d
        finally:
            if watcher is not None:
                watcher.cancel()
            if self.pending:
                self.abort()

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage: tokens in and out, and how many of the prompts' the prefix cache held."""
        prompt = self.prompt_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached)},
        }

    async def _collect(self, request: Request) -> list[_Choice]:
        choices = [_Choice() for _ in range(len(self.prompts) * self.params.n)]
        async for k, d in self.deltas(request):
            choices[k].add(d)
        return choices

    def _prompt_of(self, k: int) -> int:
        return k // self.params.n

    def _echo(self, k: int) -> str:
        return self.texts[self._prompt_of(k)] if self.echo and self.texts is not None else ""

    async def completion(self, model: str, request: Request) -> dict[str, Any]:
        choices = []
        for k, c in enumerate(await self._collect(request)):
            logprobs = None
            if self.logprobs:
                lp = self._echoed_logprobs(k, c.prompt_logprobs)
                for token, value, top, piece in zip(c.ids, c.logprobs, c.tops, c.pieces, strict=True):
                    lp.add(token, value, top, piece)
                logprobs = lp.take()
            choices.append(
                {"index": k, "text": self._echo(k) + c.text, "logprobs": logprobs, "finish_reason": c.reason}
            )
        return self._body("text_completion", model, choices) | {"usage": self.usage()}

    def _echoed_logprobs(self, k: int, prompt_logprobs: list[TokenLogprob | None] | None) -> CompletionLogprobs:
        """Choice k's log-probabilities, started: with echo the prompt's tokens (with their log-probabilities when
        they were computed), otherwise only the offset past the prompt's text."""
        prompt = self.prompts[self._prompt_of(k)]
        lp = CompletionLogprobs(self.names)
        if self.echo:
            lp.add_prompt(prompt, prompt_logprobs or [None] * len(prompt))
        elif self.texts is not None:
            lp.offset = len(self.texts[self._prompt_of(k)])
        return lp

    async def replies(self, request: Request) -> list[Reply]:
        """Every sequence's reply, read: its thinking apart, its tool calls out of its text."""
        out = []
        for c in await self._collect(request):
            thought, text = self.reasoning.split(c.text) if self.reasoning is not None else (None, c.text)
            calls: list[ToolCall] = []
            if self.tools is not None:
                content, calls = self.tools.reply(text)
                text = (content or "") if calls else text
            out.append(Reply(text, thought, calls, c.reason, c.stop, c.ids, c.logprobs, c.tops))
        return out

    async def chat(self, model: str, request: Request) -> dict[str, Any]:
        choices = []
        for k, r in enumerate(await self.replies(request)):
            message: dict[str, Any] = {"role": "assistant", "content": r.text}
            if r.calls:
                message = {"role": "assistant", "content": r.text or None, "tool_calls": [x.openai() for x in r.calls]}
            if self.reasoning is not None:
                message["reasoning_content"] = r.thought
            logprobs = chat_logprobs(self.names, r.ids, r.logprobs, r.tops) if self.logprobs else None
            choices.append({"index": k, "message": message, "logprobs": logprobs, "finish_reason": self.ended(r)})
        return self._body("chat.completion", model, choices) | {"usage": self.usage()}

    def ended(self, reply: Reply | Piece) -> str | None:
        """OpenAI's finish reason for a chat reply: "tool_calls" for calls the model chose to make."""
        if self.tools is None or reply.reason is None:
            return reply.reason
        return self.tools.finish_reason(reply.calls, reply.reason)

    async def completion_chunks(self, model: str, usage: bool) -> AsyncIterator[dict[str, Any]]:
        started: dict[int, CompletionLogprobs] = {}  # each choice's, from its first delta on
        async for k, d in self._guarded():
            text = d.text
            if k not in started:  # its first delta: the echoed prompt comes first
                started[k] = self._echoed_logprobs(k, d.prompt_logprobs)
                text = self._echo(k) + text
            logprobs = None
            if self.logprobs:
                lp = started[k]
                for token, value, top in zip(d.token_ids, d.logprobs, d.top_logprobs, strict=True):
                    lp.add(token, value, top, d.text)
                logprobs = lp.take()
            choice = {"index": k, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason}
            yield self._body("text_completion", model, [choice])
        if usage:
            yield self._body("text_completion", model, []) | {"usage": self.usage()}

    async def pieces(self) -> AsyncIterator[Piece]:
        """What each delta adds to its sequence's reply, read as it arrives: the thinking block apart, prose that may
        be a tool call held to the end and parsed there (a stream: failures are StreamError)."""
        choices = range(len(self.prompts) * self.params.n)
        streams = {k: self.tools.stream() for k in choices} if self.tools else {}
        thoughts = {k: ReasoningStream(self.reasoning) for k in choices} if self.reasoning else {}
        async for k, d in self._guarded():
            text, reason, thought = d.text, d.finish_reason, ""
            if self.reasoning is not None:
                thought, text = thoughts[k].push(text)
                if reason is not None:
                    more_thought, more_text = thoughts[k].end()
                    thought, text = thought + more_thought, text + more_text
            calls: list[ToolCall] = []
            if self.tools is not None:
                text = streams[k].push(text)
                if reason is not None:
                    rest, calls = self.tools.end(streams[k])
                    text += rest
            yield Piece(k, text, thought, calls, reason, d.stop, d)

    async def chat_chunks(self, model: str, usage: bool) -> AsyncIterator[dict[str, Any]]:
        for k in range(len(self.prompts) * self.params.n):
            first = {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield self._body("chat.completion.chunk", model, [first])
        async for p in self.pieces():
            k, text, thought, d = p.index, p.text, p.thought, p.delta
            delta: dict[str, Any] = {"content": text} if text or (p.reason is None and not thought) else {}
            if thought:
                delta["reasoning_content"] = thought
            logprobs = chat_logprobs(self.names, d.token_ids, d.logprobs, d.top_logprobs) if self.logprobs else None
            if p.calls:  # OpenAI's shape: the calls, each whole, in a delta of their own before the finish reason
                if text:
                    choice = {"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": None}
                    yield self._body("chat.completion.chunk", model, [choice])
                delta, logprobs = {"tool_calls": [x.openai(i) for i, x in enumerate(p.calls)]}, None
            choice = {"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": self.ended(p)}
            yield self._body("chat.completion.chunk", model, [choice])
        if usage:
            yield self._body("chat.completion.chunk", model, []) | {"usage": self.usage()}

    async def _guarded(self) -> AsyncIterator[tuple[int, Delta]]:
        """Deltas for a stream: the status line is sent already, so a failure becomes an error event."""
        try:
            async for item in self.deltas():
                yield item
        except APIError as e:
            raise StreamError(e) from e

    def _body(self, kind: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
        return {
            "id": f"{prefix}-{self.id}",
            "object": kind,
            "created": self.created,
            "model": model,
            "choices": choices,
        }


class StreamError(Exception):
    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


# finish reasons that are failures: the HTTP status and message the client gets
_FAILED = {
    "timeout": (504, "the request ran past the server's time limit"),
    "error": (500, "the engine failed on this request"),
    "shutdown": (503, "the server shut down before the request finished"),
}
