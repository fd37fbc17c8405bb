"""A download that stops moving is seen: its status says how long since its last byte, a
request that gives up on it says so, and the deep probe reports it once it has had no byte for
`load_timeout_s` (a stall, not a wedge: nothing is restarted for it)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from packserve.backends.fake import FakeBackend
from packserve.core.backend import Backend, LoadSpec
from packserve.core.catalog import DeviceBudget
from packserve.core.fetch import STALLED_S, Downloads
from packserve.core.scheduler import Scheduler
from packserve.errors import ModelUnavailable
from packserve.types import Task
from tests.factories import MIB, Clock, entry
from tests.factories.scheduler import FakeProbe

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


class Trickle:
    """A fetcher that sends `first` bytes of 100 MiB, then nothing until released."""

    def __init__(self, first: int = 10 * MIB) -> None:
        self.first = first
        self.release = threading.Event()
        self.started = threading.Event()

    def missing(self, load: LoadSpec) -> str | None:
        return None if self.release.is_set() else f"hf:org/{load.path.parent.name}"

    def fetch(self, load: LoadSpec, progress: Callable[[int, int], None]) -> None:
        progress(self.first, 100 * MIB)
        self.started.set()
        self.release.wait(20)
        progress(100 * MIB, 100 * MIB)


async def test_a_download_without_a_byte_says_so_and_a_request_that_gives_up_too() -> None:
    clock, fetcher = Clock(), Trickle()
    downloads = Downloads(fetcher, clock=clock)
    load = LoadSpec(backend="fake", path=Path("m") / "fake:1MiB", device="cpu",
                    context_length=0)
    downloads.start(load, "hf:org/m")
    await asyncio.to_thread(fetcher.started.wait, 10)
    clock.advance(STALLED_S + 5)
    status = downloads.status(load)
    assert status is not None and status.done_bytes == 10 * MIB and status.idle_s == 35.0
    assert downloads.stalled(30.0) == [(str(load.path), "hf:org/m", 35.0)]
    assert downloads.stalled(60.0) == []

    async def via(wait: Callable[[], object]) -> None:
        await wait()  # type: ignore[misc]

    with pytest.raises(ModelUnavailable, match=r"10.0 MiB of 100.0 MiB, no byte for 35s"):
        await downloads.wait(load, "hf:org/m", "m", 0.0, via)
    fetcher.release.set()


async def test_the_deep_probe_reports_a_stalled_download_and_restarts_nothing() -> None:
    clock, fetcher = Clock(), Trickle()

    def factory(spec: LoadSpec) -> Backend:
        return FakeBackend(spec)

    s = Scheduler([entry("m")], [DeviceBudget("cpu", budget_bytes=1024 * MIB, headroom_bytes=0)],
                  factory, FakeProbe(), None, clock=clock, load_timeout_s=60.0,
                  load_wait_s=10.0, fetcher=fetcher, sinks=())
    await s.start()
    request = asyncio.create_task(_use(s))
    await asyncio.to_thread(fetcher.started.wait, 10)
    clock.advance(61.0)
    live = s.liveness()
    (stuck,) = live.stuck
    assert (stuck.kind, stuck.model, stuck.detail, stuck.seconds) == (
        "download", "m", "hf:org/m", 61.0)
    assert not live.ok and not live.restart
    fetcher.release.set()
    await request
    await s.close()


async def _use(s: Scheduler) -> None:
    async with s.acquire("m", Task.EMBED):
        pass
