"""Where a server's CPU goes while a benchmark drives it: CPU seconds per process and thread
from /proc (cheap enough to run during measured rounds), and py-spy profiles reduced to top-N
tables (run outside the measured rounds: sampling costs CPU of its own).

The split that matters on a CPU box: the front (HTTP in, relay to the worker), the worker's
event-loop thread (HTTP, validation, scheduling, JSON) and the worker's other threads (the
engine calls and their compute threads). Each is what the benchmark's requests cost, divided by
the number of requests.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(stat_path: str) -> float:
    """utime + stime of a /proc/.../stat file (a process's or one thread's), in seconds; 0 if
    it is gone."""
    try:
        fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_seconds(pid: int) -> float:
    """User + system CPU time `pid` has used so far, all its threads."""
    return _cpu_s(f"/proc/{pid}/stat")


def worker_pid(front_pid: int) -> int | None:
    """The front's worker: its child that runs `packserve.worker`."""
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{front_pid}/task/{front_pid}/children").read_text().split()
        for child in map(int, children):
            with contextlib.suppress(OSError):
                if b"packserve.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return child
    return None


@dataclass(frozen=True)
class CpuSnapshot:
    front: float
    worker_loop: float  # the worker's main thread: its event loop
    worker_other: float  # every other thread of the worker: engine calls and their compute
    client: float  # this (the benchmark's) process

    @staticmethod
    def take(front_pid: int) -> CpuSnapshot:
        worker = worker_pid(front_pid)
        loop = other = 0.0
        if worker is not None:
            loop = _cpu_s(f"/proc/{worker}/task/{worker}/stat")
            other = cpu_seconds(worker) - loop
        times = os.times()
        return CpuSnapshot(front=cpu_seconds(front_pid), worker_loop=loop,
                           worker_other=other, client=times.user + times.system)

    def per_request_ms(self, later: CpuSnapshot, requests: int) -> dict[str, float]:
        """CPU milliseconds per request between this snapshot and `later`."""
        n = max(1, requests)
        return {name: 1000 * (getattr(later, name) - getattr(self, name)) / n
                for name in ("client", "front", "worker_loop", "worker_other")}


# ----------------------------------------------------------------------- py-spy


def py_spy() -> str | None:
    """py-spy next to this interpreter (the venv's), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


@contextlib.contextmanager
def profiled(pids: dict[str, int], out: Path, rate: int = 250) -> Iterator[dict[str, Path]]:
    """Sample each named process with py-spy while the block runs (raw collapsed stacks, GIL
    holders and idle threads left out); yields the files it writes."""
    exe = py_spy()
    files = {name: out / f"{name}.folded" for name in pids}
    if exe is None:
        yield {}
        return
    out.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([exe, "record", "--format", "raw", "--rate", str(rate),
                               "--nonblocking", "--output", str(files[name]),
                               "--pid", str(pid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, pid in pids.items()]
    try:
        yield files
    finally:
        for p in procs:  # py-spy writes its file when interrupted
            p.send_signal(2)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


_SITE = re.compile(r" \(/(?:\S*/site-packages/|\S*?/lib/python3\.\d+/)")


# Waiting, which py-spy samples as running when a thread waits in a system call with the GIL
# released (an event loop in epoll_wait): left out of the tables.
_WAITS = ("EpollSelector.select (", "Condition.wait (")


def top_frames(folded: Path, n: int = 12) -> list[dict[str, Any]]:
    """The `n` functions with the most samples on top of the stack (self time), with their
    share of all samples but the waits, from a py-spy raw (collapsed) file."""
    own: collections.Counter[str] = collections.Counter()
    total = 0
    with contextlib.suppress(OSError):
        for line in folded.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            leaf = _SITE.sub(" (", stack.rsplit(";", 1)[-1])
            if leaf.startswith(_WAITS):
                continue
            own[leaf] += int(count)
            total += int(count)
    return [{"function": name, "share": c / total, "samples": c}
            for name, c in own.most_common(n)] if total else []
