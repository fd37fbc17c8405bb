"""Engine I/O for the scheduler: building and measuring a load, giving weights back, the
executor all of it runs on, the memory probe and the footprint store.

The loader holds no scheduling state: the scheduler decides what moves where, under its
device lock, and calls the loader for the blocking part. Every call that blocks (an engine's
load, unload or release, a probe's reading, a footprint write) runs on the loader's own
executor, never on the loop and never in the default pool that inference uses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import json
import logging
import os
import re
import statistics
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from packserve import atomic
from packserve.core.backend import Backend, BackendFactory, EngineDied, LoadSpec
from packserve.core.memory import DEVICE_TOTAL, PER_PROCESS, MemoryProbe
from packserve.core.status import DeviceStatus

log = logging.getLogger("packserve.scheduler")

T = TypeVar("T")

FOOTPRINT_HISTORY = 5  # measurements per load the footprint store keeps

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


def _be_nice(nice: int) -> None:
    """Lower this thread's CPU priority (Linux: a thread id is a process id to setpriority)."""
    if nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: loads run as before
        log.debug("could not lower the load threads' priority: %s", exc)


class Loader:
    """Runs the scheduler's engine calls and measures them. `probe` and `store` are public:
    the scheduler's tests swap the probe."""

    def __init__(self, factory: BackendFactory, probe: MemoryProbe, store: FootprintStore,
                 *, devices: int, nice: int = 0) -> None:
        self.factory = factory
        self.probe = probe
        self.store = store
        # Per CUDA device, what this process held there before its first load, its context
        # opened: its base, counted once, never in a model's bytes.
        self.base: dict[str, int] = {}
        # One device lock admits one load or unload at a time, so a worker per device
        # suffices: 32 reranks in flight must not starve an unload holding a device lock.
        # They run at `nice` (nice is per thread on Linux): resident models keep serving while
        # weights are read; `python -m benchmarks coldstart` measures what it costs a load.
        self._executor = ThreadPoolExecutor(max_workers=max(2, devices),
                                            thread_name_prefix="packserve-load",
                                            initializer=functools.partial(_be_nice, nice))

    def room(self, device: str) -> int | None:
        """What `device` has for models now: its total less other processes' bytes and this
        process's base; None where other processes' bytes are unknown (the CPU, MIG, a PID
        namespace)."""
        others = self.probe.others_bytes(device)
        if others is None:
            return None
        return self.probe.total_bytes(device) - others - self.base.get(device, 0)

    def read(self, row: DeviceStatus) -> DeviceStatus:
        """`row` with what the probe says of its device: how its bytes are counted, this
        process's base there and what other processes hold."""
        return dataclasses.replace(row, accounting=self.probe.accounting(row.name),
                                   base_bytes=self.base.get(row.name),
                                   others_bytes=self.probe.others_bytes(row.name))

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run a blocking lifecycle call (load, unload, release, footprint write) off the loop,
        on the loader's own executor."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def release(self, device: str) -> None:
        """Hand freed heap pages of `device` back (after an unload, before a measurement)."""
        await self.run(self.probe.release, device)

    async def build(self, load: LoadSpec, *, settle: bool,
                    turn: tuple[float, float]) -> tuple[Backend, int]:
        """Create and load an engine for `load`; the engine and its measured footprint.
        `settle`: no other model's objects are alive, so the live ones may be frozen out of
        the collector first. The load competes for compute at `turn` (deadline, SLO: see
        `Backend.working`). An engine whose load raises is unloaded before the error goes on.
        """
        device = load.device
        probe = self.probe

        def build() -> tuple[Backend, int]:
            # Hand freed heap pages back first, so the load cannot reuse memory that was
            # already resident and hide its size (without it, the same Gemma load measured
            # anywhere from 285 to 320 MiB).
            backend = self.factory(load)
            # The engine library is imported on first use (a server with no torch model never
            # imports torch), and before the measurement: its code is not the model's bytes.
            backend.prepare()
            if settle:
                probe.settle()
            if (device.startswith("cuda") and device not in self.base
                    and not backend.out_of_process  # a runner opens its own, in its bytes
                    and probe.accounting(device) == PER_PROCESS):  # else: the device's total
                probe.open_device(device)  # this process's context first: its base
                probe.release(device)
                self.base[device] = probe.used_bytes(device)
            probe.release(device)
            before = probe.used_bytes(device)
            try:
                _working(backend, turn, backend.load)
            except BaseException:
                backend.unload()
                probe.release(device)
                raise
            grown = probe.used_bytes(device) - before
            return backend, max(grown, backend.weight_bytes())

        return await self.run(build)

    async def restore(self, backend: Backend, turn: tuple[float, float]) -> None:
        """A warm engine reads its weights back, competing for compute at `turn`."""
        await self.run(_working, backend, turn, backend.restore_weights)

    async def record(self, load: LoadSpec, measured: int, label: str) -> None:
        """Keep a load's raw reading: the store answers a median of recent ones across
        restarts. No store fault fails a load."""
        try:
            await self.run(self.store.put, load, measured)
        except Exception:  # the store logs its own write failures
            log.exception("could not record the footprint of %s", label)

    async def release_weights(self, backend: Backend, load: LoadSpec, held: int,
                              label: str) -> int | None:
        """Ask the engine to give its weights back and keep its objects. The bytes it still
        holds then (measured as the load is, never more than the `held` it held), or None if
        it cannot: then the caller unloads it whole. EngineDied if its process died doing it."""
        return await self.run(self._release_weights, backend, load, held, label)

    def _release_weights(self, backend: Backend, load: LoadSpec, held: int,
                         label: str) -> int | None:
        device = load.device
        probe = self.probe
        before = mapped = 0
        # A runner's memory is its own process's, which it reports (`weight_bytes`), except on
        # a card without NVML's per-process figures (MIG): there, as its load was, it is
        # measured by the device's used memory, before and after.
        own = backend.out_of_process and probe.accounting(device) != DEVICE_TOTAL
        if not own:
            probe.release(device)  # garbage from before is not the release's to claim
            before = probe.used_bytes(device)
            mapped = probe.mapped_file_bytes(device, load.path)
        try:
            kept = backend.release_weights()
        except EngineDied:
            raise  # its process died on the way: the caller counts it, then unloads it
        except Exception:
            log.exception("%s could not give its weights back; unloading it", label)
            return None
        if not kept:
            return None
        if own:  # a runner: what its process still holds, all of it
            return min(held, backend.weight_bytes())
        probe.release(device)
        freed = before - probe.used_bytes(device)
        # Weights mapped from their file count in its bytes whether read or not, and pages never
        # read (MiniLM's unused vocabulary rows: most of its 45 MiB embedding table) were never
        # resident: unmapped now, they are freed too, though the resident set cannot show it.
        # `freed` counts the pages that were read, and maybe more: the larger of the two.
        unmapped = max(0, mapped - probe.mapped_file_bytes(device, load.path))
        return min(held, max(held - max(freed, unmapped), backend.weight_bytes(), 0))


def _working(backend: Backend, turn: tuple[float, float], call: Callable[[], T]) -> T:
    """`call` (an engine's load or restore, in a load thread) under `backend.working`."""
    with backend.working(*turn):
        return call()
