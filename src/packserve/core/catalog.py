"""The catalog the scheduler serves, and what a reconfigure changes in it.

Pure: `diff` compares the running catalog with the new entries, `check_devices` and
`check_pins` refuse a catalog that cannot run, all over plain data. The scheduler applies the
answer (`Residency.swap`, called by `Scheduler.reconfigure`), synchronously, so no request
sees half of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from packserve.core.backend import LoadSpec
from packserve.core.policy import ResidentView, pins_fit
from packserve.errors import PinsDoNotFit
from packserve.types import State, Task


class Served(Protocol):
    """What the core reads of a catalog entry: the name clients send, what it does, its pin and
    its quotas. The server passes the config file's `ModelSpec`, which is one; the core holds it
    as this and never imports the config's types. Compared with `==` by the reconfigure diff
    (any change to an entry is a change)."""

    @property
    def name(self) -> str: ...
    @property
    def tasks(self) -> Sequence[Task]: ...
    @property
    def pin(self) -> bool: ...
    @property
    def concurrency(self) -> int: ...  # requests served at once
    @property
    def max_queue(self) -> int: ...  # requests waiting beyond those
    @property
    def max_memory(self) -> int | None: ...  # a quota on its weights' bytes
    @property
    def keep_alive(self) -> float | None: ...  # idle seconds before it lets go; None: device's


@dataclass(frozen=True)
class DeviceBudget:
    """The bytes the scheduler may fill on one device, less what it keeps free."""

    name: str
    budget_bytes: int
    headroom_bytes: int

    @property
    def capacity_bytes(self) -> int:
        return max(0, self.budget_bytes - self.headroom_bytes)


@dataclass(frozen=True)
class Entry:
    """A catalog entry ready to schedule: its spec, how to load it, its estimated bytes."""

    spec: Served
    load: LoadSpec
    bytes_estimated: int


@dataclass(frozen=True)
class Listed:
    """A model as the running catalog has it: its weights' key, its entry, its pin now (an
    operator's pin or unpin included)."""

    key: str
    spec: Served
    estimated: int
    pinned: bool


@dataclass(frozen=True)
class ReconfigureReport:
    """What `Scheduler.reconfigure` changed, by catalog name."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]  # quotas, pin, tasks or estimate; or new weights (a remove + add)
    new_weights: tuple[str, ...] = ()  # those of `changed` whose weights are new


@dataclass(frozen=True)
class CatalogDiff:
    """What making `entries` the catalog does, by catalog name."""

    report: ReconfigureReport
    kept: frozenset[str]  # same weights: its queue and record carry over, with the new entry
    pinned: Mapping[str, bool]  # every new entry's pin: the file's if it changed the pin (or
    # the weights changed), else the running one (an operator's pin or unpin stays)


def diff(old: Mapping[str, Listed], entries: Sequence[Entry]) -> CatalogDiff:
    """Compare the running catalog `old` with `entries`. A model whose weights change is a
    removal plus an addition under the same name, reported as changed."""
    added: list[str] = []
    changed: list[str] = []
    new_weights: list[str] = []
    kept: set[str] = set()
    pinned: dict[str, bool] = {}
    for e in entries:
        name = e.spec.name
        before = old.get(name)
        if before is not None and before.key == e.load.key:
            kept.add(name)
            if (before.spec, before.estimated) != (e.spec, e.bytes_estimated):
                changed.append(name)
            pinned[name] = e.spec.pin if before.spec.pin != e.spec.pin else before.pinned
        else:
            (added if before is None else changed).append(name)
            if before is not None:
                new_weights.append(name)
            pinned[name] = e.spec.pin
    removed = tuple(n for n in old if n not in pinned)
    return CatalogDiff(report=ReconfigureReport(added=tuple(added), removed=removed,
                                                changed=tuple(changed),
                                                new_weights=tuple(new_weights)),
                       kept=frozenset(kept), pinned=pinned)


def check_devices(entries: Sequence[Entry], budgets: Mapping[str, DeviceBudget]) -> None:
    """Raise PinsDoNotFit for an entry on a device that has no budget."""
    for e in entries:
        if e.load.device not in budgets:
            raise PinsDoNotFit(
                f"model {e.spec.name!r} is on {e.load.device}, which has no budget")


def check_pins(entries: Sequence[Entry], pinned: Mapping[str, bool],
               measured: Mapping[str, int | None], floor: Mapping[str, int],
               budgets: Mapping[str, DeviceBudget]) -> None:
    """Raise PinsDoNotFit if the pinned `entries` do not fit their devices together.

    A pin counts its weights' `measured` bytes (by resident key) where known, else the larger
    of its estimate and the running resident's (`floor`); weights shared by several entries
    count once, at their largest.
    """
    views: dict[str, ResidentView] = {}
    for e in entries:
        if not pinned[e.spec.name]:
            continue
        key = e.load.key
        known = measured.get(key)
        size = known if known is not None else max(e.bytes_estimated, floor.get(key, 0))
        view = views.get(key)
        names = (*view.models, e.spec.name) if view else (e.spec.name,)
        views[key] = ResidentView(key=key, device=e.load.device, state=State.COLD, pinned=True,
                                  bytes=max(size, view.bytes if view else 0), models=names)
    for name, budget in budgets.items():
        reason = pins_fit([v for v in views.values() if v.device == name],
                          budget.capacity_bytes)
        if reason:
            raise PinsDoNotFit(reason)
