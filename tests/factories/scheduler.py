"""Scheduler and policy tests: fake models on one cpu device, a fake probe, clock and sleeper,
requests that hold their lease; plain residents for the policy's tables.

No sleeping to wait: tests wait on events or loop state with timeouts (`TIMEOUT` bounds every
wait; it is never a timing assertion)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from packserve.backends import check_weights
from packserve.backends.fake import FakeBackend, FakeControl, held_bytes
from packserve.config import ModelSpec
from packserve.core.backend import Backend, LoadSpec, Runner
from packserve.core.catalog import DeviceBudget, Entry
from packserve.core.events import Event, EvictEvent, LoadEvent, LoadFailedEvent
from packserve.core.idle import IdleRule
from packserve.core.loader import FootprintStore
from packserve.core.policy import ResidentView, VictimPolicy, lru_by_bytes
from packserve.core.scheduler import Scheduler
from packserve.core.status import ModelStatus
from packserve.types import State, Task

MIB = 1 << 20
GIB = 1 << 30
TIMEOUT = 10.0  # seconds; a bound on waiting for events, never a timing assertion

T = TypeVar("T")


class FakeProbe:
    """A MemoryProbe that reads what the fake backends hold, so measured = the backend's
    weight bytes (and a warm copy keeps its declared `warm` bytes)."""

    def __init__(self) -> None:
        self.releases = 0
        self.settles = 0

    def total_bytes(self, device: str) -> int:
        return 64 * GIB

    def used_bytes(self, device: str) -> int:
        return GIB + held_bytes(device)

    def release(self, device: str) -> None:
        self.releases += 1

    def settle(self) -> None:
        self.settles += 1

    def mapped_file_bytes(self, device: str, path: Path) -> int:
        return 0

    def accounting(self, device: str) -> str:
        return "rss" if device == "cpu" else "per_process"

    def others_bytes(self, device: str) -> int | None:
        return None if device == "cpu" else 0

    def open_device(self, device: str) -> None:
        pass


class Clock:
    """A scheduler clock that moves only when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Sleeper:
    """An injected `sleep` (the pin retries' backoff timer): records each delay and returns
    only when the test calls `wake()`."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._wake = asyncio.Event()
        self._called = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        self._called.set()
        self._called = asyncio.Event()
        await self._wake.wait()

    async def asleep(self, count: int) -> None:
        """Return once `count` sleeps have started."""
        async with asyncio.timeout(TIMEOUT):
            while len(self.delays) < count:
                await self._called.wait()

    def wake(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()


class Recorder:
    """An event sink that remembers every event and lets a test await one."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.gauges: list[int] = []  # `gauge()` at each event
        self.gauge: Callable[[], int] = lambda: 0
        self._changed = asyncio.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        self.gauges.append(self.gauge())
        self._changed.set()
        self._changed = asyncio.Event()

    def of(self, kind: type[T]) -> list[T]:
        return [e for e in self.events if isinstance(e, kind)]

    def names(self, kind: type[LoadEvent] | type[EvictEvent] | type[LoadFailedEvent]) -> list[str]:
        return [e.model for e in self.of(kind)]

    async def wait_for(self, pred: Callable[[Event], bool]) -> Event:
        async with asyncio.timeout(TIMEOUT):
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                await self._changed.wait()


def entry(
    name: str, mib: int = 100, *, declared_mib: int | None = None, weights: str | None = None,
    pin: bool = False, max_concurrency: int = 32, max_queue: int = 64,
    max_memory: int | None = None, tasks: Sequence[Task] = (Task.EMBED,),
    context_length: int = 0, warm_mib: int | None = None, keep_alive: float | None = None,
) -> Entry:
    """A fake model estimated at `mib` MiB whose backend declares `declared_mib` (default: same)
    and, with `warm_mib`, a warm state that keeps that much.

    Entries with equal `weights` (default: the name) and context share one LoadSpec, hence one
    resident.
    """
    source = f"fake:{declared_mib or mib}MiB" + (f"?warm={warm_mib}MiB" if warm_mib else "")
    spec = ModelSpec(name=name, tasks=list(tasks), backend="fake", source=source, device="cpu",
                     pin=pin, max_concurrency=max_concurrency, max_queue=max_queue,
                     max_memory=max_memory, keep_alive=keep_alive)
    load = LoadSpec(backend="fake", path=Path(weights or name) / source, device="cpu",
                    context_length=context_length)
    return Entry(spec=spec, load=load, bytes_estimated=mib * MIB)


def file_entry(name: str, path: Path, backend: str = "llama-server", mib: int = 100) -> Entry:
    """A model whose weights are the real file `path` (its header is checked before a load).
    The harness's factory still builds a fake engine for it, declaring `mib`."""
    spec = ModelSpec(name=name, tasks=[Task.CHAT], backend="llama-server", source=str(path),
                     device="cpu")
    load = LoadSpec(backend=backend, path=path, device="cpu", context_length=512)
    return Entry(spec=spec, load=load, bytes_estimated=mib * MIB)


@dataclass
class Harness:
    scheduler: Scheduler
    control: FakeControl
    events: Recorder
    probe: FakeProbe
    clock: Clock
    capacity: int
    built: list[FakeBackend] = field(default_factory=list)
    building: threading.Event = field(default_factory=threading.Event)

    def status(self, name: str) -> ModelStatus:
        (row,) = [m for m in self.scheduler.models() if m.name == name]
        return row

    def state(self, name: str) -> State:
        return self.scheduler.state_of(name)

    def loaded_bytes(self) -> int:
        """What the fake engines really hold now, independent of the scheduler's accounting."""
        return sum(b.weight_bytes() for b in self.built)

    @property
    def used(self) -> int:
        return self.scheduler.devices()[0].used_bytes


def harness(
    entries: Sequence[Entry], budget_mib: int, *, headroom_mib: int = 0,
    clock: Clock | None = None, real_clock: bool = False, store: FootprintStore | None = None,
    load_wait_s: float = 120.0, failure_cooldown_s: float = 30.0,
    sleep: Sleeper | None = None,
    victim_policy: VictimPolicy | Mapping[str, VictimPolicy] = lru_by_bytes,
    check_files: bool = False, warm_tier: bool = False, load_turn: float = 0.0,
    idle: IdleRule | None = None, load_timeout_s: float = 600.0,
) -> Harness:
    """A scheduler over `entries` on one cpu device. Call inside a running event loop.

    Without `check_files` no header check runs before a load, so a load reaches its device
    lock without a trip through a thread, and `drain()` is enough to bring it there.
    """
    control = FakeControl()
    events = Recorder()
    probe = FakeProbe()
    clock = clock or Clock()
    built: list[FakeBackend] = []
    building = threading.Event()

    def factory(spec: LoadSpec) -> Backend:
        backend = FakeBackend(spec)
        if spec.backend != "fake":  # a real file stands behind it; the fake declares the size
            backend.spec = LoadSpec(backend="fake", path=Path(spec.path.stem) / "fake:100MiB",
                                    device=spec.device, context_length=spec.context_length)
            backend.name = "fake:100MiB"
        backend.control = control
        built.append(backend)
        building.set()
        return backend

    scheduler = Scheduler(
        entries, [DeviceBudget("cpu", budget_bytes=budget_mib * MIB,
                               headroom_bytes=headroom_mib * MIB)],
        factory, probe, store, load_wait_s=load_wait_s, failure_cooldown_s=failure_cooldown_s,
        load_timeout_s=load_timeout_s,
        clock=time.monotonic if real_clock else clock, sinks=(events,),
        sleep=sleep or asyncio.sleep, victim_policy=victim_policy,
        check_files=check_weights if check_files else None,
        warm_tier={"cpu"} if warm_tier else (), load_turn=load_turn,
        idle={"cpu": idle} if idle else None,
    )
    h = Harness(scheduler=scheduler, control=control, events=events, probe=probe, clock=clock,
                capacity=(budget_mib - headroom_mib) * MIB, built=built, building=building)
    events.gauge = lambda: max(h.used, h.loaded_bytes())
    return h


def run(coro: Coroutine[object, object, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 4 * TIMEOUT))


async def use(scheduler: Scheduler, name: str, task: Task = Task.EMBED, *,
              request_id: str = "", slo_s: float | None = None) -> Runner:
    """One request: take a lease, return the runner it lent."""
    async with scheduler.acquire(name, task, request_id=request_id, slo_s=slo_s) as lease:
        assert lease.model == name
        return lease.runner


def backend_of(runner: Runner) -> Backend:
    """The backend a runner runs (white box: which load a lease lent)."""
    return runner._backend


async def drain(rounds: int = 50) -> None:
    """Let every ready task run until it blocks. Yields to the loop; never waits on time."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class Hold:
    """A request that keeps its lease until `release()`."""

    def __init__(self, scheduler: Scheduler, name: str, request_id: str = "") -> None:
        self._acquired = asyncio.Event()
        self._release = asyncio.Event()
        self.task = asyncio.create_task(self._run(scheduler, name, request_id))

    async def _run(self, scheduler: Scheduler, name: str, request_id: str) -> None:
        async with scheduler.acquire(name, Task.EMBED, request_id=request_id):
            self._acquired.set()
            await self._release.wait()

    async def acquired(self) -> Hold:
        waiter = asyncio.create_task(self._acquired.wait())
        await asyncio.wait({waiter, self.task}, timeout=TIMEOUT,
                           return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self.task.done():
            self.task.result()  # re-raise what went wrong
        assert self._acquired.is_set(), "lease not granted in time"
        return self

    async def release(self) -> None:
        self._release.set()
        await asyncio.wait_for(self.task, TIMEOUT)


async def hold(scheduler: Scheduler, name: str, request_id: str = "") -> Hold:
    return await Hold(scheduler, name, request_id).acquired()


# ------------------------------------------------------------------- policy tests: plain residents

def resident(
    key: str, mib: int, *, last_used: float = 0.0, pinned: bool = False, in_flight: int = 0,
    state: State = State.HOT, device: str = "cpu", models: Sequence[str] = (),
    reload_s: float = 0.0, rate_per_s: float = 0.0, warm_mib: int | None = None,
    restore_s: float = 0.0,
) -> ResidentView:
    """A resident of `mib` MiB; `models` defaults to one catalog name equal to the key. With
    `warm_mib`: a hot one goes warm when evicted and keeps that much; a warm one holds it."""
    return ResidentView(
        key=key, device=device, state=state, bytes=mib * MIB, pinned=pinned,
        in_flight=in_flight, last_used=last_used, models=tuple(models) or (key,),
        reload_s=reload_s, rate_per_s=rate_per_s, goes_warm=warm_mib is not None,
        keeps_bytes=(warm_mib or 0) * MIB, restore_s=restore_s,
        warm_bytes=(warm_mib or 0) * MIB if state is not State.HOT else 0,
    )


def cold(key: str, mib: int, *, models: Sequence[str] = ()) -> ResidentView:
    """A target that is not loaded yet."""
    return resident(key, mib, state=State.COLD, models=models)


def victim_rows() -> tuple[ResidentView, ...]:
    """The residents of one device the victim-policy tables start from: `a`, `b` and `c` idle
    (100, 200 and 300 MiB, least to most recently used), then three no policy may name: `busy`
    (a request in flight), `pin` (pinned) and `loading`."""
    return (resident("a", 100, last_used=1), resident("b", 200, last_used=2),
            resident("c", 300, last_used=3), resident("busy", 400, last_used=0, in_flight=1),
            resident("pin", 400, last_used=0, pinned=True),
            resident("loading", 50, last_used=0, state=State.LOADING))
