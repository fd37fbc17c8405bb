"""The front's client for relaying requests to its worker: HTTP/1.1 over the worker's Unix
socket, connections kept alive in a `WorkerConnections` per worker, responses parsed by
httptools (uvicorn's own parser).

Why not httpx: relaying a small request through httpx's AsyncClient cost the front several
times the CPU of this, on the same cores the worker's engines need (`python -m benchmarks
overhead` reports the front's CPU per request), and importing it cost the idle front 1.6 MiB
(httpx, httpcore, h11, http.cookiejar). The front's own calls (health pings, the config reload,
/metrics) go through `call`. The peer is always
packserve's own worker (uvicorn), so this needs no redirects, cookies, proxies or content
decoding: a request line, headers, a body, and a response read as it comes.

Kept-alive connections: opening and closing a connection for each relayed request took 18% of
the front's samples under 16 single-sentence clients (`python -m benchmarks overhead
--profile`, benchmarks/results/history.md), and the worker paid for it too. A connection goes
back to its pool only after a whole response was read; one whose client left mid-response is
closed, so that the worker sees its client go. The pool drops a connection idle for `IDLE_S`,
well before the worker's own keep-alive timeout (`packserve.worker.KEEP_ALIVE_S`), so the
worker does not close a connection the front is about to use; should it happen anyway,
`request` tries once more on a new connection (its docstring says why that sends nothing
twice).

Any failure of the connection, before or during the response, is an `UpstreamError`: the
front then asks its supervisor whether the worker died (front.app).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence

import httptools

_READ = 1 << 16
IDLE_S = 30.0  # a kept-alive connection idle longer is closed, not used
MAX_IDLE = 64  # kept-alive connections per worker; more are closed when their response ends


class UpstreamError(Exception):
    """The connection to the worker failed: refused, reset, or closed before the response's
    end."""


class _Parser:
    """httptools' callbacks: the head once complete, then the body's pieces as they come."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.done = False
        self.started = False  # a byte of the response came
        self.extra = False  # bytes came after the response's end
        self.keep_alive = False  # the worker may take another request on the connection
        self.http: httptools.HttpResponseParser | None = None
        self.pieces: list[bytes] = []

    def on_message_begin(self) -> None:
        if self.done:  # a second response on the connection: the worker sent what it may not
            self.extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.done:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.done:
            return
        self.head_done = True
        # Here: httptools forgets it once the message is complete, which may be in the same
        # feed as the head.
        self.keep_alive = self.http is not None and self.http.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if not self.done:
            self.pieces.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class WorkerConnections:
    """The front's connections to one worker's socket: idle ones kept alive for the next
    request, newest first. A worker's pool dies with it (`close`); the next worker has another
    socket and another pool."""

    def __init__(self, socket_path: str, *, idle_s: float = IDLE_S, max_idle: int = MAX_IDLE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.socket_path = socket_path
        self._idle_s = idle_s
        self._max_idle = max_idle
        self._clock = clock
        self._idle: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._closed = False
        self.opened = 0  # connections opened over the pool's life

    @property
    def idle(self) -> int:
        return len(self._idle)

    async def connect(self, *, fresh: bool = False
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """An idle connection that is still open (unless `fresh`), else a new one; and whether
        it was used before."""
        self._expire()
        while self._idle and not fresh:
            _, reader, writer = self._idle.pop()
            if _open(reader, writer):
                return reader, writer, True
            writer.close()
        try:
            reader, writer = await asyncio.open_unix_connection(self.socket_path, limit=_READ)
        except OSError as exc:  # refused, or the socket file is gone: the worker is not there
            raise UpstreamError(f"cannot connect to the worker: {exc}") from exc
        self.opened += 1
        return reader, writer, False

    def give_back(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Keep a connection whose response was read to its end, or close it."""
        self._expire()
        if self._closed or len(self._idle) >= self._max_idle or not _open(reader, writer):
            writer.close()
            return
        self._idle.append((self._clock(), reader, writer))

    def _expire(self) -> None:
        """Close the connections idle for longer than `idle_s` (the oldest are first)."""
        limit = self._clock() - self._idle_s
        stale = 0
        while stale < len(self._idle) and self._idle[stale][0] < limit:
            self._idle[stale][2].close()
            stale += 1
        del self._idle[:stale]

    def close(self) -> None:
        """Close the idle connections and keep none from now on (the worker is gone)."""
        self._closed = True
        for _, _, writer in self._idle:
            writer.close()
        self._idle.clear()


def _open(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    return not writer.is_closing() and not reader.at_eof() and reader.exception() is None


class Upstream:
    """One response from the worker, its head read; the body is read by `read` or `chunks`.
    `close` (always call it) gives the connection back to its pool if the response was read
    to its end, else drops it: a worker still generating sees its client go and stops."""

    def __init__(self, pool: WorkerConnections, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, parser: _Parser,
                 http: httptools.HttpResponseParser, head_only: bool) -> None:
        self._pool = pool
        self._reader = reader
        self._writer = writer
        self._parser = parser
        self._http = http
        self.status = http.get_status_code()
        self.headers = parser.headers
        self._done = head_only
        self._closed = False

    def header(self, name: bytes) -> bytes:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return b""

    async def chunks(self) -> AsyncGenerator[bytes]:
        """The body as the worker sends it (chunked transfer coding removed)."""
        while True:
            if self._parser.pieces:
                pieces, self._parser.pieces = self._parser.pieces, []
                yield b"".join(pieces)
            if self._done or self._parser.done:
                return
            await _feed(self._reader, self._http, self._parser)

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if (self._parser.done and not self._parser.extra and not self._done
                and self._parser.keep_alive):
            self._pool.give_back(self._reader, self._writer)
        else:  # mid-response, a HEAD's (no end to see), or the worker said it closes
            self._writer.close()


async def request(pool: WorkerConnections, method: str, target: bytes,
                  headers: Sequence[tuple[bytes, bytes]], body: bytes) -> Upstream:
    """Send one request and read the response's head. `target`: the path and query as the
    client sent them (percent-encoded).

    A kept-alive connection that fails before the first byte of its response is tried once
    more on a new one. The worker cannot have taken the request and stayed up then (it closes
    no connection on its own before `KEEP_ALIVE_S`): either the connection was closed idle
    (the request never read; the new one serves it), or the worker died (the new connect is
    refused, and the crash path decides, as for any request)."""
    head = [method.encode("ascii") + b" " + target + b" HTTP/1.1\r\n"]
    if not any(k.lower() == b"host" for k, _ in headers):
        head.append(b"host: packserve-worker\r\n")
    head.extend(k + b": " + v + b"\r\n" for k, v in headers)
    head.append(b"content-length: %d\r\n\r\n" % len(body))
    message = b"".join(head) + body
    fresh = False
    while True:
        reader, writer, reused = await pool.connect(fresh=fresh)
        parser = _Parser()
        http = parser.http = httptools.HttpResponseParser(parser)
        try:
            writer.write(message)
            await writer.drain()
            while not parser.head_done:
                await _feed(reader, http, parser)
            return Upstream(pool, reader, writer, parser, http, head_only=method == "HEAD")
        except (UpstreamError, OSError) as exc:
            writer.close()
            if reused and not parser.started:
                fresh = True
                continue
            if isinstance(exc, UpstreamError):
                raise
            raise UpstreamError(f"the connection to the worker failed: {exc}") from exc
        except BaseException:  # cancelled (the client left): the worker sees its client go too
            writer.close()
            raise


async def _feed(reader: asyncio.StreamReader, http: httptools.HttpResponseParser,
                parser: _Parser) -> None:
    try:
        data = await reader.read(_READ)
    except OSError as exc:
        raise UpstreamError(f"the connection to the worker broke: {exc}") from exc
    if not data:
        raise UpstreamError("the worker closed the connection before the response's end")
    parser.started = True
    try:
        http.feed_data(data)
    except httptools.HttpParserError as exc:
        if parser.done:  # bytes after the response's end: nothing of this response
            parser.extra = True  # and the connection is not used again
            return
        raise UpstreamError(f"the worker's response could not be read: {exc}") from exc



async def call(pool: WorkerConnections, method: str, path: str, body: bytes = b""
               ) -> tuple[int, bytes]:
    """One whole request of the front's own (not a client's): its status and body. Raises
    `UpstreamError`; the caller bounds it with `asyncio.timeout`."""
    headers = [(b"content-type", b"application/json")] if body else []
    upstream = await request(pool, method, path.encode("ascii"), headers, body)
    try:
        return upstream.status, await upstream.read()
    finally:
        upstream.close()
