"""Runner processes: each engine load that runs outside the worker is a child process of it,
and this module is their one supervisor, from the spawn to the reaped exit.

- `RunnerHost`: what the worker's runners share, built once by the server (`server.
  build_scheduler`) and handed to the engines through the backend factory: the thread that
  spawns children, the CPU turns (`Turns`), the folder their logs are kept in and the start
  deadline (`load_timeout_s`). A backend built alone (the tests, the benchmarks) gets
  `RunnerHost.default()`, made on first use. Nothing here starts a thread at import.
- `Child`: one process: its folder (the unix socket it serves on: no port to race for), its
  log file, its start and readiness, its stop, its resident set, and its reaper, a thread
  that waits for it and reports its exit once and at once, with the status, the signal, the
  OOM killer's evidence and the log's last lines (`core.backend.EngineExit`). The scheduler
  then takes its model out of service and loads it again through its one load path.
- `Turns`: runners on a CPU compute one at a time while several are busy, by deadline.

An engine module (`backends.llama_server`) keeps only what is its own: its command line, its
routes, its JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from packserve.core.backend import EngineDied, EngineExit, ExitReport
from packserve.core.compute import moved_on
from packserve.logs import tail
from packserve.pdeath import die_with_parent

log = logging.getLogger(__name__)

# A runner's log is kept beside its model's last few (the newest KEEP_LOGS), each trimmed to
# its last TRIM_TO bytes once it passes TRIM_AT: a runner logs its warnings and errors only.
KEEP_LOGS = 5
TRIM_AT, TRIM_TO = 16 << 20, 1 << 20
TAIL_LINES = 12  # of the log, in an exit's report


class RunnerGoneError(Exception):
    """Raised by `Child` when its process is gone; the engine turns it into its own error."""


class RunnerHost:
    """What every runner of one worker shares. `start()` must be called on the thread whose
    priority the runners should have (the worker's main thread: not a load thread at
    `load_nice`, whose nice value a child would inherit), before the first spawn."""

    _default: RunnerHost | None = None
    _default_lock = threading.Lock()

    def __init__(self, logs: Path, *, start_timeout_s: float = 600.0,
                 turns: bool = True) -> None:
        self.logs = logs
        self.start_timeout_s = start_timeout_s
        self.turns = Turns(enabled=turns)
        self._spawner: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @classmethod
    def default(cls) -> RunnerHost:
        """The host of backends built without a server (tests, benchmarks): logs in a temporary
        folder, the default start deadline, turns on."""
        with cls._default_lock:
            if cls._default is None:
                cls._default = RunnerHost(Path(tempfile.gettempdir()) / "packserve-runner-logs")
            return cls._default

    def start(self) -> None:
        """Make the spawning thread now, on this thread (it inherits this thread's nice)."""
        self.spawner().submit(int).result()

    def spawner(self) -> ThreadPoolExecutor:
        """The one long-lived thread that forks every runner: a child asks the kernel to kill it
        when the thread that forked it ends (PR_SET_PDEATHSIG), so that thread lives as long as
        the worker. The supervisor also kills the worker's whole process group when the worker
        dies; the death signal covers a scheduler run inside another program (the tests)."""
        with self._lock:
            if self._spawner is None:
                self._spawner = ThreadPoolExecutor(max_workers=1,
                                                   thread_name_prefix="packserve-runner-spawn")
            return self._spawner

    def log_folder(self, name: str, key: str) -> Path:
        """Where the logs of one load are kept: its file's name and a digest of its load key
        (two loads of one file, another context say, keep theirs apart)."""
        digest = hashlib.sha256(key.encode()).hexdigest()[:8]
        return self.logs / f"{name}-{digest}"


class Child:
    """One runner process. Not thread-safe for its lifecycle (the scheduler serialises `start`
    and `stop` of one load); `watch`, `exited`, `alive` and the readings are safe from any
    thread."""

    def __init__(self, host: RunnerHost, name: str, log_folder: Path) -> None:
        self.host = host
        self.name = name  # for messages: the model's file
        self.log_folder = log_folder
        self.log: Path | None = None  # this process's log, kept after it ends
        self.turn = Competitor()
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._report: ExitReport | None = None
        self._exit: EngineExit | None = None  # how it ended, once reaped
        self._on_its_own = False  # it ended without being stopped
        self._exited = threading.Event()
        self._oom_events: Path | None = None
        self._oom_before: int | None = None

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def socket(self) -> Path:
        assert self._dir is not None
        return self._dir / "runner.sock"

    def start(self, argv: Callable[[Path], Sequence[str]], ready: Callable[[], bool]) -> None:
        """Spawn `argv(socket)` and return once `ready()` says it serves. Raises EngineDied
        with the log's last lines if it exits first, or if it does not serve within the host's
        start deadline (the time its turns hold it paused does not count: it is then killed,
        `hung`)."""
        self._dir = Path(tempfile.mkdtemp(prefix="packserve-runner-"))
        self.log = self._new_log()
        args = [str(a) for a in argv(self.socket)]
        with open(self.log, "ab") as sink:
            sink.write(f"packserve: {' '.join(args)}\n".encode())
            sink.flush()
            self._stopping, self._exit, self._report = False, None, None
            self._on_its_own = False
            self._exited.clear()
            proc = self.host.spawner().submit(
                subprocess.Popen, args, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink,
                preexec_fn=die_with_parent, close_fds=True).result()
        self._proc = proc
        self._oom_events = _memory_events(proc.pid)
        self._oom_before = _oom_kills(self._oom_events)
        threading.Thread(target=self._reap, args=(proc,), name=f"packserve-reaper-{proc.pid}",
                         daemon=True).start()
        self.host.turns.spawned(self.turn, proc.pid)
        try:
            self._wait_ready(ready)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, ready: Callable[[], bool]) -> None:
        limit = self.host.start_timeout_s
        held = self.turn.held()
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline + self.turn.held() - held:
            if self._exited.is_set():
                assert self._exit is not None
                raise EngineDied(f"the runner of {self.name} exited while loading "
                                 f"({self._exit.cause}): {self._exit.log_tail}", self._exit)
            if ready():
                return
            time.sleep(0.01)
        raise self.hung(f"was not serving after {limit:g} s (load_timeout_s)")

    def hung(self, what: str) -> EngineDied:
        """Kill a runner that did not serve in time (a start, a wake): its death, `hung`, for
        the scheduler to count; `what` says what it did not do."""
        pid = self.pid or 0
        self.stop()
        gone = EngineExit(pid=pid, status=None, signal="SIGKILL", oom_kill=False,
                          log_tail=self.log_tail(), log=str(self.log or ""), hung=True)
        return EngineDied(f"the runner of {self.name} {what}: killed; its log: "
                          f"{gone.log_tail}", gone)

    def stop(self) -> None:
        """Kill the process (nothing of a runner outlives it: no request is in flight when it
        is stopped, and its own shutdown took 0.11-0.16 s that a model switch waited for),
        reap it and remove its folder; its log stays. Its exit is not reported."""
        with self._lock:
            self._stopping = True
        proc, self._proc = self._proc, None
        self.host.turns.spawned(self.turn, None)  # let go if paused, never paused again
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        folder, self._dir = self._dir, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        if self.log is not None:
            _trim(self.log)

    # -- its death ------------------------------------------------------------------------

    def watch(self, report: ExitReport) -> None:
        """Call `report` once when the process ends on its own (at once if it already has)."""
        with self._lock:
            if self._stopping:
                return
            self._report = report
            done = self._exit
        if done is not None:
            self._deliver()

    def exited(self, timeout_s: float) -> EngineExit | None:
        """How the process ended, waiting up to `timeout_s`; None while it runs (or when it
        was stopped, not dead)."""
        if self._proc is None and not self._exited.is_set():
            return None
        self._exited.wait(timeout_s)
        return self._exit if self._on_its_own else None

    def _reap(self, proc: subprocess.Popen[bytes]) -> None:
        """The reaper: waits for the process (a process its turn holds stopped is not
        reaped: only its end wakes this) and reports how it ended, once."""
        rc = proc.wait()
        sig = _signal_name(rc)
        oom: bool | None = None
        if self._oom_before is not None:
            after = _oom_kills(self._oom_events)
            oom = sig == "SIGKILL" and after is not None and after > self._oom_before
        with self._lock:
            self._on_its_own = not self._stopping
        self._exit = EngineExit(pid=proc.pid, status=rc if rc >= 0 else None, signal=sig,
                                oom_kill=oom, log_tail=self.log_tail(),
                                log=str(self.log or ""))
        self._exited.set()
        self._deliver()

    def _deliver(self) -> None:
        with self._lock:
            report, self._report = self._report, None
            stopping = self._stopping
        if report is None or stopping or self._exit is None:
            return
        log.error("the runner of %s (pid %d) died: %s; its log: %s", self.name,
                  self._exit.pid, self._exit.cause, self._exit.log)
        try:
            report(self._exit)
        except Exception:  # the report hands over to the event loop; never kill the reaper
            log.exception("reporting the death of %s's runner failed", self.name)

    # -- readings -------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and not self._exited.is_set()

    def rss_bytes(self) -> int:
        """The process's resident set (its weights' pages, its buffers, its code), 0 once it
        is gone."""
        pid = self.pid
        if pid is None or not self.alive():
            return 0
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return 0
        return 0

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        """The last `lines` non-empty lines of its log, joined by " | "."""
        return " | ".join(tail(self.log, lines)) if self.log is not None else ""

    def _new_log(self) -> Path:
        self.log_folder.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%f")
        path = self.log_folder / f"{stamp}.log"
        old = sorted(self.log_folder.glob("*.log"))
        for stale in old[:max(0, len(old) - (KEEP_LOGS - 1))]:
            with contextlib.suppress(OSError):
                stale.unlink()
        return path


def _trim(path: Path) -> None:
    """Keep the last TRIM_TO bytes of a log that grew past TRIM_AT."""
    try:
        if path.stat().st_size <= TRIM_AT:
            return
        with open(path, "rb") as f:
            f.seek(-TRIM_TO, os.SEEK_END)
            kept = f.read()
        path.write_bytes(b"packserve: (trimmed to its last MiB)\n" + kept)
    except OSError:
        return


def _memory_events(pid: int) -> Path | None:
    """The cgroup v2 `memory.events` file of process `pid` (its OOM kills are counted there),
    if there is one to read."""
    try:
        line = next(ln for ln in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                    if ln.startswith("0::"))
    except (OSError, StopIteration):
        return None
    path = Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "memory.events"
    return path if path.is_file() else None


def _oom_kills(path: Path | None) -> int | None:
    if path is None:
        return None
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def _signal_name(rc: int) -> str | None:
    """The name of the signal that ended a process with return code `rc`, if one did."""
    if rc >= 0:
        return None
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


class UnixHTTP(http.client.HTTPConnection):
    """HTTP over a runner's unix socket (no port to race for, nothing on the network)."""

    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class Competitor:
    """One runner as the CPU's turns see it: its process id while it has one (None before its
    start and after its stop; a runner restarted in place gets a new one), and how long its
    turns have held it so far (a start's timeout does not count that time)."""

    __slots__ = ("_held_since", "held_s", "pid")

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.held_s = 0.0  # seconds paused by its turns, up to its last resume
        self._held_since: float | None = None

    def held(self) -> float:
        """Seconds its turns have held it, including the pause it may be in now."""
        since = self._held_since
        return self.held_s + (time.monotonic() - since if since is not None else 0.0)


class Turns:
    """The CPU's runners compute one at a time when several are busy: the one serving the
    earliest deadline runs, the others are stopped (SIGSTOP) until it is idle or a request with
    an earlier deadline comes (SIGCONT).

    Why: llama.cpp's threads (OpenMP) spin at each of the hundreds of barriers of a token's
    graph, so two runners with every core each, busy at once, spend their time spinning for
    threads the other runner's hold: two SmolLM2 runners on 2 cores made 18 + 18 tokens/s
    where one alone made 134 (`scripts/runner_checks.py contention`, docs/engines.md). In
    turns, the cores serve one runner at its full speed; an embedding's runner (0.5 s SLO)
    takes them from a generation's (4 s) for the milliseconds it needs.

    A request's deadline is its arrival plus its model's SLO (`[server.slo]`); one already
    past it competes as if it came again (its deadline moves on by its SLO), so late requests
    do not keep the cores from every other runner (the domino effect `core.compute` describes).
    A runner's start (its load, llama-server's warm-up pass) competes too, at the deadline of
    the earliest request waiting for it when it began (the time it is held does not count
    against its start deadline); a runner loaded again keeps its requests' turns. A start
    beside a burst of embeddings once took 6.2 s where it takes 0.2, and held the embeddings as
    long (docs/benchmarks.md, trace). A runner
    is stopped only while it has work and another runner's is more urgent; an idle runner, or
    one being stopped or released, is never held. On by default; `[server] runner_turns =
    false` leaves the sharing to the OS.
    """

    RECHECK_S = 0.02  # how often the deadlines are compared again while runners wait

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._cond = threading.Condition()
        self._work: dict[Competitor, list[tuple[float, float]]] = {}  # (deadline, SLO) each
        self._stopped: dict[int, Competitor] = {}  # pid -> whose it is
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def working(self, who: Competitor, deadline: float, slo_s: float) -> Iterator[None]:
        """`who` computes for a request (or its start) due at `deadline` (time.monotonic()),
        for as long as the block runs. Any thread."""
        entry = (deadline, max(slo_s, 0.001))
        with self._cond:
            self._work.setdefault(who, []).append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="packserve-runner-turns",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                entries = self._work.get(who)
                if entries is not None and entry in entries:
                    entries.remove(entry)
                    if not entries:
                        del self._work[who]
                self._cond.notify()

    def spawned(self, who: Competitor, pid: int | None) -> None:
        """`who` has a process now (None: none any more, as it is killed or found dead); a
        start waiting under its turn competes from now on. Its work stays: the requests and
        the start of a runner restarted in place go on competing with its new process."""
        with self._cond:
            if who.pid is not None and who.pid != pid:
                self._resume(who.pid)
            who.pid = pid
            self._cond.notify()

    def forget(self, who: Competitor) -> None:
        """`who` is released to warm, idle: drop its work and let it go now if it is held (a
        runner that is stopped or dead drops its pid instead: `spawned(who, None)`)."""
        with self._cond:
            self._work.pop(who, None)
            if who.pid is not None:
                self._resume(who.pid)
            self._cond.notify()

    def stopped(self) -> frozenset[int]:
        with self._cond:
            return frozenset(self._stopped)

    def _stop(self, pid: int, who: Competitor) -> None:
        self._signal(pid, signal.SIGSTOP)
        self._stopped[pid] = who
        who._held_since = time.monotonic()

    def _run(self) -> None:
        while True:
            with self._cond:
                # A runner without a process yet (its start is being spawned) uses no CPU.
                owners = {who.pid: who for who, entries in self._work.items()
                          if entries and who.pid is not None}
                busy = {pid: self._work[who] for pid, who in owners.items()}
                winner = min(busy, key=lambda pid: _urgency(busy[pid])) if len(busy) > 1 \
                    else None
                for pid in list(self._stopped):
                    if winner is None or pid == winner or pid not in busy:
                        self._resume(pid)
                if winner is not None:
                    for pid in busy:
                        if pid != winner and pid not in self._stopped:
                            self._stop(pid, owners[pid])
                self._cond.wait(self.RECHECK_S if winner is not None else None)

    def _resume(self, pid: int) -> None:
        who = self._stopped.pop(pid, None)
        if who is not None:
            self._signal(pid, signal.SIGCONT)
            if who._held_since is not None:
                who.held_s += time.monotonic() - who._held_since
                who._held_since = None

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _urgency(entries: list[tuple[float, float]]) -> float:
    """The earliest deadline of a runner's requests, each late one's moved on by its SLO."""
    now = time.monotonic()
    return min(moved_on(d, slo, now) for d, slo in entries)
