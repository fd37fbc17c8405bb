"""The front's client for relaying requests to its worker: HTTP/1.1 over the worker's Unix
socket, one connection per request, responses parsed by httptools (uvicorn's own parser).

Why not httpx: relaying a small request through httpx's AsyncClient cost the front several
times the CPU of this, on the same cores the worker's engines need (`packserve bench overhead`
reports the front's CPU per request), and importing it cost the idle front 1.6 MiB (httpx,
httpcore, h11, http.cookiejar). The front's own calls (health pings, the config reload,
/metrics) go through `call`. The peer is always
packserve's own worker (uvicorn), so this needs no redirects, cookies, proxies or content
decoding: a request line, headers, a body, and a response read as it comes.

Any failure of the connection, before or during the response, is an `UpstreamError`: the
front then asks its supervisor whether the worker died (front.app).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

import httptools

_READ = 1 << 16


class UpstreamError(Exception):
    """The connection to the worker failed: refused, reset, or closed before the response's
    end."""


class _Parser:
    """httptools' callbacks: the head once complete, then the body's pieces as they come."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.done = False
        self.pieces: list[bytes] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class Upstream:
    """One response from the worker, its head read; the body is read by `read` or `chunks`.
    `close` (always call it) drops the connection: a worker still generating sees its client
    go and stops."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 parser: _Parser, http: httptools.HttpResponseParser, head_only: bool) -> None:
        self._reader = reader
        self._writer = writer
        self._parser = parser
        self._http = http
        self.status = http.get_status_code()
        self.headers = parser.headers
        self._done = head_only

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
        self._writer.close()


async def request(socket_path: str, method: str, target: bytes,
                  headers: Sequence[tuple[bytes, bytes]], body: bytes) -> Upstream:
    """Send one request and read the response's head. `target`: the path and query as the
    client sent them (percent-encoded)."""
    try:
        reader, writer = await asyncio.open_unix_connection(socket_path, limit=_READ)
    except OSError as exc:  # refused, or the socket file is gone: the worker is not there
        raise UpstreamError(f"cannot connect to the worker: {exc}") from exc
    try:
        head = [method.encode("ascii") + b" " + target + b" HTTP/1.1\r\n"]
        if not any(k.lower() == b"host" for k, _ in headers):
            head.append(b"host: packserve-worker\r\n")
        head.extend(k + b": " + v + b"\r\n" for k, v in headers)
        head.append(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        writer.write(b"".join(head) + body)
        await writer.drain()
        parser = _Parser()
        http = httptools.HttpResponseParser(parser)
        while not parser.head_done:
            await _feed(reader, http, parser)
        return Upstream(reader, writer, parser, http, head_only=method == "HEAD")
    except UpstreamError:
        writer.close()
        raise
    except OSError as exc:
        writer.close()
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
    try:
        http.feed_data(data)
    except httptools.HttpParserError as exc:
        if parser.done:  # bytes after the response's end: nothing of this response
            return
        raise UpstreamError(f"the worker's response could not be read: {exc}") from exc



async def call(socket_path: str, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """One whole request of the front's own (not a client's): its status and body. Raises
    `UpstreamError`; the caller bounds it with `asyncio.timeout`."""
    headers = [(b"content-type", b"application/json")] if body else []
    upstream = await request(socket_path, method, path.encode("ascii"), headers, body)
    try:
        return upstream.status, await upstream.read()
    finally:
        upstream.close()
