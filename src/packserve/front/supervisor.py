"""The front's supervisor: starts the worker process that holds the models, knows which models'
engines are running, charges a crash to them, and starts a new worker.

One worker at a time. Each start is a *generation*; a `Worker` is one generation's process, its
socket and its client. The worker tells the supervisor, over a pipe, when an engine call starts
and ends (packserve.worker.ControlChannel), so the supervisor can say who was running when the
process died, whatever killed it (a native fault, the OOM killer, an operator's kill).

A worker's death is charged to the models whose engine was running, and the crash rule every
engine follows (core.crashes) decides what it costs each: the second charge within
crash_window_s holds the model back for a back-off, the third quarantines it until the window
has passed. This supervisor keeps the charges, hands the back-offs and quarantines to each new
worker (PACKSERVE_QUARANTINE: each with its seconds left), and forgets them, with the model's
charges, when the worker reports on the pipe that an operator's load of that model succeeded
(`operator_loaded`). The deaths of runner processes are the worker's scheduler's to judge; the
worker reports each on the pipe (`exit`, with its verdict): `on_runner_crash` counts it, and
the supervisor keeps it (apart from the worker's charges: a runner's model is not the worker's
death, nor the other way round) and holds its verdict, so that the next worker is told both
(PACKSERVE_DEATHS: each model's runner deaths, so many seconds ago; PACKSERVE_QUARANTINE) and
a worker's restart gives no model a clean slate.

Invariants: everything here runs on the front's event loop; `Supervisor.current` is the newest
generation; a `Worker.dead` future is resolved exactly once, after the process has exited and
its pipe has been read to the end, so a crash's charge never misses a line written before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from packserve import backoff
from packserve.config import Config
from packserve.core import crashes
from packserve.front import upstream
from packserve.worker import (
    ENV_CONFIG,
    ENV_CONTROL_FD,
    ENV_DEATHS,
    ENV_FRONT_PID,
    ENV_QUARANTINE,
    ENV_SOCKET,
    EXIT_CONFIG,
)

log = logging.getLogger("packserve.front")
_event_log = logging.getLogger("packserve.events")

# Restarts of a worker that dies before it answers, or within STABLE_S of answering, back off
# from this, doubling, to the cap; a worker that served longer is replaced at once.
RESTART_BACKOFF_S = (0.5, 30.0)
STABLE_S = 30.0
# A worker that does not answer its deep probe within PING_S, MISSES times in a row, is hung
# (stopped, its loop blocked): it is killed, and its death charged like a crash. One whose
# scheduler says it is wedged (a load or a device lock past load_timeout_s) is killed at once,
# charged to the models whose load hung.
PING_S, MISSES = 5.0, 4
DEEP_PROBE_S = 2.0  # how long /healthz/deep waits for the worker's reading
GENERATION_TASKS = frozenset({"chat", "complete"})


class WorkerState(StrEnum):
    STARTING = "starting"  # spawned, not answering yet
    UP = "up"
    RESTARTING = "restarting"  # died; a new one is on its way
    STOPPED = "stopped"


@dataclass(frozen=True)
class Running:
    """An engine call the worker said was running: a request's, or a load's (rid empty)."""

    model: str
    task: str  # chat, complete, embed, rerank, or "load"


@dataclass(frozen=True)
class Crash:
    """A worker's death, and whom it is charged to."""

    generation: int
    pid: int
    cause: str  # "SIGSEGV", "SIGKILL", "exit status 1"
    at: float  # wall clock
    running: dict[str, Running]  # request id -> what it was running, at the moment of death
    charged: tuple[str, ...]  # models whose engine call (or load) was running
    quarantined: tuple[str, ...]  # its third charge within crash_window_s

    def fails(self, rid: str) -> Running | None:
        """The engine call `rid` was running if it cannot be sent again: a generation (not safe
        to repeat: it may have streamed, and sampling is not repeatable). Embeddings and
        reranks are safe to repeat; requests that were queued or waiting for a load too."""
        run = self.running.get(rid)
        return run if run is not None and run.task in GENERATION_TASKS else None

    def as_dict(self) -> dict[str, object]:
        return {"generation": self.generation, "pid": self.pid, "signal": self.cause,
                "ts": round(self.at, 3), "models": list(self.charged),
                "quarantined": list(self.quarantined),
                "requests_running": sorted(self.running)}


@dataclass(eq=False)
class Worker:
    """One generation of the worker process."""

    generation: int
    proc: asyncio.subprocess.Process
    socket_path: Path
    started_at: float
    # Called with a model's name when the worker reports that an operator's load of it succeeded.
    on_operator_load: Callable[[str], None]
    # Called with a runner's models ("a+b"), its death's cause, what it was doing and the crash
    # rule's verdict when the worker reports one.
    on_runner_exit: Callable[[str, str, str, crashes.Verdict], None] = \
        lambda _model, _cause, _doing, _verdict: None
    up: asyncio.Event = field(default_factory=asyncio.Event)
    up_at: float = 0.0
    dead: asyncio.Future[Crash | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    running: dict[str, Running] = field(default_factory=dict)
    loading: dict[str, int] = field(default_factory=dict)
    pipe_done: asyncio.Event = field(default_factory=asyncio.Event)
    pending: str = ""  # what it said it is busy with before it can serve (first-start work)
    wedged: tuple[str, ...] | None = None  # killed as wedged: the models whose load hung
    # kept-alive connections; closed when it dies
    pool: upstream.WorkerConnections = field(init=False)

    def __post_init__(self) -> None:
        self.pool = upstream.WorkerConnections(str(self.socket_path))

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def call(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        """The front's own request to this worker (not a client's): status and body. Raises
        `UpstreamError`; the caller bounds it with `asyncio.timeout`."""
        return await upstream.call(self.pool, method, path, body)

    def on_line(self, line: bytes) -> None:
        try:
            self._on_line(line)
        except (ValueError, AttributeError, KeyError, TypeError):  # the pipe's reader goes on
            log.error("unreadable control line from worker %d: %r", self.generation, line[:200])

    def _on_line(self, line: bytes) -> None:
        msg = json.loads(line)
        kind = msg.get("k")
        if kind == "start":
            self.running[msg["rid"]] = Running(model=msg["model"], task=msg["task"])
        elif kind == "end":
            self.running.pop(msg["rid"], None)
        elif kind == "pending":
            self.pending = str(msg.get("what", ""))
        elif kind == "load":
            self.loading[msg["model"]] = self.loading.get(msg["model"], 0) + 1
        elif kind == "loaded":
            left = self.loading.get(msg["model"], 0) - 1
            if left > 0:
                self.loading[msg["model"]] = left
            else:
                self.loading.pop(msg["model"], None)
        elif kind == "operator_loaded":
            self.on_operator_load(msg["model"])
        elif kind == "exit":
            model, cause, doing = str(msg["model"]), str(msg["signal"]), str(msg["doing"])
            verdict = crashes.Verdict(crashes.Action(msg["action"]), float(msg["for_s"]),
                                      int(msg["deaths"]))
            self.on_runner_exit(model, cause, doing, verdict)


class Supervisor:
    """Starts, watches and restarts the worker. Construct, then `await start()` on the loop."""

    def __init__(self, config: Config, *, python: str = sys.executable,
                 on_crash: Callable[[Crash], None] | None = None,
                 on_runner_crash: Callable[[str, str], None] | None = None,
                 on_start: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 ping_s: float = PING_S, misses: int = MISSES) -> None:
        self.config = config
        self._python = python
        self._on_crash = on_crash
        self._on_runner_crash = on_runner_crash
        self._on_start = on_start
        self._ping_s, self._misses = ping_s, misses
        self._clock = clock
        self._dir = Path(tempfile.mkdtemp(prefix="packserve-"))
        self._generation = 0
        self.current: Worker | None = None
        self.state = WorkerState.STOPPED
        self._stopping = False
        self._early_deaths = 0
        self.crashes: deque[Crash] = deque(maxlen=50)
        self._charges: dict[str, deque[float]] = {}
        self._runner_deaths: dict[str, deque[float]] = {}  # the worker's scheduler judges them
        self.quarantined: dict[str, str] = {}
        # model -> (the crash rule's action, until when on this clock)
        self._held: dict[str, tuple[crashes.Action, float]] = {}
        self.config_error: str | None = None  # the worker refused its config at start
        self.refused = asyncio.Event()  # set with config_error
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self._spawn()

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the worker (it unloads its models and exits), then SIGKILL it after
        `grace_s` (0: at once)."""
        self._stopping = True
        worker = self.current
        self.state = WorkerState.STOPPED
        self._notify()
        if worker is not None and worker.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                if grace_s > 0:
                    worker.proc.terminate()
                else:
                    worker.proc.kill()
            try:
                await asyncio.wait_for(worker.proc.wait(), max(grace_s, 1.0))
            except TimeoutError:
                log.warning("worker %d did not stop within %.0fs; killing it", worker.pid,
                            grace_s)
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()
                await worker.proc.wait()
        if worker is not None:
            with contextlib.suppress(TimeoutError):  # let _watch resolve `dead` and clean up
                await asyncio.wait_for(asyncio.shield(worker.dead), 3.0)
        for task in list(self._tasks):
            task.cancel()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def wait_up(self, within_s: float) -> Worker | None:
        """The current worker once it answers; None if none does within `within_s` or we stop."""
        deadline = self._clock() + within_s
        while not self._stopping:
            worker = self.current
            if worker is not None and worker.up.is_set() and not worker.dead.done():
                return worker
            left = deadline - self._clock()
            if left <= 0:
                return None
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)
        return None

    async def death_of(self, worker: Worker, within_s: float = 5.0) -> Crash | None:
        """Wait for `worker` to be confirmed dead (a connection error usually comes first)."""
        try:
            return await asyncio.wait_for(asyncio.shield(worker.dead), within_s)
        except TimeoutError:
            raise WorkerAlive(worker.pid) from None

    def _operator_loaded(self, load: str) -> None:
        """A worker reported that an operator's load succeeded (`load`: every name of it,
        "a+b"): they are no longer held back, their charges and deaths are forgiven."""
        self.forget(load.split("+"), "an operator's load")

    def forget(self, models: Iterable[str], why: str) -> None:
        """Forget what the crash rule holds against `models`: their charges, runner deaths,
        back-offs and quarantines (an operator loaded them; a reload removed them or gave
        them new weights)."""
        for model in models:
            if self.quarantined.pop(model, None) is not None:
                log.info("%s: quarantine lifted by %s", model, why)
            self._held.pop(model, None)
            self._charges.pop(model, None)
            self._runner_deaths.pop(model, None)

    def hold(self, model: str, verdict: crashes.Verdict, reason: str) -> None:
        """Apply the crash rule's `verdict` on `model`: from the next worker on, it backs off
        or is quarantined (with `reason`) for the verdict's seconds."""
        if verdict.action is crashes.Action.RELOAD:
            return
        if verdict.action is crashes.Action.QUARANTINE:
            self.quarantined[model] = reason
        else:
            self.quarantined.pop(model, None)
        self._held[model] = (verdict.action, self._clock() + verdict.delay_s)

    def _runner_exit(self, model: str, cause: str, doing: str,
                     verdict: crashes.Verdict) -> None:
        """A runner of `model` ("a+b": one load of both) died, and the worker's scheduler
        judged it: counted, kept under each name and held (`hold`) for the next worker. The
        worker's count is the truth: deaths it no longer counts (forgotten by an operator's
        load, or out of the window) are dropped, and a reload verdict (its model was serving,
        so nothing held it back) ends what was held."""
        now = self._clock()
        reason = crashes.quarantine_reason(verdict.deaths, cause, doing)
        for name in model.split("+"):
            times = self._runner_deaths.setdefault(name, deque(maxlen=8))
            times.append(now)
            while len(times) > max(verdict.deaths, 1):
                times.popleft()
            if verdict.action is crashes.Action.RELOAD:
                self._held.pop(name, None)
                self.quarantined.pop(name, None)
            else:
                self.hold(name, verdict, reason)
            if self._on_runner_crash is not None:
                self._on_runner_crash(name, cause)

    def _ages(self) -> dict[str, list[float]]:
        """Each model's runner deaths, as seconds ago: what the next worker is told."""
        now = self._clock()
        return {model: [round(now - t, 3) for t in times]
                for model, times in self._runner_deaths.items() if times}

    def _expire(self) -> float:
        """Forget the back-offs and quarantines that have run out; the clock's now."""
        now = self._clock()
        for model, (_action, until) in list(self._held.items()):
            if until <= now:
                del self._held[model]
                self.quarantined.pop(model, None)
        return now

    def _rules(self) -> dict[str, dict[str, object]]:
        """What the next worker is told of each model the crash rule holds back: the action,
        the reason and the seconds left; what has run out is forgotten."""
        now = self._expire()
        return {model: {"action": action.value, "for_s": until - now,
                        "reason": self.quarantined.get(model, "")}
                for model, (action, until) in self._held.items()}

    def view(self) -> dict[str, object]:
        worker = self.current
        now = self._expire()
        return {"state": self.state.value, "pid": worker.pid if worker else None,
                "generation": self._generation, "crashes": len(self.crashes),
                "quarantined": dict(self.quarantined),
                "backing_off": {m: round(until - now, 1) for m, (action, until)
                                in self._held.items()
                                if action is crashes.Action.BACKOFF and until > now}}

    # ------------------------------------------------------------------ internals

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _spawn(self) -> None:
        self._generation += 1
        gen = self._generation
        config_path = self._dir / f"config-{gen}.json"
        config_path.write_text(self.config.model_dump_json(), "utf-8")
        socket_path = self._dir / f"worker-{gen}.sock"
        read_fd, write_fd = os.pipe()
        env = {**os.environ, ENV_CONFIG: str(config_path), ENV_SOCKET: str(socket_path),
               ENV_CONTROL_FD: str(write_fd), ENV_QUARANTINE: json.dumps(self._rules()),
               ENV_DEATHS: json.dumps(self._ages()),
               ENV_FRONT_PID: str(os.getpid())}
        try:
            # Its own session: a Ctrl-C in the terminal reaches the front, which drains and
            # then stops the worker, instead of killing both at once.
            proc = await asyncio.create_subprocess_exec(
                self._python, "-m", "packserve.worker", env=env, pass_fds=(write_fd,),
                start_new_session=True)
        finally:
            os.close(write_fd)
        worker = Worker(generation=gen, proc=proc, socket_path=socket_path,
                        started_at=self._clock(), on_operator_load=self._operator_loaded,
                        on_runner_exit=self._runner_exit)
        self.current = worker
        self.state = WorkerState.STARTING if gen == 1 else WorkerState.RESTARTING
        self._notify()
        log.info("worker %d started (pid %d)", gen, proc.pid)
        if self._on_start is not None:
            self._on_start()
        self._spawn_task(self._read_pipe(worker, read_fd))
        self._spawn_task(self._watch(worker))
        self._spawn_task(self._wait_answering(worker))
        self._spawn_task(self._watchdog(worker))

    async def _read_pipe(self, worker: Worker, fd: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0))
        try:
            while line := await reader.readline():
                worker.on_line(line)
        finally:
            transport.close()
            worker.pipe_done.set()

    async def _wait_answering(self, worker: Worker) -> None:
        while not worker.dead.done() and not self._stopping:
            try:
                async with asyncio.timeout(2.0):
                    status, _ = await worker.call("GET", "/healthz")
                if status == 200:
                    worker.up.set()
                    worker.up_at = self._clock()
                    if self.current is worker:
                        self.state = WorkerState.UP
                    self._notify()
                    log.info("worker %d answering after %.2fs", worker.generation,
                             self._clock() - worker.started_at)
                    return
            except (upstream.UpstreamError, TimeoutError):
                pass
            await asyncio.sleep(0.05)

    async def _watchdog(self, worker: Worker) -> None:
        """Kill a worker that stops answering (SIGSTOP, a blocked loop) or whose scheduler is
        wedged (a load or a device lock held past load_timeout_s): its requests would wait for
        ever. Its death then goes the way of any crash."""
        await worker.up.wait()
        misses = 0
        while not worker.dead.done() and not self._stopping:
            await asyncio.sleep(self._ping_s)
            try:
                async with asyncio.timeout(self._ping_s):
                    status, text = await worker.call("GET", "/internal/liveness")
                live = json.loads(text) if status in (200, 503) else None
                misses = 0 if isinstance(live, dict) else misses + 1
            except (upstream.UpstreamError, TimeoutError, ValueError):
                live, misses = None, misses + 1
            if worker.proc.returncode is not None:
                return
            if isinstance(live, dict) and live.get("restart"):
                worker.wedged = tuple(live.get("wedged", ()))
                log.error("worker %d (pid %d) is wedged: %s; killing it", worker.generation,
                          worker.pid, "; ".join(f"{s['kind']} {s['model'] or s['detail']} on "
                                                f"{s['device']} for {s['seconds']:.0f}s"
                                                for s in live.get("stuck", ())))
            elif misses >= self._misses:
                log.error("worker %d (pid %d) has not answered for %.0fs; killing it",
                          worker.generation, worker.pid, self._ping_s * self._misses)
            else:
                continue
            with contextlib.suppress(ProcessLookupError):
                worker.proc.kill()
            return

    async def _watch(self, worker: Worker) -> None:
        crash: Crash | None = None
        try:
            rc = await worker.proc.wait()
            # Anything the worker forked (its own session) goes with it, so that nothing holds
            # the pipe or the device.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.pid, signal.SIGKILL)
            # The pipe closes when the process is gone; read what it wrote before dying.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.pipe_done.wait(), 2.0)
            if not self._stopping:
                if rc == EXIT_CONFIG and worker.generation == 1 and not worker.up.is_set():
                    self.config_error = "the worker refused its config (see the log above)"
                    self.refused.set()
                    self.state = WorkerState.STOPPED
                    self._stopping = True
                else:
                    crash = self._charge(worker, rc)
        finally:
            worker.pool.close()
            if not worker.dead.done():
                worker.dead.set_result(crash)
            self._notify()
            with contextlib.suppress(OSError):
                worker.socket_path.unlink()
        if crash is None:
            return
        if self._on_crash is not None:
            self._on_crash(crash)
        if worker.up.is_set() and self._clock() - worker.up_at > STABLE_S:
            self._early_deaths, delay = 0, 0.0
        else:
            self._early_deaths += 1
            # the first early death restarts at once, the next ones back off
            delay = backoff.doubling(*RESTART_BACKOFF_S, self._early_deaths - 1) \
                if self._early_deaths > 1 else 0.0
        if delay:
            log.warning("worker %d died %s; next start in %.1fs", worker.generation,
                        "soon after it started" if worker.up.is_set() else "before answering",
                        delay)
            await asyncio.sleep(delay)
        if not self._stopping:
            await self._spawn()

    def _charge(self, worker: Worker, rc: int) -> Crash:
        cause = _cause(rc)
        now = self._clock()
        charged: dict[str, str] = {}
        if worker.wedged is not None:  # killed for a hung load: that alone is charged
            cause = "hung past load_timeout_s"
            charged = dict.fromkeys(worker.wedged, "loading")
        else:
            for run in worker.running.values():
                charged.setdefault(run.model, f"serving {run.task}")
            for label in worker.loading:
                for name in label.split("+"):
                    charged.setdefault(name, "loading")
        quarantined = []
        window = self.config.server.crash_window_s
        if worker.wedged is not None:  # two hung loads are at least load_timeout_s apart
            window += self.config.server.load_timeout_s
        for model, doing in charged.items():
            times = self._charges.setdefault(model, deque(maxlen=8))
            times.append(now)
            verdict = crashes.judge(list(times), window)
            self.hold(model, verdict, f"engine crashed: {cause} while {doing} "
                                      f"({verdict.deaths} times within crash_window_s)")
            if verdict.action is crashes.Action.QUARANTINE:
                quarantined.append(model)
        crash = Crash(generation=worker.generation, pid=worker.pid, cause=cause, at=time.time(),
                      running=dict(worker.running), charged=tuple(charged),
                      quarantined=tuple(quarantined))
        self.crashes.append(crash)
        _event_log.info(json.dumps({"ts": round(crash.at, 3), "kind": "crash",
                                    "signal": cause, "pid": worker.pid,
                                    "models": list(charged), "doing": charged,
                                    "quarantined": quarantined,
                                    "requests_running": sorted(worker.running)},
                                   sort_keys=True))
        log.error("worker %d (pid %d) died: %s; charged: %s%s", worker.generation, worker.pid,
                  cause, ", ".join(f"{m} ({d})" for m, d in charged.items()) or "nobody",
                  f"; quarantined: {', '.join(quarantined)}" if quarantined else "")
        return crash


class WorkerAlive(Exception):
    """A connection to the worker failed, yet the worker did not die."""


def _cause(rc: int) -> str:
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit status {rc}"
