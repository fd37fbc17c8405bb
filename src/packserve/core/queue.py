"""A catalog model's queue: its quota slots, shared fairly between API keys, and load turns.

A request takes a slot of its model (`Model.take`) before anything else; excess requests wait
in a bounded queue served by fair share (`core.fairness`), and past it get QueueFull with a
Retry-After derived from the real queue (`core.policy.admit_request`).

A load's turn: once a load that waits for busy models to finish (WAIT_FOR_BUSY) has kept one
of its requests waiting `load_turn` of its SLO, requests that arrive for those models and are
due no earlier than its earliest wait behind it (`Resident.turn`, `LoadInFlight.due`; each at
most `load_turn` of its own SLO), so that they drain and the load is not starved by a steady
stream to the model it must evict. Held requests hold a quota slot but no lease, so they never
keep their model busy.

All of it lives on the event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from packserve.core.catalog import Served
from packserve.core.fairness import FairQueue
from packserve.core.policy import admit_request
from packserve.core.resident import Resident
from packserve.errors import QueueFull

log = logging.getLogger("packserve.scheduler")


@dataclass(eq=False)
class Model:
    """A catalog entry the scheduler serves: its spec, its weights, its pin and its queue."""

    spec: Served
    resident: Resident
    pinned: bool
    estimated: int
    running: int = 0  # requests holding a slot
    # requests waiting for a slot, shared fairly between API keys
    queue: FairQueue[asyncio.Future[None]] = field(default_factory=FairQueue)
    mean_service_s: float = 1.0
    moved: float = 0.0  # when a request last got a slot, or came to an empty queue
    # The keep-alive its last request asked for (Ollama's per-request keep_alive); None: the
    # configured one. Each request sets it, as in Ollama: one without it goes back to the config.
    keep_alive: float | None = None

    @property
    def idle(self) -> bool:
        return self.running == 0 and not self.queue

    async def take(self, key: str = "", weight: float = 1.0, now: float = 0.0) -> None:
        """Wait for a slot, served fairly between keys by `weight`. Raises QueueFull. `now`: the
        request's arrival; a queue's wait counts from it when the queue was empty."""
        spec = self.spec
        if not self.queue:
            self.moved = now
        decision = admit_request(self.running, len(self.queue), spec.concurrency,
                                 spec.max_queue, self.mean_service_s)
        if decision.run:
            self.running += 1
            return
        if not decision.queue:
            raise QueueFull(
                f"model {spec.name!r} has {self.running} requests running and "
                f"{len(self.queue)} queued (max_concurrency={spec.concurrency}, "
                f"max_queue={spec.max_queue}); retry in {decision.retry_after_s}s",
                retry_after_s=decision.retry_after_s)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.queue.push(waiter, key, weight)
        try:
            await waiter  # `give` hands its slot over: running is already counted
        except asyncio.CancelledError:
            if not self.queue.remove(waiter) and waiter.done() and not waiter.cancelled():
                self.give()  # the slot was handed to us as we were cancelled
            raise

    def give(self) -> None:
        """A request leaves its slot: hand it to the next waiter, unless the model now has more
        running than its (reconfigured, smaller) max_concurrency."""
        if self.running <= self.spec.concurrency:
            while self.queue:
                waiter = self.queue.pop()
                if not waiter.done():
                    waiter.set_result(None)
                    return
        self.running -= 1

    def fill(self) -> None:
        """Start queued requests while slots are free (after max_concurrency grew)."""
        while self.queue and self.running < self.spec.concurrency:
            waiter = self.queue.pop()
            if not waiter.done():
                self.running += 1
                waiter.set_result(None)

    def served(self, seconds: float) -> None:
        """A request was served in `seconds`: the mean that Retry-After is derived from."""
        self.mean_service_s = 0.8 * self.mean_service_s + 0.2 * seconds


@dataclass(eq=False)
class Turn:
    """A load waits for this busy resident: requests for it that arrive from `since` on wait
    for `done` (set when the load is admitted or gives up)."""

    load: Resident  # the waiting load's resident
    since: float
    done: asyncio.Event = field(default_factory=asyncio.Event)


async def wait_turn(res: Resident, t_enter: float, slo: float, load_turn: float) -> None:
    """Wait while a load waits for `res` to drain that began waiting before this request
    came, has kept one of its requests waiting `load_turn` of its SLO, and serves requests
    due before this one (earliest deadline first, as compute)."""
    turn = res.turn
    if (turn is None or t_enter < max(turn.since, turn.load.flight.at_risk)
            or t_enter + slo < turn.load.flight.due):
        return
    limit = load_turn * slo
    log.debug("request for %s waits up to %.2fs behind the load of %s", res.label, limit,
              turn.load.label)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(limit):
            await turn.done.wait()


def hold(res: Resident, keys: Sequence[str], residents: Mapping[str, Resident],
         now: float) -> None:
    """`res`'s load waits for `keys` to drain: later requests for them wait behind it
    (none while `load_turn` is 0: the policy then names none)."""
    holding = res.flight.holding
    for key in [k for k in holding if k not in keys]:
        _end_turn(key, holding.pop(key), residents)
    for key in keys:
        other = residents.get(key)
        if other is not None and other.turn is None:
            other.turn = holding[key] = Turn(load=res, since=now)


def release_holds(res: Resident, residents: Mapping[str, Resident]) -> None:
    """`res`'s load stops waiting for others to drain: their requests go ahead."""
    holding = res.flight.holding
    while holding:
        _end_turn(*holding.popitem(), residents)


def _end_turn(key: str, turn: Turn, residents: Mapping[str, Resident]) -> None:
    turn.done.set()
    other = residents.get(key)
    if other is not None and other.turn is turn:
        other.turn = None
