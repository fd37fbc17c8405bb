"""ASGI pieces shared by the front process and the worker: error shape, request ids, body limit,
and cancellation when the client goes away.

Nothing here imports an engine, the scheduler or a metrics library: the front process, which
must stay light, uses it as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
# The id of the request being served, set by `RequestId` for everything the request runs.
REQUEST_ID: ContextVar[str] = ContextVar("packserve_request_id", default="")
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")



def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def request_id_of(scope: Scope) -> str:
    """The client's X-Request-ID if it is a sane token, else a fresh one."""
    for key, value in scope.get("headers", []):
        if key == b"x-request-id":
            text = bytes(value).decode("latin-1")
            if _CLIENT_ID.match(text):
                return text
    return new_request_id()


class RequestId:
    """Give every request an id (the client's `X-Request-ID`, or a new one), expose it to the
    code that serves the request through `REQUEST_ID`, and return it on every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_of(scope)
        token = REQUEST_ID.set(rid)
        header = (b"x-request-id", rid.encode("latin-1"))

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != header[0]]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            REQUEST_ID.reset(token)


class CancelOnDisconnect:
    """Cancel the request's handler when its client goes away before the response is complete.

    Starlette notices a disconnect only while it streams a response; a handler that waits for a
    model's load or for a slot would go on and take memory for nobody. Once the body has been
    read, this watches the connection and cancels the handler's task when it closes; the
    handler sees `CancelledError` (counted as 499, `CLIENT_CLOSED`). `on_cancel` is told.
    """

    def __init__(self, app: ASGIApp, on_cancel: Callable[[Scope], None] | None = None) -> None:
        self.app = app
        self.on_cancel = on_cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_read = asyncio.Event()
        disconnected = asyncio.Event()
        complete = False

        async def receiving() -> Message:
            if body_read.is_set():  # only the watcher reads the connection from now on
                await disconnected.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected.set()
                body_read.set()
            elif not message.get("more_body", False):
                body_read.set()
            return message

        async def sending(message: Message) -> None:
            nonlocal complete
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        async def serve() -> None:
            await self.app(scope, receiving, sending)

        handler = asyncio.create_task(serve())

        async def watch() -> None:
            await body_read.wait()
            while not disconnected.is_set():
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
            if not complete and not handler.done():
                if self.on_cancel is not None:
                    self.on_cancel(scope)
                handler.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await asyncio.shield(handler)
        except asyncio.CancelledError:
            if not handler.cancelled():  # we were cancelled ourselves: pass it on
                handler.cancel()
                with contextlib.suppress(BaseException):
                    await handler
                raise
        finally:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher


class BodyLimit:
    """Refuse request bodies over `max_bytes` with 413, before anything parses them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self.refuse(send, int(declared))
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise TooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)

    async def refuse(self, send: Send, size: int) -> None:
        response = JSONResponse(error_body(
            f"request body is {size} bytes; this server accepts at most {self.max_bytes} "
            f"(server.max_request_bytes)", "invalid_request_error", code="request_too_large"),
            status_code=413)
        await response({"type": "http"}, _no_receive, send)


class TooLarge(StarletteHTTPException):
    """Raised while reading a body with no Content-Length; the 413 handler formats it."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body is over {max_bytes} bytes, more than this server "
                              f"accepts (server.max_request_bytes)")


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
