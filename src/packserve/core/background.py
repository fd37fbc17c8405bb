"""Work the scheduler owns that no request waits on (pin retries, retirements), and the signal
that wakes whoever waits for memory to change or models to go idle (a load, a retirement).

Both live on the event loop thread; neither holds or takes a device lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine

log = logging.getLogger("packserve.scheduler")


class Background:
    """The scheduler's background tasks: started with `spawn`, cancelled at shutdown with
    `cancel`. A task that fails is logged; nobody else awaits it."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[object, object, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def cancel(self) -> list[asyncio.Task[None]]:
        """Cancel every task still running; returns them, for the caller to await."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return tasks

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())


class Changed:
    """A signal fired whenever memory may have changed: a load or unload ended, a request let
    go of its model, a budget grew. A waiter takes `event` *before* it looks at the state it
    waits on, then waits on that event: a signal fired in between is not missed."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def fire(self) -> None:
        self.event.set()
        self.event = asyncio.Event()

    @staticmethod
    async def wait(event: asyncio.Event, seconds: float) -> None:
        """Until `event` fires or `seconds` pass."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(0.0, seconds))
