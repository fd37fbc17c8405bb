"""An eviction, once chosen: the victim leaves its tier (hot to warm or cold, warm to cold),
and the event says which policy chose it and why; and shedding, evicting idle models in the
policy's order until a device fits its budget again. Every method must be called holding the
victim's device lock (the scheduler's, the idle reaper's); `Tiers` applies the moves.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from packserve.core.events import Event, EvictEvent
from packserve.core.policy import explain_victim, policy_name
from packserve.core.residency import Residency
from packserve.core.resident import Resident
from packserve.core.tiers import Tiers
from packserve.types import State
from packserve.units import format_bytes

log = logging.getLogger("packserve.scheduler")


class Evictions:
    """Applies the victim policy's choices."""

    def __init__(self, residency: Residency, tiers: Tiers, emit: Callable[[Event], None]) -> None:
        self._residency = residency
        self._tiers = tiers
        self._emit = emit

    async def evict(self, res: Resident, reason: str, *, cause: str,
                     cold: bool = False) -> None:
        """The victim policy's choice leaves its tier: hot to warm where its device has a warm
        tier and its engine a warm state (unless `cold`: warm copies would leave too little
        room), else to cold; warm to cold. Must hold the lock."""
        policy = self._residency.policy(res.load.device)  # it chose: the event says why
        if res.state is State.ADMITTING:  # its load waits for memory: only its copy goes
            why = explain_victim(policy, view := self._residency.view(res))
            await self._tiers.drop_warm(res)
            self._emit(EvictEvent(model=res.label, device=res.load.device, bytes=view.frees,
                                  seconds=0.0, reason=reason, cause=cause,
                                  policy=policy_name(policy), why=why, tier_to="cold"))
            return
        warm = not cold and res.state is State.HOT and self._residency.goes_warm(res)
        why = explain_victim(policy, dataclasses.replace(self._residency.view(res), goes_warm=warm))
        await self._tiers.evict_to(res, State.WARM if warm else State.COLD, reason, cause=cause,
                                   policy=policy_name(policy), why=why)

    async def shed(self, device: str, reason: str, *, cause: str,
                    keep: Resident | None = None) -> None:
        """Evict idle models of `device` other than `keep`, in the victim policy's order,
        until what it holds fits its budget again. Must hold the device lock.

        Two things push a device over: a budget made smaller, and a load that measured more
        than its estimate (the estimate is a median of past loads; the machine, the engine's
        buffers or the heap can differ this time). Busy models stay; the excess is logged.
        """
        while True:
            over, victim = self._residency.over_budget(device, keep)
            if over <= 0:
                return
            if victim is None:
                log.warning("%s holds %s more than its budget of %s until busy models finish "
                            "(%s)", device, format_bytes(over),
                            format_bytes(self._residency.devices[device].capacity_bytes), reason)
                return
            await self.evict(victim, reason, cause=cause)
