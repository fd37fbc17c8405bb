"""What an edge does to the requests it relays, written once for both edges.

packserve has two edges: the front (`front.app`), which relays to its worker process, and the
pool's entry point (`pool.entry`), which relays to Ray Serve replicas. Both drop the headers
that belong to one hop, answer in OpenAI's error shape, read the `model` a request body names
(to route it, authorize it, or charge a crash to it) and, where the edge enforces API keys'
limits (the pool's entry point; behind the front, the worker does), admit a request against
its key and release it once with the tokens it used. The stream ending after a source dies
mid-stream is `api.stream_end`; the event writer is `api.sse`.

Starlette only: the front imports this module and must import no engine and no FastAPI.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from packserve.api.asgi import error_body
from packserve.auth import Key, KeyLimits
from packserve.errors import PackserveError

# Headers that belong to one hop, not to the request or response being relayed. The client's
# Host goes through, so that what the source writes with it (a redirect) names this server.
HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer",
                  b"upgrade", b"proxy-connection", b"content-length", b"expect"})
# ...and what the edge's own server adds to every response.
HOP_RESPONSE = HOP | {b"date", b"server"}
_REQUEST_ID = b"x-request-id"
_TOTAL = re.compile(rb'"total_tokens"\s*:\s*(\d+)')


def relayed_headers(raw: Iterable[tuple[bytes, bytes]], request_id: str,
                    drop: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
    """A client's request headers as the edge sends them on: without the hop's own and the
    (lower-case) names in `drop`, with `request_id` as the one X-Request-ID."""
    kept = [(k, v) for k, v in raw
            if (name := k.lower()) not in HOP and name != _REQUEST_ID and name not in drop]
    return [*kept, (_REQUEST_ID, request_id.encode("latin-1"))]


def error_response(status: int, message: str, type_: str, code: str | None, *,
                   param: str | None = None, retry_after: float | None = None) -> JSONResponse:
    """An error the edge answers itself, in OpenAI's shape; `retry_after` (seconds, at least
    one) becomes Retry-After."""
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    return JSONResponse(error_body(message, type_, param=param, code=code),
                        status_code=status, headers=headers)


def error_of(exc: PackserveError) -> JSONResponse:
    """`exc` answered as the worker's routes answer it: its status, type, code and headers."""
    return JSONResponse(error_body(exc.message, exc.type, param=exc.param, code=exc.code),
                        status_code=exc.status, headers=exc.headers or None)


async def http_error(_: Request, exc: Exception) -> Response:
    """Starlette's own refusals (a body over the limit, a method a route does not take)."""
    assert isinstance(exc, StarletteHTTPException)
    code = "request_too_large" if exc.status_code == 413 else str(exc.status_code)
    return error_response(exc.status_code, str(exc.detail), "invalid_request_error", code)


def unexpected(log: logging.Logger, edge: str) -> Callable[[Request, Exception],
                                                            Awaitable[Response]]:
    """The handler of an exception nothing else caught: logged with its traceback, a 500."""

    async def handler(_: Request, exc: Exception) -> Response:
        log.exception("%s failed: %s", edge, exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}",
                              "server_error", None)

    return handler


@dataclass(frozen=True)
class Sniffed:
    """What an edge reads of a request body: the model it names (None for a body that is not
    a JSON object with a string `model`) and whether it asks for a stream."""

    model: str | None
    stream: bool = False
    keep_alive: bool = False  # it sets Ollama's keep_alive (an admin key's field)


def sniff(body: bytes) -> Sniffed:
    """The model `body` names and whether it streams. The body is parsed whole: callers that
    need it only after a failure (the front) sniff then, not on the way in."""
    if body[:1] != b"{":
        return Sniffed(None)
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        return Sniffed(None)
    if not isinstance(value, dict) or not isinstance(value.get("model"), str):
        return Sniffed(None)
    return Sniffed(value["model"], value.get("stream") is True,
                   value.get("keep_alive") is not None)


def usage_tokens(body: bytes) -> int:
    """A response's (or an event's) total_tokens; its usage comes last, so the tail is
    searched first. 0 when it reports none."""
    found = _TOTAL.findall(body[-1024:]) or _TOTAL.findall(body)
    return int(found[-1]) if found else 0


class KeyHold:
    """One request's place in its API key's limits, from `admit` to one `release` with the
    tokens its usage reported. A request without a key (keys off) holds nothing."""

    def __init__(self, limits: KeyLimits, key: Key | None) -> None:
        self.limits, self.key = limits, key
        self.tokens = 0
        self.released = False

    @classmethod
    def admit(cls, limits: KeyLimits, key: Key | None) -> KeyHold:
        """Count the request in; RateLimited (429) if its key is over a limit."""
        if key is not None:
            limits.admit(key)
        return cls(limits, key)

    def count(self, chunk: bytes) -> None:
        """Read the tokens used from a relayed body or stream chunk that reports usage."""
        if b'"total_tokens"' in chunk:
            self.tokens = usage_tokens(chunk)

    def release(self) -> None:
        """Give the request back to its key's limits; again is a no-op."""
        if not self.released and self.key is not None:
            self.released = True
            self.limits.release(self.key, self.tokens)
