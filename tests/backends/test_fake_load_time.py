"""The fake engine's declared load time (`fake:SIZE?load_s=S`): a load takes at least S seconds,
and the declared size is read before the `?`, for the engine and for the scheduler alike."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from packserve.backends.fake import ENGINE, FakeBackend, declared_bytes, declared_load_s
from packserve.core.backend import LoadSpec
from packserve.types import State
from tests.factories import MIB, TIMEOUT, entry, harness, use

# Coroutine tests run on asyncio through anyio's pytest plugin, each bounded in time.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(4 * TIMEOUT)]


def spec(source: str) -> LoadSpec:
    return LoadSpec(backend="fake", path=Path(source), device="cpu", context_length=0)


def test_a_load_takes_at_least_the_declared_seconds_and_holds_the_declared_bytes() -> None:
    backend = FakeBackend(spec("fake:8MiB?load_s=0.3"))
    t0 = time.monotonic()
    backend.load()
    assert time.monotonic() - t0 >= 0.3  # never an upper bound: the machine may be busy
    assert backend.weight_bytes() == 8 * MIB
    backend.unload()
    assert backend.weight_bytes() == 0


def test_the_size_is_parsed_before_the_options() -> None:
    assert declared_bytes(spec("fake:64MiB?load_s=1.5")) == 64 * MIB
    assert declared_load_s(spec("fake:64MiB?load_s=1.5")) == 1.5
    assert declared_bytes(spec("fake:64MiB")) == 64 * MIB
    assert declared_load_s(spec("fake:64MiB")) == 0.0
    assert ENGINE.size(None, spec("fake:3MiB?load_s=2"), "m", 1).total == 3 * MIB
    with pytest.raises(ValueError, match="unknown option"):
        declared_load_s(spec("fake:64MiB?load_seconds=1"))


async def test_the_scheduler_sees_the_declared_bytes_and_waits_out_the_load() -> None:
    e = entry("slow", 16)
    h = harness([replace(e, load=replace(e.load, path=Path("fake:16MiB?load_s=0.2")))],
                budget_mib=64, real_clock=True)
    t0 = time.monotonic()
    await use(h.scheduler, "slow")
    assert time.monotonic() - t0 >= 0.2
    assert h.state("slow") is State.HOT
    assert h.status("slow").bytes_measured == 16 * MIB
    await h.scheduler.close()
