"""The benchmarks' CPU accounting: /proc snapshots and py-spy's collapsed stacks as tables."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.cpu import CpuSnapshot, top_frames, worker_pid


def test_top_frames_ranks_functions_by_self_samples(tmp_path: Path) -> None:
    folded = tmp_path / "p.folded"
    folded.write_text(
        "main (/venv/lib/python3.11/site-packages/app.py:1);encode (/venv/lib/python3.11/"
        "site-packages/st/model.py:9);forward (/venv/lib/python3.11/site-packages/nn.py:3) 30\n"
        "main (/venv/lib/python3.11/site-packages/app.py:1);dumps (/usr/lib/python3.11/"
        "json/encoder.py:200) 10\n"
        "main (/venv/lib/python3.11/site-packages/app.py:1);encode (/venv/lib/python3.11/"
        "site-packages/st/model.py:9);forward (/venv/lib/python3.11/site-packages/nn.py:3) 20\n"
        "main (/venv/lib/python3.11/site-packages/app.py:1);EpollSelector.select (/usr/lib/"
        "python3.11/selectors.py:468) 90\n"
        "garbage line\n")
    rows = top_frames(folded, n=5)
    assert [(r["function"], r["samples"]) for r in rows] == [
        ("forward (nn.py:3)", 50), ("dumps (json/encoder.py:200)", 10)]
    assert abs(rows[0]["share"] - 50 / 60) < 1e-9
    assert top_frames(tmp_path / "missing.folded") == []


def test_a_snapshot_splits_a_workers_threads_from_its_loop(tmp_path: Path) -> None:
    # A stand-in "front" whose child runs a module named packserve.worker: a thread that
    # spins while the main thread sleeps.
    pkg = tmp_path / "packserve"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "worker.py").write_text(
        "import threading, time\n"
        "def spin():\n    while True: pass\n"
        "threading.Thread(target=spin, daemon=True).start()\ntime.sleep(60)\n")
    front = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-m', "
         "'packserve.worker'])"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    try:
        deadline = time.monotonic() + 10
        while worker_pid(front.pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker_pid(front.pid) is not None
        before = CpuSnapshot.take(front.pid)
        time.sleep(1.0)
        ms = before.per_request_ms(CpuSnapshot.take(front.pid), 1)
    finally:
        worker = worker_pid(front.pid)
        if worker is not None:
            os.kill(worker, 9)
        front.wait(timeout=30)
    # The spinning thread is counted as the worker's other threads, not as its loop (asleep),
    # and not as the front's (waiting for its child).
    assert ms["worker_other"] > 0
    assert ms["worker_loop"] < ms["worker_other"] / 4
    assert ms["front"] < ms["worker_other"] / 4
