"""Weights moving between tiers: hot to warm or cold, warm back to hot, a warm copy let go.

The scheduler decides who moves and where, and holds the resident's device lock while the move
runs; this module applies it: the state moves (along `core.resident.TRANSITIONS`), the engine
calls (through the loader), the warm copy's bookkeeping, and the events that say so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from packserve.core.backend import Backend, EngineDied, EngineExit
from packserve.core.events import Event, EvictEvent, LoadEvent, LoadFailedEvent, LoadStartEvent
from packserve.core.loader import Loader
from packserve.core.resident import Resident
from packserve.types import State

log = logging.getLogger("packserve.scheduler")

# A warm copy that keeps more than this share of its hot bytes saves too little to hold: the
# eviction unloads it instead, and the model's later evictions go cold (`WarmCopy.too_big`).
WARM_KEEPS_AT_MOST = 0.8


class Tiers:
    """Applies the scheduler's moves between tiers. Every method must be called holding the
    resident's device lock; `changed` wakes whoever waits for memory."""

    def __init__(self, loader: Loader, *, clock: Callable[[], float],
                 emit: Callable[[Event], None], changed: Callable[[], None],
                 died: Callable[[Resident, EngineExit, str], object]) -> None:
        self._loader = loader
        self._clock = clock
        self._emit = emit
        self._changed = changed
        self._died = died  # the scheduler's count of a death (core.crashes)

    async def evict_to(self, res: Resident, tier: State, reason: str | None,
                       backend: Backend | None = None, *, cause: str = "retired",
                       policy: str = "", why: str = "") -> None:
        """The one way weights leave a device: HOT (or LOADING, with the `backend` that loaded)
        -> UNLOADING -> `tier`: COLD (FAILED if quarantined), or WARM if the engine can keep its
        objects without its weights (else COLD); a WARM one to COLD. Nothing may hold a lease
        on a HOT one. Emits an EvictEvent with `reason` unless it is None (shutdown, a quota),
        with the victim `policy` that chose it and `why`, if one did."""
        assert tier in (State.WARM, State.COLD)
        backend = backend or res.backend or res.warm.backend
        assert backend is not None and (res.state is State.LOADING or res.leases == 0)
        freed = res.warm.bytes if res.state is State.WARM else res.bytes
        res.unloading_bytes = freed  # what it holds until the engine has let go
        res.backend = res.runner = None
        res.move(State.UNLOADING)  # holds its bytes until the engine has let go
        res.settled = settled = asyncio.Event()  # new requests wait, then load it again
        t0 = self._clock()
        kept: int | None = None
        try:
            if tier is State.WARM:
                try:
                    kept = await self._loader.release_weights(backend, res.load, res.bytes,
                                                              res.label)
                except EngineDied as exc:  # counted; a quarantine leaves it FAILED below
                    self._died(res, exc.exit, exc.doing or "going warm")
                    kept = None
                if kept is not None and kept > WARM_KEEPS_AT_MOST * res.bytes:
                    log.info("the warm copy of %s keeps %.0f%% of its bytes (%d of %d): it is "
                             "unloaded, and goes cold from now on", res.label,
                             100 * kept / max(res.bytes, 1), kept, res.bytes)
                    res.warm.too_big, kept = True, None
                res.warm.possible = kept is not None  # asked again only of a new engine object
            if kept is None:
                res.warm.backend = None
                await self._loader.run(backend.unload)
                del backend  # before the release: its memory must be collectable then
                await self._loader.release(res.load.device)
            else:
                res.warm.backend, res.warm.bytes = backend, kept
                res.warm.host_seen = backend.host_bytes()
                freed = res.bytes - kept
        finally:
            res.move(res.at_rest())
            res.unloading_bytes = None
            res.settled = None
            settled.set()
            self._changed()
        if reason is not None:
            self._emit(EvictEvent(model=res.label, device=res.load.device, bytes=freed,
                                  seconds=self._clock() - t0, reason=reason, cause=cause,
                                  policy=policy, why=why,
                                  tier_to="warm" if kept is not None else "cold"))

    async def drop_warm(self, res: Resident) -> None:
        """Unload the warm copy of `res`, which is loading (or failing to): its next load is
        a whole one."""
        backend, res.warm.backend = res.warm.backend, None
        if backend is None:
            return
        try:
            await self._loader.run(backend.unload)
        finally:
            del backend
            await self._loader.release(res.load.device)
            self._changed()

    async def restore(self, res: Resident, turn: tuple[float, float]) -> bool:
        """LOADING -> HOT from the warm tier: the engine reads its weights back into the
        objects it kept, competing for compute at `turn` (deadline, SLO: `Backend.working`).
        If that fails, the warm copy is unloaded and False returned: the caller loads anew;
        if its process died (`EngineDied`), that is raised after, for the caller to count."""
        backend = res.warm.backend
        assert backend is not None
        device = res.load.device
        t0 = self._clock()
        self._emit(LoadStartEvent(model=res.label, device=device))
        try:
            await self._loader.restore(backend, turn)
        except Exception as exc:
            died = isinstance(exc, EngineDied)
            if not died:  # a death is the caller's to count and say, by its crash rule
                reason = f"{type(exc).__name__}: {exc}"
                log.warning("restoring %s from the warm tier failed (%s); loading it anew",
                            res.label, reason)
                self._emit(LoadFailedEvent(model=res.label, device=device, bytes=res.bytes,
                                           seconds=self._clock() - t0, reason=reason,
                                           will_retry=True))
            del backend
            await self.drop_warm(res)
            if died:
                raise
            return False
        res.warm.backend = None
        res.warm.restore_seconds = seconds = self._clock() - t0
        res.publish(backend, self._clock())
        self._emit(LoadEvent(model=res.label, device=device, bytes_estimated=res.estimated,
                             bytes_measured=res.bytes, seconds=seconds, reason="first use",
                             tier_from="warm"))
        self._changed()
        return True
