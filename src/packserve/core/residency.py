"""The tables the scheduler decides over: the catalog's models by name, the residents by
weights key, the devices' budgets; the snapshots its policy reads, and the status views.

Synchronous: no method awaits, so whatever one reads or changes is one consistent picture on
the event loop thread, and a catalog swap (`swap`) is seen by no request half done. It decides
and moves nothing: the scheduler asks it who fits and who leaves, then applies the answer
holding the device lock (lock order and the other invariants: `core.scheduler`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

from packserve.core import catalog
from packserve.core.catalog import DeviceBudget, Entry, Listed, ReconfigureReport, Served
from packserve.core.fetch import Downloads
from packserve.core.pins import PinRetry
from packserve.core.policy import (
    Admission,
    CostAware,
    ResidentView,
    Verdict,
    VictimPolicy,
    arrival_rate,
    pins_fit,
    plan_admission,
)
from packserve.core.queue import Model
from packserve.core.resident import Resident
from packserve.core.status import (
    DeviceStatus,
    LastCrash,
    Liveness,
    ModelStatus,
    PinStatus,
    Readiness,
    Stuck,
)
from packserve.errors import ConfigError, ModelNotFound, PinsDoNotFit
from packserve.types import State
from packserve.units import format_bytes

HOST = "cpu"  # the device whose budget host RAM is: warm copies of GPU models count there


# Beyond load_timeout_s, how long a device lock or a load in its engine may still run before
# the deep probe calls the scheduler wedged (`Residency.liveness`); at most a quarter of it.
WEDGE_GRACE_S = 15.0


class Residency:
    """What is served and where it stands. Invariants: every model's resident is in
    `residents` under its key; a resident's `models` names the catalog entries that use it
    (none once removed: it retires, then `forget` drops it); `devices` has a budget for every
    resident's device."""

    def __init__(self, entries: Sequence[Entry], devices: Iterable[DeviceBudget],
                 measured: Mapping[str, int | None], *, clock: Callable[[], float],
                 wall_offset: float, victim_policy: VictimPolicy | Mapping[str, VictimPolicy]
                 | None, warm_tier: Iterable[str], turns: bool,
                 room: Callable[[str], int | None] | None = None) -> None:
        """`measured`: each resident key's stored footprint, or None. `victim_policy`:
        packserve's rule, or one per device (the config's `eviction`; the bench swaps in other
        engines' rules). `warm_tier`: devices whose evictions keep an engine's objects and give
        back only its weights. `turns`: admission may hold busy models for a load's turn.
        `room`: what a device has for models at all, now: its total less what other processes
        and this process's base (its CUDA context) hold there; None where unknown (the CPU).
        No load is planned past it, whatever the budget says."""
        self._clock = clock
        self._wall_offset = wall_offset
        self._policies: Mapping[str, VictimPolicy] | None = (
            victim_policy if isinstance(victim_policy, Mapping) else None)
        self._default_policy: VictimPolicy = (
            victim_policy if victim_policy is not None and not isinstance(victim_policy, Mapping)
            else CostAware())
        self._warm_tier = frozenset(warm_tier)
        self._turns = turns
        self._room = room
        self.devices = {d.name: d for d in devices}
        self.residents: dict[str, Resident] = {}
        self.models: dict[str, Model] = {}
        catalog.check_devices(entries, self.devices)
        self._apply(entries, measured, catalog.diff({}, entries))

    # ----------------------------------------------------------------- lookups

    def model(self, name: str) -> Model:
        """The catalog's model `name`. Raises ModelNotFound."""
        model = self.models.get(name)
        if model is None:
            raise ModelNotFound(
                f"model {name!r} does not exist; this server has: {', '.join(self.models)}",
                param="model")
        return model

    def is_pinned(self, res: Resident) -> bool:
        return any(self.models[n].pinned for n in res.models)

    def memory_cap(self, res: Resident) -> int | None:
        """The smallest `max_memory` of the models that use `res` (or used it, while they
        drain), or None."""
        users = [self.models[n] for n in res.models] or res.retired
        caps = [c for m in users if (c := m.spec.max_memory) is not None]
        return min(caps) if caps else None

    def overshoot(self, res: Resident, measured: int) -> str | None:
        """Why `res`, just loaded and measured at `measured` bytes, cannot stay: over its
        max_memory quota or over its device's whole budget; None if it may."""
        cap = self.memory_cap(res)
        budget = self.devices[res.load.device].capacity_bytes
        if cap is not None and measured > cap:
            limit = f"its max_memory quota of {format_bytes(cap)}"
        elif measured > budget:
            limit = f"{res.load.device}'s whole budget of {format_bytes(budget)}"
        else:
            return None
        return (f"model {res.label} measured {format_bytes(measured)} after loading, over "
                f"{limit}; it was unloaded")

    def goes_warm(self, res: Resident) -> bool:
        """Whether an eviction of `res` now would try the warm tier: a warm copy that parks
        weights in host RAM (a GPU model's) only if the `cpu` budget has room for it."""
        return (res.load.device in self._warm_tier and self.may_go_warm(res)
                and res.quarantine is None and bool(res.models) and self._host_fits(res))

    @staticmethod
    def may_go_warm(res: Resident) -> bool:
        """Whether `res` can have a warm copy worth keeping: its engine has a warm state (or was
        not asked yet), its load maps its weights (one read into memory has nothing to give
        back: `LoadSpec.mapped`), and no copy of it kept most of its bytes (`too_big`)."""
        return res.warm.possible is not False and res.load.mapped and not res.warm.too_big

    def host_copies(self) -> int:
        """Host RAM the warm copies of other devices' models hold: part of `cpu`'s budget."""
        return sum(r.warm.host_bytes for r in self.residents.values() if r.load.device != HOST)

    def _host_fits(self, res: Resident) -> bool:
        """Whether the warm copy of `res`, a GPU model's, would fit in host RAM: what its last
        one parked there (before any, its bytes) within `cpu`'s budget; never without one."""
        if res.load.device == HOST:
            return True  # a CPU model's warm copy is part of its own bytes
        need = res.warm.host_seen
        if need is None:  # no copy yet: all its bytes, unless its engine parks none there
            need = res.bytes if res.backend is None or res.backend.parks_on_host() else 0
        if need == 0:
            return True
        return HOST in self.devices and self.used(HOST) + need <= self.capacity(HOST)

    def policy(self, device: str) -> VictimPolicy:
        """The victim policy of `device` (packserve's cost-aware `CostAware` unless told
        otherwise)."""
        if self._policies is not None:
            return self._policies.get(device, self._default_policy)
        return self._default_policy

    def view(self, res: Resident) -> ResidentView:
        """`res` as the victim policy sees it, now."""
        return ResidentView(
            key=res.key, device=res.load.device, state=res.state,
            bytes=res.unloading_bytes if res.unloading_bytes is not None else res.bytes,
            pinned=self.is_pinned(res), in_flight=res.leases, last_used=res.last_used,
            models=tuple(res.models), reload_s=res.load_seconds or 0.0,
            rate_per_s=arrival_rate(res.arrivals, self._clock()),
            goes_warm=self.goes_warm(res), keeps_bytes=res.warm.bytes,
            restore_s=res.warm.restore_seconds or _expected_restore(res),
            warm_bytes=res.warm.bytes if res.warm.kept else 0)

    def used(self, device: str) -> int:
        """The bytes `device` holds now, by the residents' own accounts."""
        return sum(self.view(r).held for r in self.residents.values()
                   if r.load.device == device)

    def holds_others(self, res: Resident) -> bool:
        """Whether any resident but `res` holds memory or a warm copy (in any device)."""
        return any(self.view(r).holds_memory or r.warm.kept
                   for r in self.residents.values() if r is not res)

    # ----------------------------------------------------------------- policy questions

    def admission(self, res: Resident) -> Admission:
        """What loading `res` now takes: fits, evict whom, wait for whom, or never fits."""
        device = self.devices[res.load.device]
        views = [self.view(r) for r in self.residents.values()]
        plan = plan_admission(self.view(res), views, device.capacity_bytes,
                              self.policy(device.name), turns=self._turns)
        room = self.capacity(device.name)
        if room >= device.capacity_bytes or plan.verdict not in (Verdict.FITS,
                                                                  Verdict.FITS_AFTER_EVICTION):
            return plan
        tight = plan_admission(self.view(res), views, room, self.policy(device.name),
                               turns=self._turns)
        if tight.verdict is not Verdict.NEVER_FITS:
            return tight
        # It fits the budget, not what is left of it now: a wait, never a 507.
        held = (f"warm copies of GPU models hold {format_bytes(self.host_copies())} of it"
                if device.name == HOST else "other processes hold the rest of the device")
        return dataclasses.replace(tight, verdict=Verdict.WAIT_FOR_BUSY, reason=(
            f"{res.label} needs {format_bytes(res.bytes)}; {device.name}'s models may hold "
            f"{format_bytes(room)} now, of a budget of {format_bytes(device.capacity_bytes)} "
            f"after headroom: {held}; it loads when they let go"))

    def capacity(self, device: str) -> int:
        """What `device`'s models may hold now: its budget after headroom, less (on `cpu`) the
        warm copies of GPU models in host RAM, and never more than what other processes leave
        (`room`), after headroom too."""
        budget = self.devices[device]
        cap = budget.capacity_bytes - (self.host_copies() if device == HOST else 0)
        room = None if self._room is None else self._room(device)
        if room is not None:
            cap = min(cap, room - budget.headroom_bytes)
        return max(0, cap)

    def labelled(self, answer: Admission, res: Resident) -> Admission:
        """`answer` for operators: policy speaks in resident keys, they know catalog names."""
        return dataclasses.replace(answer, target=res.label, victims=tuple(
            self.residents[k].label for k in answer.victims), draining=tuple(
            self.residents[k].label for k in answer.draining))

    def retry_victims(self, res: Resident) -> tuple[str, ...]:
        """Whom to unload before retrying a load of `res` that ran out of memory.

        Admission said `res` fit and the engine still could not allocate, so the free figure
        cannot be trusted (other processes, fragmentation, an estimate too low): the shortfall
        is unknown, but the load never needs more than its own footprint. So the victim policy
        is asked to free that much again, counting nothing as free; if the idle models hold
        less, all of them go, still in the policy's order.
        """
        others = [dataclasses.replace(self.view(r), goes_warm=False)  # they go cold
                  for r in self.residents.values()
                  if r is not res and r.load.device == res.load.device]
        policy = self.policy(res.load.device)
        victims = policy(others, res.bytes, 0)
        if victims is None:
            victims = policy(others, sum(v.frees for v in others if v.evictable), 0)
        return victims or ()

    def over_budget(self, device: str, keep: Resident | None) -> tuple[int, Resident | None]:
        """How many bytes `device` holds over its budget (<= 0: it fits), and the idle
        resident other than `keep` to evict first, in the victim policy's order (None when
        the idle ones do not cover it: then the first of them, if any, to free what there is)."""
        over = self.used(device) - self.devices[device].capacity_bytes
        if over <= 0:
            return over, None
        views = [self.view(r) for r in self.residents.values()
                 if r.load.device == device and r is not keep]
        victims = self.policy(device)(views, over, 0)
        if not victims:  # not enough idle bytes: free what there is, the rest waits
            idle = sum(v.frees for v in views if v.evictable)
            victims = self.policy(device)(views, idle, 0) if idle else None
        return over, self.residents[victims[0]] if victims else None

    def check_pins(self) -> None:
        """Raise PinsDoNotFit if the pinned models of any device cannot fit together."""
        for dev in self.devices.values():
            pinned = [self.view(r) for r in self.residents.values()
                      if r.load.device == dev.name and self.is_pinned(r)]
            reason = pins_fit(pinned, dev.capacity_bytes)
            if reason:
                raise PinsDoNotFit(reason)

    # ----------------------------------------------------------------- the catalog

    def check(self, entries: Sequence[Entry],
              devices: Iterable[DeviceBudget] | None) -> dict[str, DeviceBudget]:
        """The budgets a reconfigure to `entries` runs with (`devices`, or the running ones).
        Raises ConfigError if `devices` adds or removes a device, PinsDoNotFit if an entry is
        on a device without a budget."""
        budgets = dict(self.devices)
        if devices is not None:
            budgets = {d.name: d for d in devices}
            if set(budgets) != set(self.devices):
                raise ConfigError(
                    f"devices cannot be added or removed without a restart (running: "
                    f"{', '.join(sorted(self.devices))}; asked: "
                    f"{', '.join(sorted(budgets))})")
        catalog.check_devices(entries, budgets)
        return budgets

    def new_loads(self, entries: Sequence[Entry]) -> dict[str, Entry]:
        """The entries, by resident key, whose weights no resident holds yet."""
        return {e.load.key: e for e in entries if e.load.key not in self.residents}

    def swap(self, entries: Sequence[Entry], budgets: Mapping[str, DeviceBudget],
             measured: Mapping[str, int | None]) -> tuple[ReconfigureReport, list[str]]:
        """Make `entries` the catalog and `budgets` the devices' (from `check`); `measured`:
        the stored footprints of `new_loads`. Raises PinsDoNotFit, having changed nothing, if
        the new pins do not fit. Returns what changed and the devices whose budget shrank;
        the caller retires the residents left without models and fits the shrunk devices."""
        change = catalog.diff({n: Listed(key=m.resident.key, spec=m.spec, pinned=m.pinned,
                                         estimated=m.estimated)
                               for n, m in self.models.items()}, entries)
        catalog.check_pins(entries, change.pinned,
                           {**measured, **{k: r.measured for k, r in self.residents.items()}},
                           {k: r.estimated for k, r in self.residents.items()}, budgets)
        shrunk = [d for d, b in budgets.items()
                  if b.capacity_bytes < self.devices[d].capacity_bytes]
        self.devices = dict(budgets)
        self._apply(entries, measured, change)
        for model in self.models.values():
            model.fill()
        return change.report, shrunk

    def _apply(self, entries: Sequence[Entry], measured: Mapping[str, int | None],
               change: catalog.CatalogDiff) -> None:
        """Swap the catalog for `entries`, as `change` says."""
        old = self.models
        models: dict[str, Model] = {}
        for e in entries:
            name = e.spec.name
            res = self.residents.get(e.load.key)
            if res is None:
                res = Resident(load=e.load, models=[], estimated=e.bytes_estimated,
                               measured=measured.get(e.load.key))
                self.residents[e.load.key] = res
            if name in change.kept:
                model = old[name]
                model.spec, model.estimated = e.spec, e.bytes_estimated
                model.pinned = change.pinned[name]
            else:
                model = Model(spec=e.spec, resident=res, pinned=change.pinned[name],
                              estimated=e.bytes_estimated)
            models[name] = model
        for name, before in old.items():
            if models.get(name) is not before and not before.idle:
                before.resident.retired.append(before)  # it drains, then lets its weights go
        self.models = models
        for res in self.residents.values():
            users = [m for m in models.values() if m.resident is res]
            res.former = res.label
            res.models = [m.spec.name for m in users]
            res.retired = [m for m in res.retired if not m.idle]
            if users:
                res.estimated = max(m.estimated for m in users)

    def forget(self, res: Resident) -> None:
        """Drop `res`, cold and named by no entry, unless a new resident took its key."""
        if not res.models and self.residents.get(res.key) is res:
            del self.residents[res.key]

    # ----------------------------------------------------------------- views

    def spec_of(self, name: str) -> Served:
        """The catalog entry of `name`. Raises ModelNotFound."""
        return self.model(name).spec

    def state_of(self, name: str) -> State:
        return self.model(name).resident.state

    def readiness(self, retries: Callable[[str], PinRetry | None]) -> Readiness:
        """Ready when every pinned model is hot; else which are not, why, and the next retry
        (`retries`: the pin keeper's, by model name)."""
        now = self._clock()
        pins = []
        for m in self.models.values():
            res = m.resident
            if not m.pinned or res.state is State.HOT:
                continue
            retry = retries(m.spec.name)
            pins.append(PinStatus(
                model=m.spec.name, state=res.state,
                error=retry.error if retry is not None else res.error,
                next_retry_s=max(0.0, retry.next_at - now) if retry is not None else None))
        return Readiness(ready=not pins, pins=tuple(pins))

    def liveness(self, locks: Mapping[str, tuple[str, float]], timeout_s: float,
                 downloads: Downloads | None = None) -> Liveness:
        """What the deep probe reports (see `Liveness`), from the device locks' holders, the
        residents' loads and queues, and downloads with no byte for `timeout_s`: plain reads,
        nothing awaited."""
        now = self._clock()
        held = tuple(Stuck("lock", device, "", now - since, who)
                     for device, (who, since) in locks.items())
        loads = tuple(Stuck("load", r.load.device, r.label, now - r.flight.engine_since, "")
                      for r in self.residents.values() if r.flight.engine_since is not None)
        queues = tuple(Stuck("queue", m.resident.load.device, m.spec.name, now - m.moved,
                             f"{len(m.queue)} waiting")
                       for m in self.models.values() if m.queue)
        by_path = {str(r.load.path): r for r in self.residents.values()}
        stalled = tuple(Stuck("download", by_path[p].load.device if p in by_path else "",
                              by_path[p].label if p in by_path else "", seconds, source)
                        for p, source, seconds in (downloads.stalled(timeout_s)
                                                   if downloads is not None else ()))
        # A lock or a load gets a grace beyond the timeout: a runner's start has a deadline of
        # its own at load_timeout_s (not counting the time its CPU turn held it), which fails
        # that load alone, and should come first.
        grace = min(WEDGE_GRACE_S, timeout_s / 4)
        stuck = (*(s for s in (*held, *loads) if s.seconds > timeout_s + grace),
                 *(s for s in queues if s.seconds > timeout_s), *stalled)
        wedged = tuple(dict.fromkeys(name for s in stuck if s.kind == "load"
                                     for name in s.model.split("+")))
        return Liveness(load_timeout_s=timeout_s, locks=held, loads=loads, stuck=stuck,
                        wedged=wedged)

    def device_rows(self) -> list[DeviceStatus]:
        return [DeviceStatus(name=d.name, budget_bytes=d.budget_bytes,
                             headroom_bytes=d.headroom_bytes, used_bytes=self.used(d.name),
                             capacity_bytes=self.capacity(d.name),
                             warm_host_bytes=self.host_copies() if d.name == HOST else None)
                for d in self.devices.values()]

    def model_rows(self) -> list[ModelStatus]:
        rows = []
        now = self._clock()
        for m in self.models.values():
            res = m.resident
            backend = res.backend or res.warm.backend
            exit = res.last_exit
            crash = None if exit is None or res.last_exit_at is None else LastCrash(
                at=res.last_exit_at + self._wall_offset, cause=exit.cause, pid=exit.pid,
                verdict=res.verdict, log=exit.log, log_tail=exit.log_tail)
            rows.append(ModelStatus(
                name=m.spec.name, tasks=tuple(m.spec.tasks), state=res.state,
                device=res.load.device, pinned=m.pinned, bytes_estimated=res.estimated,
                bytes_measured=res.measured, in_flight=m.running, queued=len(m.queue),
                last_used=(res.last_used + self._wall_offset) if res.last_used else None,
                load_seconds=res.load_seconds, error=res.error,
                shares_weights_with=tuple(n for n in res.models if n != m.spec.name),
                bytes_warm=res.warm.bytes if res.warm.kept else None,
                restore_seconds=res.warm.restore_seconds, last_crash=crash,
                restart_in_s=_restart_in(res, now),
                log=(backend.log() if backend is not None else None)
                or (exit.log if exit is not None else None)))
        return rows


def _restart_in(res: Resident, now: float) -> float | None:
    """Seconds until `res` may load again: a back-off after a crash, or a quarantine with an
    end (a third death's); None when it may now, or only an operator's load lifts it."""
    at = res.restart_at if res.quarantine is None else res.quarantine_until
    return round(at - now, 3) if at is not None and at > now else None


def _expected_restore(res: Resident) -> float:
    """A restore's seconds before one was measured: the engine's declared share of its
    load's, or 0.0 (unknown: the policy counts a whole load)."""
    backend = res.backend or res.warm.backend
    share = backend.restore_share() if backend is not None else None
    return share * (res.load_seconds or 0.0) if share else 0.0
