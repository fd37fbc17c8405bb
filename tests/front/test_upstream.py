"""The front's relay client (front.upstream) against a Unix-socket server that answers with
bytes written here: what it sends, bodies whole and chunked, every way a connection fails, and
which connections are kept alive for the next request."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from packserve.front.upstream import UpstreamError, WorkerConnections, request
from tests.factories import fake_config, serve_process

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
POOLS: list[WorkerConnections] = []


def pool_of(sock: str, **kwargs: Any) -> WorkerConnections:
    """A pool that `run` closes at the end."""
    POOLS.append(WorkerConnections(sock, **kwargs))
    return POOLS[-1]


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
            try:
                return await asyncio.wait_for(client(sock), 10)
            finally:
                for pool in POOLS:  # what the supervisor does when its worker goes
                    pool.close()
                POOLS.clear()

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
        up = await request(pool_of(sock), "POST", b"/v1/embeddings?x=1",
                           [(b"host", b"example:8000"), (b"x-request-id", b"r1")], b'{"a": 1}')
        try:
            return up.status, up.header(b"content-type"), up.header(b"X-Request-Id"), \
                await up.read()
        finally:
            up.close()

    assert run(tmp_path, handler, client) == (201, b"application/json", b"r1", b'{"ok": true}')
    head, body = seen[0]
    assert head.startswith(b"POST /v1/embeddings?x=1 HTTP/1.1\r\n")
    assert b"host: example:8000\r\n" in head and b"connection:" not in head  # kept alive
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
        up = await request(pool_of(sock), "GET", b"/s", [], b"")
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
        up = await request(pool_of(sock), "HEAD", b"/", [], b"")
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
        up = await request(pool_of(sock), "GET", b"/", [], b"")
        try:
            return await up.read()
        finally:
            up.close()

    with pytest.raises(UpstreamError):
        run(tmp_path, handler, client)


def test_no_worker_listening_is_an_upstream_error(tmp_path: Path) -> None:
    async def main() -> None:
        await request(WorkerConnections(str(tmp_path / "gone.sock")), "GET", b"/", [], b"")

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
        up = await request(pool_of(sock), "GET", b"/", [], b"")
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


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def serving(answers: list[bytes], connections: list[int]) -> Handler:
    """A handler answering requests on one connection in turn, for as long as it stays open;
    `connections` gets one entry per connection, the number of requests it carried."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(0)
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:  # the client closed it
                return
            connections[-1] += 1
            writer.write(answers.pop(0))
            await writer.drain()
    return handler


async def fetch(pool: WorkerConnections) -> bytes:
    up = await request(pool, "POST", b"/x", [], b"{}")
    try:
        return await up.read()
    finally:
        up.close()


def test_a_connection_whose_answer_was_read_whole_carries_the_next_request(
        tmp_path: Path) -> None:
    connections: list[int] = []

    async def client(sock: str) -> object:
        pool = pool_of(sock)
        got = [await fetch(pool) for _ in range(3)]
        return got, pool.opened, pool.idle

    assert run(tmp_path, serving([OK] * 3, connections), client) == ([b"ok"] * 3, 1, 1)
    assert connections == [3]


def test_a_connection_is_not_used_again_when_its_answer_was_not_read_to_the_end(
        tmp_path: Path) -> None:
    """A relay whose client left closes the connection (the worker must see it go): it never
    returns to the pool."""
    connections: list[int] = []
    started = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n"

    async def client(sock: str) -> object:
        pool = pool_of(sock)
        up = await request(pool, "POST", b"/x", [], b"{}")
        assert await up.chunks().__anext__() == b"a"
        up.close()
        await fetch(pool)
        return pool.opened

    assert run(tmp_path, serving([started, OK], connections), client) == 2
    assert connections == [1, 1]


def test_a_worker_that_says_it_closes_gets_a_new_connection_next_time(tmp_path: Path) -> None:
    connections: list[int] = []
    closing = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"

    async def client(sock: str) -> object:
        pool = pool_of(sock)
        return [await fetch(pool), await fetch(pool)], pool.opened

    assert run(tmp_path, serving([closing, OK], connections), client) == ([b"ok"] * 2, 2)


def test_an_idle_connection_is_dropped_before_the_worker_would_drop_it(tmp_path: Path) -> None:
    from packserve.worker import KEEP_ALIVE_S

    now = [0.0]
    connections: list[int] = []

    async def client(sock: str) -> object:
        pool = pool_of(sock, idle_s=30, clock=lambda: now[0])
        await fetch(pool)
        now[0] += 29
        await fetch(pool)  # fresh enough: used again
        now[0] += 31
        await fetch(pool)  # idle too long: closed, and a new one opened
        return pool.opened

    assert run(tmp_path, serving([OK] * 3, connections), client) == 2
    assert connections == [2, 1]
    assert WorkerConnections("x")._idle_s < KEEP_ALIVE_S / 2


def test_a_closed_pool_keeps_nothing(tmp_path: Path) -> None:
    """What the supervisor does when a worker dies: its connections are closed, and a response
    still being read when it died does not bring one back."""
    connections: list[int] = []

    async def client(sock: str) -> object:
        pool = pool_of(sock)
        await fetch(pool)
        up = await request(pool, "POST", b"/x", [], b"{}")
        pool.close()
        assert await up.read() == b"ok"
        up.close()
        return pool.idle, pool.opened

    assert run(tmp_path, serving([OK, OK], connections), client) == (0, 1)


def test_a_pooled_connection_the_worker_closed_is_not_used(tmp_path: Path) -> None:
    """A worker gone between two requests (it died; its socket file stays until the front
    notices): the dead connection is not written to, and the new connect fails as before."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        writer.close()  # after the answer, without saying so in its headers

    async def client(sock: str) -> object:
        pool = pool_of(sock)
        first = await fetch(pool)
        await asyncio.sleep(0.1)  # the close reaches the front's side
        second = await fetch(pool)
        return first, second, pool.opened

    assert run(tmp_path, handler, client) == (b"ok", b"ok", 2)


def test_a_head_answer_leaves_its_connection_out_of_the_pool(tmp_path: Path) -> None:
    """A HEAD's answer has a length and no body: the end of the message cannot be seen on the
    wire, so the connection is not used again."""
    connections: list[int] = []
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 500\r\n\r\n"

    async def client(sock: str) -> object:
        pool = pool_of(sock)
        up = await request(pool, "HEAD", b"/", [], b"")
        assert await up.read() == b""
        up.close()
        return pool.idle

    assert run(tmp_path, serving([head], connections), client) == 0


def test_bytes_after_the_answer_are_not_read_as_its_body_nor_kept(tmp_path: Path) -> None:
    connections: list[int] = []
    two = OK + b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nxyz"

    async def client(sock: str) -> object:
        pool = pool_of(sock)
        return await fetch(pool), pool.idle

    assert run(tmp_path, serving([two], connections), client) == (b"ok", 0)


def test_a_kept_alive_connection_closed_before_its_answer_began_is_tried_once_more(
        tmp_path: Path) -> None:
    """The worker closes idle connections only after KEEP_ALIVE_S, but if one is closed as the
    next request goes out, that request (never read) goes again on a new connection."""
    seen: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(len(seen))
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        if len(seen) == 1:  # the first connection: closed when the next request arrives
            await reader.read(1)
            writer.close()
            return
        await asyncio.sleep(5)

    async def client(sock: str) -> object:
        pool = pool_of(sock)
        return await fetch(pool), await fetch(pool), pool.opened

    assert run(tmp_path, handler, client) == (b"ok", b"ok", 2)


def test_a_new_connection_that_fails_before_its_answer_is_not_tried_again(
        tmp_path: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()

    async def client(sock: str) -> object:
        pool = pool_of(sock)
        with pytest.raises(UpstreamError, match="closed the connection"):
            await fetch(pool)
        return pool.opened

    assert run(tmp_path, handler, client) == 1


def test_idle_connections_past_their_time_are_closed_oldest_first(tmp_path: Path) -> None:
    now = [0.0]
    connections: list[int] = []

    async def client(sock: str) -> object:
        pool = pool_of(sock, idle_s=30, clock=lambda: now[0])
        ups = [await request(pool, "POST", b"/x", [], b"{}") for _ in range(3)]
        for up in ups:
            await up.read()
            up.close()
            now[0] += 10  # given back at 0, 10 and 20 s
        now[0] = 45  # the first two have been idle for over 30 s
        await fetch(pool)  # takes the newest
        return pool.idle, pool.opened

    assert run(tmp_path, serving([OK] * 4, connections), client) == (1, 3)
