"""Retirement: weights that nothing may use any more (quarantined, or removed from the catalog)
leave their device once their last request ends, and are forgotten once cold if no catalog
entry names them. A background task per resident; it takes the device lock only to unload.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from packserve.core.background import Changed
from packserve.core.residency import Residency
from packserve.core.resident import Resident
from packserve.core.tiers import Tiers
from packserve.errors import ModelUnavailable
from packserve.types import State

log = logging.getLogger("packserve.scheduler")


class Retirer:
    """Watches retiring residents until they are cold (and forgotten, if unnamed)."""

    def __init__(self, residency: Residency, tiers: Tiers, changed: Changed,
                 lock: Callable[[str, str], AbstractAsyncContextManager[None]]) -> None:
        self._residency = residency
        self._tiers = tiers
        self._changed = changed
        self._lock = lock  # (device, who): the device's lock, bounded by load_wait_s

    async def retire(self, res: Resident, reason: str) -> None:
        """Unload `res` once nothing uses it, because it was quarantined or removed from the
        catalog; forget it once cold if no catalog entry names it. One task per resident."""
        if res.retiring:
            return
        res.retiring = True
        try:
            await self._when_idle(res, reason)
        finally:
            res.retiring = False

    async def _when_idle(self, res: Resident, reason: str) -> None:
        while res.quarantine is not None or not res.models:
            changed = self._changed.event  # taken before looking, so no signal is missed
            busy = bool(res.leases or res.flight.task or any(not m.idle for m in res.retired))
            if not busy and res.state in (State.HOT, State.WARM):
                try:
                    async with self._lock(res.load.device, f"retiring {res.label}"):
                        if (res.state in (State.HOT, State.WARM) and not res.leases
                                and not any(not m.idle for m in res.retired)):
                            await self._tiers.evict_to(res, State.COLD, reason)
                except ModelUnavailable as exc:
                    log.warning("%s; trying again when the device is free", exc.message)
                continue
            if not busy and res.state is not State.UNLOADING:
                self._residency.forget(res)
                return
            await changed.wait()
