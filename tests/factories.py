"""Test factories, shared by every test module: configs, servers (in this process and as
`packserve serve` processes), and small scheduler and policy fixtures.

No sleeping to wait: tests wait on events or loop state with timeouts (`TIMEOUT` bounds every
wait; it is never a timing assertion).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn

from packserve import backends
from packserve.api.app import create_app
from packserve.backends import check_weights
from packserve.backends.fake import FakeBackend, FakeControl, held_bytes
from packserve.config import Config, ModelSpec, load_config
from packserve.core.backend import Backend, LoadSpec, Runner
from packserve.core.events import Event, EvictEvent, LoadEvent, LoadFailedEvent
from packserve.core.policy import ResidentView, VictimPolicy, lru_by_bytes
from packserve.core.scheduler import (
    DeviceBudget,
    Entry,
    FootprintStore,
    ModelStatus,
    Scheduler,
)
from packserve.metrics.telemetry import Telemetry
from packserve.server import build_keyring, build_scheduler, build_telemetry
from packserve.sources import resolve_source
from packserve.types import State, Task

# ---------------------------------------------------------- the default catalog on the test device

TEST_DEVICE = os.environ.get("PACKSERVE_TEST_DEVICE", "cpu")


def default_config(data_dir: Path, **overrides: object) -> Config:
    """The built-in catalog with its data in `data_dir`, on the test device."""
    config = load_config(None, **overrides)  # type: ignore[arg-type]
    return config.model_copy(update={
        "server": config.server.model_copy(update={"data_dir": str(data_dir)}),
        "models": [m.model_copy(update={"device": TEST_DEVICE}) for m in config.models],
    })


def catalog_path(name: str, tmp: Path, *, converted: bool = False) -> Path:
    """The weights file of the default catalog's entry `name`, resolved as the server would
    (an assembled GGUF lands under `tmp`); with `converted`, what its engine serves from it
    (MiniLM's safetensors folder converted to the GGUF its runner reads)."""
    spec = next(m for m in load_config(None).models if m.name == name)
    path = resolve_source(spec.source, base_dir=tmp, models_dir=tmp / "models", roots=None)
    engine = backends.get(spec.backend)
    if converted and engine.convert is not None:  # MiniLM's folder -> the GGUF its runner reads
        path = engine.convert(path, tmp / "models", None)
    return path


# ----------------------------------------- servers in this process (a real uvicorn on a free port)

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


# ------------------------------------------ scheduler tests: fake models, one cpu device, requests

MIB = 1 << 20
GIB = 1 << 30
TIMEOUT = 10.0  # seconds; a bound on waiting for events, never a timing assertion

T = TypeVar("T")


class FakeProbe:
    """A MemoryProbe that reads what the fake backends hold, so measured = the backend's
    weight bytes (and a warm copy keeps its declared `warm` bytes)."""

    def __init__(self) -> None:
        self.releases = 0
        self.settles = 0

    def total_bytes(self, device: str) -> int:
        return 64 * GIB

    def used_bytes(self, device: str) -> int:
        return GIB + held_bytes(device)

    def release(self, device: str) -> None:
        self.releases += 1

    def settle(self) -> None:
        self.settles += 1

    def mapped_file_bytes(self, device: str, path: Path) -> int:
        return 0


class Clock:
    """A scheduler clock that moves only when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Sleeper:
    """An injected `sleep` (the pin retries' backoff timer): records each delay and returns
    only when the test calls `wake()`."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._wake = asyncio.Event()
        self._called = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        self._called.set()
        self._called = asyncio.Event()
        await self._wake.wait()

    async def asleep(self, count: int) -> None:
        """Return once `count` sleeps have started."""
        async with asyncio.timeout(TIMEOUT):
            while len(self.delays) < count:
                await self._called.wait()

    def wake(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()


class Recorder:
    """An event sink that remembers every event and lets a test await one."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.gauges: list[int] = []  # `gauge()` at each event
        self.gauge: Callable[[], int] = lambda: 0
        self._changed = asyncio.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        self.gauges.append(self.gauge())
        self._changed.set()
        self._changed = asyncio.Event()

    def of(self, kind: type[T]) -> list[T]:
        return [e for e in self.events if isinstance(e, kind)]

    def names(self, kind: type[LoadEvent] | type[EvictEvent] | type[LoadFailedEvent]) -> list[str]:
        return [e.model for e in self.of(kind)]

    async def wait_for(self, pred: Callable[[Event], bool]) -> Event:
        async with asyncio.timeout(TIMEOUT):
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                await self._changed.wait()


def entry(
    name: str, mib: int = 100, *, declared_mib: int | None = None, weights: str | None = None,
    pin: bool = False, max_concurrency: int = 32, max_queue: int = 64,
    max_memory: int | None = None, tasks: Sequence[Task] = (Task.EMBED,),
    context_length: int = 0, warm_mib: int | None = None,
) -> Entry:
    """A fake model estimated at `mib` MiB whose backend declares `declared_mib` (default: same)
    and, with `warm_mib`, a warm state that keeps that much.

    Entries with equal `weights` (default: the name) and context share one LoadSpec, hence one
    resident.
    """
    source = f"fake:{declared_mib or mib}MiB" + (f"?warm={warm_mib}MiB" if warm_mib else "")
    spec = ModelSpec(name=name, tasks=list(tasks), backend="fake", source=source, device="cpu",
                     pin=pin, max_concurrency=max_concurrency, max_queue=max_queue,
                     max_memory=max_memory)
    load = LoadSpec(backend="fake", path=Path(weights or name) / source, device="cpu",
                    context_length=context_length)
    return Entry(spec=spec, load=load, bytes_estimated=mib * MIB)


def file_entry(name: str, path: Path, backend: str = "llama-cpp", mib: int = 100) -> Entry:
    """A model whose weights are the real file `path` (its header is checked before a load).
    The harness's factory still builds a fake engine for it, declaring `mib`."""
    spec = ModelSpec(name=name, tasks=[Task.CHAT], backend="llama-cpp", source=str(path),
                     device="cpu")
    load = LoadSpec(backend=backend, path=path, device="cpu", context_length=512)
    return Entry(spec=spec, load=load, bytes_estimated=mib * MIB)


@dataclass
class Harness:
    scheduler: Scheduler
    control: FakeControl
    events: Recorder
    probe: FakeProbe
    clock: Clock
    capacity: int
    built: list[FakeBackend] = field(default_factory=list)
    building: threading.Event = field(default_factory=threading.Event)

    def status(self, name: str) -> ModelStatus:
        (row,) = [m for m in self.scheduler.models() if m.name == name]
        return row

    def state(self, name: str) -> State:
        return self.scheduler.state_of(name)

    def loaded_bytes(self) -> int:
        """What the fake engines really hold now, independent of the scheduler's accounting."""
        return sum(b.weight_bytes() for b in self.built)

    @property
    def used(self) -> int:
        return self.scheduler.devices()[0].used_bytes


def harness(
    entries: Sequence[Entry], budget_mib: int, *, headroom_mib: int = 0,
    clock: Clock | None = None, real_clock: bool = False, store: FootprintStore | None = None,
    load_wait_s: float = 120.0, failure_cooldown_s: float = 30.0,
    sleep: Sleeper | None = None,
    victim_policy: VictimPolicy | Mapping[str, VictimPolicy] = lru_by_bytes,
    check_files: bool = False, warm_tier: bool = False, load_turn: float = 0.0,
) -> Harness:
    """A scheduler over `entries` on one cpu device. Call inside a running event loop.

    Without `check_files` no header check runs before a load, so a load reaches its device
    lock without a trip through a thread, and `drain()` is enough to bring it there.
    """
    control = FakeControl()
    events = Recorder()
    probe = FakeProbe()
    clock = clock or Clock()
    built: list[FakeBackend] = []
    building = threading.Event()

    def factory(spec: LoadSpec) -> Backend:
        backend = FakeBackend(spec)
        if spec.backend != "fake":  # a real file stands behind it; the fake declares the size
            backend.spec = LoadSpec(backend="fake", path=Path(spec.path.stem) / "fake:100MiB",
                                    device=spec.device, context_length=spec.context_length)
            backend.name = "fake:100MiB"
        backend.control = control
        built.append(backend)
        building.set()
        return backend

    scheduler = Scheduler(
        entries, [DeviceBudget("cpu", budget_bytes=budget_mib * MIB,
                               headroom_bytes=headroom_mib * MIB)],
        factory, probe, store, load_wait_s=load_wait_s, failure_cooldown_s=failure_cooldown_s,
        clock=time.monotonic if real_clock else clock, sinks=(events,),
        sleep=sleep or asyncio.sleep, victim_policy=victim_policy,
        check_files=check_weights if check_files else None,
        warm_tier={"cpu"} if warm_tier else (), load_turn=load_turn,
    )
    h = Harness(scheduler=scheduler, control=control, events=events, probe=probe, clock=clock,
                capacity=(budget_mib - headroom_mib) * MIB, built=built, building=building)
    events.gauge = lambda: max(h.used, h.loaded_bytes())
    return h


def run(coro: Coroutine[object, object, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 4 * TIMEOUT))


async def use(scheduler: Scheduler, name: str, task: Task = Task.EMBED, *,
              request_id: str = "", slo_s: float | None = None) -> Runner:
    """One request: take a lease, return the runner it lent."""
    async with scheduler.acquire(name, task, request_id=request_id, slo_s=slo_s) as lease:
        assert lease.model == name
        return lease.runner


def backend_of(runner: Runner) -> Backend:
    """The backend a runner runs (white box: which load a lease lent)."""
    return runner._backend


async def drain(rounds: int = 50) -> None:
    """Let every ready task run until it blocks. Yields to the loop; never waits on time."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class Hold:
    """A request that keeps its lease until `release()`."""

    def __init__(self, scheduler: Scheduler, name: str, request_id: str = "") -> None:
        self._acquired = asyncio.Event()
        self._release = asyncio.Event()
        self.task = asyncio.create_task(self._run(scheduler, name, request_id))

    async def _run(self, scheduler: Scheduler, name: str, request_id: str) -> None:
        async with scheduler.acquire(name, Task.EMBED, request_id=request_id):
            self._acquired.set()
            await self._release.wait()

    async def acquired(self) -> Hold:
        waiter = asyncio.create_task(self._acquired.wait())
        await asyncio.wait({waiter, self.task}, timeout=TIMEOUT,
                           return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self.task.done():
            self.task.result()  # re-raise what went wrong
        assert self._acquired.is_set(), "lease not granted in time"
        return self

    async def release(self) -> None:
        self._release.set()
        await asyncio.wait_for(self.task, TIMEOUT)


async def hold(scheduler: Scheduler, name: str, request_id: str = "") -> Hold:
    return await Hold(scheduler, name, request_id).acquired()


# ------------------------------------------------------------------- policy tests: plain residents

def resident(
    key: str, mib: int, *, last_used: float = 0.0, pinned: bool = False, in_flight: int = 0,
    state: State = State.HOT, device: str = "cpu", models: Sequence[str] = (),
    reload_s: float = 0.0, rate_per_s: float = 0.0, warm_mib: int | None = None,
    restore_s: float = 0.0,
) -> ResidentView:
    """A resident of `mib` MiB; `models` defaults to one catalog name equal to the key. With
    `warm_mib`: a hot one goes warm when evicted and keeps that much; a warm one holds it."""
    return ResidentView(
        key=key, device=device, state=state, bytes=mib * MIB, pinned=pinned,
        in_flight=in_flight, last_used=last_used, models=tuple(models) or (key,),
        reload_s=reload_s, rate_per_s=rate_per_s, goes_warm=warm_mib is not None,
        keeps_bytes=(warm_mib or 0) * MIB, restore_s=restore_s,
        warm_bytes=(warm_mib or 0) * MIB if state is not State.HOT else 0,
    )


def cold(key: str, mib: int, *, models: Sequence[str] = ()) -> ResidentView:
    """A target that is not loaded yet."""
    return resident(key, mib, state=State.COLD, models=models)


# ------------------------------------------------------------------ pools (packserve pool, Ray)

@dataclass
class RayCluster:
    """A local Ray cluster of CPU nodes, each with one `packserve_node` resource (so each holds
    one pool replica), started in this process by `ray.cluster_utils.Cluster`."""

    address: str
    nodes: list[Any]
    cluster: Any


@contextlib.contextmanager
def ray_cluster(nodes: int = 2, cpus: int = 2) -> Iterator[RayCluster]:
    """Start the cluster and connect this process to it (to kill replicas); shut all down on
    exit. Imports Ray here only: a test that never asks for a pool never loads it."""
    import ray
    from ray.cluster_utils import Cluster

    store = 80 * MIB
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": cpus, "resources": {"packserve_node": 1}, "object_store_memory": store,
        "include_dashboard": False})
    added = [cluster.head_node]
    for _ in range(nodes - 1):
        added.append(cluster.add_node(num_cpus=cpus, resources={"packserve_node": 1},
                                      object_store_memory=store))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        yield RayCluster(cluster.address, added, cluster)
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]


def pool_section(address: str, replicas: int, **extra: object) -> str:
    """A `[pool]` table: `replicas` replicas, one per cluster node, quick stats."""
    settings: dict[str, object] = {
        "address": address, "min_replicas": replicas, "max_replicas": replicas,
        "replica_cpus": 0, "stats_period_s": 0.2, **extra}
    lines = [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    return "[pool]\n" + "\n".join(lines) + "\nreplica_resources = { packserve_node = 1 }\n"


@contextlib.contextmanager
def pool_process(config: Path, tmp: Path, timeout: float = 240.0) -> Iterator[Served]:
    """Run `packserve pool --config CONFIG` on a free port until its entry point is ready;
    SIGTERM it on exit (it deletes its replicas)."""
    port = free_port()
    log_path = tmp / f"pool-{port}.log"
    cmd = [sys.executable, "-m", "packserve.cli", "pool", "--config", str(config),
           "--port", str(port)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    served = Served(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)
    try:
        served.wait_ready(timeout)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
