"""The compute gate (packserve.core.compute): earliest deadline first, generation yields between
tokens. Threads coordinate through events; nothing here depends on how long anything takes."""

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
    between_tokens,
    step_units,
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


def test_a_generation_hands_its_turn_to_tighter_work_between_tokens() -> None:
    gate = ComputeGate("cpu", clock=Clock())
    gen = gate.ticket("chat", slo_s=4.0)
    embed = gate.ticket("embed", slo_s=0.5)
    events: list[str] = []
    token_out = threading.Event()
    go_on = threading.Event()

    def generate() -> None:
        with turn():
            events.append("token 1")
            token_out.set()
            go_on.wait(5)
            between_tokens()  # the embedding waits: it goes first
            events.append("token 2")

    def embed_call() -> None:
        with turn():
            events.append("embed")

    g = _in_thread(generate, gen)
    token_out.wait(5)
    e = _in_thread(embed_call, embed)
    _wait_until(lambda: gate.waiting == 1)
    go_on.set()
    g.join(5)
    e.join(5)
    assert events == ["token 1", "embed", "token 2"]
    assert gate.yields == 1 and gen.tokens == 1


def test_a_generation_keeps_its_turn_when_only_later_deadlines_wait() -> None:
    gate = ComputeGate("cpu", clock=Clock())
    first, later = gate.ticket("a", slo_s=1.0), gate.ticket("b", slo_s=9.0)
    events: list[str] = []
    waiting = threading.Event()

    def generate() -> None:
        with turn():
            waiting.wait(5)
            between_tokens()
            events.append("a token 2")

    def other() -> None:
        with turn():
            events.append("b")

    a = _in_thread(generate, first)
    _wait_until(lambda: gate.busy_units == 1)
    b = _in_thread(other, later)
    _wait_until(lambda: gate.waiting == 1)
    waiting.set()
    a.join(5)
    b.join(5)
    assert events == ["a token 2", "b"] and gate.yields == 0


def test_a_stream_after_its_first_token_moves_its_deadline() -> None:
    clock = Clock()
    gate = ComputeGate("cpu", clock=clock)
    t = gate.ticket("chat", slo_s=4.0)
    t.streaming = True
    token = TICKET.set(t)
    try:
        with turn():
            clock.now = 10.0
            between_tokens()
    finally:
        TICKET.reset(token)
    assert t.deadline == pytest.approx(14.0)


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
        between_tokens()


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


def test_one_thread_decodes_share_the_cores_and_an_embedding_waits_for_both_tokens() -> None:
    gate = ComputeGate("cpu", capacity=2, clock=Clock())
    inside = threading.Barrier(3, timeout=5)
    release = threading.Event()
    events: list[str] = []

    def decode(name: str) -> None:
        with turn(units=1):
            inside.wait()  # both decodes hold a core at once
            release.wait(5)
            between_tokens()  # the embedding waits for all of the device: both yield
            events.append(f"{name} token 2")

    def embed() -> None:
        with turn():  # all units
            events.append("embed")

    decoders = [_in_thread(functools.partial(decode, n), gate.ticket(n, slo_s=4.0))
                for n in ("chat", "complete")]
    inside.wait()
    assert gate.busy_units == 2
    e = _in_thread(embed, gate.ticket("embed", slo_s=0.5))
    _wait_until(lambda: gate.waiting == 1)
    release.set()
    for thread in (*decoders, e):
        thread.join(5)
    assert events[0] == "embed" and sorted(events[1:]) == ["chat token 2", "complete token 2"]
    assert gate.busy_units == 0 and gate.yields == 2


def test_a_prompt_slice_on_both_cores_waits_for_the_other_decode_and_gives_the_core_back(
) -> None:
    # A one-thread decode's turn reads a prompt slice on two threads: it holds both units for
    # the slice, waiting for the other decode to let go of its core, and one after it.
    gate = ComputeGate("cpu", capacity=2, clock=Clock())
    other_in = threading.Event()
    other_go = threading.Event()
    seen: list[tuple[str, int]] = []

    def other() -> None:
        with turn(units=1):
            other_in.set()
            other_go.wait(5)

    def reader() -> None:
        t = TICKET.get()
        assert t is not None
        with turn(units=1):
            seen.append(("decode", gate.held(t)))
            with step_units(2):
                seen.append(("slice", gate.held(t)))
            seen.append(("decode", gate.held(t)))

    o = _in_thread(other, gate.ticket("other", slo_s=4.0))
    other_in.wait(5)
    r = _in_thread(reader, gate.ticket("chat", slo_s=4.0))
    _wait_until(lambda: gate.waiting == 1)  # the slice waits for the other core
    assert seen == [("decode", 1)] and gate.busy_units == 1
    other_go.set()
    for thread in (o, r):
        thread.join(5)
    assert seen == [("decode", 1), ("slice", 2), ("decode", 1)]
    assert gate.busy_units == 0
    with step_units(2):  # outside a request: nothing to hold
        assert gate.busy_units == 0


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
    assert late.deadline == pytest.approx(14.0)  # re-armed: now + its SLO
    threads.append(_in_thread(functools.partial(work, "embed"), fresh))
    _wait_until(lambda: gate.waiting == 2)
    gate.release(holder)
    for thread in threads:
        thread.join(5)
    assert order == ["embed", "chat"]
