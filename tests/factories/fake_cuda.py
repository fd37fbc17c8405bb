"""A fake CUDA machine for the suite (issue 31): what the scheduler's GPU accounting meets on a
card, modelled on the CPU.

- `FakeCuda`: devices with a total; per process a CUDA context (opened on first use of a
  device) and torch's caching allocator (a freed block stays reserved, and counted by NVML,
  until the process empties its cache); other tenants, processes that allocate and free
  whenever a test says, during a load included; host RAM that warm copies park in, copied at
  `copy_bytes_per_s`.
- `FakeCuda.nvml(per_process=...)`: NVML over it (`core.memory.GpuList`): device totals and
  used, and the process list, with per-process figures, with none (`per_process=False`: a
  process listed without its figure) or without a list at all (`per_process=None`: MIG).
- `FakeCuda.runtime(pid)`: one process's CUDA runtime as the probe uses it
  (`core.memory.CudaRuntime`: open a context, empty the cache).
- `CudaEngine`: a fake engine on `cuda:N` whose load allocates its declared bytes through its
  process's allocator, and whose warm state parks them in host RAM (`Backend.host_bytes`).
- `SleepingRunner`: a llama-server runner on `cuda:N`, a process of its own whose warm state is
  llama.cpp's sleeping state (weights and caches freed on the card, its context kept), whose
  wake allocates them again or, told to, aborts the process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from packserve.backends.fake import FakeBackend, declared_bytes
from packserve.backends.llama_server import RESTORE_SHARE, WarmState, runner_device_bytes
from packserve.core.backend import EngineDied, EngineExit
from packserve.core.memory import SystemProbe

MIB = 1 << 20
GIB = 1 << 30
BLOCK = 2 * MIB  # the caching allocator rounds each allocation up to whole blocks


@dataclass
class _Process:
    context: dict[int, int] = field(default_factory=dict)  # device -> context bytes
    allocated: dict[int, int] = field(default_factory=dict)
    reserved: dict[int, int] = field(default_factory=dict)  # >= allocated

    def holds(self, index: int) -> int:
        return self.context.get(index, 0) + self.reserved.get(index, 0)


@dataclass
class FakeCuda:
    """One machine's cards and host RAM. Thread-safe: engines allocate in load threads."""

    totals: dict[int, int] = field(default_factory=lambda: {0: 16 * GIB})
    context_bytes: int = 500 * MIB
    copy_bytes_per_s: float = 64 * GIB  # host <-> device, for warm copies
    processes: dict[int, _Process] = field(default_factory=dict)
    host_bytes: int = 0  # parked in host RAM by warm copies
    copies: list[tuple[str, int, float]] = field(default_factory=list)  # direction, bytes, s
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _process(self, pid: int) -> _Process:
        return self.processes.setdefault(pid, _Process())

    def open(self, pid: int, index: int) -> None:
        with self.lock:
            proc = self._process(pid)
            proc.context.setdefault(index, self.context_bytes)

    def malloc(self, pid: int, index: int, nbytes: int) -> None:
        """Allocate `nbytes` for `pid` on device `index` (opening its context): from blocks it
        keeps reserved first, then new ones; MemoryError past the device's total."""
        self.open(pid, index)
        with self.lock:
            proc = self._process(pid)
            allocated = proc.allocated.get(index, 0) + nbytes
            reserved = max(proc.reserved.get(index, 0), -(-allocated // BLOCK) * BLOCK)
            used = sum(p.holds(index) for p in self.processes.values())
            if used - proc.reserved.get(index, 0) + reserved > self.totals[index]:
                raise MemoryError(f"CUDA out of memory on device {index}")
            proc.allocated[index], proc.reserved[index] = allocated, reserved

    def free(self, pid: int, index: int, nbytes: int) -> None:
        """Free `nbytes`: the blocks stay reserved (and counted) until `empty_cache`."""
        with self.lock:
            proc = self._process(pid)
            proc.allocated[index] = max(0, proc.allocated.get(index, 0) - nbytes)

    def empty_cache(self, pid: int, index: int) -> None:
        with self.lock:
            proc = self._process(pid)
            proc.reserved[index] = -(-proc.allocated.get(index, 0) // BLOCK) * BLOCK

    def used(self, index: int) -> int:
        with self.lock:
            return sum(p.holds(index) for p in self.processes.values())

    def held_by(self, pid: int, index: int) -> int:
        with self.lock:
            return self._process(pid).holds(index)

    def copy(self, direction: str, nbytes: int) -> None:
        """A copy between host and device at the bus's speed (it takes that long)."""
        seconds = nbytes / self.copy_bytes_per_s
        time.sleep(seconds)
        with self.lock:
            self.copies.append((direction, nbytes, seconds))

    def nvml(self, per_process: bool | None = True) -> FakeNvml:
        return FakeNvml(self, per_process)

    def runtime(self, pid: int) -> FakeRuntime:
        return FakeRuntime(self, pid)

    def probe(self, pid: int, *, per_process: bool | None = True,
              ours: Callable[[int], frozenset[int]] | None = None) -> SystemProbe:
        """The real probe over this machine, as process `pid` (with no children unless `ours`
        says which pids are its family)."""
        nvml = self.nvml(per_process)
        return SystemProbe(gpu=lambda: nvml, pid=pid, namespaced=lambda: False,
                           cuda=self.runtime(pid),
                           family=ours or (lambda p: frozenset({p})))


@dataclass
class FakeNvml:
    """NVML over a `FakeCuda` (`core.memory.GpuList`)."""

    cuda: FakeCuda
    per_process: bool | None

    def count(self) -> int:
        return len(self.cuda.totals)

    def name(self, index: int) -> str:
        return f"Fake CUDA {index}"

    def memory(self, index: int) -> tuple[int, int]:
        return self.cuda.totals[index], self.cuda.used(index)

    def processes(self, index: int, *, graphics: bool = False
                  ) -> list[tuple[int, int | None]] | None:
        if self.per_process is None:
            return None  # MIG: no process list
        with self.cuda.lock:
            listed = [(pid, p.holds(index)) for pid, p in self.cuda.processes.items()
                      if index in p.context]
        return [(pid, held if self.per_process else None) for pid, held in listed]


@dataclass
class FakeRuntime:
    """One process's CUDA runtime (`core.memory.CudaRuntime`)."""

    cuda: FakeCuda
    pid: int

    def open(self, device: str) -> None:
        self.cuda.open(self.pid, _index(device))

    def empty_cache(self, device: str) -> None:
        self.cuda.empty_cache(self.pid, _index(device))


class Tenant:
    """Another process on the card: allocates and frees when the test says."""

    def __init__(self, cuda: FakeCuda, pid: int, index: int = 0) -> None:
        self.cuda, self.pid, self.index = cuda, pid, index

    def allocate(self, nbytes: int) -> None:
        self.cuda.malloc(self.pid, self.index, nbytes)

    def free_all(self) -> None:
        self.cuda.free(self.pid, self.index, 1 << 62)
        self.cuda.empty_cache(self.pid, self.index)


class CudaEngine(FakeBackend):
    """A fake engine on `cuda:N` in process `pid` of `cuda`: its load allocates its declared
    bytes (calling `during_load` between two halves, where a test lets a tenant allocate);
    its warm state parks them in host RAM and copies them back."""

    cuda: FakeCuda
    pid: int
    during_load: Callable[[], None] = staticmethod(lambda: None)
    _parked: int = 0

    def _index(self) -> int:
        return _index(self.spec.device)

    def load(self) -> None:
        half = declared_bytes(self.spec) // 2
        self.cuda.malloc(self.pid, self._index(), half)
        self.during_load()
        self.cuda.malloc(self.pid, self._index(), declared_bytes(self.spec) - half)
        super().load()

    def unload(self) -> None:
        if self._loaded and not self._parked:
            self.cuda.free(self.pid, self._index(), declared_bytes(self.spec))
        with self.cuda.lock:
            self.cuda.host_bytes -= self._parked
        self._parked = 0
        super().unload()

    def release_weights(self) -> bool:
        if not self._loaded:
            return False
        nbytes = declared_bytes(self.spec)
        self.cuda.copy("to_host", nbytes)
        with self.cuda.lock:
            self.cuda.host_bytes += nbytes
        self.cuda.free(self.pid, self._index(), nbytes)
        self._parked = nbytes
        self._warm = True
        return True

    def restore_weights(self) -> None:
        self.cuda.malloc(self.pid, self._index(), self._parked)
        self.cuda.copy("to_device", self._parked)
        with self.cuda.lock:
            self.cuda.host_bytes -= self._parked
        self._parked = 0
        self._warm = False

    def host_bytes(self) -> int:
        return self._parked

    def weight_bytes(self) -> int:
        return 0 if not self._loaded or self._parked else declared_bytes(self.spec)


class SleepingRunner(FakeBackend):
    """A llama-server runner on `cuda:N` as backends.llama_server runs one there: a process of
    its own (`pid`, its CUDA context opened by its load) whose declared bytes are its weights,
    KV cache and compute buffers; its bytes are what NVML says its pid holds. Its warm state is
    the sleeping state: every buffer freed (ggml frees them: no cache keeps them), the context
    kept; its wake allocates them again (MemoryError past the card's total) or, with
    `wake_dies`, aborts: the process and all it held are gone, and EngineDied says so (with
    `killed_asleep`, it was killed asleep and its restore finds it gone first). Its
    bytes are read as the real runner reads them (`runner_device_bytes`, through `nvml`: 0
    where NVML gives no per-process figure)."""

    out_of_process = True
    cuda: FakeCuda
    pid: int
    nvml: FakeNvml
    wake_dies: bool = False
    sleep_dies: bool = False
    killed_asleep: bool = False  # its reaper's report never reaches the scheduler
    killed_hot: bool = False  # the same, killed before it was sent to sleep

    def _index(self) -> int:
        return _index(self.spec.device)

    def load(self) -> None:
        self.cuda.malloc(self.pid, self._index(), declared_bytes(self.spec))
        super().load()

    def unload(self) -> None:  # the process exits: its context and buffers go with it
        self._exit()
        super().unload()

    def _exit(self) -> None:
        with self.cuda.lock:
            self.cuda.processes.pop(self.pid, None)

    def release_weights(self) -> bool:
        if not self._loaded or self._warm:
            return False
        if self.killed_hot:
            self._abort("idle", "SIGKILL")
        if self.sleep_dies:
            self._abort("going warm")
        self.cuda.free(self.pid, self._index(), declared_bytes(self.spec))
        self.cuda.empty_cache(self.pid, self._index())
        self._count(self.control.releases)
        self._warm = True
        return True

    def restore_weights(self) -> None:
        if self.killed_asleep:
            self._abort("warm", "SIGKILL")
        if self.wake_dies:
            self._abort("waking")
        self.cuda.malloc(self.pid, self._index(), declared_bytes(self.spec))
        super().restore_weights()

    def _abort(self, doing: str, signal: str = "SIGABRT") -> None:
        self._exit()
        self._loaded = self._warm = False
        raise EngineDied(f"the runner of {self.name} died {doing} ({signal})", EngineExit(
            pid=self.pid, status=None, signal=signal, oom_kill=None,
            log_tail="failed to reload model after sleeping", log=""), doing)

    def restore_share(self) -> float | None:
        return RESTORE_SHARE[WarmState.SLEEP]

    def parks_on_host(self) -> bool:
        return False

    def weight_bytes(self) -> int:
        if not self._loaded:
            return 0
        return runner_device_bytes(self.pid, self.spec.device, gpu=lambda: self.nvml)


def _index(device: str) -> int:
    return int(device.partition(":")[2] or 0)
