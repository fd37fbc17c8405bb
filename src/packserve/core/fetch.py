"""Weights that are not on disk yet: the seam a load fetches them through, and the downloads
in flight.

The server injects a `Fetcher` (packserve.hub's, for `hf:` sources); the core knows nothing of
the Hub. Before every load the scheduler asks it what is missing; a download runs in its own
thread, outside every device lock, one per set of weights however many loads wait for it. It
belongs to the scheduler, not to the requests that asked: a request that gives up (or whose
`load_wait_s` runs out) leaves it running, and the next load joins it. Its progress is a field of
the model's status (`ModelStatus.download`), not a residency state: a download holds no device
memory and needs no move of the state table (the resident waits in `admitting`, as for memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from packserve.core.backend import LoadSpec
from packserve.core.locks import LOCK_RETRY_AFTER_S
from packserve.core.status import Download
from packserve.errors import ModelUnavailable
from packserve.units import format_bytes

log = logging.getLogger("packserve.fetch")

STALLED_S = 30.0  # a download this long without a byte says so when a request gives up on it


class Fetcher(Protocol):
    """Fetches a load's files. Both methods may be called for any load of the catalog."""

    def missing(self, load: LoadSpec) -> str | None:
        """What must be fetched before `load` can be read (its source, for messages and the
        status), or None when its files are on disk. Called on the event loop before every
        load: it may only look at the disk."""

    def fetch(self, load: LoadSpec, progress: Callable[[int, int], None]) -> None:
        """Fetch the files of `load`, telling `progress` bytes done and in all as it goes.
        Blocking (a worker thread runs it); raises ConfigError naming the source and why."""


@dataclass
class _InFlight:
    source: str
    future: asyncio.Future[None]
    moved: float  # when its last byte came (its start before the first)
    done: int = 0
    total: int = 0


class Downloads:
    """The downloads in flight, by the path they fetch. Used on the event loop."""

    def __init__(self, fetcher: Fetcher, clock: Callable[[], float] = time.monotonic) -> None:
        self._fetcher = fetcher
        self._clock = clock
        self._flights: dict[str, _InFlight] = {}

    def missing(self, load: LoadSpec) -> str | None:
        return self._fetcher.missing(load)

    def start(self, load: LoadSpec, source: str) -> asyncio.Future[None]:
        """The download of `load`'s files: the one in flight, else a new one."""
        key = str(load.path)
        flight = self._flights.get(key)
        if flight is not None:
            return flight.future
        loop = asyncio.get_running_loop()
        flight = _InFlight(source, loop.create_future(), moved=self._clock())
        flight.future.add_done_callback(_seen)  # its waiters may all have left
        self._flights[key] = flight

        def progress(done: int, total: int) -> None:
            if done != flight.done:
                flight.moved = self._clock()
            flight.done, flight.total = done, total  # read by the event loop; plain values

        def settle(error: BaseException | None) -> None:
            self._flights.pop(key, None)
            if flight.future.done():
                return
            if error is None:
                flight.future.set_result(None)
            else:
                flight.future.set_exception(error)

        def run() -> None:
            error: BaseException | None = None
            try:
                self._fetcher.fetch(load, progress)
            except Exception as exc:
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(settle, error)

        # A daemon thread, not the loop's executor: shutting down must not wait for a download.
        threading.Thread(target=run, name=f"packserve fetch {source}", daemon=True).start()
        log.info("downloading %s for %s", source, load.path)
        return flight.future

    async def wait(self, load: LoadSpec, source: str, label: str, seconds: float,
                   via: Callable[[Callable[[], Awaitable[None]]], Awaitable[None]]) -> None:
        """Wait up to `seconds` (through `via`: the load's abandonable wait) for the download of
        `load`'s files from `source`, starting it if none is in flight. When time runs out the
        download goes on and ModelUnavailable names `label` and the bytes done; a failed
        download raises what the fetcher raised."""
        future = self.start(load, source)
        try:
            await via(lambda: asyncio.wait_for(asyncio.shield(future), max(0.0, seconds)))
        except TimeoutError as exc:
            got = self.status(load)
            done = "" if got is None or not got.total_bytes else (
                f": {format_bytes(got.done_bytes)} of {format_bytes(got.total_bytes)}")
            if got is not None and got.idle_s >= STALLED_S:
                done += f", no byte for {got.idle_s:.0f}s"
            raise ModelUnavailable(
                f"model {label} is still downloading {source}{done} after {seconds:.0f}s "
                f"(load_wait_s); the download goes on, try again later",
                retry_after_s=LOCK_RETRY_AFTER_S) from exc

    def status(self, load: LoadSpec) -> Download | None:
        """The progress of `load`'s download, None when none is in flight."""
        flight = self._flights.get(str(load.path))
        if flight is None:
            return None
        return Download(source=flight.source, done_bytes=flight.done, total_bytes=flight.total,
                        idle_s=round(self._clock() - flight.moved, 1))

    def stalled(self, timeout_s: float) -> list[tuple[str, str, float]]:
        """The downloads that have had no byte for over `timeout_s`: (path, source, seconds)."""
        now = self._clock()
        return [(path, f.source, now - f.moved) for path, f in self._flights.items()
                if now - f.moved > timeout_s]


def _seen(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()
