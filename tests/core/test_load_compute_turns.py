"""A load competes for compute as the request it serves would: the scheduler holds the engine's
`working` around a load and a restore, at the deadline and SLO of the earliest request waiting
for it (runners on a CPU take turns by deadline, `backends.runner.Turns`), and a load
nobody waits on with a deadline (a pin) competes as a request due now, with the shortest SLO.
The turn is taken when the engine call starts: a more urgent waiter that comes later does not
move it."""

from __future__ import annotations

import asyncio

import pytest

from packserve.core.resident import UNWAITED_LOAD_SLO_S
from tests.factories import TIMEOUT, drain, entry, harness, use

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(4 * TIMEOUT)]


async def test_a_load_competes_at_the_deadline_of_the_earliest_request_waiting() -> None:
    h = harness([entry("m")], budget_mib=1024)
    h.control.gate.clear()
    late = asyncio.create_task(use(h.scheduler, "m", slo_s=30.0))
    await drain()  # the load is in the engine now: it took the only waiter's deadline
    urgent = asyncio.create_task(use(h.scheduler, "m", slo_s=0.5))
    await drain()
    h.control.gate.set()
    await asyncio.wait_for(asyncio.gather(late, urgent), TIMEOUT)
    assert h.control.turns == [("fake:100MiB", h.clock.now + 30.0, 30.0)]
    await h.scheduler.close()


async def test_the_earliest_deadline_among_waiters_is_the_loads() -> None:
    h = harness([entry("m")], budget_mib=1024, check_files=True)  # a thread trip first
    tasks = [asyncio.create_task(use(h.scheduler, "m", slo_s=slo)) for slo in (30.0, 0.5, 4.0)]
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
    assert h.control.turns == [("fake:100MiB", h.clock.now + 0.5, 0.5)]
    await h.scheduler.close()


async def test_a_pins_load_competes_as_a_request_due_now() -> None:
    h = harness([entry("p", pin=True)], budget_mib=1024, load_wait_s=45.0)
    await h.scheduler.start()
    assert h.control.turns == [("fake:100MiB", h.clock.now, UNWAITED_LOAD_SLO_S)]
    await h.scheduler.close()


async def test_a_restore_competes_at_its_requests_deadline() -> None:
    h = harness([entry("a", 100, warm_mib=10), entry("b", 200)], budget_mib=250, warm_tier=True)
    await use(h.scheduler, "a", slo_s=2.0)
    h.clock.advance(1)
    await use(h.scheduler, "b", slo_s=2.0)  # a goes warm
    h.clock.advance(1)
    await use(h.scheduler, "a", slo_s=3.0)  # restored, b evicted
    assert h.control.restores == {"fake:100MiB?warm=10MiB": 1}
    assert h.control.turns[-1] == ("fake:100MiB?warm=10MiB", h.clock.now + 3.0, 3.0)
    await h.scheduler.close()
