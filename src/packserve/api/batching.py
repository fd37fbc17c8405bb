"""Coalesce concurrent embedding calls on one loaded model into forward passes.

While a model's passes run in worker threads, new requests queue; when a pass ends, the next
takes all of them (up to `max_batch` inputs). A model may run several passes at once
(`Runner.embed_passes`: sentence-transformers on a CPU, one per core, each on one thread): its
passes then overlap, and one pass's clients send their next requests while the others compute.
Each caller still holds its own lease, so the model cannot be evicted under a batch. If a
combined batch fails, its requests run one by one so that only the request with the bad input
gets the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from packserve.core.backend import Embeddings, Runner
from packserve.core.compute import TICKET, Ticket

# The fewest inputs worth a second pass beside a running one. MiniLM on one torch thread of the
# build machine (by hand, in one process): 20 ms of CPU per sentence alone, 10.8 in passes of 4,
# 8.7 in passes of 8; beside another pass with every waiting request taken at once, 16
# single-sentence clients made passes of 3 (docs/tuning.md, embedding passes).
_BESIDE = 8

# Told of each forward pass: the model named by its first request, and its inputs.
OnPass = Callable[[str, int], None]


@dataclass
class _Pending:
    runner: Runner
    model: str  # the catalog name its request asked for
    texts: list[str]
    future: asyncio.Future[Embeddings]
    ticket: Ticket | None  # its request's compute deadline
    ran: asyncio.Event = field(default_factory=asyncio.Event)  # its batch's thread returned


class EmbedBatcher:
    def __init__(self, max_batch: int, on_pass: OnPass | None = None, passes: int = 1) -> None:
        self._max_batch = max_batch
        self._on_pass = on_pass
        self._passes = max(1, passes)  # passes in flight at most
        self._pending: list[_Pending] = []
        self._running: set[asyncio.Task[None]] = set()

    async def embed(self, runner: Runner, texts: list[str], model: str = "") -> Embeddings:
        """Embed `texts` on `runner` for a request to `model`; the caller holds a lease on
        the runner until this returns."""
        future: asyncio.Future[Embeddings] = asyncio.get_running_loop().create_future()
        item = _Pending(runner, model, texts, future, TICKET.get())
        self._pending.append(item)
        self._start()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The caller's client left. Not started yet: drop it. Inside a running batch: the
            # caller's lease must outlive the engine call, so wait for the batch to return.
            if item in self._pending:
                self._pending.remove(item)
            else:
                while not item.ran.is_set():
                    with contextlib.suppress(asyncio.CancelledError):
                        await item.ran.wait()
            raise

    def _start(self) -> None:
        """Start passes with what is queued while fewer than `passes` run: at once when none
        runs, beside a running pass only with at least `_BESIDE` inputs (a few texts on a
        core of their own cost more per text than they gain)."""
        while self._pending and len(self._running) < self._passes and (
                not self._running
                or sum(len(p.texts) for p in self._pending) >= min(_BESIDE, self._max_batch)):
            batch: list[_Pending] = []
            size = 0
            while self._pending and (not batch or size + len(self._pending[0].texts)
                                     <= self._max_batch):
                item = self._pending.pop(0)
                batch.append(item)
                size += len(item.texts)
            task = asyncio.create_task(self._pass(batch))
            self._running.add(task)
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._start()

    async def _pass(self, batch: list[_Pending]) -> None:
        live = [p for p in batch if not p.future.done()]
        try:
            if live and self._on_pass is not None:
                self._on_pass(live[0].model, sum(len(p.texts) for p in live))
            if live:
                await self._run(live)
        except Exception as exc:  # not the engine's (`_run` settles those): the callers get it
            for p in live:
                _settle(p.future, exc)
        finally:  # also if this task is cancelled: nobody waits for ever
            for p in batch:
                p.ran.set()

    async def _run(self, batch: list[_Pending]) -> None:
        texts = [t for p in batch for t in p.texts]
        # The batch computes under its most urgent request's deadline. This task's context
        # is its own: setting the ticket here reaches only the thread below.
        tickets = [p.ticket for p in batch if p.ticket is not None]
        TICKET.set(min(tickets, key=lambda t: t.deadline) if tickets else None)
        try:
            out = await asyncio.to_thread(batch[0].runner.embed, texts)
        except Exception as exc:
            if len(batch) == 1:
                _settle(batch[0].future, exc)
                return
            for p in batch:  # find the request that broke the batch
                await self._run([p])
            return
        start = 0
        for p in batch:
            end = start + len(p.texts)
            if not p.future.done():
                p.future.set_result(Embeddings(vectors=out.vectors[start:end],
                                               tokens=out.tokens[start:end]))
            start = end


def _settle(future: asyncio.Future[Embeddings], exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)


class Batchers:
    """One batcher per load (the scheduler makes one `Runner` per load, which names it);
    forgotten when the runner is garbage-collected, after its unload."""

    def __init__(self, on_pass: OnPass | None = None) -> None:
        self._on_pass = on_pass
        self._by_runner: weakref.WeakKeyDictionary[Runner, EmbedBatcher] = (
            weakref.WeakKeyDictionary())

    def for_runner(self, runner: Runner) -> EmbedBatcher:
        batcher = self._by_runner.get(runner)
        if batcher is None:
            batcher = EmbedBatcher(runner.max_batch, self._on_pass, runner.embed_passes)
            self._by_runner[runner] = batcher
        return batcher
