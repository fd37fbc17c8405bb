"""The one owner of residency: loads, evicts and lends models; enforces quotas.

Request handlers never touch a backend's lifecycle. They ask for a lease, which lends a
`Runner` (the loaded backend's task methods, nothing else):

    async with scheduler.acquire("all-minilm-l6-v2", Task.EMBED) as lease:
        result = await asyncio.to_thread(lease.runner.embed, texts)

Vocabulary: a *model* is a catalog entry (the name clients send, `core.queue.Model`). A
*resident* is one set of weights on one device (`core.resident`); catalog entries with the
same `LoadSpec` share one resident. Memory, states and eviction are per resident; quotas per
model. A request goes acquire -> ensure hot -> load -> admit -> evict; its states move along
`core.resident.TRANSITIONS` (drawn in docs/scheduling.md). The scheduler decides and applies.
Elsewhere in `core`: residency (tables, policy snapshots, views), loader (engine calls), tiers
(moves between tiers), queue, catalog (the diff), pins (retries), background (tasks, the
memory-changed signal), lease (a request's accounting), locks, retire, idle (keep_alive).

Invariants (all state lives on the event loop thread; only backend calls run in threads):
- `res.leases` counts requests that hold or wait for the resident; a resident with leases is
  never evicted.
- A load is a task the scheduler owns (`res.flight.task`), never the caller's: callers await
  it through `asyncio.shield`, so one that is cancelled cannot interrupt it. Until the engine
  call starts, a load nobody waits for any more gives up, having loaded and evicted nothing;
  from LOADING on it runs to the end and publishes the model hot or undoes itself.
- Every transition of a resident on device D (ADMITTING->LOADING->HOT, HOT->UNLOADING->COLD,
  and the same through WARM) happens while holding D's lock (`self._locks`): two loads never
  count the same free bytes, and no load is measured while another load or unload on D moves
  its memory. Waiting for that lock is bounded by `load_wait_s`.
- Weights leave a device only through `Tiers.evict_to` (which also makes warm copies), or by
  the death of their engine's process (`_lost`): that one needs no device lock, since the
  kernel has freed its memory already and nothing is measured from it; it moves only a
  resident at rest (HOT, WARM) whose backend is the one that died.
- Lock order: a model's quota slot is taken before the device lock; nothing holds a device lock
  while waiting for a quota slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from packserve.core import crashes
from packserve.core.backend import Backend, BackendFactory, EngineDied, EngineExit, LoadSpec, Runner
from packserve.core.background import Background, Changed
from packserve.core.catalog import DeviceBudget, Entry, ReconfigureReport, Served
from packserve.core.events import (
    CrashEvent,
    EventSink,
    LoadEvent,
    LoadFailedEvent,
    LoadStartEvent,
    OperatorLoadEvent,
    RequestStartEvent,
    emit,
    log_event,
)
from packserve.core.evict import Evictions
from packserve.core.fetch import Downloads, Fetcher
from packserve.core.idle import IdleReaper, IdleRule
from packserve.core.lease import Lease, Visit
from packserve.core.loader import FootprintStore, Loader, is_memory_failure
from packserve.core.locks import LOCK_RETRY_AFTER_S, DeviceLocks
from packserve.core.memory import MemoryProbe
from packserve.core.pins import PinKeeper
from packserve.core.policy import Admission, Verdict, VictimPolicy
from packserve.core.queue import hold, release_holds, wait_turn
from packserve.core.residency import HOST, Residency
from packserve.core.resident import Resident
from packserve.core.retire import Retirer
from packserve.core.status import DeviceStatus, Download, Liveness, ModelStatus, Readiness
from packserve.core.tiers import Tiers
from packserve.errors import (
    ConfigError,
    Conflict,
    ModelUnavailable,
    NeverFits,
    PinsDoNotFit,
    QueueFull,
    TaskNotSupported,
)
from packserve.types import State, Task
from packserve.units import format_bytes

log = logging.getLogger("packserve.scheduler")

T = TypeVar("T")

QUARANTINE_RETRY_AFTER_S = 60  # a quarantined model waits for an operator; clients back off

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
        load_timeout_s: float = 600.0,
        failure_cooldown_s: float = 30.0,
        crash_window_s: float = 300.0,
        pin_retry_s: tuple[float, float] = (1.0, 60.0),
        victim_policy: VictimPolicy | Mapping[str, VictimPolicy] | None = None,
        check_files: Callable[[LoadSpec], None] | None = None,
        fetcher: Fetcher | None = None,
        sinks: Sequence[EventSink] = (log_event,),
        load_nice: int = 0,
        warm_tier: Iterable[str] = (),
        load_turn: float = 0.0,
        idle: Mapping[str, IdleRule] | None = None,
    ) -> None:
        self._clock = clock
        self._load_wait_s, self._load_timeout_s = load_wait_s, load_timeout_s
        self._cooldown_s = failure_cooldown_s
        self._crash_window_s = crash_window_s
        self._sleep = sleep
        self._check_files = check_files  # before every load; the server checks headers
        # Before that, files not on disk yet (Hub sources) are fetched, outside the locks.
        self._downloads = Downloads(fetcher, clock=clock) if fetcher is not None else None
        # A load waiting for busy models takes its turn once one of its requests has waited this
        # fraction of its SLO, and holds their new requests, each for at most this fraction of
        # its own (0: they go ahead; `acquire` without an SLO counts `load_wait_s` as one).
        self._load_turn = load_turn
        self._sinks = list(sinks)
        self._emit = functools.partial(emit, self._sinks)
        devices = list(devices)
        # Loads, unloads and footprint writes run on the loader's executor.
        self._loader = Loader(factory, probe, store or FootprintStore(None),
                              devices=len(devices), nice=load_nice)
        self._residency = Residency(
            entries, devices, {e.load.key: self._loader.store.get(e.load) for e in entries},
            clock=clock, wall_offset=wall_clock() - clock(), victim_policy=victim_policy,
            warm_tier=warm_tier, turns=load_turn > 0, room=self._loader.room)
        self._locks = DeviceLocks((d.name for d in devices), clock=clock, wait_s=load_wait_s)
        self._changed = Changed()  # memory changed, or a model went idle
        self._tiers = Tiers(self._loader, clock=clock, emit=self._emit,
                            changed=self._changed.fire, died=self._died)
        self._evictions = Evictions(self._residency, self._tiers, self._emit)
        self._background = Background()  # pin retries, retirements
        self._retirer = Retirer(self._residency, self._tiers, self._changed, self._locks.hold)
        self._idle = IdleReaper(self._residency, self._tiers, self._changed, self._locks,
                                rules=idle or {}, clock=clock)  # keep_alive, per device
        self._pins = PinKeeper(functools.partial(self._ensure_hot, ignore_cooldown=True),
                               self._background.spawn,
                               lambda name: self._residency.models.get(name),  # the catalog now
                               clock=clock, sleep=sleep, retry_s=pin_retry_s)
        self._reconfiguring = asyncio.Lock()
        self._closing = False

    # ----------------------------------------------------------------- lifecycle

    def add_sink(self, sink: EventSink) -> None:
        self._sinks.append(sink)

    def check_pins(self) -> None:
        """Raise PinsDoNotFit if the pinned models of any device cannot fit together."""
        self._residency.check_pins()

    async def start(self) -> None:
        """Check and load the pins. A pin that fails to load leaves the server up but not ready
        and is retried in the background with backoff; `ready()` says why and when."""
        self.check_pins()
        await self._pins.load([m for m in self._residency.models.values() if m.pinned])
        self._background.spawn(self._idle.run(), "packserve idle models")
        # What starting allocated and freed (config, catalog, imports) goes back to the OS,
        # heap that glibc would otherwise keep for the idle worker's whole life.
        await asyncio.to_thread(self._loader.probe.release, "cpu")

    async def close(self) -> None:
        """Stop background work, let loads that reached their engine finish, unload everything.

        Called once, at shutdown. Requests still waiting for a load get ModelUnavailable.
        """
        self._closing = True
        background = self._background.cancel()
        residents = list(self._residency.residents.values())
        loads = [r.flight.task for r in residents if r.flight.task is not None]
        for res in residents:
            if res.flight.task is not None and res.flight.abandonable:
                res.flight.task.cancel()
        await asyncio.gather(*background, *loads, return_exceptions=True)
        for res in list(self._residency.residents.values()):
            if res.state not in (State.HOT, State.WARM):
                continue
            if res.leases:  # unloading an engine in use could crash it; the process ends anyway
                log.warning("%s still has %d requests in flight at shutdown; not unloaded",
                            res.label, res.leases)
                continue
            try:
                async with self._device_lock(res.load.device, f"unloading {res.label}"):
                    if res.state in (State.HOT, State.WARM) and not res.leases:
                        await self._tiers.evict_to(res, State.COLD, None)
            except ModelUnavailable as exc:
                log.error("could not unload %s at shutdown: %s", res.label, exc.message)
        self._loader.close()

    # ----------------------------------------------------------------- requests

    @contextlib.asynccontextmanager
    async def acquire(self, name: str, task: Task, *, request_id: str = "",
                      key: str = "", weight: float = 1.0, slo_s: float | None = None,
                      keep_alive: float | None = None) -> AsyncIterator[Lease]:
        """Lend `name` for one request: quota slot, then load if needed. Raises PackserveError.
        `request_id` and `key` (the caller's API key name) travel in the request's events;
        requests waiting for a slot are served fairly between keys, by `weight`. A request for
        a model that a waiting load must evict waits behind that load, at most `load_turn` of
        its `slo_s`. `keep_alive`: its idle seconds after this request (Ollama's; None: config).

        A caller cancelled while it waits or holds the lease (its client went away) is counted
        with status 499, outcome "client_closed"; the load it may have started goes on if the
        engine already runs it (see `_load`).
        """
        model = self._residency.model(name)
        if task not in model.spec.tasks:
            raise TaskNotSupported(
                f"model {name!r} does not do {task.value}; it does "
                f"{', '.join(t.value for t in model.spec.tasks)}", param="model")
        res = model.resident
        slo = self._load_wait_s if slo_s is None else slo_s  # without one, load_wait_s
        visit = Visit(model=name, task=task, device=res.load.device, request_id=request_id,
                      key=key, entered=self._clock())
        res.arrivals.append(visit.entered)
        try:
            await model.take(key, weight, visit.entered)
            try:
                await wait_turn(res, visit.entered, slo, self._load_turn)
            except BaseException:
                model.give()
                raise
        except (QueueFull, asyncio.CancelledError) as exc:
            self._emit(visit.event(self._clock(), exc, slo))
            self._changed.fire()  # a retiring model may have become idle
            raise
        res.leases += 1
        visit.slot = model.moved = self._clock()
        model.keep_alive = keep_alive  # a request refused or gone before its slot sets nothing
        error: BaseException | None = None
        try:
            await self._ensure_hot(res, name=name, due=(visit.entered + slo,
                                                        visit.entered + self._load_turn * slo,
                                                        slo))
            visit.ready = self._clock()
            assert res.runner is not None
            visit.lease = Lease(model=name, task=task, runner=res.runner, clock=self._clock)
            self._emit(RequestStartEvent(model=name, task=task.value, device=res.load.device,
                                         request_id=request_id, key=key))
            yield visit.lease
        except BaseException as exc:
            error = exc
            raise
        finally:
            t_done = self._clock()
            res.leases -= 1
            res.last_used = t_done
            model.give()
            if error is None:
                model.served(t_done - (visit.ready or visit.slot))
            # Loads waiting for memory and retiring residents wait for requests to end.
            self._changed.fire()
            self._emit(visit.event(t_done, error, slo))

    # ----------------------------------------------------------------- loading

    async def _ensure_hot(self, res: Resident, *, ignore_cooldown: bool = False,
                          due: tuple[float, float, float] | None = None,
                          name: str | None = None) -> None:
        """Return when `res` is hot, joining its load or starting one. Raises PackserveError,
        naming `name` (the model a request asked for) where given, else the load.

        The caller counts as a waiter while it awaits the load; it may be cancelled at any
        point without harming the load. `ignore_cooldown`: the pin retries and operator
        actions have their own pace and do not wait out a failure's cooldown.
        """
        while True:
            if self._closing:
                raise ModelUnavailable(f"{_called(res, name)}: packserve is shutting down",
                                       retry_after_s=LOCK_RETRY_AFTER_S)
            if res.quarantine is not None:
                self._quarantined(res, name)  # raises, unless its time is up
            if res.state is State.HOT:
                return
            wait = res.restart_at - self._clock()
            if wait > 0 and not ignore_cooldown and res.flight.task is None:
                # A back-off after its engine died again soon (core.crashes): requests wait
                # it out, then the first of them loads it.
                await self._sleep(min(wait, self._load_wait_s))
                continue
            if res.state is State.UNLOADING:
                assert res.settled is not None
                await res.settled.wait()
                continue
            task = res.flight.task
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
                flight = res.flight
                if due[0] < flight.due:
                    flight.due, flight.due_slo = due[0], due[2]
                flight.at_risk = min(flight.at_risk, due[1])
            res.flight.callers += 1
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if not task.cancelled() or (me is not None and me.cancelling()):
                    raise  # our caller is cancelled
                continue  # the load was cancelled under us (shutdown): look again
            finally:
                res.flight.callers -= 1
                if res.flight.callers == 0 and res.flight.abandonable and not task.done():
                    task.cancel()  # nobody waits any more, and it holds nothing yet
                elif res.flight.callers == 0:
                    self._changed.fire()  # its keep-alive may run from now on

    def _start_load(self, res: Resident) -> asyncio.Task[None]:
        res.move(State.ADMITTING)
        res.flight.reset_deadlines()  # its waiters set them
        task = asyncio.create_task(self._load(res), name=f"packserve load {res.label}")
        res.flight.task = task
        task.add_done_callback(_retrieve)  # waiters get its outcome; nobody else needs it
        return task

    def _check_wanted(self, res: Resident) -> None:
        """Stop a load of `res` unless somebody waits for it and it may be served."""
        if res.flight.callers == 0 or res.quarantine is not None or self._closing:
            raise _Abandoned

    async def _abandonable(self, res: Resident, wait: Callable[[], Awaitable[T]]) -> T:
        """Wait in the load of `res` where the last waiter to leave may cancel the load."""
        self._check_wanted(res)  # the last one may have left while nobody could cancel
        res.flight.abandonable = True
        try:
            return await wait()
        finally:
            res.flight.abandonable = False

    async def _load(self, res: Resident) -> None:
        """The scheduler-owned load of `res`: ADMITTING -> LOADING -> HOT, or COLD / FAILED.

        Until the engine call starts, it gives up as soon as nobody waits for it: cancelled where
        it waits (device lock, memory), and checking before each eviction and before loading.
        Whatever ends it, the bytes it reserved are published (HOT) or released here.
        """
        try:
            await self._admit_and_load(res)
        except _Abandoned:
            log.debug("load of %s abandoned: nobody waits for it any more", res.label)
        except _Deferred:
            log.info("load of %s deferred: %s", res.label, res.error)
        finally:
            release_holds(res, self._residency.residents)
            res.flight.reset_deadlines()
            res.flight.task = None
            res.flight.abandonable = False
            if res.state in (State.ADMITTING, State.LOADING):
                res.move(res.at_rest())
                self._changed.fire()

    async def _admit_and_load(self, res: Resident) -> None:
        device = self._residency.devices[res.load.device]
        cap = self._residency.memory_cap(res)
        if cap is not None and res.bytes > cap:
            raise NeverFits(f"model {res.label} needs {format_bytes(res.bytes)}, over its "
                            f"max_memory quota of {format_bytes(cap)}")
        t0 = self._clock()
        deadline = t0 + self._load_wait_s
        if self._downloads is not None:
            await self._fetch(res, self._downloads, deadline)
        if self._check_files is not None:
            try:
                # Before any eviction: a file that cannot load must cost other models nothing.
                await self._loader.run(self._check_files, res.load)
            except ConfigError as exc:
                await self._tiers.drop_warm(res)  # its files are gone or broken: so is the copy
                raise self._failed(res, exc.message, self._clock() - t0) from exc
        retried = False
        while True:
            # A load waiting for busy models to finish waits outside the device lock, so that
            # a load which fits meanwhile (a small model beside a busy generator) goes ahead.
            waiting = await self._admit_under_lock(res, device.name, deadline, retried)
            if waiting is None:
                return
            changed, retried = waiting
            if res.load.device == HOST and await self._idle.reclaim_host(
                    res, deadline, functools.partial(self._abandonable, res)):
                continue  # warm copies of GPU models held the host RAM it needs
            await self._abandonable(res, functools.partial(
                Changed.wait, changed, deadline - self._clock()))

    async def _fetch(self, res: Resident, downloads: Downloads, deadline: float) -> None:
        """Wait, holding no lock, for the download of `res`'s files if any are missing: at most
        until `deadline`, after which the download goes on and the caller gets a 503."""
        if (source := downloads.missing(res.load)) is None:
            return
        t0 = self._clock()
        try:
            await downloads.wait(res.load, source, res.label, deadline - t0,
                                 functools.partial(self._abandonable, res))
        except ConfigError as exc:
            raise self._failed(res, exc.message, self._clock() - t0) from exc
        except (ModelUnavailable, _Abandoned):
            raise  # still downloading, or nobody waits any more: nothing failed
        except Exception as exc:
            raise self._failed(res, f"downloading {source}: {type(exc).__name__}: {exc}",
                               self._clock() - t0) from exc

    async def _admit_under_lock(self, res: Resident, device: str, deadline: float,
                                retried: bool) -> tuple[asyncio.Event, bool] | None:
        """Under `device`'s lock: plan, evict, load. None once `res` is hot; when it must wait
        for busy models, the event that says memory changed (taken before the lock is let go,
        so no signal is missed) and whether a load already ran out of memory once."""
        async with self._device_lock(device, f"model {res.label}", deadline=deadline, res=res):
            while True:
                self._check_wanted(res)  # every waiter gone before the engine started: stop
                admission = self._residency.admission(res)
                if admission.verdict is Verdict.NEVER_FITS:
                    raise NeverFits(admission.reason)
                if admission.verdict is Verdict.WAIT_FOR_BUSY:
                    if deadline - self._clock() <= 0:
                        raise ModelUnavailable(
                            f"model {res.label} timed out after {self._load_wait_s:g}s waiting "
                            f"for memory: {admission.reason}", retry_after_s=LOCK_RETRY_AFTER_S)
                    hold(res, admission.draining, self._residency.residents, self._clock())
                    return self._changed.event, retried
                if admission.victims:
                    # One at a time, then plan again: a request may lease the next victim
                    # while this one unloads.
                    await self._evictions.evict(self._residency.residents[admission.victims[0]],
                                      f"make room for {res.label}", cause="make_room",
                                      cold=admission.to_cold)
                    continue
                res.move(State.LOADING)
                release_holds(res, self._residency.residents)
                t_load = self._clock()
                try:
                    await self._materialize(res)
                    return None
                except (NeverFits, _Deferred):
                    raise
                except Exception as exc:
                    res.move(State.ADMITTING)  # the engine undid its own load: nothing held
                    reason = f"{type(exc).__name__}: {exc}"
                    if isinstance(exc, EngineDied):  # its process died or hung: a death too
                        self._died(res, exc.exit, exc.doing or "loading")
                    if retried or not is_memory_failure(exc):
                        raise self._failed(res, reason, self._clock() - t_load,
                                           twice=retried) from exc
                    retried = True
                    self._emit(LoadFailedEvent(model=res.label, device=device,
                                               bytes=res.bytes, seconds=self._clock() - t_load,
                                               reason=reason, will_retry=True))
                    victims = self._residency.retry_victims(res)
                    log.warning("load of %s ran out of memory (%s); unloading %s and retrying "
                                "once", res.label, reason,
                                ", ".join(self._residency.residents[k].label for k in victims)
                                or "nothing")
                    for key in victims:
                        self._check_wanted(res)
                        victim = self._residency.residents.get(key)
                        if victim is not None and self._residency.view(victim).evictable:
                            await self._evictions.evict(victim, f"free memory to retry {res.label}",
                                              cause="memory_retry", cold=True)

    def _failed(self, res: Resident, reason: str, seconds: float, *,
                twice: bool = False) -> ModelUnavailable:
        """Mark `res` FAILED for the cooldown and say so; returns the error to raise."""
        res.move(State.FAILED)
        res.error = reason
        res.failed_until = self._clock() + self._cooldown_s
        self._emit(LoadFailedEvent(model=res.label, device=res.load.device, bytes=res.bytes,
                                   seconds=seconds, reason=reason, will_retry=False))
        return ModelUnavailable(
            f"model {res.label} failed to load{' twice' if twice else ''}: {reason}",
            retry_after_s=int(self._cooldown_s) + 1)

    async def _materialize(self, res: Resident) -> None:
        """LOADING -> HOT: run the engine's load (or restore its warm copy) and publish it. Must
        hold the device lock.

        Never abandoned: once the engine call has started, its outcome is published or undone.
        """
        turn, device = res.flight.turn(self._clock()), res.load.device
        res.flight.engine_since = t0 = self._clock()  # the deep probe's: a load in its engine
        try:
            if res.warm.kept:
                try:
                    restored = await self._tiers.restore(res, turn)
                except EngineDied as exc:  # its process died warm or waking: a death
                    verdict = self._died(res, exc.exit, exc.doing or "waking")
                    again = verdict.action is crashes.Action.RELOAD
                    self._emit(LoadFailedEvent(model=res.label, device=device, bytes=res.bytes,
                                               seconds=self._clock() - t0, reason=str(exc),
                                               will_retry=again))  # the front's load ends
                    if not again:
                        raise _Deferred from exc  # its waiters wait out the back-off, or 503
                    restored = False  # loaded anew at once, as after a first death
                if restored:
                    self._watch(res)
                    return
                res.flight.engine_since = t0 = self._clock()  # the load's seconds are its own
            # No other model's objects alive: the live ones may be frozen out of the collector.
            alone = not self._residency.holds_others(res)
            self._emit(LoadStartEvent(model=res.label, device=device))
            backend, measured = await self._loader.build(res.load, settle=alone, turn=turn)
        finally:  # what follows (a shed, a retry's evictions) is not the engine's load
            res.flight.engine_since = None
        seconds = self._clock() - t0
        await self._loader.record(res.load, measured, res.label)
        # Within this process, keep the largest figure seen for these weights: a reload in a
        # long-lived process can reuse heap pages that trimming could not return and read low
        # (seen: SmolLM2 139 MiB against 156-160 on a fresh heap); under-counting would let the
        # budget be exceeded.
        measured = max(measured, res.peak_here or 0)
        res.peak_here = measured
        res.measured = measured
        reason = self._residency.overshoot(res, measured)
        if reason is not None:
            await self._tiers.evict_to(res, State.COLD, None, backend)
            self._emit(LoadFailedEvent(model=res.label, device=device, bytes=measured,
                                       seconds=seconds, reason=reason, will_retry=False))
            raise NeverFits(reason)
        res.warm.possible = None  # a new engine object: whether it can go warm is asked anew
        res.load_seconds = seconds
        res.publish(backend, self._clock())
        self._watch(res)
        self._emit(LoadEvent(model=res.label, device=device, bytes_estimated=res.estimated,
                             bytes_measured=measured, seconds=seconds, reason="first use"))
        await self._evictions.shed(device, f"{res.label} measured more than its estimate",
                         cause="overshoot", keep=res)
        self._changed.fire()

    # ----------------------------------------------------------------- deaths

    def _watch(self, res: Resident) -> None:
        """Arm the reaper's report of `res`'s newly published backend: its death reaches
        `_lost` on the event loop, at once."""
        backend = res.backend
        assert backend is not None
        loop = asyncio.get_running_loop()

        def report(exit: EngineExit) -> None:  # the reaper's thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: shutting down
                loop.call_soon_threadsafe(self._lost, res, backend, exit)

        backend.watch(report)

    def _lost(self, res: Resident, backend: Backend, exit: EngineExit) -> None:
        """The engine process of `res` died on its own. If `backend` is still what `res` holds
        at rest (HOT, or WARM as its warm copy), `res` goes out of service now: COLD (FAILED
        if the crash rule quarantines it), counted, its requests in flight failing on their
        own, and the next request loading it through the one load path. A death seen in the
        middle of a move (a release, a restore, an unload) is that move's to handle."""
        if res.state is State.HOT and res.backend is backend:
            res.backend = res.runner = None
            doing = "serving" if res.leases else "idle"
        elif res.state is State.WARM and res.warm.backend is backend:
            res.warm.backend = None
            doing = "warm"
        else:
            return
        verdict = self._died(res, exit, doing)
        res.move(State.FAILED if verdict.action is crashes.Action.QUARANTINE else State.COLD)
        self._background.spawn(self._loader.run(backend.unload),
                               f"packserve clean up {res.label}")
        self._changed.fire()
        if verdict.action is not crashes.Action.QUARANTINE:
            pinned = [m for m in self._residency.models.values()
                      if m.pinned and m.resident is res]
            if pinned:  # a pin stays loaded: not waiting for a request
                self._background.spawn(self._pins.load(pinned[:1]),
                                       f"packserve reload pinned {res.label}")

    def _died(self, res: Resident, exit: EngineExit, doing: str) -> crashes.Verdict:
        """Count a death of `res`'s engine process and apply the crash rule: a back-off
        (`restart_at`) or a quarantine, and the event that says so."""
        now = self._clock()
        cause = exit.cause
        res.deaths.append(now)
        verdict = crashes.judge(list(res.deaths), self._crash_window_s)
        words = verdict.describe(self._crash_window_s)
        res.last_exit, res.last_exit_at, res.verdict = exit, now, words
        res.error = f"its engine process died ({cause}) while {doing}: {words}"
        if verdict.action is crashes.Action.BACKOFF:
            res.restart_at = now + verdict.delay_s
        elif verdict.action is crashes.Action.QUARANTINE:
            res.quarantine = crashes.quarantine_reason(verdict.deaths, cause, doing)
            res.quarantine_until = now + verdict.delay_s
        self._emit(CrashEvent(model=res.label, device=res.load.device, pid=exit.pid,
                              signal=cause, doing=doing, action=verdict.action.value,
                              retry_in_s=verdict.delay_s, deaths=verdict.deaths, log=exit.log,
                              log_tail=exit.log_tail))
        return verdict

    async def recover(self, lease: Lease) -> Runner | None:
        """A request found its engine unreachable before the engine took it: if the engine's
        process died, see the death now (its reaper's report may not have come yet), load the
        model again through the one load path and return the runner to send the request to
        once more; None if the process lives (the failure was something else). Raises
        PackserveError as a request for the model would (a back-off is waited out, a
        quarantine is a 503)."""
        res = self._residency.model(lease.model).resident
        if res.runner is lease.runner and res.backend is not None:
            backend = res.backend
            exit = await asyncio.to_thread(backend.exited, 2.0)
            if exit is None:
                return None
            self._lost(res, backend, exit)
        await self._ensure_hot(res, name=lease.model)
        assert res.runner is not None
        return res.runner

    def _quarantined(self, res: Resident, name: str | None = None) -> None:
        """Raise the 503 of quarantined `res` (naming `name`, the model asked for, where
        given), or lift the quarantine if its time is up."""
        until = res.quarantine_until
        left = None if until is None else until - self._clock()
        if left is not None and left <= 0:
            res.quarantine = res.quarantine_until = None
            if res.state is State.FAILED:
                res.move(State.COLD)
            return
        raise ModelUnavailable(
            f"{_called(res, name)} is quarantined: {res.quarantine}; it stays unavailable "
            + ("until an operator loads it again" if left is None else
               f"for {left:.0f} s more, or until an operator loads it"),
            retry_after_s=QUARANTINE_RETRY_AFTER_S if left is None else int(left) + 1)

    # ----------------------------------------------------------------- waiting

    def _device_lock(self, device: str, who: str, *, deadline: float | None = None,
                     res: Resident | None = None) -> contextlib.AbstractAsyncContextManager[None]:
        """`device`'s lock (see `DeviceLocks.hold`); with `res`, the wait is part of that
        resident's load, which its last waiter may abandon."""
        return self._locks.hold(device, who, deadline=deadline, via=None if res is None else
                                functools.partial(self._abandonable, res))

    # ----------------------------------------------------------------- admin

    async def load(self, name: str) -> None:
        """Operator action: load `name` now, clearing a failed state (cooldown or quarantine);
        once hot, an OperatorLoadEvent says so (the front lifts its quarantine on that alone)."""
        res = self._residency.model(name).resident
        res.quarantine = res.quarantine_until = None
        res.failed_until = res.restart_at = 0.0
        res.deaths.clear()
        if res.state is State.FAILED:
            res.move(State.COLD)
        await self._ensure_hot(res)
        self._emit(OperatorLoadEvent(model=name, device=res.load.device, load=res.label))

    async def unload(self, name: str) -> None:
        """Operator action: unload `name` if it is hot (or warm) and idle. Conflict if pinned or
        busy; ModelUnavailable if its device stays busy with other loads for load_wait_s."""
        await self._operator_evict(name, "unloading", (State.HOT, State.WARM),
                                   lambda res: State.COLD, "unloaded by operator")

    async def offload(self, name: str) -> None:
        """Operator action: move `name` from hot to the next tier down now, whether or not its
        device evicts to the warm tier: warm if its engine can keep its objects without its
        weights, else cold (the answer's state says which). Conflict if pinned or busy."""
        await self._operator_evict(
            name, "offloading", (State.HOT,),
            lambda res: State.WARM if self._residency.may_go_warm(res) else State.COLD,
            "offloaded by operator")

    async def _operator_evict(self, name: str, doing: str, movable: tuple[State, ...],
                              tier: Callable[[Resident], State], reason: str) -> None:
        res = self._residency.model(name).resident
        async with self._device_lock(res.load.device, f"{doing} {res.label}"):
            if self._residency.is_pinned(res):  # under the lock: a pin may come while it waits
                raise Conflict(f"model {res.label} is pinned; unpin it first")
            if res.state not in movable:
                return
            if res.leases:
                raise Conflict(f"model {res.label} has {res.leases} requests in flight")
            await self._tiers.evict_to(res, tier(res), reason, cause="operator")

    async def pin(self, name: str) -> None:
        """Operator action: keep `name` loaded. If its load fails the pin is rolled back and the
        error raised: the operator sees it at once, and nothing retries behind their back."""
        model = self._residency.model(name)
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
        self._residency.model(name).pinned = False
        self._changed.fire()  # its keep-alive may run from now on

    def quarantine(self, name: str, reason: str, for_s: float | None = None) -> None:
        """Mark `name`'s weights FAILED with `reason` for `for_s` seconds (None: until an
        operator loads them again).

        Called at a worker's start for a model whose engine crashed the worker three times
        within crash_window_s (the front's supervisor applies core.crashes), or whose runner
        died three times under earlier workers (the verdict the front held for it). New
        requests get ModelUnavailable naming the model and the reason; requests holding a
        lease finish, then the weights are unloaded.
        """
        res = self._residency.model(name).resident
        res.quarantine = reason
        res.quarantine_until = None if for_s is None else self._clock() + for_s
        res.error = reason
        if res.state is State.COLD:
            res.move(State.FAILED)
        elif res.state is not State.FAILED:
            self._background.spawn(self._retirer.retire(res, f"quarantined: {reason}"),
                        f"packserve quarantine {res.label}")

    def remember_deaths(self, ages_s: Mapping[str, Sequence[float]]) -> None:
        """Deaths of each named model's engine processes before this worker started (each so
        many seconds ago: the front's history, core.crashes): the crash rule counts them with
        the deaths to come. Called at the worker's start; a load shared by several names
        counts the deaths of each, those they share once. Names not served are skipped."""
        now = self._clock()
        ages: dict[Resident, set[float]] = {}
        for name, seen in ages_s.items():
            if name in self._residency.models:
                ages.setdefault(self._residency.model(name).resident, set()).update(seen)
        for res, known in ages.items():
            times = sorted({*res.deaths, *(now - age for age in known)})
            res.deaths.clear()
            res.deaths.extend(times[-(res.deaths.maxlen or len(times)):])

    def back_off(self, name: str, seconds: float) -> None:
        """Let `name` load again only after `seconds`: its engine crashed the worker, or its
        runner died, again soon (core.crashes); called at the worker's start."""
        res = self._residency.model(name).resident
        res.restart_at = max(res.restart_at, self._clock() + seconds)

    def plan(self, name: str) -> Admission:
        """The dry run: what loading `name` now would evict, and why. Changes nothing."""
        res = self._residency.model(name).resident
        return self._residency.labelled(self._residency.admission(res), res)

    # ----------------------------------------------------------------- reload

    async def reconfigure(
        self, entries: Sequence[Entry], devices: Iterable[DeviceBudget] | None = None,
    ) -> ReconfigureReport:
        """Make `entries` the catalog without dropping a request. Raises ConfigError, having
        changed nothing, if the new pins do not fit or `devices` adds or removes a device.

        Called by the reload path (SIGHUP, POST /v1/admin/reload) with resolved, estimated
        entries. A removed model gets 404 at once; its requests finish, then its weights are
        unloaded unless another model shares them. New weights (LoadSpec) under a name are a
        removal plus an addition. Models that stay keep their queue and take new quotas at once;
        a pin changed in the file is applied (an operator's stays otherwise). New pins load
        before this returns (retried in the background if they fail). A shrunk budget evicts
        idle models until it fits.
        """
        async with self._reconfiguring:
            budgets = self._residency.check(entries, devices)
            measured = {k: await self._loader.run(self._loader.store.get, e.load)
                        for k, e in self._residency.new_loads(entries).items()}
            # From here on nothing awaits until the catalog is swapped: no request sees half.
            report, shrunk = self._residency.swap(entries, budgets, measured)
            for res in list(self._residency.residents.values()):
                if not res.models:
                    self._background.spawn(self._retirer.retire(res, "removed from the config"),
                                f"packserve retire {res.label}")
            self._changed.fire()  # a larger budget may admit a waiting load
            for device in shrunk:
                try:
                    await self._fit_budget(device)
                except ModelUnavailable as exc:
                    log.warning("%s; %s stays over its new budget for now", exc.message, device)
            await self._pins.load([m for m in self._residency.models.values()
                                   if m.pinned and m.resident.state is not State.HOT
                                   and self._pins.get(m.spec.name) is None])
            log.info("reconfigured: added %s, removed %s, changed %s",
                     list(report.added), list(report.removed), list(report.changed))
            return report

    async def _fit_budget(self, device: str) -> None:
        """Evict idle models of `device`, in the victim policy's order, until it fits."""
        async with self._device_lock(device, f"fitting {device} to its new budget"):
            await self._evictions.shed(device, f"{device}'s budget shrank", cause="budget_shrank")

    # ----------------------------------------------------------------- views

    def model_names(self) -> list[str]:
        return list(self._residency.models)

    def spec_of(self, name: str) -> Served:
        """The catalog entry of `name`. Raises ModelNotFound."""
        return self._residency.spec_of(name)

    def state_of(self, name: str) -> State:
        return self._residency.state_of(name)

    def ready(self) -> Readiness:
        """Ready when every pinned model is hot; else which are not, why, the next retry and
        the download it waits for."""
        readiness = self._residency.readiness(self._pins.get)
        return dataclasses.replace(readiness, pins=tuple(
            dataclasses.replace(p, download=self._download_of(p.model)) for p in readiness.pins))

    def liveness(self) -> Liveness:
        """The deep probe: locks held, loads running, queues not moving. Waits for nothing."""
        return self._residency.liveness(self._locks.held(), self._load_timeout_s, self._downloads)

    def devices(self) -> list[DeviceStatus]:
        return [self._loader.read(d) for d in self._residency.device_rows()]

    def models(self) -> list[ModelStatus]:
        return [dataclasses.replace(m, download=self._download_of(m.name))
                for m in self._residency.model_rows()]

    def _download_of(self, name: str) -> Download | None:
        model = self._residency.models.get(name)
        if self._downloads is None or model is None:
            return None
        return self._downloads.status(model.resident.load)


class _Abandoned(Exception):
    """Every waiter of a load left before its engine call started: it stops, having loaded
    and evicted nothing."""


class _Deferred(Exception):
    """The load's engine died on the way (a warm copy's wake) and the crash rule says wait (a
    back-off) or stop (a quarantine): the load ends having loaded nothing, and its waiters look
    again (`_ensure_hot` waits out the back-off, or answers the quarantine's 503)."""


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a load's outcome as seen: its waiters got it, or nobody was left to care."""
    if not task.cancelled():
        task.exception()


def _called(res: Resident, name: str | None) -> str:
    """How a message names `res` to a client that asked for `name`: that model, and the others
    its load serves (their fate is one), else the load's label."""
    if name is None or name not in res.models:
        return f"model {res.label}"
    others = [m for m in res.models if m != name]
    return f"model {name}" + (f" (one load with {', '.join(others)})" if others else "")
