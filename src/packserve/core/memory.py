"""Memory probes: what a device has, what this process uses on it, and giving freed memory back.

The scheduler receives a `MemoryProbe` in its constructor; tests pass a fake.
On `cpu` the figure is this process's resident set (RSS), so the budget governs the RAM that
model weights and caches take. On `cuda:N` it is the device's used memory (NVML's view, through
torch), which counts llama.cpp's allocations as well as torch's.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import sys
from pathlib import Path
from typing import Protocol


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

    def mapped_file_bytes(self, device: str, path: Path) -> int:
        """Bytes of the files at or under `path` (a model's weights) mapped into this process,
        resident or not. Called before and after a model gives its weights back (the warm
        tier): weights mapped from their file count in a model's bytes whether or not they were
        ever read, and unmapping them frees them all, where `used_bytes` shows only the pages
        that were read."""
        ...


class SystemProbe:
    """The real probe: /proc on CPU, torch.cuda on GPUs."""

    def __init__(self) -> None:
        libc_name = ctypes.util.find_library("c")
        self._libc = ctypes.CDLL(libc_name) if libc_name else None
        self._settled_modules = 0  # len(sys.modules) when the live objects were last frozen

    def total_bytes(self, device: str) -> int:
        if device.startswith("cuda"):
            import torch

            return int(torch.cuda.get_device_properties(_index(device)).total_memory)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def used_bytes(self, device: str) -> int:
        if device.startswith("cuda"):
            import torch

            free, total = torch.cuda.mem_get_info(_index(device))
            return int(total - free)
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")

    def release(self, device: str) -> None:
        gc.collect()
        if device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
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
