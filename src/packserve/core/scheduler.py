"""The one owner of residency: loads, evicts and lends models; enforces quotas.

Request handlers never touch a backend's lifecycle. They ask for a lease:

    async with scheduler.acquire("all-minilm-l6-v2", Task.EMBED) as lease:
        result = await asyncio.to_thread(lease.backend.embed, texts)

Vocabulary: a *model* is a catalog entry (the name clients send). A *resident* is one set of
weights on one device; catalog entries with the same `LoadSpec` share one resident, which is
loaded once and counted once. Memory, states and eviction are per resident; quotas per model.

Invariants (all state lives on the event loop thread; only backend calls run in threads):
- `res.leases` counts requests that hold or wait for the resident; a resident with leases is
  never evicted.
- Every transition of a resident on device D (cold->loading->hot, hot->cold) happens while
  holding `self._device_locks[D]`, so two loads never both count the same free bytes.
- Lock order: a model's quota slot is taken before the device lock; nothing holds a device lock
  while waiting for a quota slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packserve.config import ModelSpec
from packserve.core.backend import Backend, BackendFactory, LoadSpec
from packserve.core.events import (
    Event,
    EventSink,
    EvictEvent,
    LoadEvent,
    LoadFailedEvent,
    RequestEvent,
    RequestStartEvent,
    log_event,
)
from packserve.core.memory import MemoryProbe
from packserve.core.policy import (
    Admission,
    ResidentView,
    Verdict,
    VictimPolicy,
    admit_request,
    lru_by_bytes,
    pins_fit,
    plan_admission,
)
from packserve.errors import (
    Conflict,
    ModelNotFound,
    ModelUnavailable,
    NeverFits,
    PackserveError,
    PinsDoNotFit,
    QueueFull,
    TaskNotSupported,
)
from packserve.types import State, Task

log = logging.getLogger("packserve.scheduler")


@dataclass(frozen=True)
class DeviceBudget:
    name: str
    budget_bytes: int
    headroom_bytes: int

    @property
    def capacity_bytes(self) -> int:
        return max(0, self.budget_bytes - self.headroom_bytes)


@dataclass(frozen=True)
class Entry:
    """A catalog entry ready to schedule: its spec, how to load it, its estimated bytes."""

    spec: ModelSpec
    load: LoadSpec
    bytes_estimated: int


@dataclass
class Lease:
    """What a request holds while it uses a model. The backend is valid until the lease ends.

    The handler records the tokens it reports to the client with `count_tokens`; they travel
    in the request's RequestEvent.
    """

    model: str
    task: Task
    backend: Backend
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def count_tokens(self, prompt: int, completion: int = 0) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion


@dataclass
class _Resident:
    load: LoadSpec
    models: list[str]
    estimated: int
    measured: int | None = None
    state: State = State.COLD
    backend: Backend | None = None
    leases: int = 0
    last_used: float = 0.0
    load_seconds: float | None = None
    error: str | None = None
    failed_until: float = 0.0
    reserved: bool = False  # admission passed; its bytes count as used
    settled: asyncio.Event | None = None  # set when a load or unload in progress ends

    @property
    def key(self) -> str:
        return self.load.key

    @property
    def label(self) -> str:
        return "+".join(self.models)

    @property
    def bytes(self) -> int:
        return self.measured if self.measured is not None else self.estimated


@dataclass
class _Model:
    spec: ModelSpec
    resident: _Resident
    pinned: bool
    running: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)
    mean_service_s: float = 1.0


@dataclass(frozen=True)
class ModelStatus:
    """One row of the residency view."""

    name: str
    tasks: tuple[Task, ...]
    state: State
    device: str
    pinned: bool
    bytes_estimated: int
    bytes_measured: int | None
    in_flight: int
    queued: int
    last_used: float | None  # wall-clock seconds since the epoch
    load_seconds: float | None
    error: str | None
    shares_weights_with: tuple[str, ...]


@dataclass(frozen=True)
class DeviceStatus:
    name: str
    budget_bytes: int
    headroom_bytes: int
    used_bytes: int


class FootprintStore:
    """Measured footprints kept across restarts, keyed by `LoadSpec.key` and the file's size."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._data: dict[str, dict[str, int]] = {}
        if path is not None and path.exists():
            try:
                self._data = json.loads(path.read_text("utf-8"))
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable footprint store %s: %s", path, exc)

    def get(self, spec: LoadSpec) -> int | None:
        row = self._data.get(spec.key)
        if row is None or row.get("file_bytes") != _size_of(spec.path):
            return None
        return int(row["bytes"])

    def put(self, spec: LoadSpec, measured: int) -> None:
        self._data[spec.key] = {"bytes": measured, "file_bytes": _size_of(spec.path)}
        if self._path is None:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._data, indent=1, sort_keys=True), "utf-8")
        os.replace(tmp, self._path)


def _size_of(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else -1


class Scheduler:
    """Decides and applies residency. Construct with injected seams; call `start()` on the loop."""

    def __init__(
        self,
        entries: Sequence[Entry],
        devices: Iterable[DeviceBudget],
        factory: BackendFactory,
        probe: MemoryProbe,
        store: FootprintStore | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        load_wait_s: float = 120.0,
        failure_cooldown_s: float = 30.0,
        victim_policy: VictimPolicy = lru_by_bytes,
        sinks: Sequence[EventSink] = (log_event,),
    ) -> None:
        self._factory = factory
        self._probe = probe
        self._store = store or FootprintStore(None)
        self._clock = clock
        self._wall_offset = wall_clock() - clock()
        self._load_wait_s = load_wait_s
        self._cooldown_s = failure_cooldown_s
        self._policy = victim_policy  # packserve's rule; bench swaps in other engines' rules
        self._sinks = list(sinks)
        self._devices = {d.name: d for d in devices}
        self._residents: dict[str, _Resident] = {}
        self._models: dict[str, _Model] = {}
        for e in entries:
            res = self._residents.get(e.load.key)
            if res is None:
                res = _Resident(load=e.load, models=[], estimated=e.bytes_estimated,
                                measured=self._store.get(e.load))
                self._residents[e.load.key] = res
            res.models.append(e.spec.name)
            res.estimated = max(res.estimated, e.bytes_estimated)
            self._models[e.spec.name] = _Model(spec=e.spec, resident=res, pinned=e.spec.pin)
            if e.load.device not in self._devices:
                raise PinsDoNotFit(
                    f"model {e.spec.name!r} is on {e.load.device}, which has no budget")
        self._device_locks = {name: asyncio.Lock() for name in self._devices}
        self._memory_changed = asyncio.Event()

    # ----------------------------------------------------------------- lifecycle

    def add_sink(self, sink: EventSink) -> None:
        self._sinks.append(sink)

    def check_pins(self) -> None:
        """Raise PinsDoNotFit if the pinned models of any device cannot fit together."""
        for dev in self._devices.values():
            pinned = [self._view(r) for r in self._residents.values()
                      if r.load.device == dev.name and self._is_pinned(r)]
            reason = pins_fit(pinned, dev.capacity_bytes)
            if reason:
                raise PinsDoNotFit(reason)

    async def start(self) -> None:
        """Check and load the pins. A pin that fails to load leaves the server up, not ready."""
        self.check_pins()
        for res in self._residents.values():
            if self._is_pinned(res):
                try:
                    await self._ensure_hot(res)
                except (ModelUnavailable, NeverFits) as exc:
                    log.error("pinned model %s did not load: %s", res.label, exc.message)

    async def close(self) -> None:
        for res in self._residents.values():
            if res.state is State.HOT and res.backend is not None:
                backend, res.backend, res.state = res.backend, None, State.COLD
                await asyncio.to_thread(backend.unload)

    # ----------------------------------------------------------------- requests

    @contextlib.asynccontextmanager
    async def acquire(self, name: str, task: Task) -> AsyncIterator[Lease]:
        """Lend `name` for one request: quota slot, then load if needed. Raises PackserveError."""
        model = self._model(name)
        if task not in model.spec.tasks:
            raise TaskNotSupported(
                f"model {name!r} does not do {task.value}; it does "
                f"{', '.join(t.value for t in model.spec.tasks)}", param="model")
        res = model.resident
        device = res.load.device
        t_enter = self._clock()
        try:
            await self._take_slot(model)
        except QueueFull as exc:
            self._emit(RequestEvent(model=name, task=task.value, device=device, queue_seconds=0.0,
                                    load_seconds=0.0, inference_seconds=0.0, status=exc.status,
                                    outcome=type(exc).__name__))
            raise
        res.leases += 1
        t_slot = self._clock()
        t_ready = t_slot
        status, outcome = 200, "ok"
        lease: Lease | None = None
        try:
            await self._ensure_hot(res)
            t_ready = self._clock()
            assert res.backend is not None
            lease = Lease(model=name, task=task, backend=res.backend)
            self._emit(RequestStartEvent(model=name, task=task.value, device=device))
            yield lease
        except BaseException as exc:
            outcome = type(exc).__name__
            status = exc.status if isinstance(exc, PackserveError) else 500
            raise
        finally:
            t_done = self._clock()
            res.leases -= 1
            res.last_used = t_done
            self._give_slot(model)
            if outcome == "ok":
                model.mean_service_s = 0.8 * model.mean_service_s + 0.2 * (t_done - t_ready)
            if res.leases == 0:
                self._signal_memory()
            self._emit(RequestEvent(
                model=name, task=task.value, device=device, queue_seconds=t_slot - t_enter,
                load_seconds=t_ready - t_slot, inference_seconds=t_done - t_ready,
                status=status, outcome=outcome,
                prompt_tokens=lease.prompt_tokens if lease else 0,
                completion_tokens=lease.completion_tokens if lease else 0,
                started=lease is not None))

    async def _take_slot(self, model: _Model) -> None:
        decision = admit_request(model.running, len(model.waiters), model.spec.concurrency,
                                 model.spec.max_queue, model.mean_service_s)
        if decision.run:
            model.running += 1
            return
        if not decision.queue:
            raise QueueFull(
                f"model {model.spec.name!r} has {model.running} requests running and "
                f"{len(model.waiters)} queued (max_concurrency={model.spec.concurrency}, "
                f"max_queue={model.spec.max_queue}); retry in {decision.retry_after_s}s",
                retry_after_s=decision.retry_after_s)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        model.waiters.append(waiter)
        try:
            await waiter  # _give_slot hands its slot over: running is already counted
        except asyncio.CancelledError:
            if waiter in model.waiters:
                model.waiters.remove(waiter)
            elif waiter.done() and not waiter.cancelled():
                self._give_slot(model)  # the slot was handed to us as we were cancelled
            raise

    def _give_slot(self, model: _Model) -> None:
        while model.waiters:
            waiter = model.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        model.running -= 1

    # ----------------------------------------------------------------- residency

    async def _ensure_hot(self, res: _Resident) -> None:
        """Return when `res` is hot; load it (once, however many callers wait) if it is not."""
        while True:
            if res.state is State.HOT and res.settled is None:
                return
            if res.settled is not None:  # a load or unload is under way: wait for its outcome
                await res.settled.wait()
                continue
            if res.state is State.FAILED:
                left = res.failed_until - self._clock()
                if left > 0:
                    raise ModelUnavailable(
                        f"model {res.label} failed to load: {res.error}; "
                        f"next try in {left:.0f}s", retry_after_s=int(left) + 1)
                res.state = State.COLD
            res.settled = asyncio.Event()
            res.state = State.LOADING
            try:
                await self._load(res)
            finally:
                if res.state is State.LOADING:
                    res.state = State.COLD
                res.settled.set()
                res.settled = None

    async def _load(self, res: _Resident) -> None:
        device = self._devices[res.load.device]
        cap = self._memory_cap(res)
        if cap is not None and res.bytes > cap:
            raise NeverFits(f"model {res.label} needs {_mib(res.bytes)}, over its max_memory "
                            f"quota of {_mib(cap)}")
        async with self._device_locks[device.name]:
            deadline = self._clock() + self._load_wait_s
            attempt = 0
            while True:
                admission = self._admission(res)
                if admission.verdict is Verdict.NEVER_FITS:
                    raise NeverFits(admission.reason)
                if admission.verdict is Verdict.WAIT_FOR_BUSY:
                    left = deadline - self._clock()
                    if left <= 0:
                        raise ModelUnavailable(
                            f"timed out after {self._load_wait_s:.0f}s waiting for memory: "
                            f"{admission.reason}", retry_after_s=5)
                    await self._wait_memory(left)
                    continue
                if admission.victims:
                    # One at a time, then plan again: a request may lease the next victim
                    # while this one unloads.
                    await self._unload(self._residents[admission.victims[0]],
                                       f"make room for {res.label}")
                    continue
                attempt += 1
                res.reserved = True
                t0 = self._clock()
                try:
                    await self._materialize(res)
                    return
                except NeverFits:
                    res.reserved = False
                    raise
                except Exception as exc:
                    res.reserved = False
                    reason = f"{type(exc).__name__}: {exc}"
                    retry = attempt == 1
                    self._emit(LoadFailedEvent(model=res.label, device=device.name,
                                               bytes=res.bytes, seconds=self._clock() - t0,
                                               reason=reason, will_retry=retry))
                    if not retry:
                        res.state, res.error = State.FAILED, reason
                        res.failed_until = self._clock() + self._cooldown_s
                        raise ModelUnavailable(
                            f"model {res.label} failed to load twice: {reason}",
                            retry_after_s=int(self._cooldown_s) + 1) from exc
                    log.warning("load of %s failed (%s); freeing idle models and retrying once",
                                res.label, reason)
                    for other in list(self._residents.values()):
                        if other.load.device == device.name and self._view(other).evictable:
                            await self._unload(other, f"free memory to retry {res.label}")

    async def _materialize(self, res: _Resident) -> None:
        """cold -> hot. Must hold the device lock and have reserved the bytes."""
        device = res.load.device
        t0 = self._clock()

        def build() -> tuple[Backend, int]:
            # Hand freed heap pages back first, so the load cannot reuse memory that was
            # already resident and hide its size (without it, the same Gemma load measured
            # anywhere from 285 to 320 MiB).
            self._probe.release(device)
            before = self._probe.used_bytes(device)
            backend = self._factory(res.load)
            try:
                backend.load()
            except BaseException:
                backend.unload()
                self._probe.release(device)
                raise
            grown = self._probe.used_bytes(device) - before
            return backend, max(grown, backend.weight_bytes())

        backend, measured = await asyncio.to_thread(build)
        seconds = self._clock() - t0
        # Keep the largest figure seen for these weights: a reload in a long-lived process can
        # reuse heap pages that trimming could not return and read low (seen: SmolLM2 139 MiB
        # against 156-160 on a fresh heap); under-counting would let the budget be exceeded.
        measured = max(measured, res.measured or 0)
        # Off the loop: the store sizes model directories and writes a file.
        await asyncio.to_thread(self._store.put, res.load, measured)
        res.measured = measured
        cap = self._memory_cap(res)
        if cap is not None and measured > cap:
            # Never publish it as HOT: the caller owns `settled` and may hold a lease.
            await asyncio.to_thread(backend.unload)
            del backend
            await asyncio.to_thread(self._probe.release, device)
            res.reserved = False
            raise NeverFits(f"model {res.label} measured {_mib(measured)} after loading, over "
                            f"its max_memory quota of {_mib(cap)}; it was unloaded")
        res.backend, res.load_seconds = backend, seconds
        res.state, res.error, res.reserved = State.HOT, None, False
        res.last_used = self._clock()
        self._emit(LoadEvent(model=res.label, device=device, bytes_estimated=res.estimated,
                             bytes_measured=measured, seconds=seconds, reason="first use"))

    async def _unload(self, res: _Resident, reason: str) -> None:
        """hot -> cold. Must hold the device lock; `res` must have no leases."""
        assert res.leases == 0 and res.state is State.HOT and res.backend is not None
        backend, res.backend = res.backend, None
        res.settled = asyncio.Event()  # new requests wait instead of using a dying backend
        t0 = self._clock()
        try:
            await asyncio.to_thread(backend.unload)
            del backend
            await asyncio.to_thread(self._probe.release, res.load.device)
        finally:
            res.state = State.COLD
            res.settled.set()
            res.settled = None
        self._emit(EvictEvent(model=res.label, device=res.load.device, bytes=res.bytes,
                              seconds=self._clock() - t0, reason=reason))
        self._signal_memory()

    def _signal_memory(self) -> None:
        self._memory_changed.set()
        self._memory_changed = asyncio.Event()

    async def _wait_memory(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._memory_changed.wait(), seconds)

    # ----------------------------------------------------------------- admin

    async def load(self, name: str) -> None:
        await self._ensure_hot(self._model(name).resident)

    async def unload(self, name: str) -> None:
        res = self._model(name).resident
        if self._is_pinned(res):
            raise Conflict(f"model {res.label} is pinned; unpin it first")
        async with self._device_locks[res.load.device]:
            if res.state is not State.HOT or res.settled is not None:
                return
            if res.leases:
                raise Conflict(f"model {res.label} has {res.leases} requests in flight")
            await self._unload(res, "unloaded by operator")

    async def pin(self, name: str) -> None:
        model = self._model(name)
        if model.pinned:
            return
        model.pinned = True
        try:
            self.check_pins()
        except PinsDoNotFit as exc:
            model.pinned = False
            raise Conflict(exc.message) from exc
        await self._ensure_hot(model.resident)

    def unpin(self, name: str) -> None:
        self._model(name).pinned = False

    def plan(self, name: str) -> Admission:
        """The dry run: what loading `name` now would evict, and why. Changes nothing."""
        res = self._model(name).resident
        answer = self._admission(res)
        # Policy speaks in resident keys; operators know catalog names.
        return dataclasses.replace(answer, target=res.label, victims=tuple(
            self._residents[k].label for k in answer.victims))

    # ----------------------------------------------------------------- views

    def model_names(self) -> list[str]:
        return list(self._models)

    def tasks_of(self, name: str) -> tuple[Task, ...]:
        return tuple(self._model(name).spec.tasks)

    def state_of(self, name: str) -> State:
        return self._model(name).resident.state

    def ready(self) -> tuple[bool, list[str]]:
        """Ready when every pinned model is hot; else the pinned models that are not."""
        waiting = [m.spec.name for m in self._models.values()
                   if m.pinned and m.resident.state is not State.HOT]
        return not waiting, waiting

    def devices(self) -> list[DeviceStatus]:
        return [DeviceStatus(name=d.name, budget_bytes=d.budget_bytes,
                             headroom_bytes=d.headroom_bytes, used_bytes=self._used(d.name))
                for d in self._devices.values()]

    def models(self) -> list[ModelStatus]:
        rows = []
        for m in self._models.values():
            res = m.resident
            rows.append(ModelStatus(
                name=m.spec.name, tasks=tuple(m.spec.tasks), state=res.state,
                device=res.load.device, pinned=m.pinned, bytes_estimated=res.estimated,
                bytes_measured=res.measured, in_flight=m.running, queued=len(m.waiters),
                last_used=(res.last_used + self._wall_offset) if res.last_used else None,
                load_seconds=res.load_seconds, error=res.error,
                shares_weights_with=tuple(n for n in res.models if n != m.spec.name)))
        return rows

    # ----------------------------------------------------------------- helpers

    def _model(self, name: str) -> _Model:
        model = self._models.get(name)
        if model is None:
            raise ModelNotFound(
                f"model {name!r} does not exist; this server has: {', '.join(self._models)}",
                param="model")
        return model

    def _is_pinned(self, res: _Resident) -> bool:
        return any(self._models[n].pinned for n in res.models)

    def _memory_cap(self, res: _Resident) -> int | None:
        caps = [c for n in res.models if (c := self._models[n].spec.max_memory) is not None]
        return min(caps) if caps else None

    def _view(self, res: _Resident) -> ResidentView:
        state = res.state
        if state is State.LOADING and not res.reserved:
            state = State.COLD  # waiting for admission: holds nothing yet
        elif state is State.HOT and res.settled is not None:
            state = State.LOADING  # unloading: still holds memory, cannot be chosen again
        return ResidentView(
            key=res.key, device=res.load.device, state=state, bytes=res.bytes,
            pinned=self._is_pinned(res), in_flight=res.leases, last_used=res.last_used,
            models=tuple(res.models))

    def _admission(self, res: _Resident) -> Admission:
        device = self._devices[res.load.device]
        views = [self._view(r) for r in self._residents.values()]
        return plan_admission(self._view(res), views, device.capacity_bytes, self._policy)

    def _used(self, device: str) -> int:
        return sum(v.bytes for v in map(self._view, self._residents.values())
                   if v.device == device and v.holds_memory)

    def _emit(self, event: Event) -> None:
        for sink in self._sinks:
            try:
                sink(event)
            except Exception:  # an exporter bug must not break scheduling
                log.exception("event sink failed on %s", event)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
