"""A resident: one set of weights on one device, and the one table its state moves along.

Catalog entries with the same `LoadSpec` share one resident, loaded once and counted once.
The record is split by lifetime: what the resident is (`Resident`), the warm copy its engine
may keep while its weights are away (`WarmCopy`), and the load in flight (`LoadInFlight`).

`state` is read-only: every change goes through `move`, which checks `TRANSITIONS` and raises
IllegalTransition for a move the table does not have. The simulator (`benchmarks/simulator.py`)
moves its residents along the same table. `docs/scheduling.md` draws it.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from packserve.core.backend import Backend, EngineExit, LoadSpec, Runner
from packserve.core.policy import RATE_WINDOW
from packserve.types import State

# A load nobody waits on with a deadline (a pin, an operator's load) takes its compute turn as
# a request due now with the shortest default SLO (embeddings'): it is asked for on purpose,
# and due later it would wait behind every stream, holding its device's lock meanwhile.
UNWAITED_LOAD_SLO_S = 0.5

if TYPE_CHECKING:
    from packserve.core.queue import Model, Turn

_C, _A, _L, _H, _U, _W, _F = (State.COLD, State.ADMITTING, State.LOADING, State.HOT,
                              State.UNLOADING, State.WARM, State.FAILED)

TRANSITIONS: Mapping[State, frozenset[State]] = {
    _C: frozenset({_A, _F}),  # a load starts; a quarantine
    _W: frozenset({_A, _U, _C, _F}),  # a load restores it; unloaded; its process died
    _F: frozenset({_A, _C}),  # a load after the cooldown; an operator's load clears it
    _A: frozenset({_L, _F, _C, _W}),  # admitted; failed; abandoned or never fits (to rest)
    _L: frozenset({_H, _A, _U, _C, _W, _F}),  # hot; the engine undid it; measured over
    _H: frozenset({_U, _C, _F}),  # evicted, offloaded, unloaded, retired; its process died
    _U: frozenset({_C, _W, _F}),  # at rest: cold, warm, or failed if quarantined
}
"""Where each state may go next (the comment says on what)."""


class IllegalTransition(RuntimeError):
    """A state change the table does not have: a bug in the scheduler, never a client's."""


def check_move(src: State, dst: State) -> None:
    """Raise IllegalTransition unless `TRANSITIONS` lets `src` go to `dst`."""
    if dst not in TRANSITIONS[src]:
        raise IllegalTransition(f"a resident cannot go from {src.value} to {dst.value}")


class Moves:
    """A read-only `state` that changes only through `move`, along `TRANSITIONS`."""

    _state: State = State.COLD

    @property
    def state(self) -> State:
        return self._state

    def move(self, to: State) -> None:
        check_move(self._state, to)
        self._state = to


@dataclass(eq=False)
class WarmCopy:
    """A backend that gave its weights back and kept its engine objects (while WARM, and while
    a load restores it), with what it holds then (as last measured, kept after the copy goes:
    the policy's guess for the next one)."""

    backend: Backend | None = None
    bytes: int = 0
    # host RAM the last one held besides (a GPU model's weights parked there); None: not yet
    host_seen: int | None = None
    possible: bool | None = None  # whether the engine has a warm state (None: not tried yet)
    too_big: bool = False  # one kept most of its hot bytes (tiers.WARM_KEEPS_AT_MOST): no more
    restore_seconds: float | None = None  # the last restore's

    @property
    def kept(self) -> bool:
        return self.backend is not None

    @property
    def host_bytes(self) -> int:
        """Host RAM the warm copy holds now besides its device's bytes (`Backend.host_bytes`)."""
        return 0 if self.backend is None else self.backend.host_bytes()


@dataclass(eq=False)
class LoadInFlight:
    """The scheduler-owned load of a resident, while one runs (`task`), and what it serves."""

    task: asyncio.Task[None] | None = None
    callers: int = 0  # awaiting `task`: requests, admin load/pin, pins at start
    abandonable: bool = False  # `task` waits where cancelling it is safe (lock, memory)
    due: float = math.inf  # the earliest deadline of the requests it serves
    due_slo: float = math.inf  # that request's SLO
    at_risk: float = math.inf  # when that request will have waited `load_turn` of its SLO
    holding: dict[str, Turn] = field(default_factory=dict)  # while it waits: whom it drains
    engine_since: float | None = None  # when its engine call started (LOADING), if it has

    def reset_deadlines(self) -> None:
        self.due = self.due_slo = self.at_risk = math.inf

    def turn(self, now: float) -> tuple[float, float]:
        """The deadline and SLO at which the engine call of this load competes for compute
        (see `Backend.working`): its earliest waiter's when the call starts (a waiter that comes
        later does not move it); a load nobody waits on with a deadline (a pin, an operator's)
        competes as a request due `now` (UNWAITED_LOAD_SLO_S)."""
        if math.isfinite(self.due):
            return self.due, self.due_slo
        return now, UNWAITED_LOAD_SLO_S


@dataclass(eq=False)
class Resident(Moves):
    """One set of weights on one device: its footprint, its engine while it has one, its use."""

    load: LoadSpec
    models: list[str]  # the catalog names that use these weights now
    estimated: int
    measured: int | None = None
    peak_here: int | None = None  # the largest footprint measured by this process
    backend: Backend | None = None  # the lifecycle: only the scheduler holds it
    runner: Runner | None = None  # what leases lend while HOT; one per load
    leases: int = 0  # requests that hold or wait for it: never evicted while any
    last_used: float = 0.0
    # when its last requests arrived (scheduler clock): the victim policy's reuse estimate
    arrivals: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))
    load_seconds: float | None = None
    error: str | None = None
    failed_until: float = 0.0
    quarantine: str | None = None  # why it stays FAILED until an operator loads it, or
    quarantine_until: float | None = None  # this time (scheduler clock; None: the operator)
    # Its engine process's deaths (scheduler clock, core.crashes), the last one's report and
    # wall time, and when it may load again after one (a back-off).
    deaths: deque[float] = field(default_factory=lambda: deque(maxlen=8))
    last_exit: EngineExit | None = None
    last_exit_at: float | None = None
    verdict: str = ""  # what the last death meant, in words
    restart_at: float = 0.0
    settled: asyncio.Event | None = None  # set when the unload in progress ends
    retired: list[Model] = field(default_factory=list)  # removed models still draining
    former: str = ""  # its label when the catalog last named it
    retiring: bool = False  # a `_retire` task watches it
    unloading_bytes: int | None = None  # while UNLOADING: a warm copy holds less than `bytes`
    turn: Turn | None = None  # a load waits for it to drain (core.queue)
    warm: WarmCopy = field(default_factory=WarmCopy)
    flight: LoadInFlight = field(default_factory=LoadInFlight)

    @property
    def key(self) -> str:
        return self.load.key

    @property
    def label(self) -> str:
        return "+".join(self.models) or self.former or self.key

    @property
    def bytes(self) -> int:
        return self.measured if self.measured is not None else self.estimated

    def publish(self, backend: Backend, now: float) -> None:
        """LOADING -> HOT with `backend` loaded: leases may lend its runner from now on."""
        self.backend, self.runner = backend, Runner(backend)
        self.move(State.HOT)
        self.error, self.failed_until = None, 0.0
        self.last_used = now

    def at_rest(self) -> State:
        """Where it is when nothing is loading it: warm while its warm copy is kept, else
        failed if quarantined, else cold."""
        if self.warm.kept:
            return State.WARM  # a quarantine's retirement takes it to cold, then FAILED
        return State.FAILED if self.quarantine is not None else State.COLD
