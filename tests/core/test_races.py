"""The races that took peer servers down, as tests (issue 32): fake engines, the test's clock.

Each test names the guard it covers in `GUARDS` (file, and the statement, found by
`test_every_named_guard_is_where_it_says`, which prints its line). Each was run with its guard
disabled and failed; the closing note of the change that added them says how each failed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from packserve.core.events import EvictEvent, LoadEvent
from packserve.types import State
from tests.factories import MIB, TIMEOUT, backend_of, drain, entry, harness, hold, use

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(4 * TIMEOUT)]

SRC = Path(__file__).resolve().parents[2] / "src" / "packserve"

# test -> (file under src/packserve, the guard's statement, exactly as written there)
GUARDS = {
    "test_a_request_for_a_model_being_evicted_waits_for_the_unload_then_loads_it_anew": (
        "core/scheduler.py", "if res.state is State.UNLOADING:"),
    "test_a_model_loaded_for_a_request_is_not_evicted_before_that_request_has_it": (
        "core/scheduler.py", "res.leases += 1"),
    "test_two_loads_on_one_device_run_one_at_a_time_and_measure_only_themselves": (
        "core/scheduler.py", "async with self._device_lock(device, f\"model {res.label}\""),
    "test_requests_that_caused_a_load_are_all_served_before_it_is_evicted": (
        "core/policy.py", "return self.state is State.HOT and self.in_flight == 0"),
}


@pytest.mark.parametrize("test", sorted(GUARDS))
def test_every_named_guard_is_where_it_says(test: str) -> None:
    path, statement = GUARDS[test]
    lines = (SRC / path).read_text().splitlines()
    found = [n for n, line in enumerate(lines, 1) if statement in line]
    assert found, f"{test}: the guard {statement!r} is no longer in {path}; rename it here"
    print(f"{test}: {path}:{found[0]}")


async def test_a_request_for_a_model_being_evicted_waits_for_the_unload_then_loads_it_anew(
) -> None:
    """Ollama #17408: a request revived a model mid-eviction and the scheduler deadlocked.
    Here a request for `a` while `a` unloads (to make room for `b`) waits for the unload to
    end, then `a` loads again, evicting `b` once `b` is idle: nothing hangs, nothing runs on
    a half-unloaded engine."""
    h = harness([entry("a"), entry("b")], budget_mib=150)
    s = h.scheduler
    first = backend_of(await use(s, "a"))
    h.control.unload_gate.clear()
    try:
        b = asyncio.create_task(use(s, "b"))
        await drain()
        assert h.state("a") is State.UNLOADING  # a's eviction is in the engine
        again = asyncio.create_task(use(s, "a"))
        await drain()
        assert not again.done()  # it waits for the unload; it is not lent the old engine
    finally:
        h.control.unload_gate.set()
    await asyncio.wait_for(asyncio.gather(b, again), TIMEOUT)
    assert backend_of(again.result()) is not first  # a new load, not the evicted engine
    assert h.events.names(LoadEvent) == ["a", "b", "a"]
    assert h.events.names(EvictEvent) == ["a", "b"]
    assert h.used == 100 * MIB == h.loaded_bytes()
    await s.close()


async def test_a_model_loaded_for_a_request_is_not_evicted_before_that_request_has_it(
) -> None:
    """llama.cpp #28698: a model was evicted between "loaded" and "request forwarded". Here the
    load of `b`, waiting for the device lock while `a` loads, cannot take `a` away before a's
    request holds it: that request counts as a lease from the moment it asked, so `a` is busy
    to every eviction plan, and `b` waits until a's request is done."""
    h = harness([entry("a"), entry("b")], budget_mib=150)
    s = h.scheduler
    h.control.gate.clear()
    try:
        a = asyncio.create_task(hold(s, "a"))
        assert await asyncio.to_thread(h.building.wait, TIMEOUT)  # a's engine holds the lock
        b = asyncio.create_task(use(s, "b"))
        await drain()
        assert h.state("b") is State.ADMITTING  # waiting for the device lock
    finally:
        h.control.gate.set()
    holder = await asyncio.wait_for(a, TIMEOUT)
    await drain()
    assert h.state("a") is State.HOT and h.control.unloads == {}
    assert not b.done()  # b waits for a's request to end
    await holder.release()
    await asyncio.wait_for(b, TIMEOUT)
    assert h.events.names(LoadEvent) == ["a", "b"]  # a was served by its one load
    await s.close()


async def test_two_loads_on_one_device_run_one_at_a_time_and_measure_only_themselves() -> None:
    """vLLM #55827: two loads on one device measured each other's memory. Here the second load
    waits for the device lock while the first is in its engine, and each footprint is its
    own."""
    h = harness([entry("a", 100), entry("b", 200)], budget_mib=1024)
    s = h.scheduler
    h.control.gate.clear()
    try:
        a = asyncio.create_task(use(s, "a"))
        assert await asyncio.to_thread(h.building.wait, TIMEOUT)
        b = asyncio.create_task(use(s, "b"))
        await drain()
        assert len(h.built) == 1  # b's engine has not started: it waits for the device
        assert h.state("b") is State.ADMITTING
    finally:
        h.control.gate.set()
    await asyncio.wait_for(asyncio.gather(a, b), TIMEOUT)
    measured = {e.model: e.bytes_measured for e in h.events.of(LoadEvent)}
    assert measured == {"a": 100 * MIB, "b": 200 * MIB}
    await s.close()


async def test_requests_that_caused_a_load_are_all_served_before_it_is_evicted() -> None:
    """llama-swap #612: under alternating demand a model was evicted before it served the
    requests that caused its load, and the two models thrashed. Here eight requests arrive at
    once, a b a b ... on a device with room for one: a loads and serves its four, then b
    loads and serves its four. Two loads; swapping per request (what a scheduler that lends a
    model only once loaded, or evicts by recency alone, does) would be eight."""
    h = harness([entry("a"), entry("b")], budget_mib=150)
    s = h.scheduler
    order: list[str] = []

    async def request(name: str) -> None:
        await use(s, name)
        order.append(name)

    await asyncio.wait_for(asyncio.gather(*(request(n) for n in "abababab")), TIMEOUT)
    assert h.events.names(LoadEvent) == ["a", "b"]
    assert h.events.names(EvictEvent) == ["a"]
    assert order == ["a"] * 4 + ["b"] * 4
    await s.close()
