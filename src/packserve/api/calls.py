"""How a route uses a leased model: every engine call runs off the event loop, and the tokens it
reports are counted on the lease (they travel in the request's RequestEvent).

A thread cannot be interrupted. When a request is cancelled (its client left), the engine is
asked to stop early and the call still waits for its thread, because the lease (and so the
model's residency and its engine-call bookkeeping) must outlive every engine call made under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from packserve.api import relay
from packserve.api.batching import Batchers
from packserve.core.backend import Embeddings, Generated, OnText, Ranking, TokenLogprob, Wire
from packserve.core.lease import Lease
from packserve.core.request import GenerationRequest

T = TypeVar("T")


class Call:
    """A request's use of its lease; made by `Services.call`."""

    def __init__(self, lease: Lease, batchers: Batchers) -> None:
        self._lease = lease
        self._batchers = batchers

    async def embed(self, texts: list[str]) -> Embeddings:
        """Through the model's batcher: concurrent requests share forward passes."""
        runner = self._lease.runner
        out = await self._batchers.for_runner(runner).embed(runner, texts, self._lease.model)
        self._lease.count_tokens(sum(out.tokens))
        return out

    async def embed_ids(self, ids: list[list[int]]) -> Embeddings:
        """Token-id inputs, in one call of their own (the batcher joins texts)."""
        out = await off_loop(self._lease.runner.embed_ids, ids)
        self._lease.count_tokens(sum(out.tokens))
        return out

    async def rerank(self, query: str, documents: list[str]) -> Ranking:
        out = await off_loop(self._lease.runner.rerank, query, documents)
        self._lease.count_tokens(out.tokens)
        return out

    def wire(self, request: GenerationRequest) -> Wire | None:
        """The request to relay for a plain generation, if the leased engine takes one."""
        return self._lease.runner.wire(request)

    async def relay_whole(self, wire: Wire) -> dict[str, Any]:
        """The engine's whole answer to `wire`, its tokens counted on the lease."""
        return await relay.whole(wire, self._lease.model, self._lease.count_tokens)

    def relay(self, wire: Wire, *, include_usage: bool) -> AsyncGenerator[bytes]:
        """The engine's events for `wire` (a refusal raises at the first), its tokens counted
        on the lease and its first text's time marked on it. Leaving early closes the
        exchange, which stops the generation."""
        return relay.stream(wire, self._lease.model, self._lease.count_tokens,
                            include_usage=include_usage, first_text=self._lease.first_token)

    async def generate(self, request: GenerationRequest, choice: int = 0) -> Generated:
        """Run `request` (its prompt number `choice`, for a completion) to the end; if the
        request is cancelled, the engine is asked to stop."""
        stop = threading.Event()
        out = await off_loop(self._lease.runner.generate, request, _until(stop), choice,
                             on_cancel=stop.set)
        _count(self._lease, out)
        return out

    @contextlib.asynccontextmanager
    async def stream(self, request: GenerationRequest) -> AsyncIterator[Stream]:
        """Start `request` and hand its pieces over as they come. On leaving (the stream ended,
        or its client left) the engine is asked to stop, and the thread is awaited, shielded
        from cancellation, before the lease can be released."""
        stream = Stream(self._lease, request)
        try:
            yield stream
        finally:
            await stream.close()


@dataclass(frozen=True)
class Piece:
    """A piece of streamed text and the logprobs of the tokens that made it (empty unless the
    request asked for them)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


class Stream:
    """The text pieces of a generation running in a worker thread, in order (`async for`), then
    its outcome (`result`)."""

    def __init__(self, lease: Lease, request: GenerationRequest) -> None:
        loop = asyncio.get_running_loop()
        self._lease = lease
        self._pieces: asyncio.Queue[Piece | None] = asyncio.Queue()
        self._stop = threading.Event()
        self._ended = False

        def on_text(text: str, logprobs: Sequence[TokenLogprob]) -> bool:
            if self._stop.is_set():
                return False
            loop.call_soon_threadsafe(self._pieces.put_nowait, Piece(text, tuple(logprobs)))
            return True

        async def work() -> Generated:
            try:
                return await asyncio.to_thread(lease.runner.generate, request, on_text)
            finally:
                self._pieces.put_nowait(None)

        self._worker = asyncio.create_task(work())

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Piece:
        piece = None if self._ended else await self._pieces.get()
        if piece is None:
            self._ended = True
            raise StopAsyncIteration
        if piece.text:
            self._lease.first_token()
        return piece

    async def result(self) -> Generated:
        """What the engine returned, its tokens counted on the lease; or what it raised."""
        out = await self._worker
        _count(self._lease, out)
        return out

    async def close(self) -> None:
        self._stop.set()
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await self._worker


async def off_loop(fn: Callable[..., T], *args: object,
                   on_cancel: Callable[[], None] | None = None) -> T:
    """`fn(*args)` in a worker thread. If the caller is cancelled, `on_cancel` asks the engine
    to stop early, and this still waits for the thread before re-raising."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    cancelled = False
    while True:
        try:
            await asyncio.wait({task})
            break
        except asyncio.CancelledError:
            if not cancelled and on_cancel is not None:
                on_cancel()
            cancelled = True
    if cancelled:
        if not task.cancelled():
            task.exception()  # retrieved: the client is gone, nobody else will read it
        raise asyncio.CancelledError
    return task.result()


def _count(lease: Lease, out: Generated) -> None:
    lease.count_tokens(out.prompt_tokens, out.completion_tokens)


def _until(stop: threading.Event) -> OnText:
    """An `on_text` that asks the engine to stop once `stop` is set."""
    return lambda _text, _logprobs: not stop.is_set()
