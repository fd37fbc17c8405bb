"""Memory probes: what a device has, what this process uses on it, and giving freed memory back.

The scheduler receives a `MemoryProbe` in its constructor; tests pass a fake.
On `cpu` the figure is this process's resident set (RSS), so the budget governs the RAM that
model weights and caches take. On `cuda:N` it comes from NVML (nvidia-ml-py; torch is never
imported to probe a device): what this process holds on the device, NVML's per-process figure,
which counts llama.cpp's allocations as well as torch's and not another tenant's. Where NVML
gives no per-process figure (MIG, a container's PID namespace, where NVML lists host pids, some
sandboxes) the fallback is the device's used memory, so another process allocating during a load
is charged to it: `accounting()` says which, and /v1/residency shows it per device.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import importlib
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

# How a device's bytes are counted (`MemoryProbe.accounting`): this process's resident set, NVML's
# figure for this process, or the device's used memory (the fallback).
RSS, PER_PROCESS, DEVICE_TOTAL = "rss", "per_process", "device_total"
FAMILY_TTL_S = 1.0  # how long a reading of this process's runners' pids is reused


class MemoryProbe(Protocol):
    def total_bytes(self, device: str) -> int:
        """Physical memory of the device. Called at start to size `auto` budgets."""
        ...

    def used_bytes(self, device: str) -> int:
        """Memory in use now, as seen by this process. Called before and after each load."""
        ...

    def release(self, device: str) -> None:
        """Return freed memory to the OS or driver. Called after each unload."""
        ...

    def settle(self) -> None:
        """Called before a load's measurement when no other model is loaded, after its
        engine's library was imported: what lives now (modules, engine libraries) lives for
        the process, so later releases need not go over it again."""
        ...

    def accounting(self, device: str) -> str:
        """How `used_bytes` counts on `device`: RSS, PER_PROCESS or DEVICE_TOTAL. Read for the
        residency view."""
        ...

    def others_bytes(self, device: str) -> int | None:
        """What processes outside this one and its children (runners) hold on the device: NVML's
        per-process figures on `cuda:N`; None where there are none (the CPU, MIG, a container's
        PID namespace). Read for the residency view and to plan loads within what is free."""
        ...

    def open_device(self, device: str) -> None:
        """Before the first load on a CUDA device in this process: open the process's CUDA
        context there (with the engine library already imported), so that the context is this
        process's base, not the first model's bytes. Nothing on the CPU."""
        ...

    def mapped_file_bytes(self, device: str, path: Path) -> int:
        """Bytes of the files at or under `path` (a model's weights) mapped into this process,
        resident or not. Called before and after a model gives its weights back (the warm
        tier): weights mapped from their file count in a model's bytes whether or not they were
        ever read, and unmapping them frees them all, where `used_bytes` shows only the pages
        that were read."""
        ...


class GpuMemory(Protocol):
    """The slice of NVML the probe reads; `Nvml` is the real one, tests pass a fake."""

    def memory(self, index: int) -> tuple[int, int]:
        """(total, used) bytes of device `index`."""
        ...

    def processes(self, index: int) -> list[tuple[int, int | None]] | None:
        """(pid, bytes) of each process on device `index` (bytes None where NVML does not say),
        or None where NVML gives no per-process list (MIG, some drivers)."""
        ...


class GpuList(GpuMemory, Protocol):
    """NVML as `packserve audit` reads it besides: how many devices, their names, and the
    graphics processes too."""

    def count(self) -> int: ...

    def name(self, index: int) -> str: ...

    def processes(self, index: int, *, graphics: bool = False
                  ) -> list[tuple[int, int | None]] | None: ...


class CudaRuntime(Protocol):
    """The CUDA runtime of this process as the probe uses it; `TorchCuda` is the real one (it
    acts only where a torch engine imported torch), tests pass a fake."""

    def open(self, device: str) -> None:
        """Open this process's context on `device` (idempotent)."""
        ...

    def empty_cache(self, device: str) -> None:
        """Hand the blocks the caching allocator keeps reserved but unused back to the driver."""
        ...


class TorchCuda:
    """torch's CUDA runtime, where torch was imported (by a torch engine): a process serving only
    llama.cpp models never imports it; llama.cpp opens its own context in its load."""

    def open(self, device: str) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.empty(0, device=device)  # the context, without a block held

    def empty_cache(self, device: str) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


class Nvml:
    """NVML through nvidia-ml-py (`pynvml`), opened on first use: the one reader of it (the
    probe, the runners' figures, `packserve audit`)."""

    def __init__(self) -> None:
        self._nv = importlib.import_module("pynvml")  # untyped: read through its module
        self._nv.nvmlInit()

    def count(self) -> int:
        return int(self._nv.nvmlDeviceGetCount())

    def name(self, index: int) -> str:
        name = self._nv.nvmlDeviceGetName(self._nv.nvmlDeviceGetHandleByIndex(index))
        return name.decode() if isinstance(name, bytes) else str(name)

    def memory(self, index: int) -> tuple[int, int]:
        info = self._nv.nvmlDeviceGetMemoryInfo(self._nv.nvmlDeviceGetHandleByIndex(index))
        return int(info.total), int(info.used)

    def processes(self, index: int, *, graphics: bool = False
                  ) -> list[tuple[int, int | None]] | None:
        """(pid, bytes) of the compute processes on device `index` (and, with `graphics`,
        the graphics ones), bytes None where NVML does not say; None without a list."""
        handle = self._nv.nvmlDeviceGetHandleByIndex(index)
        try:
            procs = list(self._nv.nvmlDeviceGetComputeRunningProcesses(handle))
            if graphics:
                procs += self._nv.nvmlDeviceGetGraphicsRunningProcesses(handle)
        except self._nv.NVMLError:
            return None
        return [(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory))
                for p in procs]


def in_child_pid_namespace(status: str = "/proc/self/status") -> bool:
    """Whether this process runs in a PID namespace below the host's (a container): NVML lists
    host pids there, so this process's own pid is not in its list."""
    try:
        with open(status, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return len(line.split()) > 2
    except OSError:
        pass
    return False


def family(pid: int, proc: Path = Path("/proc")) -> frozenset[int]:
    """`pid` and its descendants (a worker and its runner processes), from /proc's ppid fields."""
    children: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text(encoding="ascii", errors="replace")
            ppid = int(text[text.rindex(")") + 2:].split()[1])  # after "(comm) state"
            children.setdefault(ppid, []).append(int(stat.parent.name))
    seen, todo = {pid}, [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return frozenset(seen)


def others_device_bytes(gpu: GpuMemory, index: int, ours: frozenset[int],
                        procs: list[tuple[int, int | None]] | None = None) -> int | None:
    """What device `index` holds beyond the processes in `ours`: its used memory less their
    per-process figures, so that graphics processes and what the driver keeps count too; None
    when per-process figures are unavailable. `procs`: NVML's process list, if read already."""
    procs = gpu.processes(index) if procs is None else procs
    if procs is None or any(used is None for _, used in procs):
        return None
    return max(0, gpu.memory(index)[1] - sum(used or 0 for p, used in procs if p in ours))


def process_device_bytes(gpu: GpuMemory, index: int, pid: int) -> int | None:
    """What process `pid` holds on device `index` by NVML's per-process figure (0 when it is not
    listed: no CUDA context there yet), or None when per-process figures are unavailable."""
    procs = gpu.processes(index)
    if procs is None or any(used is None for _, used in procs):
        return None
    return sum(used or 0 for p, used in procs if p == pid)


class SystemProbe:
    """The real probe: /proc on CPU, NVML on GPUs (`gpu`, opened on the first CUDA question;
    `pid` is whose per-process figure counts, this process's; `namespaced` whether the PID
    namespace hides it from NVML)."""

    def __init__(self, gpu: Callable[[], GpuMemory] = Nvml, pid: int | None = None,
                 namespaced: Callable[[], bool] = in_child_pid_namespace,
                 cuda: CudaRuntime | None = None,
                 family: Callable[[int], frozenset[int]] = family,
                 clock: Callable[[], float] = time.monotonic) -> None:
        libc_name = ctypes.util.find_library("c")
        self._libc = ctypes.CDLL(libc_name) if libc_name else None
        self._settled_modules = 0  # len(sys.modules) when the live objects were last frozen
        self._open_gpu = gpu
        self._gpu: GpuMemory | None = None
        self._pid = os.getpid() if pid is None else pid
        self._namespaced = namespaced
        self._cuda = cuda or TorchCuda()
        self._family = family
        # (when, our pids, every pid NVML listed then)
        self._ours: tuple[float, frozenset[int], frozenset[int]] = (
            -math.inf, frozenset(), frozenset())
        self._clock = clock

    def gpu(self) -> GpuMemory:
        if self._gpu is None:
            self._gpu = self._open_gpu()
        return self._gpu

    def total_bytes(self, device: str) -> int:
        if device.startswith("cuda"):
            return self.gpu().memory(_index(device))[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def _own_bytes(self, device: str) -> int | None:
        if self._namespaced():
            return None
        return process_device_bytes(self.gpu(), _index(device), self._pid)

    def accounting(self, device: str) -> str:
        if not device.startswith("cuda"):
            return RSS
        return DEVICE_TOTAL if self._own_bytes(device) is None else PER_PROCESS

    def used_bytes(self, device: str) -> int:
        if device.startswith("cuda"):
            own = self._own_bytes(device)
            return self.gpu().memory(_index(device))[1] if own is None else own
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")

    def others_bytes(self, device: str) -> int | None:
        if not device.startswith("cuda") or self._namespaced():
            return None
        gpu, index = self.gpu(), _index(device)
        procs = gpu.processes(index)
        if procs is None:
            return None
        ours = self._our_pids(frozenset(pid for pid, _ in procs))
        return others_device_bytes(gpu, index, ours, procs)

    def _our_pids(self, listed: frozenset[int]) -> frozenset[int]:
        """This process and its runners, read from /proc at most once a second (admission asks
        at every step, and /proc on a busy host has thousands of entries), and at once when
        NVML lists a process the last reading did not: a runner started since is ours, and
        counted as another's it would leave no room for the next load (which would wait for a
        change that never comes)."""
        at, pids, seen = self._ours
        now = self._clock()
        if now - at >= FAMILY_TTL_S or not listed <= seen:
            pids = self._family(self._pid)
            self._ours = (now, pids, listed)
        return pids

    def open_device(self, device: str) -> None:
        if device.startswith("cuda"):
            self._cuda.open(device)

    def release(self, device: str) -> None:
        gc.collect()
        if device.startswith("cuda"):
            self._cuda.empty_cache(device)
        # glibc keeps freed heap pages; without this RSS would not fall after an unload and the
        # next load's measured delta would be too small.
        trim = getattr(self._libc, "malloc_trim", None)
        if trim is not None:
            trim(0)

    def mapped_file_bytes(self, device: str, path: Path) -> int:
        if device.startswith("cuda"):
            return 0
        return mapped_file_bytes(path)

    def settle(self) -> None:
        """Freeze the objects alive now out of the collector's sight (`gc.freeze`), once per
        newly imported library. A full collection (each `release`) goes over every object:
        with torch and sentence-transformers imported that is ~440k objects and 0.2 s holding
        the GIL, which stalls every request of every other model at each load and unload;
        frozen, it takes under a millisecond. Only when no model is loaded: a model's object
        graph has reference cycles, and frozen it would never be collected after its unload."""
        if len(sys.modules) <= self._settled_modules:
            return
        gc.collect()
        gc.freeze()
        self._settled_modules = len(sys.modules)


def mapped_file_bytes(path: Path, maps: str = "/proc/self/maps") -> int:
    """The sum of the sizes of this process's mappings of the file `path` or of files under it
    (`file_mappings`). Only a model's own files: a figure for the whole process would move with
    whatever else maps or unmaps meanwhile (another device's load, shared memory)."""
    return sum(end - start for start, end in file_mappings(path, maps))


def file_mappings(path: Path, maps: str = "/proc/self/maps") -> frozenset[tuple[int, int]]:
    """The address ranges listed in `maps` (its lines: range, perms, offset, device, inode,
    name) of the file `path` or of files under the directory `path`: by name (a file since
    deleted included), or by device and inode, so that a file that is a symlink (a Hugging Face
    cache's snapshot into its blobs) counts as its target. None where `maps` cannot be read
    (not Linux). /proc/self/maps, not smaps: smaps walks every page table to count resident
    pages, 50 ms with torch loaded; maps reads in a millisecond."""
    root = str(path.resolve())
    ids = set()
    for file in (path.rglob("*") if path.is_dir() else (path,)):
        with contextlib.suppress(OSError):
            st = file.stat()  # a symlink's target
            ids.add((st.st_dev, st.st_ino))
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return frozenset()
    ranges = set()
    for line in lines:
        fields = line.rstrip("\n").split(maxsplit=5)
        if len(fields) < 6:
            continue
        name = fields[5].removesuffix(" (deleted)")
        major, _, minor = fields[3].partition(":")
        if (name == root or name.startswith(root + "/")
                or (os.makedev(int(major, 16), int(minor, 16)), int(fields[4])) in ids):
            start, _, end = fields[0].partition("-")
            ranges.add((int(start, 16), int(end, 16)))
    return frozenset(ranges)


# Where NVIDIA's driver shows itself, in a container as on a host. Without it there is no CUDA
# device, and no engine is asked whether it could use one (asking torch would cost an import of
# over a second and ~150 MiB held for the life of the process).
NVIDIA_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia/version")


def nvidia_driver(driver_paths: tuple[str, ...] = NVIDIA_DRIVER_PATHS) -> bool:
    """Whether NVIDIA's driver is there: the first question before `device = "auto"` asks an
    engine whether its build can use a CUDA device (`Engine.cuda`). Imports nothing."""
    return any(os.path.exists(p) for p in driver_paths)


def _index(device: str) -> int:
    _, _, idx = device.partition(":")
    return int(idx or 0)
