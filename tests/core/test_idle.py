"""Idle models let go (`keep_alive`, issue 32): the pure `due` table, then the scheduler's
reaper on fake engines with a real clock and keep-alives of milliseconds (tests wait on its
events, bounded by TIMEOUT; nothing asserts a time)."""

from __future__ import annotations

import asyncio
import functools
import math

import pytest

from packserve.config import DeviceConfig
from packserve.core.events import EvictEvent
from packserve.core.idle import IdleRule, due
from packserve.types import State, Task
from tests.factories import MIB, TIMEOUT, drain, entry, harness, hold, use
from tests.factories.scheduler import Recorder

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(4 * TIMEOUT)]

INF = math.inf


@pytest.mark.parametrize(("state", "keep_alive", "cold_after", "expected"), [
    (State.HOT, 60.0, INF, 160.0),  # hot: last used + keep_alive
    (State.HOT, INF, 10.0, INF),  # never
    (State.HOT, 0.0, INF, 100.0),  # at once, after its last request
    (State.WARM, 60.0, 30.0, 190.0),  # warm: a further cold_after
    (State.WARM, 60.0, INF, INF),
    (State.WARM, INF, 30.0, INF),  # keep_alive never: warm copies stay too
    (State.COLD, 1.0, 1.0, INF),
    (State.LOADING, 1.0, 1.0, INF),
    (State.UNLOADING, 1.0, 1.0, INF),
    (State.FAILED, 1.0, 1.0, INF),
])
def test_due(state: State, keep_alive: float, cold_after: float, expected: float) -> None:
    assert due(state, 100.0, keep_alive, cold_after) == expected


@pytest.mark.parametrize(("written", "seconds"), [
    ("5m", 300.0), ("90s", 90.0), ("1h30m", 5400.0), ("250ms", 0.25), (300, 300.0),
    ("300", 300.0), ("never", INF), (-1, INF), ("-1", INF), (0, 0.0), (10**400, INF),
])
def test_keep_alive_reads_ollamas_forms(written: object, seconds: float) -> None:
    assert DeviceConfig.model_validate({"keep_alive": written}).keep_alive == seconds


@pytest.mark.parametrize("written", ["5x", "", "m", "nan", True, "5 m"])
def test_a_bad_keep_alive_is_refused_with_the_forms_it_takes(written: object) -> None:
    with pytest.raises(ValueError, match="5m, 90s, 1h30m, 300 or never"):
        DeviceConfig.model_validate({"keep_alive": written})


@pytest.mark.parametrize("written", ["5m", "never"])
def test_keep_alive_survives_the_json_the_front_hands_the_worker(written: str) -> None:
    config = DeviceConfig.model_validate({"keep_alive": written})
    assert DeviceConfig.model_validate_json(config.model_dump_json()) == config


def test_keep_alive_is_never_by_default() -> None:
    assert (DeviceConfig().keep_alive, DeviceConfig().cold_after) == (INF, INF)


def _idle_count_is(recorder: Recorder, n: int, _event: object) -> bool:
    return len(_idle_evictions(recorder.of(EvictEvent))) == n


def _idle_evictions(events: list[EvictEvent]) -> list[tuple[str, str]]:
    return [(e.model, e.tier_to) for e in events if e.cause == "idle"]


async def test_an_idle_model_goes_cold_after_its_keep_alive_and_its_memory_comes_back() -> None:
    h = harness([entry("a"), entry("b")], budget_mib=1024, real_clock=True,
                idle=IdleRule(keep_alive_s=0.05))
    s = h.scheduler
    await s.start()
    await use(s, "a")
    event = await h.events.wait_for(lambda e: isinstance(e, EvictEvent))
    assert isinstance(event, EvictEvent)
    assert (event.model, event.cause, event.tier_to) == ("a", "idle", "cold")
    assert event.reason.startswith("idle for ") and "(keep_alive 0.05s)" in event.reason
    assert h.state("a") is State.COLD
    assert h.used == 0 == h.loaded_bytes()
    await use(s, "a")  # it comes back on its next request
    await s.close()


async def test_idle_goes_warm_first_then_cold_after_cold_after() -> None:
    h = harness([entry("a", warm_mib=10)], budget_mib=1024, real_clock=True, warm_tier=True,
                idle=IdleRule(keep_alive_s=0.05, cold_after_s=0.05))
    s = h.scheduler
    await s.start()
    await use(s, "a")
    await h.events.wait_for(lambda e: isinstance(e, EvictEvent) and e.tier_to == "cold")
    assert _idle_evictions(h.events.of(EvictEvent)) == [("a", "warm"), ("a", "cold")]
    assert h.state("a") is State.COLD and h.used == 0
    await s.close()


async def test_a_model_in_use_or_pinned_stays_however_long_it_is_idle() -> None:
    h = harness([entry("busy"), entry("pinned", pin=True), entry("idle")], budget_mib=1024,
                real_clock=True, idle=IdleRule(keep_alive_s=0.02))
    s = h.scheduler
    await s.start()
    holder = await hold(s, "busy")
    await use(s, "idle")
    await h.events.wait_for(lambda e: isinstance(e, EvictEvent) and e.model == "idle")
    await drain()
    assert (h.state("busy"), h.state("pinned")) == (State.HOT, State.HOT)
    await holder.release()  # busy's keep-alive counts from its last request's end
    await h.events.wait_for(lambda e: isinstance(e, EvictEvent) and e.model == "busy")
    assert h.state("pinned") is State.HOT
    assert {m for m, _ in _idle_evictions(h.events.of(EvictEvent))} == {"busy", "idle"}
    await s.close()


async def test_a_models_own_keep_alive_overrides_its_devices() -> None:
    h = harness([entry("quick", keep_alive=0.02), entry("forever", keep_alive=INF)],
                budget_mib=1024, real_clock=True, idle=IdleRule(keep_alive_s=0.02))
    s = h.scheduler
    await s.start()
    await use(s, "forever")
    await use(s, "quick")
    await h.events.wait_for(lambda e: isinstance(e, EvictEvent) and e.model == "quick")
    assert h.state("forever") is State.HOT
    assert h.used == 100 * MIB
    await s.close()


async def test_weights_shared_by_two_names_stay_as_long_as_the_more_patient_asks() -> None:
    h = harness([entry("short", weights="w", keep_alive=0.02),
                 entry("long", weights="w", keep_alive=0.05)], budget_mib=1024,
                real_clock=True)
    s = h.scheduler
    await s.start()
    await use(s, "short")
    event = await h.events.wait_for(lambda e: isinstance(e, EvictEvent))
    assert isinstance(event, EvictEvent)
    assert event.model == "short+long" and "(keep_alive 0.05s)" in event.reason
    await s.close()


async def test_a_requests_keep_alive_sets_the_models_until_the_next_request() -> None:
    """Ollama's per-request keep_alive: the last request's wins; one without it goes back to
    the configured keep-alive (here never)."""
    h = harness([entry("a")], budget_mib=1024, real_clock=True)
    s = h.scheduler
    await s.start()
    async with s.acquire("a", Task.EMBED, keep_alive=INF):
        pass
    async with s.acquire("a", Task.EMBED, keep_alive=0.0):  # let go as soon as it is idle
        pass
    event = await h.events.wait_for(lambda e: isinstance(e, EvictEvent))
    assert isinstance(event, EvictEvent) and event.cause == "idle"
    assert "(keep_alive 0s)" in event.reason
    async with s.acquire("a", Task.EMBED):  # back to the config's: never
        pass
    await drain()
    assert h.state("a") is State.HOT and len(h.events.of(EvictEvent)) == 1
    await s.close()


async def test_an_engine_whose_unload_raises_does_not_stop_the_others_letting_go(
        caplog: pytest.LogCaptureFixture) -> None:
    h = harness([entry("broken"), entry("fine")], budget_mib=1024, real_clock=True,
                idle=IdleRule(keep_alive_s=0.02))
    s = h.scheduler
    await s.start()
    await use(s, "broken")
    (engine,) = h.built

    def unload() -> None:
        raise RuntimeError("the engine would not let go")

    engine.unload = unload  # type: ignore[method-assign]
    await use(s, "fine")
    await h.events.wait_for(lambda e: isinstance(e, EvictEvent) and e.model == "fine")
    assert "letting idle broken go failed; trying again in 30s" in caplog.text
    await s.close()


async def test_an_operators_load_of_a_model_that_lets_go_at_once_returns_once_it_was_hot() -> None:
    """With keep_alive 0 the reaper woke when the load published, ahead of the operator's
    `load` waiting for it, let the model go, and the load started again: a livelock that held
    `POST /v1/residency/NAME/load` until the client gave up (seen in the API fuzzer). The load
    returns once hot; the model lets go after it, as its keep-alive says."""
    h = harness([entry("a")], budget_mib=1024, real_clock=True, idle=IdleRule(keep_alive_s=0.0))
    s = h.scheduler
    await s.start()
    for n in range(1, 4):
        async with asyncio.timeout(TIMEOUT):
            await s.load("a")
        await h.events.wait_for(functools.partial(_idle_count_is, h.events, n))
        assert h.state("a") is State.COLD
    assert len(h.built) == 3  # one load each, none undone before the operator saw it
    await s.close()
