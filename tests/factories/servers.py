"""Servers under test: the real app on uvicorn in this process (`serve`), and `packserve
serve` as processes, the front and its worker (`serve_process`), with small configs of fake
models."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from packserve.api.app import create_app
from packserve.config import Config, load_config
from packserve.core.events import Event
from packserve.core.scheduler import Scheduler
from packserve.metrics.telemetry import Telemetry
from packserve.server import build_keyring, build_scheduler, build_telemetry


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    """A server under test: its URL, its scheduler, and every event it emitted."""

    url: str
    scheduler: Scheduler
    loop: asyncio.AbstractEventLoop
    events: list[Event] = field(default_factory=list)
    telemetry: Telemetry | None = None

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def call(self, coro: object) -> object:
        """Run a coroutine on the server's loop (to poke the scheduler from a test)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)  # type: ignore[arg-type]


def write_config(tmp: Path, text: str) -> Path:
    path = tmp / "packserve.toml"
    path.write_text(text, "utf-8")
    return path


@contextlib.contextmanager
def serve(config: Config, **scheduler_kwargs: object) -> Iterator[Running]:
    """Start packserve for `config` on a free port; stop it on exit."""
    port = free_port()
    ready = threading.Event()
    box: dict[str, object] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        events: list[Event] = []
        scheduler = build_scheduler(config, sinks=(events.append,), **scheduler_kwargs)  # type: ignore[arg-type]
        telemetry = build_telemetry(config, scheduler)
        app = create_app(scheduler, telemetry, max_request_bytes=config.server.max_request_bytes,
                         keys=build_keyring(config), operator_views=config.server.operator_views,
                         compute_priority=config.server.compute_priority, slo=config.server.slo)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="warning", lifespan="on"))
        box.update(scheduler=scheduler, server=server, loop=loop, events=events,
                   telemetry=telemetry)
        ready.set()
        loop.run_until_complete(server.serve())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(timeout=120)
    server = box["server"]
    assert isinstance(server, uvicorn.Server)
    deadline = time.monotonic() + 300
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("packserve did not start")
        time.sleep(0.05)
    running = Running(url=f"http://127.0.0.1:{port}", scheduler=box["scheduler"],  # type: ignore[arg-type]
                      loop=box["loop"], events=box["events"],  # type: ignore[arg-type]
                      telemetry=box["telemetry"])  # type: ignore[arg-type]
    try:
        yield running
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def config_from(tmp: Path, text: str, **overrides: object) -> Config:
    """A Config from TOML text, with data_dir inside `tmp` unless the text sets one."""
    if "data_dir" not in text:
        text = f'[server]\ndata_dir = "{tmp / "data"}"\n' + text if "[server]" not in text \
            else text.replace("[server]", f'[server]\ndata_dir = "{tmp / "data"}"', 1)
    return load_config(write_config(tmp, text), **overrides)  # type: ignore[arg-type]


# --------------------------------------- `packserve serve` as a process (the front and its worker)

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

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels`, from /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line
                                                   for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

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
    config_args = ["--config", str(config)] if config is not None else []
    with cli_process("serve", [*config_args, *args], tmp, ready=wait) as served:
        yield served


@contextlib.contextmanager
def cli_process(verb: str, args: list[str], tmp: Path, *, ready: bool = True,
                ready_s: float = 180.0, stop_s: float = 60.0) -> Iterator[Served]:
    """Run `packserve VERB --port PORT ARGS` on a free port, its output in `tmp`; wait until
    it is ready (within `ready_s`); on exit SIGTERM it, and SIGKILL it if it has not exited
    within `stop_s`."""
    port = free_port()
    log_path = tmp / f"{verb}-{port}.log"
    cmd = [sys.executable, "-m", "packserve.cli", verb, "--port", str(port), *args]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    served = Served(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)
    try:
        if ready:
            served.wait_ready(ready_s)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=stop_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def fake_model(name: str, *extra: str, tasks: str = '["embed"]', backend: str = "fake",
               source: str = "fake:64MiB") -> str:
    """One `[[models]]` entry as TOML; `extra` lines are added as they are."""
    lines = ["[[models]]", f'name = "{name}"', f"tasks = {tasks}", f'backend = "{backend}"',
             f'source = "{source}"', *extra]
    return "\n".join(lines) + "\n"


def cpu_device(budget: str = "2GiB", headroom: str = "1MiB", *extra: str) -> str:
    """The `[devices.cpu]` table as TOML."""
    return "\n".join(["[devices.cpu]", f'memory_budget = "{budget}"',
                      f'headroom = "{headroom}"', *extra]) + "\n"


def chat_body(content: str, model: str = "gen", **extra: object) -> dict[str, object]:
    """A chat request of one user message."""
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def fake_config(tmp: Path, extra: str = "", **server: object) -> Path:
    """Two fake models (a generator and an embedder) for fault-injection tests."""
    settings = {"data_dir": str(tmp / "data"), "drain_s": 10, "crash_window_s": 120, **server}
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in settings.items())
    text = (f"[server]\n{lines}\n" + cpu_device()
            + fake_model("gen", "max_concurrency = 4", tasks='["chat", "complete"]')
            + fake_model("emb", "max_concurrency = 8", source="fake:32MiB") + extra)
    path = tmp / "packserve.toml"
    path.write_text(text, "utf-8")
    return path
