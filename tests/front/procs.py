"""Test helpers for the front process: `packserve serve` run for real, as a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import free_port


@dataclass
class Served:
    """A `packserve serve` process under test."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def health(self) -> dict[str, object]:
        data = httpx.get(f"{self.url}/healthz", timeout=10).json()
        assert isinstance(data, dict)
        return data

    def worker_pid(self) -> int:
        worker = self.health()["worker"]
        assert isinstance(worker, dict)
        return int(worker["pid"])

    def log(self) -> str:
        return self.log_path.read_text("utf-8", errors="replace")

    def events(self, kind: str) -> list[dict[str, Any]]:
        rows = []
        for line in self.log().splitlines():
            if line.startswith("{") and f'"kind": "{kind}"' in line:
                rows.append(json.loads(line))
        return rows

    def wait_ready(self, timeout: float = 180.0, *, other_than_pid: int | None = None) -> float:
        """Wait for /readyz 200 (from a worker other than `other_than_pid`); seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"packserve exited with {self.proc.returncode}:\n"
                                     + self.log()[-4000:])
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200 and (
                        other_than_pid is None or self.worker_pid() != other_than_pid):
                    return time.monotonic() - t0
            time.sleep(0.05)
        raise AssertionError(f"packserve not ready after {timeout}s:\n" + self.log()[-4000:])

    def post_later(self, path: str, body: dict[str, object],
                   headers: dict[str, str] | None = None) -> Future[httpx.Response]:
        """POST in a background thread; the future holds the response (or the error)."""
        def post() -> httpx.Response:
            with self.client() as c:
                return c.post(path, json=body, headers=headers)
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            return pool.submit(post)
        finally:
            pool.shutdown(wait=False)

    def wait_in_flight(self, model: str, n: int = 1, timeout: float = 60.0) -> None:
        """Wait until the worker has `n` requests of `model` running."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = httpx.get(f"{self.url}/v1/residency", timeout=10).json()["models"]
            if any(r["name"] == model and r["in_flight"] >= n for r in rows):
                return
            time.sleep(0.02)
        raise AssertionError(f"{model} never had {n} requests in flight")


@contextlib.contextmanager
def serve_process(config: Path | None, tmp: Path, *args: str,
                  wait: bool = True) -> Iterator[Served]:
    """Run `packserve serve` on a free port; SIGTERM it (then SIGKILL) on exit."""
    port = free_port()
    log_path = tmp / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "packserve.cli", "serve", "--port", str(port), *args]
    if config is not None:
        cmd[4:4] = ["--config", str(config)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    served = Served(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)
    try:
        if wait:
            served.wait_ready()
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def fake_config(tmp: Path, extra: str = "", **server: object) -> Path:
    """Two fake models (a generator and an embedder) for fault-injection tests."""
    settings = {"data_dir": str(tmp / "data"), "drain_s": 10, "crash_window_s": 120, **server}
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in settings.items())
    text = f"""[server]
{lines}

[devices.cpu]
memory_budget = "2GiB"
headroom = "1MiB"

[[models]]
name = "gen"
tasks = ["chat", "complete"]
backend = "fake"
source = "fake:64MiB"
max_concurrency = 4

[[models]]
name = "emb"
tasks = ["embed"]
backend = "fake"
source = "fake:32MiB"
max_concurrency = 8
{extra}"""
    path = tmp / "packserve.toml"
    path.write_text(text, "utf-8")
    return path
