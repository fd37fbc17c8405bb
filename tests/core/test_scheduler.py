"""Scheduler tests on CPU with the fake backend: no sockets, no weights, no sleeping to wait.

Each test builds a Scheduler directly from small factories (tests/core/factories.py), steers
loads through a fresh `FakeControl`, and waits on events or loop state with timeouts. Faults
(cancellation, failed loads and writes, pins, reloads) are in test_scheduler_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from pathlib import Path

import pytest

from packserve.core.events import EvictEvent, LoadEvent, LoadFailedEvent, LoadStartEvent
from packserve.core.loader import FootprintStore
from packserve.core.policy import Verdict
from packserve.core.scheduler import Scheduler
from packserve.core.status import PinStatus, Readiness
from packserve.errors import (
    Conflict,
    ModelNotFound,
    ModelUnavailable,
    NeverFits,
    PinsDoNotFit,
    QueueFull,
)
from packserve.types import State, Task
from tests.factories import (
    GIB,
    MIB,
    TIMEOUT,
    FakeProbe,
    Harness,
    Hold,
    backend_of,
    drain,
    entry,
    harness,
    hold,
    run,
    use,
)

# Coroutine tests run on asyncio through anyio's pytest plugin, each bounded in time.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(4 * TIMEOUT)]

# ------------------------------------------------------------------------- single flight


async def test_twenty_concurrent_acquires_on_a_cold_model_load_it_once() -> None:
    h = harness([entry("m")], budget_mib=1024)
    h.control.gate.clear()
    try:
        tasks = [asyncio.create_task(use(h.scheduler, "m")) for _ in range(20)]
        await drain()
        assert h.status("m").in_flight == 20
        assert await asyncio.to_thread(h.building.wait, TIMEOUT)
        assert h.state("m") is State.LOADING
        assert h.events.of(LoadEvent) == []
    finally:
        h.control.gate.set()
    backends = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)

    assert len(h.built) == 1
    assert h.control.loads == {"fake:100MiB": 1}
    assert h.events.names(LoadEvent) == ["m"]
    assert all(backend_of(b) is h.built[0] for b in backends)
    assert h.state("m") is State.HOT
    assert h.status("m").in_flight == 0
    await h.scheduler.close()


# ------------------------------------------------------------------------- eviction


async def test_lru_eviction_keeps_used_bytes_within_the_budget() -> None:
    h = harness([entry("a"), entry("b"), entry("c")], budget_mib=250)
    s = h.scheduler
    await use(s, "a")
    h.clock.advance(1)
    await use(s, "b")
    h.clock.advance(1)
    assert h.used == 200 * MIB
    assert h.events.of(EvictEvent) == []

    await use(s, "c")  # a is least recently used
    assert [(e.model, e.bytes) for e in h.events.of(EvictEvent)] == [("a", 100 * MIB)]
    assert [h.state(n) for n in "abc"] == [State.COLD, State.HOT, State.HOT]
    h.clock.advance(1)

    await use(s, "a")  # back in; now b is least recently used
    assert h.events.names(EvictEvent) == ["a", "b"]
    assert [h.state(n) for n in "abc"] == [State.HOT, State.COLD, State.HOT]
    assert h.events.names(LoadEvent) == ["a", "b", "c", "a"]
    assert h.control.unloads == {"fake:100MiB": 2}
    assert h.probe.releases == 2 + 4  # after each unload, and before each of 4 loads

    assert h.used == 200 * MIB == h.loaded_bytes()
    assert max(h.events.gauges) <= h.capacity
    await s.close()


async def test_recent_use_protects_a_model_from_eviction() -> None:
    h = harness([entry("a"), entry("b"), entry("c")], budget_mib=250)
    s = h.scheduler
    await use(s, "a")
    h.clock.advance(1)
    await use(s, "b")
    h.clock.advance(1)
    await use(s, "a")  # a is now more recent than b
    h.clock.advance(1)
    await use(s, "c")
    assert h.events.names(EvictEvent) == ["b"]
    assert h.state("a") is State.HOT
    await s.close()


async def test_model_with_a_lease_is_never_evicted_the_load_waits_for_it() -> None:
    h = harness([entry("a"), entry("b")], budget_mib=150)
    s = h.scheduler
    holder = await hold(s, "a")
    assert s.plan("b").verdict is Verdict.WAIT_FOR_BUSY

    b = asyncio.create_task(use(s, "b"))
    await drain()  # b reaches admission, finds a busy, and waits for memory
    assert h.state("b") is State.ADMITTING  # waiting for admission holds nothing
    assert h.used == 100 * MIB
    assert not b.done()
    assert h.state("a") is State.HOT
    assert h.events.of(EvictEvent) == []
    assert h.events.names(LoadEvent) == ["a"]

    await holder.release()
    await asyncio.wait_for(b, TIMEOUT)
    assert h.events.names(EvictEvent) == ["a"]
    assert h.events.names(LoadEvent) == ["a", "b"]
    assert (h.state("a"), h.state("b")) == (State.COLD, State.HOT)
    assert max(h.events.gauges) <= h.capacity
    await s.close()


async def test_load_waiting_on_a_busy_model_times_out_with_503() -> None:
    h = harness([entry("a"), entry("b")], budget_mib=150, real_clock=True, load_wait_s=0.05)
    s = h.scheduler
    holder = await hold(s, "a")
    with pytest.raises(ModelUnavailable) as caught:
        await use(s, "b")
    err = caught.value
    assert err.status == 503
    assert err.retry_after_s >= 1
    assert err.headers == {"Retry-After": str(err.retry_after_s)}
    assert "waiting for memory" in err.message
    assert (h.state("a"), h.state("b")) == (State.HOT, State.COLD)
    assert h.events.of(EvictEvent) == []
    assert len(h.built) == 1

    await holder.release()
    await use(s, "b")  # memory frees up once the lease ends
    assert (h.state("a"), h.state("b")) == (State.COLD, State.HOT)
    await s.close()


async def _b_waits_for_busy_a(load_turn: float, b_slo_s: float, *, real_clock: bool = False
                              ) -> tuple[Harness, Hold, asyncio.Task[object]]:
    """a holds a lease; b's load, which must evict a, waits for it with a request due in
    `b_slo_s`."""
    h = harness([entry("a"), entry("b")], budget_mib=150, load_turn=load_turn,
                real_clock=real_clock)
    holder = await hold(h.scheduler, "a")
    b: asyncio.Task[object] = asyncio.create_task(use(h.scheduler, "b", slo_s=b_slo_s))
    await drain()
    assert h.scheduler.plan("b").verdict is Verdict.WAIT_FOR_BUSY
    return h, holder, b


async def test_a_waiting_load_gets_its_turn_before_later_requests_for_the_busy_model() -> None:
    """a is busy when b's load must evict it: a request for a that arrives afterwards waits
    behind b's load instead of keeping a busy for ever."""
    h, holder, b = await _b_waits_for_busy_a(0.5, 4.0)
    s = h.scheduler
    plan = s.plan("b")
    assert "new requests for a wait behind it" in plan.reason
    assert plan.draining == ("a",)
    await asyncio.wait_for(use(s, "a", slo_s=60.0), TIMEOUT)  # b is not at risk yet: a goes
    h.clock.advance(2.0)  # b's request has waited half its SLO: b's load takes its turn

    later = asyncio.create_task(use(s, "a", slo_s=60.0))
    await drain()
    assert not later.done()  # held behind b's load: a is HOT, it would be served at once
    await holder.release()
    await asyncio.wait_for(asyncio.gather(b, later), TIMEOUT)
    # b loaded once a drained; the later request for a then brought a back.
    assert h.events.names(LoadEvent) == ["a", "b", "a"]
    assert h.events.names(EvictEvent) == ["a", "b"]
    await s.close()


async def test_without_load_turns_later_requests_for_the_busy_model_go_first() -> None:
    h, holder, b = await _b_waits_for_busy_a(0.0, 4.0)
    s = h.scheduler
    await asyncio.wait_for(use(s, "a", slo_s=60.0), TIMEOUT)  # a goes ahead of b's load
    assert h.events.names(LoadEvent) == ["a"]
    await holder.release()
    await asyncio.wait_for(b, TIMEOUT)
    assert h.events.names(LoadEvent) == ["a", "b"]
    await s.close()


async def test_a_held_request_waits_at_most_its_share_of_its_slo() -> None:
    """b's load waits for a long request on a; a request for a that cannot afford to wait that
    long goes ahead after load_turn x its SLO."""
    h, holder, b = await _b_waits_for_busy_a(0.5, 0.01, real_clock=True)
    s = h.scheduler
    await asyncio.sleep(0.01)  # b's request is past half its SLO
    t0 = time.monotonic()
    await asyncio.wait_for(use(s, "a", slo_s=0.1), TIMEOUT)  # held 0.05 s, then served
    assert 0.05 <= time.monotonic() - t0 < TIMEOUT
    assert h.events.names(LoadEvent) == ["a"]
    assert not b.done()
    await holder.release()
    await asyncio.wait_for(b, TIMEOUT)
    await s.close()


async def test_a_request_due_before_the_waiting_load_goes_first() -> None:
    """Earliest deadline first: b's load serves a request due in 60 s and is at risk after 30;
    then a request for a due in 1 s is not held behind it, and one due in 120 s is."""
    h, holder, b = await _b_waits_for_busy_a(0.5, 60.0)
    s = h.scheduler
    h.clock.advance(30.0)
    await asyncio.wait_for(use(s, "a", slo_s=1.0), TIMEOUT)
    later = asyncio.create_task(use(s, "a", slo_s=120.0))
    await drain()
    assert not later.done()
    assert h.events.names(LoadEvent) == ["a"]
    await holder.release()
    await asyncio.wait_for(asyncio.gather(b, later), TIMEOUT)
    assert h.events.names(LoadEvent) == ["a", "b", "a"]
    await s.close()


async def test_a_failed_load_leaves_no_turn_behind_for_the_next_one() -> None:
    """A request refused during a failure's cooldown never joined a load: the next load of that
    model is not at risk from the refused request's deadline."""
    h = harness([entry("a"), entry("b")], budget_mib=150, load_turn=0.5,
                failure_cooldown_s=10.0)
    s = h.scheduler
    h.control.fail_next = 1
    h.control.failure = lambda name: RuntimeError(f"{name}: unsupported architecture")
    with pytest.raises(ModelUnavailable):
        await use(s, "b", slo_s=1.0)  # the load fails: b is FAILED for 10 s
    with pytest.raises(ModelUnavailable):
        await use(s, "b", slo_s=1.0)  # refused in the cooldown
    h.clock.advance(20.0)
    holder = await hold(s, "a")
    b = asyncio.create_task(use(s, "b", slo_s=60.0))  # at risk only 30 s from now
    await drain()
    await asyncio.wait_for(use(s, "a", slo_s=60.0), TIMEOUT)  # not held
    await holder.release()
    await asyncio.wait_for(b, TIMEOUT)
    await s.close()


async def test_a_request_cancelled_while_held_gives_its_slot_back() -> None:
    h = harness([entry("a"), entry("b", max_concurrency=2)], budget_mib=150,
                load_turn=0.5)
    s = h.scheduler
    holder = await hold(s, "b")
    a = asyncio.create_task(use(s, "a", slo_s=1.0))  # a's load waits for b
    await drain()
    h.clock.advance(0.5)
    later = asyncio.create_task(use(s, "b", slo_s=60.0))  # takes b's second slot, held
    await drain()
    assert not later.done()
    later.cancel()
    with pytest.raises(asyncio.CancelledError):
        await later
    third = asyncio.create_task(use(s, "b", slo_s=60.0))
    await drain()
    assert h.status("b").queued == 0  # it has the slot that `later` gave back, and waits
    await holder.release()
    await asyncio.wait_for(asyncio.gather(a, third), TIMEOUT)
    assert h.events.names(LoadEvent) == ["b", "a", "b"]
    await s.close()


# ------------------------------------------------------------------------- pins


async def test_check_pins_names_models_and_numbers_when_pins_exceed_the_budget() -> None:
    h = harness([entry("emb", 100, pin=True), entry("chat", 60, pin=True), entry("free")],
                budget_mib=200, headroom_mib=50)
    with pytest.raises(PinsDoNotFit) as caught:
        h.scheduler.check_pins()
    message = caught.value.message
    assert "emb 100.0 MiB" in message
    assert "chat 60.0 MiB" in message
    assert "160.0 MiB" in message
    assert "150.0 MiB" in message
    assert "free" not in message

    with pytest.raises(PinsDoNotFit):
        await h.scheduler.start()
    assert h.built == []


async def test_pins_that_fit_pass_the_check() -> None:
    h = harness([entry("emb", 100, pin=True), entry("chat", 50, pin=True)], budget_mib=150)
    h.scheduler.check_pins()


async def test_start_loads_pins_and_only_pins() -> None:
    h = harness([entry("p", pin=True), entry("a")], budget_mib=1024)
    s = h.scheduler
    assert s.ready() == Readiness(ready=False, pins=(
        PinStatus(model="p", state=State.COLD, error=None, next_retry_s=None),))
    await s.start()
    assert (h.state("p"), h.state("a")) == (State.HOT, State.COLD)
    assert s.ready() == Readiness(ready=True, pins=())
    assert h.events.names(LoadEvent) == ["p"]
    await s.close()


async def test_pinned_model_is_never_evicted_even_when_least_recently_used() -> None:
    h = harness([entry("p", pin=True), entry("a"), entry("b")], budget_mib=250)
    s = h.scheduler
    await s.start()
    h.clock.advance(1)
    await use(s, "a")
    h.clock.advance(1)
    await use(s, "b")
    h.clock.advance(1)
    await use(s, "a")
    assert h.events.names(EvictEvent) == ["a", "b"]
    assert h.state("p") is State.HOT
    assert h.events.names(LoadEvent).count("p") == 1
    assert max(h.events.gauges) <= h.capacity
    await s.close()


# ------------------------------------------------------------------------- never fits


async def test_model_larger_than_the_budget_never_fits_507() -> None:
    h = harness([entry("big", 200)], budget_mib=150)
    with pytest.raises(NeverFits) as caught:
        await use(h.scheduler, "big")
    assert caught.value.status == 507
    assert "big needs 200.0 MiB" in caught.value.message
    assert "budget of 150.0 MiB" in caught.value.message
    assert h.built == []
    assert h.state("big") is State.COLD


async def test_model_that_fits_only_without_the_pins_never_fits_and_names_them() -> None:
    h = harness([entry("p", pin=True), entry("big", 200)], budget_mib=250)
    await h.scheduler.start()
    with pytest.raises(NeverFits) as caught:
        await use(h.scheduler, "big")
    assert "pinned models hold 100.0 MiB" in caught.value.message
    assert "p (100.0 MiB)" in caught.value.message
    assert h.state("p") is State.HOT
    assert h.events.of(EvictEvent) == []
    await h.scheduler.close()


# ------------------------------------------------------------------------- load failures


async def test_failed_load_evicts_idle_models_and_retries_once() -> None:
    h = harness([entry("idle"), entry("busy"), entry("m")], budget_mib=1024)
    s = h.scheduler
    await use(s, "idle")
    holder = await hold(s, "busy")
    h.control.fail_next = 1

    await use(s, "m")
    failures = h.events.of(LoadFailedEvent)
    assert [(f.model, f.will_retry) for f in failures] == [("m", True)]
    assert "MemoryError" in failures[0].reason
    assert h.events.names(EvictEvent) == ["idle"]
    kinds = [(e.kind, e.model) for e in h.events.events]
    assert kinds.index(("failure", "m")) < kinds.index(("evict", "idle")) \
        < kinds.index(("load", "m"))
    assert [h.state(n) for n in ("idle", "busy", "m")] == [State.COLD, State.HOT, State.HOT]
    assert h.status("m").error is None

    await holder.release()
    await s.close()


async def test_second_failure_marks_failed_and_honours_the_cooldown() -> None:
    h = harness([entry("ok"), entry("m")], budget_mib=1024, failure_cooldown_s=30)
    s = h.scheduler
    await use(s, "ok")
    h.control.fail_next = 2

    with pytest.raises(ModelUnavailable) as caught:
        await use(s, "m")
    assert caught.value.status == 503
    assert caught.value.retry_after_s >= 1
    assert h.state("m") is State.FAILED
    error = h.status("m").error
    assert error is not None
    assert "MemoryError" in error
    assert [f.will_retry for f in h.events.of(LoadFailedEvent)] == [True, False]
    attempts = len(h.built)

    h.clock.advance(10)
    with pytest.raises(ModelUnavailable) as caught:
        await use(s, "m")
    assert caught.value.retry_after_s == 21  # 20 s of cooldown left, rounded up
    assert "MemoryError" in caught.value.message
    assert len(h.built) == attempts  # no load attempted during the cooldown

    await use(s, "ok")  # other models keep serving
    assert h.state("ok") is State.HOT

    h.clock.advance(21)
    await use(s, "m")
    assert h.state("m") is State.HOT
    assert h.status("m").error is None
    await s.close()


async def test_waiters_on_a_failing_load_all_get_503() -> None:
    h = harness([entry("m")], budget_mib=1024)
    h.control.fail_next = 2
    h.control.gate.clear()
    try:
        tasks = [asyncio.create_task(use(h.scheduler, "m")) for _ in range(5)]
        await drain()
        assert h.status("m").in_flight == 5
    finally:
        h.control.gate.set()
    results = await asyncio.wait_for(
        asyncio.gather(*tasks, return_exceptions=True), TIMEOUT)
    assert all(isinstance(r, ModelUnavailable) for r in results)
    assert len(h.built) == 2  # the first attempt and its one retry, shared by all five
    assert h.status("m").in_flight == 0


# ------------------------------------------------------------------------- quotas


async def test_queue_full_gets_429_and_the_queued_request_runs_after_the_first() -> None:
    h = harness([entry("q", max_concurrency=1, max_queue=1)], budget_mib=1024)
    s = h.scheduler
    first = await hold(s, "q")
    second = asyncio.create_task(use(s, "q"))
    await drain()
    assert h.status("q").queued == 1

    with pytest.raises(QueueFull) as caught:
        await asyncio.wait_for(use(s, "q"), TIMEOUT)
    err = caught.value
    assert err.status == 429
    assert err.retry_after_s >= 1
    assert err.headers == {"Retry-After": str(err.retry_after_s)}
    assert not second.done()
    assert (h.status("q").in_flight, h.status("q").queued) == (1, 1)

    await first.release()
    await asyncio.wait_for(second, TIMEOUT)
    assert (h.status("q").in_flight, h.status("q").queued) == (0, 0)
    await s.close()


# ------------------------------------------------------------------------- dry run


async def test_plan_names_victims_by_catalog_name_and_changes_nothing() -> None:
    h = harness([entry("x", weights="shared"), entry("y", weights="shared"), entry("b"),
                 entry("c")], budget_mib=250)
    s = h.scheduler
    await use(s, "x")
    h.clock.advance(1)
    await use(s, "b")
    h.clock.advance(1)
    before = ([h.state(n) for n in "xybc"], len(h.events.events), len(h.built), h.used)

    answer = s.plan("c")
    assert answer.verdict is Verdict.FITS_AFTER_EVICTION
    assert answer.target == "c"
    assert answer.victims == ("x+y",)
    assert "evicting x+y" in answer.reason
    assert s.plan("b").verdict is Verdict.ALREADY_LOADED

    after = ([h.state(n) for n in "xybc"], len(h.events.events), len(h.built), h.used)
    assert after == before
    await s.close()


# ------------------------------------------------------------------------- shared weights


async def test_models_with_equal_load_specs_share_one_load_counted_once() -> None:
    h = harness([entry("x", weights="w"),
                 entry("y", weights="w", tasks=(Task.RERANK,))], budget_mib=1024)
    s = h.scheduler
    bx = await use(s, "x")
    by = await use(s, "y", Task.RERANK)
    assert bx is by
    assert len(h.built) == 1
    assert h.events.names(LoadEvent) == ["x+y"]
    assert (h.state("x"), h.state("y")) == (State.HOT, State.HOT)
    assert s.devices()[0].used_bytes == 100 * MIB
    assert h.status("x").shares_weights_with == ("y",)
    await s.close()


# ------------------------------------------------------------------------- footprints


def test_measured_footprint_is_persisted_and_used_by_a_new_scheduler(tmp_path: Path) -> None:
    path = tmp_path / "f.json"

    async def first() -> None:
        h = harness([entry("m", 50, declared_mib=100)], budget_mib=1024,
                    store=FootprintStore(path))
        await use(h.scheduler, "m")
        (load,) = h.events.of(LoadEvent)
        assert (load.bytes_estimated, load.bytes_measured) == (50 * MIB, 100 * MIB)
        assert h.status("m").bytes_measured == 100 * MIB
        await h.scheduler.close()

    async def second() -> None:
        # The estimate (50 MiB) would fit in 80 MiB; the measured 100 MiB does not.
        h = harness([entry("m", 50, declared_mib=100)], budget_mib=80,
                    store=FootprintStore(path))
        assert h.status("m").bytes_measured == 100 * MIB
        assert h.scheduler.plan("m").need_bytes == 100 * MIB
        with pytest.raises(NeverFits):
            await use(h.scheduler, "m")
        assert h.built == []

    run(first())
    assert path.exists()
    run(second())


# ------------------------------------------------------------------------- admin


async def test_unload_of_a_pinned_model_is_a_conflict() -> None:
    h = harness([entry("p", pin=True)], budget_mib=1024)
    await h.scheduler.start()
    with pytest.raises(Conflict) as caught:
        await h.scheduler.unload("p")
    assert caught.value.status == 409
    assert h.state("p") is State.HOT
    await h.scheduler.close()


async def test_unload_of_a_busy_model_is_a_conflict_and_of_an_idle_one_works() -> None:
    h = harness([entry("a")], budget_mib=1024)
    s = h.scheduler
    holder = await hold(s, "a")
    with pytest.raises(Conflict) as caught:
        await s.unload("a")
    assert caught.value.status == 409
    assert h.state("a") is State.HOT
    assert h.events.of(EvictEvent) == []

    await holder.release()
    await s.unload("a")
    assert h.state("a") is State.COLD
    assert [e.reason for e in h.events.of(EvictEvent)] == ["unloaded by operator"]
    assert h.used == 0 == h.loaded_bytes()


async def test_unknown_model_is_not_found() -> None:
    h = harness([entry("a")], budget_mib=1024)
    with pytest.raises(ModelNotFound) as caught:
        await use(h.scheduler, "nope")
    assert caught.value.status == 404
    assert "a" in caught.value.message


# ------------------------------------------------------------------------- max_memory quota


async def test_estimate_over_max_memory_never_fits_without_loading() -> None:
    h = harness([entry("m", 100, max_memory=50 * MIB)], budget_mib=1024)
    with pytest.raises(NeverFits) as caught:
        await use(h.scheduler, "m")
    assert caught.value.status == 507
    assert "max_memory" in caught.value.message
    assert h.built == []
    assert h.state("m") is State.COLD


async def _request(scheduler: Scheduler, name: str) -> None:
    await use(scheduler, name)


async def _admin_load(scheduler: Scheduler, name: str) -> None:
    await scheduler.load(name)


@pytest.mark.parametrize("load", [_request, _admin_load], ids=["request", "admin-load"])
async def test_measured_footprint_over_max_memory_never_fits_and_is_unloaded(
    load: Callable[[Scheduler, str], Coroutine[object, object, None]],
) -> None:
    # Estimated 50 MiB passes the 80 MiB quota; the load then measures 100 MiB.
    h = harness([entry("m", 50, declared_mib=100, max_memory=80 * MIB)], budget_mib=1024)
    with pytest.raises(NeverFits) as caught:
        await load(h.scheduler, "m")
    assert caught.value.status == 507
    assert "max_memory" in caught.value.message
    assert h.state("m") is State.COLD
    assert len(h.built) == 1  # a quota verdict is not a load failure: no retry
    assert h.loaded_bytes() == 0  # nothing left holding memory
    assert h.used == 0
    # The engine load ran (LoadStartEvent), so it ends with exactly one LoadFailedEvent.
    (failure,) = h.events.of(LoadFailedEvent)
    assert not failure.will_retry and "max_memory" in failure.reason
    assert len(h.events.of(LoadStartEvent)) == 1


async def test_live_objects_are_settled_only_when_no_other_model_is_loaded() -> None:
    h = harness([entry("a"), entry("b")], budget_mib=1024)
    probe = h.scheduler._loader.probe
    assert isinstance(probe, FakeProbe)
    await use(h.scheduler, "a")  # nothing else loaded: settle
    await use(h.scheduler, "b")  # `a` is loaded: its objects must stay collectable
    assert probe.settles == 1
    await h.scheduler.unload("a")
    await h.scheduler.unload("b")
    await use(h.scheduler, "a")
    assert probe.settles == 2
    await h.scheduler.close()


async def test_a_load_that_measures_over_its_estimate_sheds_idle_models_to_stay_in_budget() -> None:
    # 100 + 250 fits 400 by the estimates; `big` then measures 320, 20 MiB over.
    h = harness([entry("small", 100), entry("other", 30), entry("big", 250, declared_mib=320)],
                budget_mib=400)
    s = h.scheduler
    await use(s, "small")
    await use(s, "other")
    await use(s, "big")
    assert h.used <= 400 * MIB
    assert h.state("big") is State.HOT
    (shed,) = [e for e in h.events.of(EvictEvent) if e.cause == "overshoot"]
    assert shed.model == "small"  # the policy's choice: LRU, enough bytes in one
    assert shed.reason == "big measured more than its estimate" and shed.why
    assert h.state("other") is State.HOT
    await s.close()


async def test_a_load_that_measures_over_the_whole_budget_never_fits_and_is_unloaded() -> None:
    h = harness([entry("m", 300, declared_mib=500)], budget_mib=400)
    with pytest.raises(NeverFits) as caught:
        await use(h.scheduler, "m")
    assert "whole budget" in caught.value.message and "500" in caught.value.message
    assert h.state("m") is State.COLD and h.used == 0


class GrowingProbe(FakeProbe):
    """Reports `grow` more bytes on every other reading: a load measures exactly `grow`."""

    def __init__(self, grows: list[int]) -> None:
        super().__init__()
        self.grows = grows
        self.readings = 0

    def used_bytes(self, device: str) -> int:
        self.readings += 1
        if self.readings % 2:  # before a load
            return GIB
        return GIB + self.grows.pop(0)  # after it


async def test_a_lower_reading_on_reload_does_not_shrink_the_counted_footprint() -> None:
    h = harness([entry("a")], budget_mib=500)
    h.scheduler._loader.probe = GrowingProbe([150 * MIB, 0])  # a reload reusing freed pages
    await use(h.scheduler, "a")
    assert h.status("a").bytes_measured == 150 * MIB
    await h.scheduler.unload("a")
    await use(h.scheduler, "a")  # measures only the declared 100 MiB this time
    assert h.status("a").bytes_measured == 150 * MIB
    assert h.used == 150 * MIB
    await h.scheduler.close()


def test_the_footprint_store_answers_the_median_of_recent_measurements(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    load = entry("m").load
    store = FootprintStore(path)
    for mib in (100, 100, 400):  # one reading taken next to busy requests
        store.put(load, mib * MIB)
    assert store.get(load) == 100 * MIB
    assert FootprintStore(path).get(load) == 100 * MIB  # across a restart too
    for mib in (400, 400, 400):  # it really grew: the last five are what counts
        store.put(load, mib * MIB)
    assert store.get(load) == 400 * MIB
    assert json.loads(path.read_text("utf-8"))[load.key]["history"] == [
        100 * MIB, 400 * MIB, 400 * MIB, 400 * MIB, 400 * MIB]
    # a row written before histories were kept is read, then replaced by new readings
    path.write_text(json.dumps({load.key: {"bytes": 999 * MIB, "file_bytes": -1}}), "utf-8")
    old = FootprintStore(path)
    assert old.get(load) == 999 * MIB
    old.put(load, 120 * MIB)
    assert old.get(load) == 120 * MIB
