"""Idle models let go (`keep_alive`): a model with no request for its keep-alive leaves its
device for the warm tier (cold where there is none), and a warm copy with none for a further
`cold_after` goes cold. Pins, busy models and loads in flight are exempt.

`due` is pure: when a resident's idle move is due, from plain numbers. `IdleReaper` is the
background task that applies it, taking the device lock for each move (like an eviction).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from packserve.core.background import Changed
from packserve.core.locks import Acquire, DeviceLocks
from packserve.core.residency import HOST, Residency
from packserve.core.resident import Resident
from packserve.core.tiers import Tiers
from packserve.errors import ModelUnavailable
from packserve.types import State
from packserve.units import format_duration

log = logging.getLogger("packserve.scheduler")

BUSY_RECHECK_S = 1.0  # a ripe model whose device's lock is held is looked at again after this
FAILED_RETRY_S = 30.0  # a model whose move raised is tried again after this


@dataclass(frozen=True)
class IdleRule:
    """A device's default: seconds idle before a hot model lets go, and then before a warm
    copy goes cold (`math.inf`: never)."""

    keep_alive_s: float = math.inf
    cold_after_s: float = math.inf


def due(state: State, last_used: float, keep_alive_s: float, cold_after_s: float) -> float:
    """When a resident at rest in `state`, last used at `last_used`, leaves its tier for being
    idle: hot after `keep_alive_s`, warm after `keep_alive_s + cold_after_s`; `math.inf` for
    never (other states, or a keep-alive of never)."""
    if state is State.HOT:
        return last_used + keep_alive_s
    if state is State.WARM:
        return last_used + keep_alive_s + cold_after_s
    return math.inf


class IdleReaper:
    """Lets idle residents go when their keep-alive runs out. Runs as one background task;
    wakes at the next expiry, and whenever a request ends or memory changes."""

    def __init__(self, residency: Residency, tiers: Tiers, changed: Changed,
                 locks: DeviceLocks, *, rules: Mapping[str, IdleRule],
                 clock: Callable[[], float]) -> None:
        self._residency = residency
        self._tiers = tiers
        self._changed = changed
        self._locks = locks
        self._rules = rules
        self._clock = clock
        self._retry_at: dict[str, float] = {}  # a resident whose move failed: not before then

    def keep_alive_s(self, res: Resident) -> float:
        """The longest keep-alive of the models that use `res` (a model's own, else its
        device's): weights shared by two names stay as long as the more patient one asks."""
        default = self._rules.get(res.load.device, IdleRule()).keep_alive_s
        return max((_first(m.keep_alive, m.spec.keep_alive, default)
                    for m in (self._residency.models[n] for n in res.models)), default=default)

    def due(self, res: Resident) -> float:
        """When `res` lets go for being idle now, or `math.inf`."""
        # `callers`: a load just ended, and those who awaited it (an operator's load, a pin)
        # have not run yet; letting go now would undo it before they see it hot, over and over.
        if (res.leases or res.flight.task is not None or res.flight.callers or not res.models
                or self._residency.is_pinned(res)
                or not all(self._residency.models[n].idle for n in res.models)):
            return math.inf
        rule = self._rules.get(res.load.device, IdleRule())
        return max(due(res.state, res.last_used, self.keep_alive_s(res), rule.cold_after_s),
                   self._retry_at.get(res.key, -math.inf))

    async def run(self) -> None:
        while True:
            changed = self._changed.event  # taken before looking, so no signal is missed
            now = self._clock()
            times = {res.key: self.due(res) for res in self._residency.residents.values()}
            moved = False
            for key in [k for k, at in times.items() if at <= now]:
                res = self._residency.residents.get(key)
                if res is not None and self._locks.busy(res.load.device):
                    times[key] = now + BUSY_RECHECK_S  # a load or unload runs there: later
                elif res is not None:
                    await self._let_go(res)
                    moved = True
            if moved:
                continue
            left = min(times.values(), default=math.inf) - now
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if math.isinf(left) else left):
                    await changed.wait()

    async def reclaim_host(self, res: Resident, deadline: float, via: Acquire) -> bool:
        """Let warm copies of GPU models go cold, least recently used first, until host RAM has
        room for `res`, a load on the CPU that must otherwise wait; only when they can make that
        room (else it waits for busy CPU models all the same). Each goes under its own device's
        lock, waited for until `deadline` through `via` (the load's abandonable wait); the
        caller holds none. Whether any went."""
        copies = sorted((r for r in self._residency.residents.values()
                         if r.state is State.WARM and r.warm.host_bytes),
                        key=lambda r: r.last_used)
        short = self._residency.used(HOST) + res.bytes - self._residency.capacity(HOST)
        if short <= 0 or sum(r.warm.host_bytes for r in copies) < short:
            return False
        went = False
        for victim in copies:
            if short <= 0:
                break
            async with self._locks.hold(victim.load.device, f"taking host RAM back for "
                                        f"{res.label}", deadline=deadline, via=via):
                if victim.state is State.WARM:  # still: nothing restored it meanwhile
                    short -= victim.warm.host_bytes
                    await self._tiers.evict_to(victim, State.COLD, f"host RAM for {res.label}",
                                               cause="make_room")
                    went = True
        return went

    async def _let_go(self, res: Resident) -> None:
        try:
            async with self._locks.hold(res.load.device, f"letting idle {res.label} go"):
                if self.due(res) > self._clock():  # used, pinned or moved meanwhile
                    return
                idle = self._clock() - res.last_used
                tier = (State.WARM if res.state is State.HOT and self._residency.goes_warm(res)
                        else State.COLD)
                idle_for = format_duration(round(idle, 1) if idle < 60 else round(idle))
                await self._tiers.evict_to(
                    res, tier, f"idle for {idle_for} "
                    f"(keep_alive {format_duration(self.keep_alive_s(res))})", cause="idle")
        except ModelUnavailable as exc:
            log.warning("%s; trying again when the device is free", exc.message)
        except Exception:  # an engine's unload that raised: that model waits, the rest go on
            log.exception("letting idle %s go failed; trying again in %gs", res.label,
                          FAILED_RETRY_S)
            self._retry_at[res.key] = self._clock() + FAILED_RETRY_S


def _first(*values: float | None) -> float:
    """The first of `values` that is set (the last of them always is)."""
    return next(v for v in values if v is not None)
