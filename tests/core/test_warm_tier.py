"""The warm tier: an evicted model keeps its engine objects and gives back its weights; its next
load restores it, admitted for the difference; warm copies go cold when their bytes are needed.
The fake engine declares what a warm copy keeps (`warm=`); the real engines' warm states are
tested in tests/backends and through HTTP in tests/api/test_real_residency.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from packserve.core.events import EvictEvent, LoadEvent, LoadFailedEvent
from packserve.core.policy import CostAware, Verdict, plan_admission
from packserve.errors import Conflict
from packserve.types import State
from tests.factories import MIB, TIMEOUT, Harness, drain, entry, harness, hold, resident, use

# Coroutine tests run on asyncio through anyio's pytest plugin, each bounded in time.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(4 * TIMEOUT)]


def _warm_pair(warm_tier: bool = True, budget_mib: int = 250) -> Harness:
    return harness([entry("a", 100, warm_mib=10), entry("b", 100), entry("c", 100)],
                   budget_mib=budget_mib, warm_tier=warm_tier)


async def _a_goes_warm(h: Harness) -> None:
    """Use a, b and c in turn: c's load evicts a, least recently used, to warm."""
    for name in ("a", "b", "c"):
        await use(h.scheduler, name)
        h.clock.advance(1)
    assert h.state("a") is State.WARM


async def _until(done: Callable[[], bool]) -> None:
    for _ in range(100):
        await drain()
        if done():
            return


async def test_an_evicted_model_goes_warm_and_comes_back_by_a_restore() -> None:
    h = _warm_pair()
    s = h.scheduler
    await use(s, "a")
    h.clock.advance(1)
    await use(s, "b")
    h.clock.advance(1)
    await use(s, "c")  # 300 MiB asked of 250: `a`, least recently used, goes warm
    assert h.state("a") is State.WARM
    assert h.status("a").bytes_warm == 10 * MIB
    assert h.used == 210 * MIB  # b, c and what a's warm copy keeps
    (offload,) = h.events.of(EvictEvent)
    assert (offload.model, offload.tier_to, offload.bytes) == ("a", "warm", 90 * MIB)
    h.clock.advance(1)
    await use(s, "a")  # 90 MiB more: b goes (cold: no warm state), a is restored
    assert h.state("a") is State.HOT and h.state("b") is State.COLD
    assert h.control.loads == {"fake:100MiB?warm=10MiB": 1, "fake:100MiB": 2}
    assert h.control.restores == {"fake:100MiB?warm=10MiB": 1}
    restored = h.events.of(LoadEvent)[-1]
    assert (restored.model, restored.tier_from) == ("a", "warm")
    assert h.status("a").restore_seconds is not None
    assert max(h.events.gauges) <= h.capacity
    await s.close()
    assert h.loaded_bytes() == 0  # the warm copy was unloaded too


async def test_without_the_warm_tier_an_eviction_unloads() -> None:
    h = _warm_pair(warm_tier=False)
    s = h.scheduler
    for name in ("a", "b", "c"):
        await use(s, name)
        h.clock.advance(1)
    assert h.state("a") is State.COLD
    assert h.control.releases == {}
    assert h.events.of(EvictEvent)[0].tier_to == "cold"
    await s.close()


async def test_a_warm_copy_keeping_most_of_its_bytes_is_unloaded_and_not_tried_again() -> None:
    """A copy that saves too little (llama.cpp's repacked weights stay in anonymous memory)
    holds memory for no gain: the eviction unloads it, and the next one plans a cold one."""
    h = harness([entry("a", 100, warm_mib=90), entry("b", 100), entry("c", 100)],
                budget_mib=250, warm_tier=True)
    s = h.scheduler
    for name in ("a", "b", "c"):
        await use(s, name)
        h.clock.advance(1)
    assert h.state("a") is State.COLD
    assert h.control.releases == {"fake:100MiB?warm=90MiB": 1}
    assert h.control.unloads == {"fake:100MiB?warm=90MiB": 1}
    (evicted,) = h.events.of(EvictEvent)
    assert (evicted.tier_to, evicted.bytes) == ("cold", 100 * MIB)
    for name in ("a", "b", "c"):  # a evicted again (by c): no release is tried
        await use(s, name)
        h.clock.advance(1)
    assert h.state("a") is State.COLD
    assert h.control.releases == {"fake:100MiB?warm=90MiB": 1}
    assert h.control.unloads["fake:100MiB?warm=90MiB"] == 2
    await s.close()


async def test_a_warm_copy_goes_cold_when_its_bytes_are_needed() -> None:
    h = _warm_pair(budget_mib=205)
    s = h.scheduler
    for name in ("a", "b", "c"):
        await use(s, name)
        h.clock.advance(1)
    # c needed 100 MiB with 5 free: a went warm (90 freed), then its copy went too
    assert h.state("a") is State.COLD
    assert [(e.model, e.tier_to) for e in h.events.of(EvictEvent)] == [
        ("a", "warm"), ("a", "cold")]
    assert h.control.unloads == {"fake:100MiB?warm=10MiB": 1}
    assert max(h.events.gauges) <= h.capacity
    await s.close()


async def test_a_failed_restore_falls_back_to_a_whole_load() -> None:
    h = _warm_pair()
    s = h.scheduler
    await _a_goes_warm(h)
    h.control.fail_next = 1  # the restore fails; the load after it does not
    await use(s, "a")
    assert h.state("a") is State.HOT
    assert h.control.loads["fake:100MiB?warm=10MiB"] == 2
    assert h.control.unloads["fake:100MiB?warm=10MiB"] == 1
    assert h.events.of(LoadEvent)[-1].tier_from == "cold"
    (failed,) = h.events.of(LoadFailedEvent)
    assert failed.model == "a" and failed.will_retry
    await s.close()


async def test_an_operator_unload_takes_a_warm_model_to_cold() -> None:
    h = _warm_pair()
    s = h.scheduler
    for name in ("a", "b", "c"):
        await use(s, name)
        h.clock.advance(1)
    await s.unload("a")
    await drain()
    assert h.state("a") is State.COLD
    assert h.used == 200 * MIB
    await s.close()


# ------------------------------------------------------------------ the policy, by table

def test_a_warm_target_needs_only_what_its_copy_does_not_hold() -> None:
    target = resident("t", 100, state=State.WARM, warm_mib=10)
    answer = plan_admission(target, [resident("x", 100, last_used=1)], 200 * MIB)
    assert answer.verdict is Verdict.FITS  # 90 MiB more, 90 free beside its own 10
    assert answer.used_bytes == 110 * MIB


@pytest.mark.parametrize(("free_mib", "victims"), [
    (0, ("w",)),  # a warm copy frees its 10 MiB first: the oldest
    (-50, ("w", "h")),  # then the hot one, which keeps 20 going warm: 10 + 80 freed
])
def test_warm_copies_count_what_they_hold_and_free(free_mib: int,
                                                   victims: tuple[str, ...]) -> None:
    others = [resident("w", 100, state=State.WARM, warm_mib=10, last_used=1),
              resident("h", 100, warm_mib=20, last_used=2)]
    # capacity so that `free_mib` is free with w's 10 and h's 100 held; the target needs 10
    answer = plan_admission(resident("t", 10, state=State.COLD), others,
                            (110 + free_mib) * MIB)
    assert answer.victims == victims
    assert "w (10.0 MiB to cold" in answer.reason
    if "h" in victims:
        assert "h (80.0 MiB to warm" in answer.reason


def test_the_cost_policy_weighs_a_restore_not_a_reload_for_a_model_that_goes_warm() -> None:
    policy = CostAware(horizon_s=60)
    goes_warm = resident("g", 100, reload_s=2.0, restore_s=0.1, rate_per_s=1.0, warm_mib=5)
    goes_cold = resident("c", 100, reload_s=2.0, rate_per_s=1.0)
    warm = resident("w", 100, state=State.WARM, reload_s=2.0, restore_s=0.1, rate_per_s=1.0,
                    warm_mib=5)
    assert policy.expected_cost_s(goes_warm) == pytest.approx(0.1)
    assert policy.expected_cost_s(goes_cold) == pytest.approx(2.0)
    assert policy.expected_cost_s(warm) == pytest.approx(1.9)
    assert policy([goes_warm, goes_cold], 50 * MIB, 0) == ("g",)
    assert "restore 0.1 s" in policy.explain(goes_warm)


def test_victims_go_cold_when_warm_copies_would_leave_too_little_room() -> None:
    others = [resident("a", 100, warm_mib=50, last_used=1),
              resident("b", 100, warm_mib=50, last_used=2)]
    answer = plan_admission(resident("t", 180, state=State.COLD), others, 200 * MIB)
    assert answer.verdict is Verdict.FITS_AFTER_EVICTION
    assert answer.to_cold and answer.victims == ("a", "b")
    assert "a (100.0 MiB to cold" in answer.reason


async def test_a_load_that_needs_every_byte_sends_warm_capable_victims_to_cold() -> None:
    h = harness([entry("a", 100, warm_mib=50), entry("b", 100, warm_mib=50),
                 entry("big", 180)], budget_mib=200, warm_tier=True)
    s = h.scheduler
    await use(s, "a")
    h.clock.advance(1)
    await use(s, "b")
    await use(s, "big")
    assert (h.state("a"), h.state("b")) == (State.COLD, State.COLD)
    # Before a warm copy was ever measured, its size is unknown: a and b went warm, then
    # cold. Once known, a load that needs every byte sends them straight to cold.
    assert h.control.releases == {"fake:100MiB?warm=50MiB": 2}
    for name in ("a", "b", "big"):
        h.clock.advance(1)
        await use(s, name)
    assert (h.state("a"), h.state("b")) == (State.COLD, State.COLD)
    assert h.control.releases == {"fake:100MiB?warm=50MiB": 2}
    assert max(h.events.gauges) <= h.capacity
    await s.close()


async def test_an_operator_offload_keeps_it_warm_or_else_unloads_it() -> None:
    h = _warm_pair(warm_tier=False)  # an explicit offload needs no warm tier by default
    s = h.scheduler
    await use(s, "a")
    await use(s, "b")
    await s.offload("a")
    assert h.state("a") is State.WARM and h.used == 110 * MIB
    await s.offload("b")  # the fake without `warm=` has no warm state: to cold
    assert h.state("b") is State.COLD
    await s.pin("c")
    with pytest.raises(Conflict, match="pinned"):
        await s.offload("c")
    await s.close()


async def test_a_warm_model_waiting_for_busy_ones_keeps_its_copy_unless_another_load_needs_it(
) -> None:
    h = harness([entry("a", 100, warm_mib=10), entry("b", 100), entry("c", 100),
                 entry("d", 50)], budget_mib=250, warm_tier=True)
    s = h.scheduler
    await _a_goes_warm(h)
    busy_b, busy_c = await hold(s, "b"), await hold(s, "c")
    waiting = asyncio.create_task(use(s, "a"))  # 90 MiB more, 40 free: waits for b or c
    await _until(lambda: h.state("a") is State.ADMITTING)
    await drain()
    assert h.status("a").bytes_warm == 10 * MIB  # its copy waits with it
    # d (50 MiB, 40 free) fits only if a's waiting copy goes: it does, to cold
    await asyncio.wait_for(use(s, "d"), 10)
    assert h.control.unloads == {"fake:100MiB?warm=10MiB": 1}
    (dropped,) = [e for e in h.events.of(EvictEvent) if e.model == "a" and e.tier_to == "cold"]
    assert (dropped.bytes, dropped.cause) == (10 * MIB, "make_room")
    await busy_b.release()
    await busy_c.release()
    await asyncio.wait_for(waiting, 10)
    assert h.control.loads["fake:100MiB?warm=10MiB"] == 2  # a whole load, no restore
    assert h.control.restores == {}
    assert max(h.events.gauges) <= h.capacity
    await s.close()


async def test_a_warm_model_that_waits_for_busy_ones_is_restored_after() -> None:
    h = _warm_pair()
    s = h.scheduler
    await _a_goes_warm(h)
    busy_b, busy_c = await hold(s, "b"), await hold(s, "c")
    waiting = asyncio.create_task(use(s, "a"))
    await _until(lambda: h.state("a") is State.ADMITTING)
    await busy_b.release()
    await busy_c.release()
    await asyncio.wait_for(waiting, 10)
    assert h.control.restores == {"fake:100MiB?warm=10MiB": 1}
    assert h.control.loads["fake:100MiB?warm=10MiB"] == 1
    await s.close()


async def test_a_quarantined_warm_model_is_unloaded() -> None:
    h = _warm_pair()
    s = h.scheduler
    await _a_goes_warm(h)
    s.quarantine("a", "crashed twice")
    await _until(lambda: h.state("a") is State.FAILED)
    assert h.state("a") is State.FAILED
    assert h.control.unloads == {"fake:100MiB?warm=10MiB": 1}
    assert h.used == 200 * MIB
    await s.close()


def test_a_waiting_loads_warm_copy_can_go_cold_but_its_requests_stay() -> None:
    waiting = resident("w", 100, state=State.ADMITTING, warm_mib=10, in_flight=3)
    cold_waiting = resident("n", 100, state=State.ADMITTING, in_flight=3)
    assert waiting.evictable and waiting.frees == 10 * MIB and waiting.evicted_to == "cold"
    assert not cold_waiting.evictable
    assert waiting.held == 10 * MIB
