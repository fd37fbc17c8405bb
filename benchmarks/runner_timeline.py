"""Who had the CPU, and who was paused, while a benchmark ran: every 50 ms, each packserve
process's and each llama-server runner's state (R running, S sleeping, T paused by its turn) and
the CPU it used since the last sample, as JSON lines; then a window of it as a table.

    .venv/bin/python -m benchmarks.runner_timeline record OUT.jsonl   # until killed
    .venv/bin/python -m benchmarks.runner_timeline show OUT.jsonl TRACE_JSON FROM_S TO_S

`show` puts the samples on the trace's clock (seconds since its first request, as the trace's
events are), from its JSON (`python -m benchmarks trace --out DIR`: DIR/trace.json). A row per
sample: each process busy or not sleeping, as NAME:STATE:CPU% (100 = one core). Runners are
named by their model's file (`--alias`), the front and worker by their role. docs/engines.md
quotes it for a runner's start beside an embedding burst.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

PERIOD_S = 0.05
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _name(cmd: list[bytes]) -> str | None:
    """The process's name in the timeline, or None if it is not packserve's."""
    if cmd and cmd[0].endswith(b"llama-server"):
        if b"--alias" in cmd:
            return cmd[cmd.index(b"--alias") + 1].decode(errors="replace")[:24]
        return "llama-server"
    if b"packserve.worker" in cmd:
        return "worker"
    if b"benchmarks.policy_server" in cmd:
        return "server"  # bench trace's: scheduler and HTTP in one process
    if any(arg.endswith(b"packserve") for arg in cmd[:2]) and b"serve" in cmd:
        return "front"
    return None


def record(out: Path) -> None:
    with out.open("w") as f:
        while True:
            rows = []
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                try:
                    cmd = Path(entry.path, "cmdline").read_bytes().split(b"\0")
                    name = _name(cmd)
                    if name is None:
                        continue
                    stat = Path(entry.path, "stat").read_text()
                except OSError:
                    continue
                fields = stat[stat.rfind(")") + 2:].split()
                rows.append([int(entry.name), name, fields[0], int(fields[11]) + int(fields[12])])
            f.write(json.dumps({"ts": time.time(), "p": rows}) + "\n")
            f.flush()
            time.sleep(PERIOD_S)


def show(samples: Path, trace_json: Path, start: float, end: float) -> None:
    trace = json.loads(trace_json.read_text())
    policy = next(iter(trace["results"]["policies"].values()))
    first = (policy["load_events"] or policy["restore_events"])[0]
    zero = first["ts"] - first["t"]  # the wall time of the trace's second 0
    last: dict[int, tuple[int, float]] = {}
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        t = sample["ts"] - zero
        cells = []
        for pid, name, state, ticks in sample["p"]:
            before, at = last.get(pid, (ticks, sample["ts"]))
            last[pid] = (ticks, sample["ts"])
            cpu = 100 * (ticks - before) / TICKS_PER_S / max(sample["ts"] - at, PERIOD_S)
            if start <= t <= end and (cpu >= 1 or state not in "SI"):
                cells.append(f"{name}:{state}:{cpu:.0f}")
        if start <= t <= end:
            print(f"{t:8.2f}  " + " ".join(cells))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "record":
        record(Path(sys.argv[2]))
    elif len(sys.argv) == 6 and sys.argv[1] == "show":
        show(Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
