"""One lock per device, held by every load, unload and eviction on it, and waited for at most
a bounded time.

Why one per device: two loads must never count the same free bytes, and no load may be measured
while another load or unload on its device moves that device's memory. Lock order (the
scheduler's): a model's quota slot before its device's lock; nothing holding a device lock waits
for a quota slot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

from packserve.errors import ModelUnavailable

LOCK_RETRY_AFTER_S = 5  # what a client is told to wait when a device stays busy

Acquire = Callable[[Callable[[], Awaitable[bool]]], Awaitable[bool]]


class DeviceLocks:
    """The devices' locks. `wait_s` bounds a wait that names no deadline (`load_wait_s`)."""

    def __init__(self, devices: Iterable[str], *, clock: Callable[[], float],
                 wait_s: float) -> None:
        self._locks = {d: asyncio.Lock() for d in devices}
        self._holders: dict[str, tuple[str, float]] = {}  # device -> (who, since)
        self._clock = clock
        self._wait_s = wait_s

    def busy(self, device: str) -> bool:
        """Whether `device`'s lock is held now (a look, not a wait)."""
        return self._locks[device].locked()

    def held(self) -> dict[str, tuple[str, float]]:
        """Who holds each held lock, and since when (the scheduler's clock): the deep probe's
        reading, taken without waiting for anything."""
        return dict(self._holders)

    @contextlib.asynccontextmanager
    async def hold(self, device: str, who: str, *, deadline: float | None = None,
                   via: Acquire | None = None) -> AsyncIterator[None]:
        """Hold `device`'s lock. Waits until `deadline` (the scheduler's clock; default
        `wait_s` from now), then raises ModelUnavailable naming `who`. `via` wraps the wait
        (a load's wait, which its last waiter may abandon)."""
        lock = self._locks[device]
        end = deadline if deadline is not None else self._clock() + self._wait_s
        try:
            async with asyncio.timeout(max(0.0, end - self._clock())):
                await (lock.acquire() if via is None else via(lock.acquire))
        except TimeoutError as exc:
            raise ModelUnavailable(
                f"{who} waited {self._wait_s:g}s for {device}, where another load or "
                f"unload is still running; retry later", retry_after_s=LOCK_RETRY_AFTER_S
            ) from exc
        self._holders[device] = (who, self._clock())
        try:
            yield
        finally:
            del self._holders[device]
            lock.release()
