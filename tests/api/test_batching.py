"""The embedding batcher: concurrent calls share forward passes; a bad input fails alone."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from packserve.api.batching import Batchers, EmbedBatcher
from packserve.core.backend import Backend, Embeddings, LoadSpec, Runner
from packserve.errors import InputTooLong


class CountingEmbedder(Backend):
    """Records each forward pass; the first pass blocks until released."""

    def __post_init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self.pass_s = 0.0  # how long each forward pass takes

    def embed(self, texts: Sequence[str]) -> Embeddings:
        self.release.wait(timeout=30)
        time.sleep(self.pass_s)
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


def test_a_pass_waits_for_the_clients_the_last_one_answered() -> None:
    """Four closed-loop clients answered by one pass come back 2 ms apart: with a wait, the
    next pass takes all four; without, it starts with the first and the rest make another."""

    async def run(wait_s: float) -> list[int]:
        b = backend()
        r = Runner(b)
        batcher = EmbedBatcher(64, wait_s)
        b.release.set()
        b.pass_s = 0.06  # a quarter of it, 15 ms, is longer than the clients' 8 ms

        async def client(i: int) -> None:
            await batcher.embed(r, [f"first {i}"])
            await asyncio.sleep(0.002 * (i + 1))  # the answer's way back, the next request's way in
            await batcher.embed(r, [f"second {i}"])

        first = asyncio.create_task(batcher.embed(r, ["slow pass"]))
        await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(first, *(client(i) for i in range(4))), 30)
        return [len(c) for c in b.calls]

    # The first pass takes "slow pass" alone; the four clients queue behind it (pass 2).
    assert asyncio.run(run(1.0)) == [1, 4, 4]
    without = asyncio.run(run(0.0))
    assert without[:2] == [1, 4] and len(without) > 3

