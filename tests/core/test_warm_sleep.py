"""A runner's warm state on a card is llama.cpp's sleeping state (issue 43), against the fake
CUDA machine (tests/factories/fake_cuda.py `SleepingRunner`): the sleep frees the weights' and
caches' bytes on the card and keeps the runner's context, which is what the warm copy is
charged; a wake needs the rest and evicts first where the card has no room for it; a wake that
kills the runner is a death through the scheduler's one path (counted, reloaded, backed off,
quarantined), never a hung request."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from packserve.config import ModelSpec
from packserve.core.backend import Backend, LoadSpec
from packserve.core.catalog import DeviceBudget, Entry
from packserve.core.events import CrashEvent, EvictEvent, LoadEvent, LoadFailedEvent
from packserve.core.scheduler import Scheduler
from packserve.errors import ModelUnavailable
from packserve.types import State, Task
from tests.factories import use
from tests.factories.fake_cuda import GIB, MIB, FakeCuda, SleepingRunner
from tests.factories.scheduler import Recorder

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

WORKER = 4242  # the worker's pid: it opens no context for runners


def model(name: str, mib: int) -> Entry:
    source = f"fake:{mib}MiB"
    spec = ModelSpec(name=name, tasks=[Task.EMBED], backend="fake", source=source,
                     device="cuda:0")
    return Entry(spec=spec, load=LoadSpec(backend="fake", path=Path(name) / source,
                                          device="cuda:0", context_length=0),
                 bytes_estimated=mib * MIB)


class Card:
    """A scheduler over a fake card whose models are sleeping runners, each load a new pid."""

    def __init__(self, entries: list[Entry], total: int, *, load_wait_s: float = 10.0,
                 per_process: bool | None = True) -> None:
        self.cuda = FakeCuda(totals={0: total})
        self.nvml = self.cuda.nvml(per_process)
        self.events = Recorder()
        self.runners: list[SleepingRunner] = []
        self.scheduler = Scheduler(
            entries, [DeviceBudget("cuda:0", budget_bytes=total, headroom_bytes=0)],
            self._build, self.cuda.probe(WORKER, per_process=per_process, ours=self._family),
            None,
            load_wait_s=load_wait_s, clock=time.monotonic, sinks=(self.events,),
            warm_tier={"cuda:0"})

    def _family(self, pid: int) -> frozenset[int]:
        """The worker and its runners: what the probe counts as this server's, not others'."""
        return frozenset({pid, *(r.pid for r in self.runners)})

    def _build(self, spec: LoadSpec) -> Backend:
        runner = SleepingRunner(spec)
        runner.cuda, runner.pid, runner.nvml = self.cuda, 9000 + len(self.runners), self.nvml
        self.runners.append(runner)
        return runner

    def runner(self, name: str) -> SleepingRunner:
        """The latest runner of `name`."""
        return [r for r in self.runners if r.spec.path.parent.name == name][-1]

    def status(self, name: str) -> dict[str, object]:
        return next(vars(m) for m in self.scheduler.models() if m.name == name)


async def test_a_sleeping_runner_keeps_its_context_and_frees_the_rest() -> None:
    card = Card([model("a", 8192), model("b", 8192)], 10 * GIB)
    s, cuda = card.scheduler, card.cuda
    await s.start()
    await use(s, "a")
    a = card.runner("a")
    hot = card.status("a")["bytes_measured"]
    assert hot == cuda.context_bytes + 8 * GIB  # its pid's bytes: context, weights, caches
    await use(s, "b")  # a is evicted: it sleeps
    assert s.state_of("a") is State.WARM
    assert cuda.held_by(a.pid, 0) == cuda.context_bytes  # the context stays, nothing else
    warm = card.status("a")["bytes_warm"]
    assert warm == cuda.context_bytes  # the warm copy is charged what NVML says it holds
    assert isinstance(hot, int) and isinstance(warm, int) and warm <= 0.1 * hot
    out = [e for e in card.events.of(EvictEvent) if e.model == "a"][-1]
    assert (out.tier_to, out.bytes) == ("warm", 8 * GIB)
    assert cuda.host_bytes == 0  # nothing parked in host RAM: the wake reads the file
    await s.close()
    assert cuda.used(0) == 0  # every runner's process is gone, context and all


async def test_without_per_process_figures_the_sleep_is_measured_on_the_device() -> None:
    """MIG: NVML lists no process, so a runner cannot say what it holds; its load was
    measured by the card's used memory, and so is its sleep: it keeps its context."""
    card = Card([model("a", 4096), model("b", 4096)], 6 * GIB, per_process=None)
    s, cuda = card.scheduler, card.cuda
    await s.start()
    await use(s, "a")
    assert card.status("a")["bytes_measured"] == cuda.context_bytes + 4 * GIB
    await use(s, "b")
    assert s.state_of("a") is State.WARM
    assert card.status("a")["bytes_warm"] == cuda.context_bytes  # not 0
    await s.close()


async def test_a_wake_with_no_room_evicts_first_then_wakes_the_same_process() -> None:
    """The card holds a sleeping a (its context) and a hot b: a's wake needs 8 GiB more, so b
    goes to sleep first; a wake before that would run out of memory on the fake card."""
    card = Card([model("a", 8192), model("b", 8192)], 10 * GIB)
    s, cuda = card.scheduler, card.cuda
    await s.start()
    await use(s, "a")
    a = card.runner("a")
    await use(s, "b")
    await use(s, "a")
    assert (s.state_of("a"), s.state_of("b")) == (State.HOT, State.WARM)
    assert card.runner("a") is a and a.control.restores.get(a.name) == 1  # woken, not built
    woke = [e for e in card.events.of(LoadEvent) if e.model == "a"][-1]
    assert woke.tier_from == "warm"
    order = [(type(e).__name__, e.model) for e in card.events.events
             if isinstance(e, (EvictEvent, LoadEvent))]
    assert order.index(("EvictEvent", "b")) < order.index(("LoadEvent", "a"), 1)
    assert cuda.used(0) == 2 * cuda.context_bytes + 8 * GIB
    await s.close()


async def test_a_wake_that_kills_the_runner_is_a_death_through_the_one_path() -> None:
    """The first death loads it anew at once (the request is answered by a new process); the
    second within crash_window_s waits out its back-off, then loads; the third quarantines it:
    503, never a hung request. Each is a CrashEvent saying it died waking."""
    card = Card([model("a", 4096), model("b", 4096)], 10 * GIB)
    s, cuda = card.scheduler, card.cuda
    await s.start()

    async def wake_dies() -> SleepingRunner:
        await use(s, "a")
        await s.offload("a")  # the operator's offload: asleep
        assert s.state_of("a") is State.WARM
        dying = card.runner("a")
        dying.wake_dies = True
        return dying

    dead = await wake_dies()
    await use(s, "a")  # answered by a runner built anew
    assert card.runner("a") is not dead and s.state_of("a") is State.HOT
    first = card.events.of(CrashEvent)[-1]
    assert (first.doing, first.action, first.signal, first.deaths) == (
        "waking", "reload", "SIGABRT", 1)

    await wake_dies()
    t0 = time.monotonic()
    await use(s, "a")  # waits out the back-off (2 s), then loads
    second = card.events.of(CrashEvent)[-1]
    assert (second.action, second.deaths) == ("backoff", 2)
    assert time.monotonic() - t0 >= second.retry_in_s * 0.9

    await wake_dies()
    with pytest.raises(ModelUnavailable, match="quarantined"):
        await use(s, "a")
    third = card.events.of(CrashEvent)[-1]
    assert (third.action, third.deaths) == ("quarantine", 3)
    # each failed wake ends its load for the front, retried only after the first
    assert [e.will_retry for e in card.events.of(LoadFailedEvent)] == [True, False, False]
    assert s.state_of("a") is State.FAILED
    assert cuda.used(0) == 0  # no process of a is left on the card
    await use(s, "b")  # the other model serves meanwhile
    await s.close()


async def test_deaths_before_the_worker_started_count_with_the_next() -> None:
    """The front hands a new worker each model's deaths (seconds ago; a shared load's names
    each bring the same ones, counted once): two within crash_window_s make the next death
    the third, a quarantine; one outside the window does not count."""
    a = model("a", 4096)
    b = Entry(spec=ModelSpec(name="b", tasks=[Task.EMBED], backend="fake", source="fake:4096MiB",
                             device="cuda:0"),
              load=a.load, bytes_estimated=a.bytes_estimated)  # one load, two names
    card = Card([a, b], 6 * GIB)
    s = card.scheduler
    # each name brings the deaths it was charged; a name not served is skipped
    s.remember_deaths({"a": [20.0, 10.0, 4000.0], "b": [10.0], "gone": [5.0]})
    await s.start()
    await use(s, "a")
    await s.offload("a")
    card.runner("a").wake_dies = True
    with pytest.raises(ModelUnavailable, match="died 3 times"):
        await use(s, "b")
    [crash] = card.events.of(CrashEvent)
    assert (crash.model, crash.action, crash.deaths) == ("a+b", "quarantine", 3)
    await s.close()


async def test_a_runner_found_dead_asleep_is_counted_as_a_warm_death_and_loaded_anew() -> None:
    """Killed while asleep, its reaper's report still on its way when a request wakes it: the
    restore finds it gone, and the death is counted once, as a death while warm (not waking);
    the request is answered by a new runner."""
    card = Card([model("a", 4096)], 6 * GIB)
    s = card.scheduler
    await s.start()
    await use(s, "a")
    await s.offload("a")
    dead = card.runner("a")
    dead.killed_asleep = True
    await use(s, "a")
    assert card.runner("a") is not dead and s.state_of("a") is State.HOT
    [crash] = card.events.of(CrashEvent)
    assert (crash.doing, crash.action, crash.signal, crash.deaths) == (
        "warm", "reload", "SIGKILL", 1)
    await s.close()


@pytest.mark.parametrize(("fault", "doing", "signal"), [
    ("sleep_dies", "going warm", "SIGABRT"),  # it crashed freeing its buffers
    ("killed_hot", "idle", "SIGKILL"),  # killed idle, its reaper's report not yet handled
])
async def test_a_runner_that_dies_as_it_is_sent_to_sleep_is_counted_once_and_goes_cold(
        fault: str, doing: str, signal: str) -> None:
    """The eviction finds the runner dead: a death, counted there once with what it was doing,
    and the eviction unloads it; the next request loads it anew."""
    card = Card([model("a", 4096)], 6 * GIB)
    s = card.scheduler
    await s.start()
    await use(s, "a")
    setattr(card.runner("a"), fault, True)
    await s.offload("a")
    assert s.state_of("a") is State.COLD
    [crash] = card.events.of(CrashEvent)
    assert (crash.doing, crash.action, crash.signal, crash.deaths) == (doing, "reload", signal, 1)
    out = card.events.of(EvictEvent)[-1]
    assert (out.model, out.tier_to) == ("a", "cold")
    await use(s, "a")
    assert len(card.runners) == 2 and s.state_of("a") is State.HOT
    await s.close()
