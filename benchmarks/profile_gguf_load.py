"""Where a llama-server start on a GGUF spends its time: starts `llama-server` (the runners'
binary, `router.direct_argv` with the runners' `--fit off`) on the file REPEATS times, one after
another, and times each from the spawn to the first 200 from `/health` (polled every 10 ms),
then splits that time by the server's own timestamped log (`--log-timestamps`): up to its
"loading model" line (process start, options, the HTTP listener), up to llama.cpp's "llama
threadpool init" (the GGUF's header and metadata, the vocabulary, the tensors, and the context),
up to "initializing, n_slots" (the warm-up decode), up to "model loaded" (the slots), and the
rest until `/health` answered. Prints the medians as JSON. docs/reliability.md ("Patches") and
docs/tuning.md quote its earlier form, which profiled `llama_model_load_from_file` of
llama-cpp-python in-process under py-spy `--native` (removed with that engine).

    .venv/bin/python -m benchmarks.profile_gguf_load \\
        ~/.cache/packserve/models/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import router
from benchmarks.common import free_port, stop

# (phase, the log line that ends it), in the order the server logs them
PHASES = (
    ("process start, options, HTTP listener", "load_model: loading model"),
    ("model load: header, metadata, vocabulary, tensors; context", "llama threadpool init"),
    ("warm-up decode", "load_model: initializing, n_slots"),
    ("slots", "model loaded"),
)
HEALTH = "until /health answers 200"
# `--log-timestamps`: minutes.seconds.milliseconds.microseconds since the log began (at start)
STAMP = re.compile(r"^(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) ")


def log_seconds(line: str) -> float | None:
    m = STAMP.match(line)
    if m is None:
        return None
    minutes, seconds, ms, us = (int(g) for g in m.groups())
    return minutes * 60 + seconds + ms / 1e3 + us / 1e6


def phases(log: str, ready_s: float) -> dict[str, float]:
    """Seconds per phase of one start from its log, the last one up to `ready_s` (the client's
    spawn-to-200); a phase whose line is missing is left out (its time goes to the next)."""
    out: dict[str, float] = {}
    lines = log.splitlines()
    before = 0.0
    for name, marker in PHASES:
        at = next((s for line in lines if marker in line
                   and (s := log_seconds(line)) is not None), None)
        if at is not None:
            out[name] = at - before
            before = at
    out[HEALTH] = ready_s - before
    return out


def start_once(argv: list[str], log: Path) -> float:
    """Spawn `argv` (short of `--port`), wait for /health 200, stop it: seconds to the 200."""
    port = free_port()
    with log.open("wb") as sink:
        t0 = time.perf_counter()
        proc = subprocess.Popen([*argv, "--port", str(port)], stdin=subprocess.DEVNULL,
                                stdout=sink, stderr=sink)
    try:
        with httpx.Client(timeout=5) as c:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {proc.returncode}; see {log}")
                with contextlib.suppress(httpx.TransportError):
                    if c.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        return time.perf_counter() - t0
                if time.perf_counter() - t0 > 300:
                    raise RuntimeError(f"llama-server was not ready within 300 s; see {log}")
                time.sleep(0.01)
    finally:
        stop(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    try:
        exe = router.binary()
    except router.Unavailable as exc:
        parser.error(str(exc))
    argv = router.direct_argv(exe, args.gguf.expanduser(), router.CTX, "--fit", "off",
                              "--log-timestamps", "--log-prefix")
    ready: list[float] = []
    split: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        for _ in range(args.repeats):
            ready.append(start_once(argv, log))
            split.append(phases(log.read_text("utf-8", "replace"), ready[-1]))
    names = [n for n, _ in PHASES if all(n in s for s in split)] + [HEALTH]
    medians = {n: round(statistics.median(s.get(n, 0.0) for s in split), 4) for n in names}
    print(json.dumps({"gguf": str(args.gguf), "repeats": args.repeats, "argv": argv,
                      "ready_s_median": round(statistics.median(ready), 4),
                      "ready_s": [round(s, 4) for s in ready],
                      "phase_s_median": medians}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
