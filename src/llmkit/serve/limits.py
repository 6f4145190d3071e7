"""Limits on what one HTTP connection can make the server hold: body size, and time to send headers and body.

    client ──► h11 connection ─────────────► ASGI app
               HeaderTimeout:                BodyLimits:
               the request line and headers  Content-Length above max_body -> 413 before a byte is read;
               within header_timeout s,      more bytes than that as they arrive -> 413;
               else the connection closes    the whole body within body_timeout s, else 408

Without these a client that promises a large Content-Length and sends a few bytes holds a socket, a file descriptor
and a task for as long as it likes (2,000 such connections held 2,000 descriptors), and a 5 MB body was parsed and
tokenized before any check. Both errors close the connection: its unread bytes would otherwise be taken for the
next request.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

import h11
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

Scope = dict[str, Any]
Message = dict[str, Any]


class BodyRefused(HTTPException):
    """The body broke a limit (status 408 or 413), raised from `receive` inside the app: an HTTPException, so that
    the framework's body reader passes it on as it is, answered with the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message, headers={"connection": "close"})
        self.status, self.message = status, message


def openai_error(path: str, status: int, message: str) -> dict[str, Any]:
    """An error body in OpenAI's shape (whatever the path)."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


class BodyLimits:
    """ASGI middleware: at most `max_body` bytes of body, all of them within `body_timeout` seconds. `shape` writes
    a refusal's body for the request's path (each API has its own error shape)."""

    def __init__(
        self, app: Any, max_body: int, body_timeout: float, shape: Callable[[str, int, str], Any] = openai_error
    ) -> None:
        self.app, self.max_body, self.body_timeout, self.shape = app, max_body, body_timeout, shape

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await _refuse(send, 413, self.shape(scope["path"], 413, self._too_large(int(declared))))
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        received, body_done, started = 0, False, False
        brackets, held = 0, []  # a body with enough brackets to nest past MAX_JSON_DEPTH is checked whole

        async def limited_receive() -> Message:
            nonlocal received, body_done, brackets
            if body_done:  # after the body: only a disconnect can come, whenever it comes
                return dict(await receive())
            try:
                message = dict(await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0)))
            except TimeoutError:
                raise BodyRefused(408, f"the request body did not arrive within {self.body_timeout:g} s") from None
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > self.max_body:
                    raise BodyRefused(413, self._too_large(received, at_least=True))
                brackets += chunk.count(b"[") + chunk.count(b"{")
                held.append(chunk)
                body_done = not message.get("more_body", False)
                if body_done:
                    deep = brackets > MAX_JSON_DEPTH and too_deep(b"".join(held))
                    held.clear()
                    if deep:
                        raise BodyRefused(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels of JSON")
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyRefused as e:
            if started:  # cannot happen for these routes (they read the body first); close rather than lie
                raise
            await _refuse(send, e.status, self.shape(scope["path"], e.status, e.message))

    def _too_large(self, size: int, at_least: bool = False) -> str:
        return (
            f"the request body is {'more than ' if at_least else ''}{size:,} bytes; this server takes at most "
            f"{self.max_body:,} (llmkit serve --max-body-size)"
        )


# Python's JSON parser recurses once a level: past about sys.getrecursionlimit() levels it fails, and FastAPI says
# only "There was an error parsing the body"
MAX_JSON_DEPTH = 512


def too_deep(body: bytes) -> bool:
    """Whether the JSON text `body` nests more than MAX_JSON_DEPTH levels (brackets inside strings not counted).
    Run only on bodies holding that many brackets; a body that is not JSON is FastAPI's to refuse."""
    depth = 0
    for token in re.finditer(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', body):
        t = token.group()
        if t in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return True
        elif t in (b"]", b"}"):
            depth -= 1
    return False


async def _refuse(send: Any, status: int, error: Any) -> None:
    """An error (its JSON body) that closes the connection (the rest of the body is never read)."""
    body = json.dumps(error).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class HeaderTimeout(H11Protocol):
    """uvicorn's h11 connection, closed when a request's line and headers take longer than `header_timeout` s.

    uvicorn times out idle keep-alive connections, but not one that has started a request and stalls in its
    headers (slowloris). The timer starts when the connection opens and again when a response completes; when it
    fires it closes the connection only if the peer is still mid-headers (h11's state for them is IDLE until the
    whole head has arrived)."""

    header_timeout = 30.0  # set by `with_header_timeout`
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(first=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm(first=False)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm(self, first: bool) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late, first)

    def _headers_late(self, first: bool) -> None:
        """Close the connection if its next request has not been handed to the app yet: on a new connection, if
        none has (a peer that connects and sends nothing, or half a head); on a kept-alive one, if the next head
        has started and not finished (an idle kept-alive connection is uvicorn's keep-alive timer's to close)."""
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return
        if not first and not self.conn.trailing_data[0]:
            return
        self.logger.info("closing a connection whose request headers took longer than %g s", self.header_timeout)
        self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderTimeout]:
    """The connection class for uvicorn's Config(http=...), with this header timeout."""
    return type("HeaderTimeoutProtocol", (HeaderTimeout,), {"header_timeout": seconds})
