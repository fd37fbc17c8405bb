"""The embedding batcher: concurrent calls share forward passes; a bad input fails alone."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from packserve.api.batching import Batchers
from packserve.core.backend import Backend, Embeddings, LoadSpec, Runner
from packserve.errors import InputTooLong


class CountingEmbedder(Backend):
    """Records each forward pass; the first pass blocks until released."""

    def __post_init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()

    def embed(self, texts: Sequence[str]) -> Embeddings:
        self.release.wait(timeout=30)
        if any(t == "bad" for t in texts):
            raise InputTooLong("input 'bad' is too long", param="input")
        self.calls.append(list(texts))
        return Embeddings(vectors=np.array([[float(len(t))] for t in texts], dtype=np.float32),
                          tokens=[len(t) for t in texts])


def backend(max_batch: int = 64) -> CountingEmbedder:
    return CountingEmbedder(LoadSpec(backend="fake", path=Path("fake:1MiB"), device="cpu",
                                     context_length=0, max_batch=max_batch))


def test_requests_arriving_during_a_pass_share_the_next_pass() -> None:
    async def run() -> tuple[CountingEmbedder, list[Embeddings]]:
        b = backend()
        r = Runner(b)
        batcher = Batchers().for_runner(r)
        first = asyncio.create_task(batcher.embed(r, ["a"]))
        await asyncio.sleep(0)  # let the first pass start and block in its thread
        rest = [asyncio.create_task(batcher.embed(r, ["x" * i])) for i in range(2, 12)]
        await asyncio.sleep(0)
        b.release.set()
        return b, await asyncio.wait_for(asyncio.gather(first, *rest), 30)

    b, results = asyncio.run(run())
    assert [len(c) for c in b.calls] == [1, 10]  # ten requests, one forward pass
    for i, out in enumerate(results[1:], start=2):
        assert out.vectors.tolist() == [[float(i)]] and out.tokens == [i]


def test_max_batch_splits_passes() -> None:
    async def run() -> CountingEmbedder:
        b = backend(max_batch=4)
        b.release.set()
        r = Runner(b)
        batcher = Batchers().for_runner(r)
        await asyncio.wait_for(asyncio.gather(*(batcher.embed(r, ["t", "t"]) for _ in range(5))),
                               30)
        return b

    b = asyncio.run(run())
    assert all(len(c) <= 4 for c in b.calls) and sum(len(c) for c in b.calls) == 10


def test_a_bad_input_fails_only_its_own_request() -> None:
    async def run() -> list[Embeddings | BaseException]:
        b = backend()
        r = Runner(b)
        batcher = Batchers().for_runner(r)
        first = asyncio.create_task(batcher.embed(r, ["warm"]))
        await asyncio.sleep(0)
        others = [asyncio.create_task(batcher.embed(r, [t])) for t in ("ok1", "bad", "ok2")]
        await asyncio.sleep(0)
        b.release.set()
        return list(await asyncio.wait_for(
            asyncio.gather(first, *others, return_exceptions=True), 30))

    results = asyncio.run(run())
    assert isinstance(results[2], InputTooLong)
    assert all(isinstance(r, Embeddings) for i, r in enumerate(results) if i != 2)


class TwoPassEmbedder(CountingEmbedder):
    """May compute two calls at once; records how many run at the same time."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.running = 0
        self.most = 0
        self.both_in = threading.Barrier(2, timeout=30)
        self._count = threading.Lock()

    def embed_passes(self) -> int:
        return 2

    def embed(self, texts: Sequence[str]) -> Embeddings:
        with self._count:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            if len(self.calls) < 2:
                self.both_in.wait()  # the first two passes are in flight together
            return super().embed(texts)
        finally:
            with self._count:
                self.running -= 1


def test_a_model_that_computes_two_calls_at_once_gets_two_passes_in_flight() -> None:
    async def run() -> TwoPassEmbedder:
        b = TwoPassEmbedder(LoadSpec(backend="fake", path=Path("fake:1MiB"), device="cpu",
                                     context_length=0, max_batch=64))
        b.release.set()
        r = Runner(b)
        batcher = Batchers().for_runner(r)
        first = asyncio.create_task(batcher.embed(r, ["a"]))  # alone: starts at once
        await asyncio.sleep(0)
        few = asyncio.create_task(batcher.embed(r, ["b"] * 3))  # too few to start beside it
        await asyncio.sleep(0.05)
        assert b.running == 1
        # Enough queued now for a pass beside the first: both then wait for each other.
        enough = asyncio.create_task(batcher.embed(r, ["c"] * 5))
        await asyncio.wait_for(asyncio.gather(first, few, enough), 30)
        return b

    b = asyncio.run(run())
    assert b.most == 2
    assert [len(c) for c in b.calls] in ([1, 8], [8, 1])
