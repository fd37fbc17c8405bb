"""The deep probe's reading (`Scheduler.liveness`, issue 32): device locks held, loads in their
engine, queues that have not moved, each against load_timeout_s. Fake engines, the test's
clock; the reading itself waits for nothing."""

from __future__ import annotations

import asyncio

import pytest

from packserve.core.residency import WEDGE_GRACE_S
from packserve.types import State
from tests.factories import TIMEOUT, drain, entry, harness, hold, use

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(4 * TIMEOUT)]


async def test_a_load_that_hangs_in_its_engine_is_wedged_past_load_timeout_s_and_a_grace() -> None:
    h = harness([entry("a"), entry("b")], budget_mib=1024, load_timeout_s=60)
    s = h.scheduler
    assert s.liveness().ok and s.liveness().locks == ()
    h.control.gate.clear()
    try:
        a = asyncio.create_task(use(s, "a"))
        assert await asyncio.to_thread(h.building.wait, TIMEOUT)
        live = s.liveness()  # answered while the load holds the lock: it takes none
        assert [(x.kind, x.detail) for x in live.locks] == [("lock", "model a")]
        assert [(x.model, x.seconds) for x in live.loads] == [("a", 0.0)]
        assert live.ok and not live.restart
        h.clock.advance(61)  # past load_timeout_s, within the grace a runner's own deadline has
        assert s.liveness().ok
        h.clock.advance(WEDGE_GRACE_S)
        live = s.liveness()
        assert {(x.kind, x.model) for x in live.stuck} == {("lock", ""), ("load", "a")}
        assert live.wedged == ("a",) and live.restart and not live.ok
    finally:
        h.control.gate.set()
    await asyncio.wait_for(a, TIMEOUT)
    live = s.liveness()
    assert live.ok and live.locks == () and live.loads == ()
    await s.close()


async def test_a_queue_that_does_not_move_is_reported_but_restarts_nothing() -> None:
    h = harness([entry("a", max_concurrency=1)], budget_mib=1024, load_timeout_s=60)
    s = h.scheduler
    holder = await hold(s, "a")  # a long generation holding the only slot
    waiting = asyncio.create_task(use(s, "a"))
    await drain()
    h.clock.advance(30)
    assert s.liveness().ok
    h.clock.advance(31)
    live = s.liveness()
    assert [(x.kind, x.model, x.detail) for x in live.stuck] == [
        ("queue", "a", "1 waiting")]
    assert not live.ok and not live.restart and live.wedged == ()
    await holder.release()
    await asyncio.wait_for(waiting, TIMEOUT)
    assert s.liveness().ok and h.state("a") is State.HOT
    await s.close()
