"""Who computes when several models contend for one device: the earliest deadline first.

Memory decides which models are loaded; this decides which of them runs. Engines compute in
worker threads, and on a CPU box two engines running at once share the same cores: an embedding
that takes 40 ms alone takes a second behind a pass of another model. So each device has a
`ComputeGate` of as many units as it has cores (a GPU: one), and each engine call made for a
request in this process (the torch engines') holds as many units as it runs threads while it
computes. A request's deadline is its arrival plus its model's SLO (by default 0.5 s for embed
and rerank, 4 s for chat and complete: `[server.slo]`, or a model's `slo_s`). Units go to the
waiter with the earliest deadline first (EDF). A request already past its deadline competes as
if it had just arrived (its deadline becomes now plus its SLO): under plain EDF the late requests
would come first and make every later one late too, the domino effect that took SLO attainment
from 92% to 65% in a 120 s bench trace. The llama.cpp runners, which compute in processes of
their own, take turns by the same deadlines through `backends.runner.Turns`.

How requests reach it: the HTTP layer sets `TICKET` (a context variable, so it travels into
the worker thread with `asyncio.to_thread`) before calling the engine; backends wrap their
compute in `turn()`. Outside a request (loads, tests of a backend alone) it does nothing.
Backends take their own lock before the turn, and nothing waits for an engine's lock while
holding a turn, so the two cannot deadlock.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass(eq=False)
class Ticket:
    """One request's claim on its device's compute."""

    gate: ComputeGate
    model: str
    deadline: float  # the gate's clock
    slo_s: float
    waited_s: float = 0.0  # time spent waiting for the turn, first wait included
    depth: int = 0  # nested turns of the same ticket (a backend method calling another)


TICKET: ContextVar[Ticket | None] = ContextVar("packserve_compute_ticket", default=None)


class ComputeGate:
    """One device's compute: `capacity` units (a CPU's usable cores; 1 for a GPU), lent to
    requests' engine calls earliest deadline first.

    An engine call asks for as many units as it runs threads (a sentence-transformers pass
    one per shard), so two one-thread passes still run side by side on two cores while one that
    wants both waits for both to end. The waiter with the earliest deadline is served first and
    nobody overtakes it, even one that would fit: a large call is never starved by small ones.
    Thread-safe; engine threads block in `acquire`. `enabled=False` lets every call through at
    once (the engines then share the cores as the OS schedules them: packserve 0.11's way).
    """

    def __init__(self, device: str, *, capacity: int = 1, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.device = device
        self.capacity = max(1, capacity)
        self.enabled = enabled
        self.clock = clock
        self._cond = threading.Condition()
        self._held: dict[Ticket, int] = {}  # holder -> units
        self._waiting: list[tuple[float, int, Ticket]] = []  # heap by deadline, then arrival
        self._seq = itertools.count()

    def ticket(self, model: str, slo_s: float, arrived: float | None = None) -> Ticket:
        start = self.clock() if arrived is None else arrived
        return Ticket(gate=self, model=model, deadline=start + slo_s, slo_s=slo_s)

    def acquire(self, t: Ticket, units: int = 0) -> None:
        """Hold `units` of compute (0: all of them) for `t`; nested calls of a holder nest."""
        if not self.enabled:
            return
        with self._cond:
            if t in self._held:
                t.depth += 1
                return
            self._wait_turn(t, self._units(units))
            t.depth = 1

    def release(self, t: Ticket) -> None:
        if not self.enabled:
            return
        with self._cond:
            if t not in self._held:
                return
            t.depth -= 1
            if t.depth == 0:
                del self._held[t]
                self._cond.notify_all()

    def _units(self, units: int) -> int:
        return self.capacity if units <= 0 else min(units, self.capacity)

    def _wait_turn(self, t: Ticket, units: int) -> None:
        """Queue `t` by deadline; return holding `units`. Call with the condition held."""
        t0 = self.clock()
        t.deadline = moved_on(t.deadline, t.slo_s, t0)
        entry = (t.deadline, next(self._seq), t)
        heapq.heappush(self._waiting, entry)
        while (self._waiting[0] is not entry
               or sum(self._held.values()) + units > self.capacity):
            self._cond.wait()
        heapq.heappop(self._waiting)
        self._held[t] = units
        self._cond.notify_all()  # the next waiter may fit beside
        t.waited_s += self.clock() - t0

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def busy_units(self) -> int:
        with self._cond:
            return sum(self._held.values())


@dataclass
class Gates:
    """A gate per device, made on first use; `enabled` is `[server] compute_priority`."""

    enabled: bool = True
    _gates: dict[str, ComputeGate] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def of(self, device: str) -> ComputeGate:
        with self._lock:
            gate = self._gates.get(device)
            if gate is None:
                units = usable_cores() if device == "cpu" else 1
                gate = self._gates[device] = ComputeGate(device, capacity=units,
                                                         enabled=self.enabled)
            return gate

    def all(self) -> list[ComputeGate]:
        with self._lock:
            return list(self._gates.values())


def moved_on(deadline: float, slo_s: float, now: float) -> float:
    """The one deadline rule of the gates and the runners' turns (`backends.runner.Turns`): a
    request already past its deadline competes as if it came again, its deadline moved on by
    whole SLOs to the first one after `now` (so it is no more urgent than fresh work of its
    kind, and a reading repeated a moment later gives the same answer)."""
    if deadline >= now:
        return deadline
    slo = max(slo_s, 1e-3)
    return deadline + slo * math.ceil((now - deadline) / slo)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def turn(units: int = 0) -> Iterator[None]:
    """Hold the current request's compute turn with `units` threads' worth of its device (0:
    all of it); nothing outside a request."""
    t = TICKET.get()
    if t is None:
        yield
        return
    t.gate.acquire(t, units)
    try:
        yield
    finally:
        t.gate.release(t)
