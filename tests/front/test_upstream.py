"""The front's relay client (front.upstream) against a Unix-socket server that answers with
bytes written here: what it sends, bodies whole and chunked, and every way a connection fails."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from packserve.front.upstream import UpstreamError, request
from tests.factories import fake_config, serve_process

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def run(tmp_path: Path, handler: Handler,
        client: Callable[[str], Awaitable[object]]) -> object:
    sock = str(tmp_path / "w.sock")

    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        finally:  # also when cancelled at the end of the test
            writer.close()

    async def main() -> object:
        server = await asyncio.start_unix_server(closing, path=sock)
        async with server:
            return await asyncio.wait_for(client(sock), 10)

    return asyncio.run(main())


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head, await reader.readexactly(length)


def test_a_request_goes_out_whole_and_its_answer_comes_back(tmp_path: Path) -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n"
                     b"content-length: 12\r\nx-request-id: r1\r\n\r\n{\"ok\": true}")
        await writer.drain()
        writer.close()

    async def client(sock: str) -> object:
        up = await request(sock, "POST", b"/v1/embeddings?x=1",
                           [(b"host", b"example:8000"), (b"x-request-id", b"r1")], b'{"a": 1}')
        try:
            return up.status, up.header(b"content-type"), up.header(b"X-Request-Id"), \
                await up.read()
        finally:
            up.close()

    assert run(tmp_path, handler, client) == (201, b"application/json", b"r1", b'{"ok": true}')
    head, body = seen[0]
    assert head.startswith(b"POST /v1/embeddings?x=1 HTTP/1.1\r\n")
    assert b"host: example:8000\r\n" in head and b"connection: close\r\n" in head
    assert body == b'{"a": 1}'


def test_a_chunked_stream_comes_as_its_pieces_arrive(tmp_path: Path) -> None:
    go_on = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n6\r\ndata 1\r\n")
        await writer.drain()
        await go_on.wait()  # the first piece must reach the client before the second is sent
        writer.write(b"6\r\ndata 2\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def client(sock: str) -> object:
        up = await request(sock, "GET", b"/s", [], b"")
        got = []
        async for piece in up.chunks():
            got.append(piece)
            go_on.set()
        up.close()
        return got

    assert run(tmp_path, handler, client) == [b"data 1", b"data 2"]


def test_a_head_answer_has_no_body_to_wait_for(tmp_path: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 500\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)  # neither body nor close: a client waiting for 500 bytes hangs

    async def client(sock: str) -> object:
        up = await request(sock, "HEAD", b"/", [], b"")
        try:
            return up.status, await up.read()
        finally:
            up.close()

    assert run(tmp_path, handler, client) == (200, b"")


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 200 OK\r\ncontent-le",
                                    b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf",
                                    b"not http at all\r\n\r\n"])
def test_a_connection_that_ends_early_or_garbled_is_an_upstream_error(
        tmp_path: Path, answer: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def client(sock: str) -> object:
        up = await request(sock, "GET", b"/", [], b"")
        try:
            return await up.read()
        finally:
            up.close()

    with pytest.raises(UpstreamError):
        run(tmp_path, handler, client)


def test_no_worker_listening_is_an_upstream_error(tmp_path: Path) -> None:
    async def main() -> None:
        await request(str(tmp_path / "gone.sock"), "GET", b"/", [], b"")

    with pytest.raises(UpstreamError, match="cannot connect"):
        asyncio.run(main())


def test_a_client_that_leaves_closes_the_workers_connection(tmp_path: Path) -> None:
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await reader.read()  # returns at EOF: the relay dropped the connection
        closed.set()
        writer.close()

    async def client(sock: str) -> object:
        up = await request(sock, "GET", b"/", [], b"")
        pieces = up.chunks()
        first = await pieces.__anext__()
        await pieces.aclose()
        up.close()  # what the front's relay does when its own client goes
        await asyncio.wait_for(closed.wait(), 5)
        return first

    assert run(tmp_path, handler, client) == b"a"


def test_the_front_relays_the_path_as_the_client_encoded_it(tmp_path: Path) -> None:
    """A decoded path may hold spaces and any character: the relay sends the client's bytes."""
    with serve_process(fake_config(tmp_path), tmp_path) as srv, srv.client() as c:
        r = c.get("/v1/models/caf%C3%A9%20au%20lait")
        assert r.status_code == 404, r.text
        assert "café au lait" in r.json()["error"]["message"]
        assert c.get("/v1/models", params={"q": "a b&c"}).status_code == 200
