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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from packserve.api import relay
from packserve.api.batching import Batchers
from packserve.core.backend import (
    Embeddings,
    Generated,
    OnText,
    Ranking,
    Runner,
    TokenLogprob,
    Wire,
)
from packserve.core.lease import Lease
from packserve.core.request import GenerationRequest
from packserve.errors import EngineCrashed

T = TypeVar("T")


Recover = Callable[[Lease], Awaitable[Runner | None]]


class Call:
    """A request's use of its lease; made by `Services.call`.

    A request whose engine process died before it took the request (nothing of its answer
    made yet: an embedding, a rerank, a generation not yet started) is sent again once, after
    the scheduler has loaded the model anew (`recover`: `Scheduler.recover`). One that had
    begun to answer ends with its error (503 `engine_crashed`)."""

    def __init__(self, lease: Lease, batchers: Batchers, recover: Recover | None = None
                 ) -> None:
        self._lease = lease
        self._batchers = batchers
        self._recover = recover

    async def recover(self) -> bool:
        """The engine was found gone: load it again and lend its new runner to this lease.
        False where it was not gone (or nothing can recover it): the caller re-raises."""
        if self._recover is None:
            return False
        runner = await self._recover(self._lease)
        if runner is None:
            return False
        self._lease.runner = runner
        return True

    async def _once_more(self, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call()
        except EngineCrashed:
            if not await self.recover():
                raise
        return await call()

    async def embed(self, texts: list[str]) -> Embeddings:
        """Through the model's batcher: concurrent requests share forward passes."""
        async def once() -> Embeddings:
            runner = self._lease.runner
            return await self._batchers.for_runner(runner).embed(runner, texts,
                                                                 self._lease.model)
        out = await self._once_more(once)
        self._lease.count_tokens(sum(out.tokens))
        return out

    async def embed_ids(self, ids: list[list[int]]) -> Embeddings:
        """Token-id inputs, in one call of their own (the batcher joins texts)."""
        out = await self._once_more(lambda: off_loop(self._lease.runner.embed_ids, ids))
        self._lease.count_tokens(sum(out.tokens))
        return out

    async def rerank(self, query: str, documents: list[str]) -> Ranking:
        out = await self._once_more(
            lambda: off_loop(self._lease.runner.rerank, query, documents))
        self._lease.count_tokens(out.tokens)
        return out

    def wire(self, request: GenerationRequest) -> Wire | None:
        """The request to relay for a plain generation, if the leased engine takes one."""
        return self._lease.runner.wire(request)

    async def relay_whole(self, request: GenerationRequest, wire: Wire) -> dict[str, Any]:
        """The engine's whole answer to `wire` (`request`'s), its tokens counted on the lease;
        sent again once to the reloaded engine if the engine's process was gone."""
        try:
            return await relay.whole(wire, self._lease.model, self._lease.count_tokens)
        except relay.Unreachable:
            again = await self.recover() and self.wire(request)
            if not again:
                raise
        return await relay.whole(again, self._lease.model, self._lease.count_tokens)

    async def relay(self, request: GenerationRequest, wire: Wire, *, include_usage: bool
                    ) -> AsyncGenerator[bytes]:
        """The engine's events for `wire` (`request`'s; a refusal raises at the first), its
        tokens counted on the lease and its first text's time marked on it; sent again once
        to the reloaded engine if the engine's process was gone before it answered. Leaving
        early closes the exchange, which stops the generation."""
        for attempt in (0, 1):
            async with contextlib.aclosing(relay.stream(
                    wire, self._lease.model, self._lease.count_tokens,
                    include_usage=include_usage, first_text=self._lease.first_token)) as raw:
                try:
                    opened = await raw.__anext__()
                except relay.Unreachable:
                    again = attempt == 0 and await self.recover() and self.wire(request)
                    if not again:
                        raise
                    wire = again
                    continue
                yield opened
                async for chunk in raw:
                    yield chunk
                return

    async def generate(self, request: GenerationRequest, choice: int = 0) -> Generated:
        """Run `request` (its prompt number `choice`, for a completion) to the end; if the
        request is cancelled, the engine is asked to stop."""
        stop = threading.Event()
        out = await self._once_more(lambda: off_loop(
            self._lease.runner.generate, request, _until(stop), choice, on_cancel=stop.set))
        _count(self._lease, out)
        return out

    @contextlib.asynccontextmanager
    async def stream(self, request: GenerationRequest) -> AsyncIterator[Stream]:
        """Start `request` and hand its pieces over as they come. On leaving (the stream ended,
        or its client left) the engine is asked to stop, and the thread is awaited, shielded
        from cancellation, before the lease can be released."""
        stream = Stream(self._lease, request, self.recover)
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
    its outcome (`result`). Sent again once to the reloaded engine (`recover`) if the engine's
    process was gone before the first piece."""

    def __init__(self, lease: Lease, request: GenerationRequest,
                 recover: Callable[[], Awaitable[bool]] | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._lease = lease
        self._pieces: asyncio.Queue[Piece | None] = asyncio.Queue()
        self._stop = threading.Event()
        self._ended = False
        sent = threading.Event()  # a piece went out: it is too late to send it again

        def on_text(text: str, logprobs: Sequence[TokenLogprob]) -> bool:
            if self._stop.is_set():
                return False
            sent.set()
            loop.call_soon_threadsafe(self._pieces.put_nowait, Piece(text, tuple(logprobs)))
            return True

        async def work() -> Generated:
            try:
                try:
                    return await asyncio.to_thread(lease.runner.generate, request, on_text)
                except EngineCrashed:
                    if sent.is_set() or recover is None or not await recover():
                        raise
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
