"""The one owner of residency: loads, evicts and lends models; enforces quotas.

Request handlers never touch a backend's lifecycle. They ask for a lease, which lends a
`Runner` (the loaded backend's task methods, nothing else):

    async with scheduler.acquire("all-minilm-l6-v2", Task.EMBED) as lease:
        result = await asyncio.to_thread(lease.runner.embed, texts)

Vocabulary: a *model* is a catalog entry (the name clients send). A *resident* is one set of
weights on one device; catalog entries with the same `LoadSpec` share one resident, which is
loaded once and counted once. Memory, states and eviction are per resident; quotas per model.

A resident moves COLD -> ADMITTING -> LOADING -> HOT -> UNLOADING -> COLD (or FAILED). ADMITTING
holds nothing; LOADING, HOT and UNLOADING hold their bytes (`ResidentView.held`). On a device
with the warm tier, an eviction chosen by the victim policy goes HOT -> UNLOADING -> WARM where
the engine can give its weights back and keep its objects; a WARM one holds what it kept, and
its next load (WARM -> ADMITTING -> LOADING -> HOT) restores it, admitted for the difference;
a WARM victim, an operator's unload, a retirement or shutdown takes it to COLD.

Invariants (all state lives on the event loop thread; only backend calls run in threads):
- `res.leases` counts requests that hold or wait for the resident; a resident with leases is
  never evicted.
- A load is a task the scheduler owns (`res.load_task`), never the caller's: callers await it
  through `asyncio.shield`, so one that is cancelled cannot interrupt it. Until the engine call
  starts, a load nobody waits for any more gives up, having loaded and evicted nothing; from
  LOADING on it runs to the end and publishes the model hot or undoes itself.
- Every transition of a resident on device D (ADMITTING->LOADING->HOT, HOT->UNLOADING->COLD,
  and the same through WARM)
  happens while holding `self._device_locks[D]`: two loads never count the same free bytes, and
  no load is measured while another load or unload on D moves its memory. Waiting for that
  lock is bounded by `load_wait_s`.
- Weights leave a device only through `_to_cold` (which also makes warm copies).
- Lock order: a model's quota slot is taken before the device lock; nothing holds a device lock
  while waiting for a quota slot.
- A load's turn: once a load that waits for busy models to finish (WAIT_FOR_BUSY) has kept one
  of its requests waiting `load_turn` of its SLO, requests that arrive for those models and are
  due no earlier than its earliest wait behind it (`res.turn`, `res.due`; each at most `load_turn`
  of its own SLO), so that they drain and the load is not starved by a steady stream to the
  model it must evict. Held requests hold a quota slot but no lease, so they never keep their
  model busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import math
import os
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from packserve import atomic, backoff
from packserve.config import ModelSpec
from packserve.core.backend import Backend, BackendFactory, LoadSpec, Runner
from packserve.core.events import (
    CLIENT_CLOSED,
    Event,
    EventSink,
    EvictEvent,
    LoadEvent,
    LoadFailedEvent,
    LoadStartEvent,
    RequestEvent,
    RequestStartEvent,
    log_event,
)
from packserve.core.fairness import FairQueue
from packserve.core.memory import MemoryProbe
from packserve.core.policy import (
    RATE_WINDOW,
    Admission,
    CostAware,
    ResidentView,
    Verdict,
    VictimPolicy,
    admit_request,
    arrival_rate,
    explain_victim,
    pins_fit,
    plan_admission,
    policy_name,
)
from packserve.errors import (
    ConfigError,
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
from packserve.units import format_bytes

log = logging.getLogger("packserve.scheduler")

T = TypeVar("T")

QUARANTINE_RETRY_AFTER_S = 60  # a quarantined model waits for an operator; clients back off
LOCK_RETRY_AFTER_S = 5


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
    """What a request holds while it uses a model. `runner` is valid until the lease ends.

    The handler records the tokens it reports to the client with `count_tokens`; they travel
    in the request's RequestEvent.
    """

    model: str
    task: Task
    runner: Runner
    prompt_tokens: int = 0
    completion_tokens: int = 0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    first_token_at: float | None = None  # a stream's first text went out (its clock's time)

    def count_tokens(self, prompt: int, completion: int = 0) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion

    def first_token(self) -> None:
        """A stream sent its first text now (time to first token, in the RequestEvent)."""
        if self.first_token_at is None:
            self.first_token_at = self.clock()


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
    bytes_warm: int | None = None  # what it holds while warm (engine objects, no weights)
    restore_seconds: float | None = None  # the last restore from warm


@dataclass(frozen=True)
class DeviceStatus:
    name: str
    budget_bytes: int
    headroom_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class PinStatus:
    """A pinned model that is not hot, as /readyz reports it."""

    model: str
    state: State
    error: str | None  # why its last load failed; None while it loads for the first time
    next_retry_s: float | None  # seconds until the scheduler tries again; None: no retry planned


@dataclass(frozen=True)
class Readiness:
    """Ready when every pinned model is hot; `pins` are the pinned models that are not."""

    ready: bool
    pins: tuple[PinStatus, ...]

    @property
    def not_loaded(self) -> list[str]:
        return [p.model for p in self.pins]


@dataclass(frozen=True)
class ReconfigureReport:
    """What `Scheduler.reconfigure` changed, by catalog name."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]  # quotas, pin, tasks or estimate; or new weights (a remove + add)


_MEMORY_MESSAGE = re.compile(
    r"out of memory|(failed|unable|cannot|can't|could not) (to )?allocate", re.IGNORECASE)


def is_memory_failure(exc: BaseException) -> bool:
    """Whether a failed load may succeed once memory is freed, so retrying it is worth it.

    True for MemoryError, ENOMEM, and an engine's allocation failure in words ("CUDA out of
    memory", ggml's "failed to allocate", numpy's "Unable to allocate"), anywhere in the
    exception's chain. Anything else (a corrupt file, a missing library, a bad argument) will
    fail the same way again.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemoryError):
            return True
        if isinstance(current, OSError) and current.errno == errno.ENOMEM:
            return True
        if _MEMORY_MESSAGE.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


@dataclass(eq=False)
class _Turn:
    """A load waits for this busy resident: requests for it that arrive from `since` on wait
    for `done` (set when the load is admitted or gives up)."""

    load: _Resident  # the waiting load's resident
    since: float
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class _Resident:
    load: LoadSpec
    models: list[str]  # the catalog names that use these weights now
    estimated: int
    measured: int | None = None
    peak_here: int | None = None  # the largest footprint measured by this process
    state: State = State.COLD
    backend: Backend | None = None  # the lifecycle: only the scheduler holds it
    runner: Runner | None = None  # what leases lend while HOT; one per load
    leases: int = 0
    last_used: float = 0.0
    # when its last requests arrived (scheduler clock): the victim policy's reuse estimate
    arrivals: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))
    load_seconds: float | None = None
    error: str | None = None
    failed_until: float = 0.0
    quarantine: str | None = None  # why it stays FAILED until an operator loads it
    load_task: asyncio.Task[None] | None = None  # the scheduler-owned load in progress
    waiters: int = 0  # callers awaiting `load_task`: requests, admin load/pin, pins at start
    abandonable: bool = False  # `load_task` waits where cancelling it is safe (lock, memory)
    settled: asyncio.Event | None = None  # set when the unload in progress ends
    retired: list[_Model] = field(default_factory=list)  # removed models still draining
    former: str = ""  # its label when the catalog last named it
    retiring: bool = False  # a `_retire` task watches it
    # The warm tier: a backend that gave its weights back and kept its engine objects (while
    # WARM, and while a load restores it), what it holds then (as last measured), whether its
    # engine has a warm state (None: not tried yet), and how long the last restore took.
    warm: Backend | None = None
    warm_bytes: int = 0
    warmable: bool | None = None
    restore_seconds: float | None = None
    unloading_bytes: int | None = None  # while UNLOADING: a warm copy holds less than `bytes`
    turn: _Turn | None = None  # a load waits for it to drain (see the module's invariants)
    due: float = math.inf  # the earliest deadline of the requests its load (if any) serves
    due_slo: float = math.inf  # that request's SLO
    at_risk: float = math.inf  # when that request will have waited `load_turn` of its SLO
    holding: dict[str, _Turn] = field(default_factory=dict)  # while its load waits: whom it drains

    @property
    def key(self) -> str:
        return self.load.key

    @property
    def label(self) -> str:
        return "+".join(self.models) or self.former or self.key

    @property
    def bytes(self) -> int:
        return self.measured if self.measured is not None else self.estimated


@dataclass(eq=False)
class _Model:
    spec: ModelSpec
    resident: _Resident
    pinned: bool
    estimated: int
    running: int = 0
    # requests waiting for a slot, shared fairly between API keys (core.fairness)
    waiters: FairQueue[asyncio.Future[None]] = field(default_factory=FairQueue)
    mean_service_s: float = 1.0

    @property
    def idle(self) -> bool:
        return self.running == 0 and not self.waiters


@dataclass(eq=False)
class _PinRetry:
    model: _Model
    error: str
    delay_s: float
    next_at: float  # scheduler clock
    failures: int = 1


FOOTPRINT_HISTORY = 5  # measurements per load the footprint store keeps


class FootprintStore:
    """Measured footprints kept across restarts, keyed by `LoadSpec.key` and the file's size.

    Each load is measured as the growth of the process while it runs, so a load next to busy
    requests reads high and one that reuses freed heap reads low. The store keeps the last
    FOOTPRINT_HISTORY measurements and answers their median: one odd reading moves nothing,
    and a figure that was once inflated does not stay so across restarts (`bench soak` saw a
    keep-the-largest rule drift Gemma from 319 to 403 MiB). `put` is called from load threads,
    for loads on several devices at once.
    """

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._data: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()  # guards `_data` and the file
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
        """Add `measured` to the load's history and save the file. A failed save (full disk,
        read-only data dir) is logged and otherwise ignored: the figure stays known to this
        process, and the load that measured it stays good."""
        file_bytes = _size_of(spec.path)
        with self._lock:
            old = self._data.get(spec.key) or {}
            history = old.get("history") if old.get("file_bytes") == file_bytes else None
            recent = [*(history if isinstance(history, list) else []), measured]
            recent = recent[-FOOTPRINT_HISTORY:]
            row: dict[str, Any] = {"bytes": int(statistics.median_high(recent)),
                                   "history": recent, "file_bytes": file_bytes}
            self._data[spec.key] = row
            if self._path is None:
                return
            text = json.dumps(self._data, indent=1, sort_keys=True)
            try:
                self._write(self._path, text)
            except OSError as exc:
                log.warning("could not save measured footprints to %s (kept in memory): %s",
                            self._path, exc)

    @staticmethod
    def _write(path: Path, text: str) -> None:
        atomic.write_text(path, text)  # another process (a restarted worker) may write too


def _size_of(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else -1


def _outcome(exc: BaseException) -> tuple[int, str]:
    """The status and outcome a request that ended with `exc` is counted with."""
    if isinstance(exc, asyncio.CancelledError):
        return CLIENT_CLOSED, "client_closed"
    if isinstance(exc, PackserveError):
        return exc.status, type(exc).__name__
    return 500, type(exc).__name__


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
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        load_wait_s: float = 120.0,
        failure_cooldown_s: float = 30.0,
        pin_retry_s: tuple[float, float] = (1.0, 60.0),
        victim_policy: VictimPolicy | Mapping[str, VictimPolicy] | None = None,
        check_files: Callable[[LoadSpec], None] | None = None,
        sinks: Sequence[EventSink] = (log_event,),
        load_nice: int = 0,
        warm_tier: Iterable[str] = (),
        load_turn: float = 0.0,
    ) -> None:
        self._factory = factory
        self._probe = probe
        self._store = store or FootprintStore(None)
        self._clock = clock
        self._wall_offset = wall_clock() - clock()
        self._sleep = sleep  # the pin retries' backoff timer
        self._load_wait_s = load_wait_s
        self._cooldown_s = failure_cooldown_s
        self._pin_retry_first_s, self._pin_retry_max_s = pin_retry_s
        # packserve's rule, or one per device (the config's `eviction`); the bench swaps in
        # other engines' rules.
        self._policies: Mapping[str, VictimPolicy] | None = (
            victim_policy if isinstance(victim_policy, Mapping) else None)
        self._default_policy: VictimPolicy = (
            victim_policy if victim_policy is not None and not isinstance(victim_policy, Mapping)
            else CostAware())
        self._check_files = check_files  # before every load; the server checks headers
        # Devices whose evictions keep an engine's objects and give back only its weights.
        self._warm_tier = frozenset(warm_tier)
        # A load waiting for busy models takes its turn once one of its requests has waited this
        # fraction of its SLO, and holds their new requests, each for at most this fraction of
        # its own (0: they go ahead; `acquire` without an SLO counts `load_wait_s` as one).
        self._load_turn = load_turn
        self._sinks = list(sinks)
        self._devices = {d.name: d for d in devices}
        self._residents: dict[str, _Resident] = {}
        self._models: dict[str, _Model] = {}
        self._check_devices(entries, self._devices)
        self._apply(entries, {e.load.key: self._store.get(e.load) for e in entries})
        self._device_locks = {name: asyncio.Lock() for name in self._devices}
        self._memory_changed = asyncio.Event()
        # Loads, unloads and footprint writes run here, never in the default pool that
        # inference uses: 32 reranks in flight must not starve an unload holding a device lock.
        # One device lock admits one load or unload at a time, so a worker per device suffices.
        # They run at `load_nice` (nice is per thread on Linux): resident models keep serving
        # while weights are read; `packserve bench coldstart` measures what it costs a load.
        self._executor = ThreadPoolExecutor(max_workers=max(2, len(self._devices)),
                                            thread_name_prefix="packserve-load",
                                            initializer=functools.partial(_be_nice, load_nice))
        self._background: set[asyncio.Task[None]] = set()  # pin retries, retirements
        self._pin_retries: dict[str, _PinRetry] = {}
        self._reconfiguring = asyncio.Lock()
        self._closing = False

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
        """Check and load the pins. A pin that fails to load leaves the server up but not ready
        and is retried in the background with backoff; `ready()` says why and when."""
        self.check_pins()
        await self._load_pins([m for m in self._models.values() if m.pinned])
        # What starting allocated and freed (config, catalog, imports) goes back to the OS,
        # heap that glibc would otherwise keep for the idle worker's whole life.
        await asyncio.to_thread(self._probe.release, "cpu")

    async def close(self) -> None:
        """Stop background work, let loads that reached their engine finish, unload everything.

        Called once, at shutdown. Requests still waiting for a load get ModelUnavailable.
        """
        self._closing = True
        for task in list(self._background):
            task.cancel()
        loads = [r.load_task for r in self._residents.values() if r.load_task is not None]
        for res in self._residents.values():
            if res.load_task is not None and res.abandonable:
                res.load_task.cancel()
        await asyncio.gather(*self._background, *loads, return_exceptions=True)
        for res in list(self._residents.values()):
            if res.state not in (State.HOT, State.WARM):
                continue
            if res.leases:  # unloading an engine in use could crash it; the process ends anyway
                log.warning("%s still has %d requests in flight at shutdown; not unloaded",
                            res.label, res.leases)
                continue
            try:
                async with self._device_lock(res.load.device, f"unloading {res.label}"):
                    if res.state in (State.HOT, State.WARM) and not res.leases:
                        await self._to_cold(res, None)
            except ModelUnavailable as exc:
                log.error("could not unload %s at shutdown: %s", res.label, exc.message)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- requests

    @contextlib.asynccontextmanager
    async def acquire(self, name: str, task: Task, *, request_id: str = "",
                      key: str = "", weight: float = 1.0,
                      slo_s: float | None = None) -> AsyncIterator[Lease]:
        """Lend `name` for one request: quota slot, then load if needed. Raises PackserveError.
        `request_id` and `key` (the caller's API key name) travel in the request's events;
        requests waiting for a slot are served fairly between keys, by `weight`. A request for
        a model that a waiting load must evict waits behind that load, at most `load_turn` of
        its `slo_s`.

        A caller cancelled while it waits or holds the lease (its client went away) is counted
        with status 499, outcome "client_closed"; the load it may have started goes on if the
        engine already runs it (see `_load`).
        """
        model = self._model(name)
        if task not in model.spec.tasks:
            raise TaskNotSupported(
                f"model {name!r} does not do {task.value}; it does "
                f"{', '.join(t.value for t in model.spec.tasks)}", param="model")
        res = model.resident
        device = res.load.device
        t_enter = self._clock()
        res.arrivals.append(t_enter)
        try:
            await self._take_slot(model, key, weight)
            try:
                await self._wait_turn(res, t_enter, slo_s)
            except BaseException:
                self._give_slot(model)
                raise
        except (QueueFull, asyncio.CancelledError) as exc:
            status, outcome = _outcome(exc)
            self._emit(RequestEvent(
                model=name, task=task.value, device=device,
                queue_seconds=self._clock() - t_enter, load_seconds=0.0, inference_seconds=0.0,
                status=status, outcome=outcome, request_id=request_id, key=key))
            self._signal_memory()  # a retiring model may have become idle
            raise
        res.leases += 1
        t_slot = self._clock()
        t_ready = t_slot
        status, outcome = 200, "ok"
        lease: Lease | None = None
        try:
            slo = self._slo(slo_s)
            await self._ensure_hot(res, due=(t_enter + slo, t_enter + self._load_turn * slo,
                                             slo))
            t_ready = self._clock()
            assert res.runner is not None
            lease = Lease(model=name, task=task, runner=res.runner, clock=self._clock)
            self._emit(RequestStartEvent(model=name, task=task.value, device=device,
                                         request_id=request_id, key=key))
            yield lease
        except BaseException as exc:
            status, outcome = _outcome(exc)
            raise
        finally:
            t_done = self._clock()
            res.leases -= 1
            res.last_used = t_done
            self._give_slot(model)
            if outcome == "ok":
                model.mean_service_s = 0.8 * model.mean_service_s + 0.2 * (t_done - t_ready)
            # Loads waiting for memory and retiring residents wait for requests to end.
            self._signal_memory()
            self._emit(RequestEvent(
                model=name, task=task.value, device=device, queue_seconds=t_slot - t_enter,
                load_seconds=t_ready - t_slot, inference_seconds=t_done - t_ready,
                status=status, outcome=outcome,
                prompt_tokens=lease.prompt_tokens if lease else 0,
                completion_tokens=lease.completion_tokens if lease else 0,
                started=lease is not None, request_id=request_id, key=key,
                first_token_seconds=None if lease is None or lease.first_token_at is None
                else lease.first_token_at - t_enter, slo_s=self._slo(slo_s)))

    async def _take_slot(self, model: _Model, key: str = "", weight: float = 1.0) -> None:
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
        model.waiters.push(waiter, key, weight)
        try:
            await waiter  # _give_slot hands its slot over: running is already counted
        except asyncio.CancelledError:
            if not model.waiters.remove(waiter) and waiter.done() and not waiter.cancelled():
                self._give_slot(model)  # the slot was handed to us as we were cancelled
            raise

    def _slo(self, slo_s: float | None) -> float:
        """A request's SLO; `load_wait_s` for a caller that gives none."""
        return self._load_wait_s if slo_s is None else slo_s

    async def _wait_turn(self, res: _Resident, t_enter: float, slo_s: float | None) -> None:
        """Wait while a load waits for `res` to drain that began waiting before this request
        came, has kept one of its requests waiting `load_turn` of its SLO, and serves requests
        due before this one (earliest deadline first, as compute)."""
        turn = res.turn
        slo = self._slo(slo_s)
        if (turn is None or t_enter < max(turn.since, turn.load.at_risk)
                or t_enter + slo < turn.load.due):
            return
        limit = self._load_turn * slo
        log.debug("request for %s waits up to %.2fs behind the load of %s", res.label, limit,
                  turn.load.label)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit):
                await turn.done.wait()

    def _hold(self, res: _Resident, keys: Sequence[str]) -> None:
        """`res`'s load waits for `keys` to drain: later requests for them wait behind it
        (none while `load_turn` is 0: the policy then names none)."""
        for key in [k for k in res.holding if k not in keys]:
            self._end_turn(key, res.holding.pop(key))
        now = self._clock()
        for key in keys:
            other = self._residents.get(key)
            if other is not None and other.turn is None:
                other.turn = res.holding[key] = _Turn(load=res, since=now)

    def _release_holds(self, res: _Resident) -> None:
        while res.holding:
            self._end_turn(*res.holding.popitem())

    def _end_turn(self, key: str, turn: _Turn) -> None:
        turn.done.set()
        other = self._residents.get(key)
        if other is not None and other.turn is turn:
            other.turn = None

    def _give_slot(self, model: _Model) -> None:
        """A request leaves its slot: hand it to the next waiter, unless the model now has more
        running than its (reconfigured, smaller) max_concurrency."""
        if model.running <= model.spec.concurrency:
            while model.waiters:
                waiter = model.waiters.pop()
                if not waiter.done():
                    waiter.set_result(None)
                    return
        model.running -= 1

    def _fill_slots(self, model: _Model) -> None:
        """Start queued requests while slots are free (after max_concurrency grew)."""
        while model.waiters and model.running < model.spec.concurrency:
            waiter = model.waiters.pop()
            if not waiter.done():
                model.running += 1
                waiter.set_result(None)

    # ----------------------------------------------------------------- loading

    async def _ensure_hot(self, res: _Resident, *, ignore_cooldown: bool = False,
                          due: tuple[float, float, float] | None = None) -> None:
        """Return when `res` is hot, joining its load or starting one. Raises PackserveError.

        The caller counts as a waiter while it awaits the load; it may be cancelled at any
        point without harming the load. `ignore_cooldown`: the pin retries and operator
        actions have their own pace and do not wait out a failure's cooldown.
        """
        while True:
            if self._closing:
                raise ModelUnavailable(f"model {res.label}: packserve is shutting down",
                                       retry_after_s=LOCK_RETRY_AFTER_S)
            if res.quarantine is not None:
                raise ModelUnavailable(
                    f"model {res.label} is quarantined: {res.quarantine}; it stays unavailable "
                    f"until an operator loads it again", retry_after_s=QUARANTINE_RETRY_AFTER_S)
            if res.state is State.HOT:
                return
            if res.state is State.UNLOADING:
                assert res.settled is not None
                await res.settled.wait()
                continue
            task = res.load_task
            if task is not None and task.cancelling():
                await asyncio.wait({task})  # abandoned a moment ago: let it unwind, start anew
                continue
            if task is None:
                left = res.failed_until - self._clock()
                if res.state is State.FAILED and left > 0 and not ignore_cooldown:
                    raise ModelUnavailable(
                        f"model {res.label} failed to load: {res.error}; "
                        f"next try in {left:.0f}s", retry_after_s=int(left) + 1)
                task = self._start_load(res)
            if due is not None:  # a request's deadline, when it is at risk, its SLO
                if due[0] < res.due:
                    res.due, res.due_slo = due[0], due[2]
                res.at_risk = min(res.at_risk, due[1])
            res.waiters += 1
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if not task.cancelled() or (me is not None and me.cancelling()):
                    raise  # our caller is cancelled
                continue  # the load was cancelled under us (shutdown): look again
            finally:
                res.waiters -= 1
                if res.waiters == 0 and res.abandonable and not task.done():
                    task.cancel()  # nobody waits any more, and it holds nothing yet

    def _start_load(self, res: _Resident) -> asyncio.Task[None]:
        res.state = State.ADMITTING
        res.due = res.due_slo = res.at_risk = math.inf  # its waiters set them
        task = asyncio.create_task(self._load(res), name=f"packserve load {res.label}")
        res.load_task = task
        task.add_done_callback(_retrieve)  # waiters get its outcome; nobody else needs it
        return task

    def _wanted(self, res: _Resident) -> bool:
        """Whether a load of `res` should go on: somebody waits for it and it may be served."""
        return res.waiters > 0 and res.quarantine is None and not self._closing

    def _check_wanted(self, res: _Resident) -> None:
        if not self._wanted(res):
            raise _Abandoned

    async def _abandonable(self, res: _Resident, wait: Callable[[], Awaitable[T]]) -> T:
        """Wait in the load of `res` where the last waiter to leave may cancel the load."""
        self._check_wanted(res)  # the last one may have left while nobody could cancel
        res.abandonable = True
        try:
            return await wait()
        finally:
            res.abandonable = False

    async def _load(self, res: _Resident) -> None:
        """The scheduler-owned load of `res`: ADMITTING -> LOADING -> HOT, or COLD / FAILED.

        Until the engine call starts, it gives up as soon as nobody waits for it: cancelled where
        it waits (device lock, memory), and checking before each eviction and before loading.
        Whatever ends it, the bytes it reserved are published (HOT) or released here.
        """
        try:
            await self._admit_and_load(res)
        except _Abandoned:
            log.debug("load of %s abandoned: nobody waits for it any more", res.label)
        finally:
            self._release_holds(res)
            res.due = res.due_slo = res.at_risk = math.inf
            res.load_task = None
            res.abandonable = False
            if res.state in (State.ADMITTING, State.LOADING):
                res.state = self._at_rest(res)
                self._signal_memory()

    async def _admit_and_load(self, res: _Resident) -> None:
        device = self._devices[res.load.device]
        cap = self._memory_cap(res)
        if cap is not None and res.bytes > cap:
            raise NeverFits(f"model {res.label} needs {format_bytes(res.bytes)}, over its "
                            f"max_memory quota of {format_bytes(cap)}")
        t0 = self._clock()
        deadline = t0 + self._load_wait_s
        if self._check_files is not None:
            try:
                # Before any eviction: a file that cannot load must cost other models nothing.
                await self._run(self._check_files, res.load)
            except ConfigError as exc:
                await self._drop_warm(res)  # its files are gone or broken: so is the copy
                raise self._failed(res, exc.message, self._clock() - t0) from exc
        retried = False
        while True:
            # A load waiting for busy models to finish waits outside the device lock, so
            # that a load which fits meanwhile (a small model beside a busy generator) is
            # not held up behind it.
            waiting = await self._admit_under_lock(res, device.name, deadline, retried)
            if waiting is None:
                return
            changed, retried = waiting
            await self._abandonable(res, functools.partial(
                self._wait_memory, deadline - self._clock(), changed))

    async def _admit_under_lock(self, res: _Resident, device: str, deadline: float,
                                retried: bool) -> tuple[asyncio.Event, bool] | None:
        """Under `device`'s lock: plan, evict, load. None once `res` is hot; when it must wait
        for busy models, the event that says memory changed (taken before the lock is let go,
        so no signal is missed) and whether a load already ran out of memory once."""
        async with self._device_lock(device, f"model {res.label}", deadline=deadline, res=res):
            while True:
                self._check_wanted(res)  # every waiter gone before the engine started: stop
                admission = self._admission(res)
                if admission.verdict is Verdict.NEVER_FITS:
                    raise NeverFits(admission.reason)
                if admission.verdict is Verdict.WAIT_FOR_BUSY:
                    if deadline - self._clock() <= 0:
                        raise ModelUnavailable(
                            f"model {res.label} timed out after {self._load_wait_s:g}s waiting "
                            f"for memory: {admission.reason}", retry_after_s=LOCK_RETRY_AFTER_S)
                    self._hold(res, admission.draining)
                    return self._memory_changed, retried
                if admission.victims:
                    # One at a time, then plan again: a request may lease the next victim
                    # while this one unloads.
                    await self._evict(self._residents[admission.victims[0]],
                                      f"make room for {res.label}", cause="make_room",
                                      cold=admission.to_cold)
                    continue
                res.state = State.LOADING
                self._release_holds(res)
                t_load = self._clock()
                try:
                    await self._materialize(res)
                    return None
                except NeverFits:
                    raise
                except Exception as exc:
                    res.state = State.ADMITTING  # the engine undid its own load: nothing held
                    reason = f"{type(exc).__name__}: {exc}"
                    if retried or not is_memory_failure(exc):
                        raise self._failed(res, reason, self._clock() - t_load,
                                           twice=retried) from exc
                    retried = True
                    self._emit(LoadFailedEvent(model=res.label, device=device,
                                               bytes=res.bytes, seconds=self._clock() - t_load,
                                               reason=reason, will_retry=True))
                    victims = self._retry_victims(res)
                    log.warning("load of %s ran out of memory (%s); unloading %s and retrying "
                                "once", res.label, reason,
                                ", ".join(self._residents[k].label for k in victims) or "nothing")
                    for key in victims:
                        self._check_wanted(res)
                        victim = self._residents.get(key)
                        if victim is not None and self._view(victim).evictable:
                            await self._evict(victim, f"free memory to retry {res.label}",
                                              cause="memory_retry", cold=True)

    def _failed(self, res: _Resident, reason: str, seconds: float, *,
                twice: bool = False) -> ModelUnavailable:
        """Mark `res` FAILED for the cooldown and say so; returns the error to raise."""
        res.state, res.error = State.FAILED, reason
        res.failed_until = self._clock() + self._cooldown_s
        self._emit(LoadFailedEvent(model=res.label, device=res.load.device, bytes=res.bytes,
                                   seconds=seconds, reason=reason, will_retry=False))
        return ModelUnavailable(
            f"model {res.label} failed to load{' twice' if twice else ''}: {reason}",
            retry_after_s=int(self._cooldown_s) + 1)

    def _retry_victims(self, res: _Resident) -> tuple[str, ...]:
        """Whom to unload before retrying a load of `res` that ran out of memory.

        Admission said `res` fit and the engine still could not allocate, so the free figure
        cannot be trusted (other processes, fragmentation, an estimate too low): the shortfall
        is unknown, but the load never needs more than its own footprint. So the victim policy
        is asked to free that much again, counting nothing as free; if the idle models hold
        less, all of them go, still in the policy's order.
        """
        others = [dataclasses.replace(self._view(r), goes_warm=False)  # they go cold
                  for r in self._residents.values()
                  if r is not res and r.load.device == res.load.device]
        policy = self._policy(res.load.device)
        victims = policy(others, res.bytes, 0)
        if victims is None:
            victims = policy(others, sum(v.frees for v in others if v.evictable), 0)
        return victims or ()

    async def _materialize(self, res: _Resident) -> None:
        """LOADING -> HOT: run the engine's load (or restore its warm copy) and publish it. Must
        hold the device lock.

        Never abandoned: once the engine call has started, its outcome is published or undone.
        """
        if res.warm is not None and await self._restore(res):
            return
        device = res.load.device
        t0 = self._clock()

        def build() -> tuple[Backend, int]:
            # Hand freed heap pages back first, so the load cannot reuse memory that was
            # already resident and hide its size (without it, the same Gemma load measured
            # anywhere from 285 to 320 MiB).
            backend = self._factory(res.load)
            # The engine library is imported on first use (a server with no torch model never
            # imports torch), and before the measurement: its code is not the model's bytes.
            backend.prepare()
            if alone:
                self._probe.settle()
            self._probe.release(device)
            before = self._probe.used_bytes(device)
            try:
                _working(backend, due, slo, backend.load)
            except BaseException:
                backend.unload()
                self._probe.release(device)
                raise
            grown = self._probe.used_bytes(device) - before
            return backend, max(grown, backend.weight_bytes())

        # No other model's objects alive: the live ones may be frozen out of the collector.
        alone = not any(self._view(r).holds_memory or r.warm is not None
                        for r in self._residents.values() if r is not res)
        self._emit(LoadStartEvent(model=res.label, device=device))
        due, slo = self._compute_turn(res)
        backend, measured = await self._run(build)
        seconds = self._clock() - t0
        try:  # the raw reading: the store keeps a median of recent ones across restarts
            await self._run(self._store.put, res.load, measured)
        except Exception:  # the store logs its own write failures; no store fault fails a load
            log.exception("could not record the footprint of %s", res.label)
        # Within this process, keep the largest figure seen for these weights: a reload in a
        # long-lived process can reuse heap pages that trimming could not return and read low
        # (seen: SmolLM2 139 MiB against 156-160 on a fresh heap); under-counting would let the
        # budget be exceeded.
        measured = max(measured, res.peak_here or 0)
        res.peak_here = measured
        res.measured = measured
        cap = self._memory_cap(res)
        budget = self._devices[device].capacity_bytes
        if (cap is not None and measured > cap) or measured > budget:
            limit = (f"its max_memory quota of {format_bytes(cap)}"
                     if cap is not None and measured > cap
                     else f"{device}'s whole budget of {format_bytes(budget)}")
            reason = (f"model {res.label} measured {format_bytes(measured)} after loading, over "
                      f"{limit}; it was unloaded")
            await self._to_cold(res, None, backend)
            self._emit(LoadFailedEvent(model=res.label, device=device, bytes=measured,
                                       seconds=seconds, reason=reason, will_retry=False))
            raise NeverFits(reason)
        res.warmable = None  # a new engine object: whether it can go warm is asked anew
        res.load_seconds = seconds
        self._publish(res, backend)
        self._emit(LoadEvent(model=res.label, device=device, bytes_estimated=res.estimated,
                             bytes_measured=measured, seconds=seconds, reason="first use"))
        await self._shed(device, f"{res.label} measured more than its estimate",
                         cause="overshoot", keep=res)
        self._signal_memory()

    def _publish(self, res: _Resident, backend: Backend) -> None:
        res.backend, res.runner = backend, Runner(backend)
        res.state, res.error, res.failed_until = State.HOT, None, 0.0
        res.last_used = self._clock()

    async def _drop_warm(self, res: _Resident) -> None:
        """Unload the warm copy of `res`, which is loading (or failing to): its next load is
        a whole one. Must hold the device lock."""
        backend, res.warm = res.warm, None
        if backend is None:
            return
        try:
            await self._run(backend.unload)
        finally:
            del backend
            await self._run(self._probe.release, res.load.device)
            self._signal_memory()

    async def _restore(self, res: _Resident) -> bool:
        """Warm -> HOT: the engine reads its weights back into the objects it kept. If that
        fails, the warm copy is unloaded and False returned: the caller loads anew."""
        backend = res.warm
        assert backend is not None
        device = res.load.device
        t0 = self._clock()
        self._emit(LoadStartEvent(model=res.label, device=device))
        due, slo = self._compute_turn(res)
        try:
            await self._run(_working, backend, due, slo, backend.restore_weights)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("restoring %s from the warm tier failed (%s); loading it anew",
                        res.label, reason)
            self._emit(LoadFailedEvent(model=res.label, device=device, bytes=res.bytes,
                                       seconds=self._clock() - t0, reason=reason,
                                       will_retry=True))
            del backend
            await self._drop_warm(res)
            return False
        res.warm = None
        res.restore_seconds = seconds = self._clock() - t0
        self._publish(res, backend)
        self._emit(LoadEvent(model=res.label, device=device, bytes_estimated=res.estimated,
                             bytes_measured=res.bytes, seconds=seconds, reason="first use",
                             tier_from="warm"))
        self._signal_memory()
        return True

    # ----------------------------------------------------------------- unloading

    def _at_rest(self, res: _Resident) -> State:
        """Where `res` is when nothing is loading it: warm while its warm copy is kept, else
        failed if quarantined, else cold."""
        if res.warm is not None:
            return State.WARM  # a quarantine's retirement takes it to cold, then FAILED
        return State.FAILED if res.quarantine is not None else State.COLD

    async def _evict(self, res: _Resident, reason: str, *, cause: str,
                     cold: bool = False) -> None:
        """The victim policy's choice leaves its tier: hot to warm where its device has a warm
        tier and its engine a warm state (unless `cold`: warm copies would leave too little
        room), else to cold; warm to cold. Must hold the lock."""
        if res.state is State.ADMITTING:  # its load waits for memory: only its copy goes
            view = self._view(res)
            policy = self._policy(res.load.device)
            await self._drop_warm(res)
            self._emit(EvictEvent(model=res.label, device=res.load.device, bytes=view.frees,
                                  seconds=0.0, reason=reason, cause=cause,
                                  policy=policy_name(policy),
                                  why=explain_victim(policy, view), tier_to="cold"))
            return
        await self._to_cold(res, reason, cause=cause,
                            warm=not cold and res.state is State.HOT and self._goes_warm(res))

    def _goes_warm(self, res: _Resident) -> bool:
        """Whether an eviction of `res` now would try the warm tier."""
        return (res.load.device in self._warm_tier and res.warmable is not False
                and res.quarantine is None and bool(res.models))

    async def _to_cold(self, res: _Resident, reason: str | None,
                       backend: Backend | None = None, *, cause: str = "retired",
                       warm: bool = False) -> None:
        """The one way weights leave a device: HOT (or LOADING, with the `backend` that loaded)
        -> UNLOADING -> COLD, or FAILED if quarantined; with `warm`, to WARM if the engine can
        keep its objects without its weights; a WARM one to COLD. Must hold the device lock;
        nothing may hold a lease on a HOT one. Emits an EvictEvent with `reason` unless it is
        None (shutdown, a quota); when the victim policy chose it (`cause` make_room,
        memory_retry, budget_shrank), the event carries the policy's explanation."""
        policy = self._policy(res.load.device)
        chosen = cause in _POLICY_CAUSES  # the victim policy picked it: say why
        view = dataclasses.replace(self._view(res), goes_warm=warm)
        why = explain_victim(policy, view) if chosen else ""
        backend = backend or res.backend or res.warm
        assert backend is not None and (res.state is State.LOADING or res.leases == 0)
        freed = res.warm_bytes if res.state is State.WARM else res.bytes
        res.unloading_bytes = freed  # what it holds until the engine has let go
        res.backend = res.runner = None
        res.state = State.UNLOADING  # holds its bytes until the engine has let go
        res.settled = settled = asyncio.Event()  # new requests wait, then load it again
        t0 = self._clock()
        kept: int | None = None
        try:
            if warm:
                kept = await self._run(self._release_weights, res, backend)
                res.warmable = kept is not None  # asked again only of a new engine object
            if kept is None:
                res.warm = None
                await self._run(backend.unload)
                del backend
                await self._run(self._probe.release, res.load.device)
            else:
                res.warm, res.warm_bytes = backend, kept
                freed = res.bytes - kept
        finally:
            res.state = self._at_rest(res)
            res.unloading_bytes = None
            res.settled = None
            settled.set()
            self._signal_memory()
        if reason is not None:
            self._emit(EvictEvent(model=res.label, device=res.load.device, bytes=freed,
                                  seconds=self._clock() - t0, reason=reason,
                                  cause=cause, policy=policy_name(policy) if chosen else "",
                                  why=why, tier_to="warm" if kept is not None else "cold"))

    def _release_weights(self, res: _Resident, backend: Backend) -> int | None:
        """In a worker thread: ask the engine to give its weights back and keep its objects.
        The bytes it still holds then (measured as the load is, never more than it held), or
        None if it cannot: then it is unloaded whole."""
        device = res.load.device
        before = mapped = 0
        if not backend.out_of_process:  # a runner's memory is not this process's to measure
            self._probe.release(device)  # garbage from before is not the release's to claim
            before = self._probe.used_bytes(device)
            mapped = self._probe.mapped_file_bytes(device, res.load.path)
        try:
            kept = backend.release_weights()
        except Exception:
            log.exception("%s could not give its weights back; unloading it", res.label)
            return None
        if not kept:
            return None
        if backend.out_of_process:  # a runner: what its process still holds, all of it
            return min(res.bytes, backend.weight_bytes())
        self._probe.release(device)
        freed = before - self._probe.used_bytes(device)
        # Weights mapped from their file count in its bytes whether read or not, and pages never
        # read (MiniLM's unused vocabulary rows: most of its 45 MiB embedding table) were never
        # resident: unmapped now, they are freed too, though the resident set cannot show it.
        # `freed` counts the pages that were read, and maybe more: the larger of the two.
        unmapped = max(0, mapped - self._probe.mapped_file_bytes(device, res.load.path))
        return min(res.bytes, max(res.bytes - max(freed, unmapped), backend.weight_bytes(), 0))

    async def _retire(self, res: _Resident, reason: str) -> None:
        """Unload `res` once nothing uses it, because it was quarantined or removed from the
        catalog; forget it once cold if no catalog entry names it. A background task."""
        if res.retiring:
            return
        res.retiring = True
        try:
            await self._retire_when_idle(res, reason)
        finally:
            res.retiring = False

    async def _retire_when_idle(self, res: _Resident, reason: str) -> None:
        while res.quarantine is not None or not res.models:
            changed = self._memory_changed  # taken before looking, so no signal is missed
            busy = bool(res.leases or res.load_task or any(not m.idle for m in res.retired))
            if not busy and res.state in (State.HOT, State.WARM):
                try:
                    async with self._device_lock(res.load.device, f"retiring {res.label}"):
                        if (res.state in (State.HOT, State.WARM) and not res.leases
                                and not any(not m.idle for m in res.retired)):
                            await self._to_cold(res, reason)
                except ModelUnavailable as exc:
                    log.warning("%s; trying again when the device is free", exc.message)
                continue
            if not busy and res.state is not State.UNLOADING:
                if not res.models and self._residents.get(res.key) is res:
                    del self._residents[res.key]
                return
            await changed.wait()

    # ----------------------------------------------------------------- waiting

    @contextlib.asynccontextmanager
    async def _device_lock(self, device: str, who: str, *, deadline: float | None = None,
                           res: _Resident | None = None) -> AsyncIterator[None]:
        """Hold `device`'s lock. Waits until `deadline` (scheduler clock; default: load_wait_s
        from now), then raises ModelUnavailable naming `who`. With `res`, the wait is part of
        that resident's load, which its last waiter may abandon."""
        lock = self._device_locks[device]
        end = deadline if deadline is not None else self._clock() + self._load_wait_s
        try:
            async with asyncio.timeout(max(0.0, end - self._clock())):
                if res is None:
                    await lock.acquire()
                else:
                    await self._abandonable(res, lock.acquire)
        except TimeoutError as exc:
            raise ModelUnavailable(
                f"{who} waited {self._load_wait_s:g}s for {device}, where another load or "
                f"unload is still running; retry later", retry_after_s=LOCK_RETRY_AFTER_S
            ) from exc
        try:
            yield
        finally:
            lock.release()

    def _signal_memory(self) -> None:
        """Wake whoever waits for memory or for models to go idle: a load, a retirement."""
        self._memory_changed.set()
        self._memory_changed = asyncio.Event()

    async def _wait_memory(self, seconds: float, changed: asyncio.Event | None = None) -> None:
        """Until memory changes (`changed`: an event taken earlier, so no signal is missed)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for((changed or self._memory_changed).wait(), max(0.0, seconds))

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        """Run a blocking lifecycle call (load, unload, release, footprint write) off the loop,
        on the scheduler's own executor."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def _spawn(self, coro: Coroutine[object, object, None], name: str) -> None:
        """Start scheduler-owned background work; `close()` cancels it."""
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())

    # ----------------------------------------------------------------- pins

    async def _load_pins(self, models: Sequence[_Model]) -> None:
        """Load pinned `models` now; a failure is retried in the background with backoff."""
        failed: dict[str, str] = {}  # resident key -> error: shared weights are tried once
        for model in models:
            res = model.resident
            if res.key not in failed:
                try:
                    await self._ensure_hot(res, ignore_cooldown=True)
                    continue
                except PackserveError as exc:
                    failed[res.key] = exc.message
            log.error("pinned model %s did not load: %s; retrying in %gs", model.spec.name,
                      failed[res.key], self._pin_retry_first_s)
            self._retry_pin(model, failed[res.key])

    def _retry_pin(self, model: _Model, error: str) -> None:
        name = model.spec.name
        retry = self._pin_retries.get(name)
        if retry is not None and retry.model is model:
            retry.error = error
            return
        retry = _PinRetry(model=model, error=error, delay_s=self._pin_retry_first_s,
                          next_at=self._clock() + self._pin_retry_first_s)
        self._pin_retries[name] = retry
        self._spawn(self._keep_pin(retry), f"packserve pin retry {name}")

    async def _keep_pin(self, retry: _PinRetry) -> None:
        """Retry a pinned model's load, the delay doubling up to pin_retry_s[1], until it is
        hot, unpinned or removed."""
        model = retry.model
        name = model.spec.name
        try:
            while True:
                retry.next_at = self._clock() + retry.delay_s
                await self._sleep(retry.delay_s)
                if self._models.get(name) is not model or not model.pinned:
                    return
                try:
                    await self._ensure_hot(model.resident, ignore_cooldown=True)
                    log.info("pinned model %s loaded on retry", name)
                    return
                except PackserveError as exc:
                    retry.error = exc.message
                    retry.failures += 1
                    retry.delay_s = backoff.doubling(self._pin_retry_first_s,
                                                     self._pin_retry_max_s, retry.failures)
                    log.warning("pinned model %s still did not load: %s; retrying in %gs",
                                name, exc.message, retry.delay_s)
        finally:
            if self._pin_retries.get(name) is retry:
                del self._pin_retries[name]

    # ----------------------------------------------------------------- admin

    async def load(self, name: str) -> None:
        """Operator action: load `name` now, clearing a failed state (cooldown or quarantine)."""
        res = self._model(name).resident
        res.quarantine = None
        res.failed_until = 0.0
        if res.state is State.FAILED:
            res.state = State.COLD
        await self._ensure_hot(res)

    async def unload(self, name: str) -> None:
        """Operator action: unload `name` if it is hot and idle. Conflict if pinned or busy;
        ModelUnavailable if its device stays busy with other loads for load_wait_s."""
        res = self._model(name).resident
        if self._is_pinned(res):
            raise Conflict(f"model {res.label} is pinned; unpin it first")
        async with self._device_lock(res.load.device, f"unloading {res.label}"):
            if res.state not in (State.HOT, State.WARM):
                return
            if res.leases:
                raise Conflict(f"model {res.label} has {res.leases} requests in flight")
            await self._to_cold(res, "unloaded by operator", cause="operator")

    async def offload(self, name: str) -> None:
        """Operator action: move `name` from hot to the next tier down now, whether or not its
        device evicts to the warm tier: warm if its engine can keep its objects without its
        weights, else cold (the answer's state says which). Conflict if pinned or busy."""
        res = self._model(name).resident
        if self._is_pinned(res):
            raise Conflict(f"model {res.label} is pinned; unpin it first")
        async with self._device_lock(res.load.device, f"offloading {res.label}"):
            if res.state is not State.HOT:
                return
            if res.leases:
                raise Conflict(f"model {res.label} has {res.leases} requests in flight")
            await self._to_cold(res, "offloaded by operator", cause="operator",
                                warm=res.warmable is not False)

    async def pin(self, name: str) -> None:
        """Operator action: keep `name` loaded. If its load fails the pin is rolled back and the
        error raised: the operator sees it at once, and nothing retries behind their back."""
        model = self._model(name)
        if model.pinned:
            await self._ensure_hot(model.resident, ignore_cooldown=True)
            return
        model.pinned = True
        try:
            self.check_pins()
        except PinsDoNotFit as exc:
            model.pinned = False
            raise Conflict(exc.message) from exc
        try:
            await self._ensure_hot(model.resident, ignore_cooldown=True)
        except BaseException:
            model.pinned = False
            raise

    def unpin(self, name: str) -> None:
        self._model(name).pinned = False

    def quarantine(self, name: str, reason: str) -> None:
        """Mark `name`'s weights FAILED with `reason` until an operator loads them again.

        Called by the supervisor for a model whose engine crashed twice within crash_window_s.
        New requests get ModelUnavailable naming the model and the reason; requests holding a
        lease finish, then the weights are unloaded.
        """
        res = self._model(name).resident
        res.quarantine = reason
        res.error = reason
        if res.state in (State.COLD, State.FAILED):
            res.state = State.FAILED
        else:
            self._spawn(self._retire(res, f"quarantined: {reason}"),
                        f"packserve quarantine {res.label}")

    def plan(self, name: str) -> Admission:
        """The dry run: what loading `name` now would evict, and why. Changes nothing."""
        res = self._model(name).resident
        answer = self._admission(res)
        # Policy speaks in resident keys; operators know catalog names.
        return dataclasses.replace(answer, target=res.label, victims=tuple(
            self._residents[k].label for k in answer.victims), draining=tuple(
            self._residents[k].label for k in answer.draining))

    # ----------------------------------------------------------------- reload

    async def reconfigure(
        self, entries: Sequence[Entry], devices: Iterable[DeviceBudget] | None = None,
    ) -> ReconfigureReport:
        """Make `entries` the catalog without dropping a request. Raises ConfigError, having
        changed nothing, if the new pins do not fit or `devices` adds or removes a device.

        Called by the reload path (SIGHUP, POST /v1/admin/reload) with entries it resolved and
        estimated. A removed model gets 404 at once; its requests in flight and queued finish,
        then its weights are unloaded unless another model shares them. A model whose weights
        (LoadSpec) change is a removal plus an addition under the same name. Models that stay
        keep their queue and take new quotas at once; a pin changed in the file is applied
        (one set by an operator stays otherwise). New pins are loaded before this returns, and
        retried in the background if they fail. Budgets may change; a shrunk one evicts idle
        models until it fits.
        """
        async with self._reconfiguring:
            budgets = dict(self._devices)
            if devices is not None:
                budgets = {d.name: d for d in devices}
                if set(budgets) != set(self._devices):
                    raise ConfigError(
                        f"devices cannot be added or removed without a restart (running: "
                        f"{', '.join(sorted(self._devices))}; asked: "
                        f"{', '.join(sorted(budgets))})")
            self._check_devices(entries, budgets)
            new_keys = {e.load.key: e.load for e in entries if e.load.key not in self._residents}
            measured = {k: await self._run(self._store.get, load) for k, load in new_keys.items()}
            # From here on nothing awaits until the catalog is swapped: no request sees half.
            self._check_new_pins(entries, budgets, measured)
            shrunk = [d for d, b in budgets.items()
                      if b.capacity_bytes < self._devices[d].capacity_bytes]
            self._devices = budgets
            report = self._apply(entries, measured)
            for model in self._models.values():
                self._fill_slots(model)
            for res in list(self._residents.values()):
                if not res.models:
                    self._spawn(self._retire(res, "removed from the config"),
                                f"packserve retire {res.label}")
            self._signal_memory()  # a larger budget may admit a waiting load
            for device in shrunk:
                try:
                    await self._fit_budget(device)
                except ModelUnavailable as exc:
                    log.warning("%s; %s stays over its new budget for now", exc.message, device)
            await self._load_pins([m for m in self._models.values()
                                   if m.pinned and m.resident.state is not State.HOT
                                   and m.spec.name not in self._pin_retries])
            log.info("reconfigured: added %s, removed %s, changed %s",
                     list(report.added), list(report.removed), list(report.changed))
            return report

    def _check_devices(self, entries: Sequence[Entry], budgets: Mapping[str, DeviceBudget],
                       ) -> None:
        for e in entries:
            if e.load.device not in budgets:
                raise PinsDoNotFit(
                    f"model {e.spec.name!r} is on {e.load.device}, which has no budget")

    def _check_new_pins(self, entries: Sequence[Entry], budgets: Mapping[str, DeviceBudget],
                        measured: Mapping[str, int | None]) -> None:
        """Raise PinsDoNotFit if the pins `entries` would leave do not fit their devices."""
        pinned: dict[str, ResidentView] = {}
        for e in entries:
            before = self._models.get(e.spec.name)
            if (before is not None and before.resident.key == e.load.key
                    and before.spec.pin == e.spec.pin):
                pin = before.pinned  # as `_apply` decides: an operator's pin or unpin stays
            else:
                pin = e.spec.pin
            if not pin:
                continue
            res = self._residents.get(e.load.key)
            known = res.measured if res is not None else measured.get(e.load.key)
            size = known if known is not None else max(
                e.bytes_estimated, res.estimated if res is not None else 0)
            view = pinned.get(e.load.key)
            names = (*view.models, e.spec.name) if view else (e.spec.name,)
            pinned[e.load.key] = ResidentView(
                key=e.load.key, device=e.load.device, state=State.COLD, pinned=True,
                bytes=max(size, view.bytes if view else 0), models=names)
        for name, budget in budgets.items():
            reason = pins_fit([v for v in pinned.values() if v.device == name],
                              budget.capacity_bytes)
            if reason:
                raise PinsDoNotFit(reason)

    def _apply(self, entries: Sequence[Entry], measured: Mapping[str, int | None],
               ) -> ReconfigureReport:
        """Swap the catalog for `entries`. Synchronous: no request can see half of it."""
        old = self._models
        models: dict[str, _Model] = {}
        added: list[str] = []
        changed: list[str] = []
        for e in entries:
            name = e.spec.name
            res = self._residents.get(e.load.key)
            if res is None:
                res = _Resident(load=e.load, models=[], estimated=e.bytes_estimated,
                                measured=measured.get(e.load.key))
                self._residents[e.load.key] = res
            before = old.get(name)
            if before is not None and before.resident is res:
                if (before.spec, before.estimated) != (e.spec, e.bytes_estimated):
                    changed.append(name)
                if before.spec.pin != e.spec.pin:  # the file changed it; else keep the operator's
                    before.pinned = e.spec.pin
                before.spec, before.estimated = e.spec, e.bytes_estimated
                models[name] = before
            else:
                (added if before is None else changed).append(name)
                models[name] = _Model(spec=e.spec, resident=res, pinned=e.spec.pin,
                                      estimated=e.bytes_estimated)
        for name, before in old.items():
            if models.get(name) is not before and not before.idle:
                before.resident.retired.append(before)  # it drains, then lets its weights go
        self._models = models
        for res in self._residents.values():
            users = [m for m in models.values() if m.resident is res]
            res.former = res.label
            res.models = [m.spec.name for m in users]
            res.retired = [m for m in res.retired if not m.idle]
            if users:
                res.estimated = max(m.estimated for m in users)
        return ReconfigureReport(added=tuple(added),
                                 removed=tuple(n for n in old if n not in models),
                                 changed=tuple(changed))

    async def _fit_budget(self, device: str) -> None:
        """Evict idle models of `device`, in the victim policy's order, until it fits."""
        async with self._device_lock(device, f"fitting {device} to its new budget"):
            await self._shed(device, f"{device}'s budget shrank", cause="budget_shrank")

    async def _shed(self, device: str, reason: str, *, cause: str,
                    keep: _Resident | None = None) -> None:
        """Evict idle models of `device` other than `keep`, in the victim policy's order,
        until what it holds fits its budget again. Must hold the device lock.

        Two things push a device over: a budget made smaller, and a load that measured more
        than its estimate (the estimate is a median of past loads; the machine, the engine's
        buffers or the heap can differ this time). Busy models stay; the excess is logged.
        """
        while True:
            over = self._used(device) - self._devices[device].capacity_bytes
            if over <= 0:
                return
            views = [self._view(r) for r in self._residents.values()
                     if r.load.device == device and r is not keep]
            victims = self._policy(device)(views, over, 0)
            if not victims:  # not enough idle bytes: free what there is, the rest waits
                idle = sum(v.frees for v in views if v.evictable)
                victims = self._policy(device)(views, idle, 0) if idle else None
            if not victims:
                log.warning("%s holds %s more than its budget of %s until busy models finish "
                            "(%s)", device, format_bytes(over),
                            format_bytes(self._devices[device].capacity_bytes), reason)
                return
            await self._evict(self._residents[victims[0]], reason, cause=cause)

    # ----------------------------------------------------------------- views

    def model_names(self) -> list[str]:
        return list(self._models)

    def spec_of(self, name: str) -> ModelSpec:
        """The catalog entry of `name`. Raises ModelNotFound."""
        return self._model(name).spec

    def tasks_of(self, name: str) -> tuple[Task, ...]:
        return tuple(self._model(name).spec.tasks)

    def state_of(self, name: str) -> State:
        return self._model(name).resident.state

    def ready(self) -> Readiness:
        """Ready when every pinned model is hot; else which are not, why, and the next retry."""
        now = self._clock()
        pins = []
        for m in self._models.values():
            res = m.resident
            if not m.pinned or res.state is State.HOT:
                continue
            retry = self._pin_retries.get(m.spec.name)
            pins.append(PinStatus(
                model=m.spec.name, state=res.state,
                error=retry.error if retry is not None else res.error,
                next_retry_s=max(0.0, retry.next_at - now) if retry is not None else None))
        return Readiness(ready=not pins, pins=tuple(pins))

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
                shares_weights_with=tuple(n for n in res.models if n != m.spec.name),
                bytes_warm=res.warm_bytes if res.warm is not None else None,
                restore_seconds=res.restore_seconds))
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
        users = [self._models[n] for n in res.models] or res.retired
        caps = [c for m in users if (c := m.spec.max_memory) is not None]
        return min(caps) if caps else None

    def _view(self, res: _Resident) -> ResidentView:
        return ResidentView(
            key=res.key, device=res.load.device, state=res.state,
            bytes=res.unloading_bytes if res.unloading_bytes is not None else res.bytes,
            pinned=self._is_pinned(res), in_flight=res.leases, last_used=res.last_used,
            models=tuple(res.models), reload_s=res.load_seconds or 0.0,
            rate_per_s=arrival_rate(res.arrivals, self._clock()),
            goes_warm=self._goes_warm(res), keeps_bytes=res.warm_bytes,
            restore_s=res.restore_seconds or self._expected_restore(res),
            warm_bytes=res.warm_bytes if res.warm is not None else 0)

    def _compute_turn(self, res: _Resident) -> tuple[float, float]:
        """The deadline and SLO at which the load of `res` competes for compute (see
        `Backend.working`): its earliest waiter's; a load nobody waits on with a deadline (a
        pin, an operator's) competes as a request due in `load_wait_s`."""
        if math.isfinite(res.due):
            return res.due, res.due_slo
        return self._clock() + self._load_wait_s, self._load_wait_s

    @staticmethod
    def _expected_restore(res: _Resident) -> float:
        """A restore's seconds before one was measured: the engine's declared share of its
        load's, or 0.0 (unknown: the policy counts a whole load)."""
        backend = res.backend or res.warm
        share = backend.restore_share if backend is not None else None
        return share * (res.load_seconds or 0.0) if share else 0.0

    def _admission(self, res: _Resident) -> Admission:
        device = self._devices[res.load.device]
        views = [self._view(r) for r in self._residents.values()]
        return plan_admission(self._view(res), views, device.capacity_bytes,
                              self._policy(device.name), turns=self._load_turn > 0)

    def _policy(self, device: str) -> VictimPolicy:
        """The victim policy of `device` (packserve's LRU-by-bytes unless told otherwise)."""
        if self._policies is not None:
            return self._policies.get(device, self._default_policy)
        return self._default_policy

    def _used(self, device: str) -> int:
        return sum(v.held for v in map(self._view, self._residents.values())
                   if v.device == device)

    def _emit(self, event: Event) -> None:
        for sink in self._sinks:
            try:
                sink(event)
            except Exception:  # an exporter bug must not break scheduling
                log.exception("event sink failed on %s", event)


def _working(backend: Backend, deadline: float, slo_s: float, call: Callable[[], T]) -> T:
    """`call` (an engine's load or restore, in a load thread) under `backend.working`."""
    with backend.working(deadline, slo_s):
        return call()


def _be_nice(nice: int) -> None:
    """Lower this thread's CPU priority (Linux: a thread id is a process id to setpriority)."""
    if nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: loads run as before
        log.debug("could not lower the load threads' priority: %s", exc)


_POLICY_CAUSES = frozenset({"make_room", "memory_retry", "budget_shrank", "overshoot"})


class _Abandoned(Exception):
    """Every waiter of a load left before its engine call started: it stops, having loaded
    and evicted nothing."""


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a load's outcome as seen: its waiters got it, or nobody was left to care."""
    if not task.cancelled():
        task.exception()
