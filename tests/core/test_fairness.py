"""Fair share of one model's queue between API keys: the pure queue, then the scheduler."""

from __future__ import annotations

import asyncio

import pytest

from packserve.core.fairness import FairQueue
from packserve.types import Task
from tests.factories import drain, entry, harness, hold, run


def order(q: FairQueue[str]) -> list[str]:
    out = []
    while q:
        out.append(q.pop())
    return out


def test_a_burst_queues_behind_its_own_requests() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.push(f"a{i}", "a")
    q.push("b0", "b")
    q.push("b1", "b")
    assert order(q) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_weights_share_in_proportion() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(6):
        q.push(f"a{i}", "a", weight=2.0)
        q.push(f"b{i}", "b")
    first_six = order(q)[:6]
    assert sum(x.startswith("a") for x in first_six) == 4, first_six  # 2:1


def test_an_idle_key_banks_no_credit() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(3):  # b ran alone for a while
        q.push(f"b{i}", "b")
    assert order(q) == ["b0", "b1", "b2"]
    for i in range(3):  # a was idle all along; it joins at the current virtual time
        q.push(f"a{i}", "a")
    for i in range(3, 6):
        q.push(f"b{i}", "b")
    assert order(q) == ["a0", "b3", "a1", "b4", "a2", "b5"]


def test_remove_and_empty() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("x", "a")
    q.push("y", "b")
    assert q.remove("x") and not q.remove("x") and len(q) == 1 and "y" in q
    assert q.pop() == "y" and not q
    with pytest.raises(IndexError):
        q.pop()
    with pytest.raises(ValueError, match="weight"):
        q.push("z", "a", weight=0)


def test_the_scheduler_serves_waiting_keys_in_turn() -> None:
    async def scenario() -> None:
        h = harness([entry("m", max_concurrency=1, max_queue=16)], budget_mib=1024)
        await h.scheduler.start()
        first = await hold(h.scheduler, "m")  # holds the only slot
        served: list[str] = []
        gate = asyncio.Event()

        async def request(key: str, tag: str) -> None:
            async with h.scheduler.acquire("m", Task.EMBED, key=key):
                served.append(tag)
                await gate.wait()
                gate.clear()

        tasks = [asyncio.create_task(request("burst", f"burst{i}")) for i in range(4)]
        await drain()
        tasks.append(asyncio.create_task(request("small", "small0")))
        await drain()
        await first.release()
        while len(served) < 5:
            await drain()
            gate.set()
            await drain()
        gate.set()  # the last one
        await asyncio.gather(*tasks)
        # the small team's one request goes second, not after the whole burst
        assert served[:3] == ["burst0", "small0", "burst1"]
        await h.scheduler.close()

    run(scenario())
