"""The llama-server runners a test started, found by their parent and command line in /proc."""

from __future__ import annotations

import os
from pathlib import Path


def runners(parent: int | None = None) -> dict[int, str]:
    """The live llama-server children of `parent` (default: this process): pid -> command
    line."""
    parent = os.getpid() if parent is None else parent
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
            command = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if (int(fields["PPid"]) == parent and "llama-server" in command
                and fields["State"].split()[0] != "Z"):
            out[int(name)] = command
    return out


def cpu_ticks(pid: int) -> int:
    """The CPU time (user + system, in clock ticks) process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def runner_of(model_file: str, parent: int | None = None) -> int:
    """The pid of the one runner of `parent` whose command line names `model_file`."""
    (pid,) = [p for p, command in runners(parent).items() if model_file in command]
    return pid
