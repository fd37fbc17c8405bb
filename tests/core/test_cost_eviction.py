"""The cost-aware victim policy inside the scheduler: reload seconds measured at each load and
arrival times recorded per request reach the policy, and every eviction says why."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from packserve.config import ModelSpec
from packserve.core.backend import LoadSpec
from packserve.core.catalog import Entry
from packserve.core.events import EvictEvent
from packserve.core.policy import CostAware, VictimPolicy, lru_by_bytes
from packserve.types import State, Task
from tests.factories import MIB, TIMEOUT, drain, entry, harness, hold, use

# Coroutine tests run on asyncio through anyio's pytest plugin, each bounded in time.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(4 * TIMEOUT)]


def _entry(name: str, load_s: float) -> Entry:
    source = f"fake:100MiB?load_s={load_s}"
    spec = ModelSpec(name=name, tasks=[Task.EMBED], backend="fake", source=source, device="cpu")
    load = LoadSpec(backend="fake", path=Path(name) / source, device="cpu", context_length=0)
    return Entry(spec=spec, load=load, bytes_estimated=100 * MIB)


@pytest.mark.parametrize(("policy", "victim", "words"), [
    (CostAware(), "cheap", "reload "),  # the slow one stays though it is least recent
    (lru_by_bytes, "dear", "least recently used"),
])
async def test_the_slow_to_reload_model_stays_under_the_cost_policy(
        policy: VictimPolicy, victim: str, words: str) -> None:
    h = harness([_entry("dear", 0.3), _entry("cheap", 0.0), _entry("new", 0.0)],
                budget_mib=250, real_clock=True, victim_policy=policy)
    s = h.scheduler
    await use(s, "dear")
    await asyncio.sleep(0.05)
    await use(s, "cheap")
    plan = s.plan("new")
    assert f"evicting {victim} (100.0 MiB to cold, idle, {words}" in plan.reason, plan.reason
    await use(s, "new")
    (evicted,) = h.events.of(EvictEvent)
    assert evicted.model == victim
    assert evicted.cause == "make_room" and words in evicted.why
    assert evicted.policy == ("cost" if isinstance(policy, CostAware) else "lru")
    await s.close()


async def test_a_load_waiting_for_a_busy_model_does_not_hold_up_one_that_fits() -> None:
    h = harness([entry("busy", 100), entry("big", 200), entry("small", 40)], budget_mib=250)
    s = h.scheduler
    held = await hold(s, "busy")
    big = asyncio.create_task(use(s, "big"))  # 200 MiB: waits for `busy` to finish
    await drain()
    assert h.state("big") is State.ADMITTING
    await asyncio.wait_for(use(s, "small"), TIMEOUT)  # 40 MiB fit now: no waiting behind
    assert h.state("small") is State.HOT and h.state("big") is State.ADMITTING
    await held.release()
    await asyncio.wait_for(big, TIMEOUT)
    assert h.state("big") is State.HOT
    assert max(h.events.gauges) <= h.capacity
    await s.close()
