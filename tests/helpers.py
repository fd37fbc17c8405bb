"""Test helpers: a real uvicorn server on a free localhost port, in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn

from packserve.api.app import create_app
from packserve.config import Config, load_config
from packserve.core.events import Event
from packserve.core.scheduler import Scheduler
from packserve.metrics.telemetry import Telemetry
from packserve.server import build_scheduler, build_telemetry


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
        app = create_app(scheduler, telemetry, max_request_bytes=config.server.max_request_bytes)
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
