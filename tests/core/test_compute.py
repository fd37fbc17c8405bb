"""The compute gate (packserve.core.compute): earliest deadline first, a late request competes as
fresh work. Threads coordinate through events; nothing here depends on how long anything takes."""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable

import pytest

from packserve.core.compute import (
    TICKET,
    ComputeGate,
    Gates,
    Ticket,
    turn,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _in_thread(fn: Callable[[], None], ticket: Ticket | None = None) -> threading.Thread:
    """Run `fn` in a thread whose context holds `ticket`, as asyncio.to_thread would."""
    ctx = contextvars.copy_context()
    ctx.run(TICKET.set, ticket)
    thread = threading.Thread(target=ctx.run, args=(fn,), daemon=True)
    thread.start()
    return thread


def _wait_until(cond: Callable[[], bool]) -> None:
    done = threading.Event()
    for _ in range(2000):
        if cond():
            return
        done.wait(0.005)
    raise AssertionError("condition never came true")


def test_waiters_get_the_turn_earliest_deadline_first() -> None:
    gate = ComputeGate("cpu", clock=Clock())
    holder = gate.ticket("gen", slo_s=100)
    gate.acquire(holder)
    order: list[str] = []
    threads = []
    for name, deadline in (("late", 3.0), ("early", 1.0), ("middle", 2.0)):
        t = gate.ticket(name, slo_s=deadline)

        def work(name: str = name, t: Ticket = t) -> None:
            with turn():
                order.append(name)
        threads.append(_in_thread(work, t))
        queued = len(threads)
        _wait_until(lambda: gate.waiting == queued)  # noqa: B023 (called at once)
    gate.release(holder)
    for thread in threads:
        thread.join(5)
    assert order == ["early", "middle", "late"]


def test_turns_nest_and_nothing_is_gated_outside_a_request() -> None:
    gate = ComputeGate("cpu")
    t = gate.ticket("m", slo_s=1.0)
    token = TICKET.set(t)
    try:
        with turn(), turn():
            assert gate.busy_units == 1
        assert gate.busy_units == 0
    finally:
        TICKET.reset(token)
    with turn():  # no ticket: a load, or a backend tested alone
        assert gate.busy_units == 0


def test_a_disabled_gate_lets_calls_run_together() -> None:
    gates = Gates(enabled=False)
    gate = gates.of("cpu")
    inside = threading.Barrier(2, timeout=5)

    def work() -> None:
        with turn():
            inside.wait()  # both inside at once, or the barrier times out

    threads = [_in_thread(work, gate.ticket(f"m{i}", slo_s=1.0)) for i in range(2)]
    for thread in threads:
        thread.join(5)
    assert not inside.broken
    assert gates.of("cpu") is gate and gates.all() == [gate]


def test_a_request_past_its_deadline_competes_as_fresh_work() -> None:
    clock = Clock()
    gate = ComputeGate("cpu", clock=clock)
    late = gate.ticket("chat", slo_s=4.0, arrived=0.0)  # waited for a load: deadline 4
    clock.now = 10.0
    fresh = gate.ticket("embed", slo_s=0.5)  # deadline 10.5
    holder = gate.ticket("other", slo_s=100.0)
    gate.acquire(holder)
    order: list[str] = []

    def work(name: str) -> None:
        with turn():
            order.append(name)

    threads = [_in_thread(functools.partial(work, "chat"), late)]
    _wait_until(lambda: gate.waiting == 1)
    assert late.deadline == pytest.approx(12.0)  # moved on by whole SLOs past now
    threads.append(_in_thread(functools.partial(work, "embed"), fresh))
    _wait_until(lambda: gate.waiting == 2)
    gate.release(holder)
    for thread in threads:
        thread.join(5)
    assert order == ["embed", "chat"]
