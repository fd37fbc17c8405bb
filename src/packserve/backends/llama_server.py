"""llama.cpp in runner processes: each load is one `llama-server` child of the worker.

The design of Ollama and of llama.cpp's own router, which beat an in-process engine (packserve's
first, through llama-cpp-python, since removed) in docs/engines.md: the engine's loop (decode,
sampling, detokenising, continuous batching of the load's `parallel` slots, prompt-prefix
reuse, grammars) runs in C++ with every core, and no Python runs per token inside it. The
worker reads the runner's server-sent events and hands each piece of text to the request, as it
does for any engine.

What a runner is to the scheduler: its bytes are the child's resident set size (`weight_bytes`
reads /proc/PID/smaps_rollup, so a load's measured footprint is the process it started, not the
worker's growth); an unload stops the process. Its warm state is the process itself with its
weights file's pages dropped from its resident set (the page cache keeps them while the kernel
has room): `release_weights` asks the runner to let them go (a patched route,
scripts/patches/llama-server-release-pages.patch), `restore_weights` to read them back, each in
milliseconds where a start takes up to half a second; what a warm runner holds is its buffers
(KV cache, compute) and code. A runner that dies (SIGSEGV, an OOM kill) costs its own requests a
503 and nothing else; its next request finds it gone and the scheduler loads it anew
(`RunnerGone`); a warm one found dead is loaded anew.

The binary is built by scripts/setup.sh from the vendored llama.cpp of the pinned
llama-cpp-python sdist (its source only: the Python package is not installed), with portable
flags and packserve's patches, into the virtual environment's `bin/` (`PACKSERVE_LLAMA_SERVER`
names another).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import functools
import http.client
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packserve.backends import gguf
from packserve.core.backend import (
    EXTENSIONS,
    Alternative,
    Backend,
    Embeddings,
    FinishReason,
    Generated,
    GenerationParams,
    LoadSpec,
    Message,
    OnText,
    Ranking,
    TokenLogprob,
    Wire,
)
from packserve.core.compute import usable_cores
from packserve.core.engine import Engine
from packserve.core.footprint import shape_of
from packserve.core.memory import GpuMemory, Nvml, process_device_bytes
from packserve.errors import ConfigError, EngineCrashed, InputTooLong, InvalidRequest
from packserve.modelfiles import ModelFacts
from packserve.planner.sizing import Breakdown, llama_encoder_breakdown
from packserve.types import Task

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from packserve.core.request import GenerationRequest

BINARY_ENV = "PACKSERVE_LLAMA_SERVER"
START_TIMEOUT_S = 120.0  # a runner that is not serving by then failed to load
RESTART_WINDOW_S = 30.0  # a runner that dies again this soon after a restart stays dead
# A warm runner's release or restore of its weights' pages: milliseconds from the page cache; a
# restore whose pages the kernel took back reads the file.
PAGES_TIMEOUT_S = 60.0
# Slots one runner decodes together (continuous batching), sharing one KV cache of the entry's
# `context_length` (llama-server's own default: four, unified).
DEFAULT_PARALLEL = 4
# A token is rarely longer than this many characters: an embedding input longer than its
# model's limit times this is refused before it is sent to be tokenized.
_MAX_CHARS_PER_TOKEN = 32

# The runners are started from this one long-lived thread, made when the registry imports this
# module (on the worker's main thread, at its priority): a child asks the kernel to kill it when
# the thread that forked it ends (PR_SET_PDEATHSIG), so that thread must live as long as the
# worker; and a child inherits its thread's nice, so it must not be one of the scheduler's load
# threads (at `load_nice`), or the runner would serve at the loads' low priority. The
# supervisor also kills the worker's whole process group when the worker dies; the death signal
# covers a scheduler run inside another program (the tests).
log = logging.getLogger(__name__)

_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="packserve-runner-spawn")
_SPAWNER.submit(int).result()  # the thread exists from now on
_PR_SET_PDEATHSIG = 1


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
    against START_TIMEOUT_S); a runner restarted in place keeps its requests' turns. A start
    beside a burst of embeddings once took 6.2 s where it takes 0.2, and held the embeddings as
    long (docs/benchmarks.md, trace). A runner
    is stopped only while it has work and another runner's is more urgent; an idle runner, or
    one being stopped or released, is never held. On by default; `[server] runner_turns =
    false` leaves the sharing to the OS.
    """

    RECHECK_S = 0.02  # how often the deadlines are compared again while runners wait

    def __init__(self) -> None:
        self.enabled = True
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
    """The earliest deadline of a runner's requests, a late one's moved on by its SLO."""
    now = time.monotonic()
    return min(d if d >= now else d + slo * math.ceil((now - d) / slo) for d, slo in entries)


TURNS = Turns()


class RunnerGone(EngineCrashed):
    """The runner process of a model died: its requests in flight get 503 `engine_crashed`."""


def binary() -> Path:
    """The llama-server to run: `PACKSERVE_LLAMA_SERVER`, else the one setup built into the
    virtual environment."""
    named = os.environ.get(BINARY_ENV)
    path = Path(named) if named else Path(sys.prefix) / "bin" / "llama-server"
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ConfigError(f"llama-server not found at {path}: run scripts/setup.sh (it builds "
                          f"it from llama.cpp's source) or set {BINARY_ENV}")
    return path


@functools.cache
def list_devices(exe: Path) -> tuple[str, ...]:
    """The devices a llama-server build can offload to ("CUDA0", ...), from its own
    `--list-devices` (17 ms for a CPU build: it prints "(none)"). The build's devices, not the
    flags it was configured with: the same answer for a binary built elsewhere
    (`PACKSERVE_LLAMA_SERVER`), and a CUDA build on a machine whose driver is gone lists none."""
    try:
        out = subprocess.run([str(exe), "--list-devices"], capture_output=True, text=True,
                             timeout=30, check=False, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(line.strip().partition(":")[0] for line in out.splitlines()
                 if line.startswith("  ") and ":" in line)


def runner_cuda(device: str = "cuda:0") -> str | None:
    """Why the llama-server runner cannot run on `device`, or None when its build lists it."""
    try:
        exe = binary()
    except ConfigError as exc:
        return exc.message
    devices = list_devices(exe)
    want = "CUDA" + (device.partition(":")[2] or "0")
    if want in devices:
        return None
    if not any(d.startswith("CUDA") for d in devices):
        return f"{exe} was built without CUDA, or sees no card (its --list-devices names none)"
    return f"{exe} lists {', '.join(devices)}, not {want}"


def runner_device_bytes(pid: int, device: str, gpu: Callable[[], GpuMemory] = Nvml) -> int:
    """What runner `pid` holds on `device` by NVML's per-process figure; where NVML gives none,
    0: the loader then counts the device's used-memory growth over the load instead (its
    fallback, reported as `device_total`)."""
    return process_device_bytes(gpu(), int(device.partition(":")[2] or 0), pid) or 0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class _UnixHTTP(http.client.HTTPConnection):
    """HTTP over the runner's unix socket (no port to race for, nothing on the network)."""

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

    def retarget(self, path: str) -> None:
        """Connect to `path` from the next request on (a runner started again)."""
        self._path = path


class _RunnerProcess(Backend):
    """One load: one llama-server process serving the weights on a unix socket. What a runner
    is to the scheduler and to a request's connection; the subclasses say what it serves."""

    _proc: subprocess.Popen[bytes] | None = None
    _dir: Path | None = None
    n_vocab: int = 0
    out_of_process = True
    # A restore reads the weights' pages back from the page cache: 2.5-17 ms against 0.11-0.85
    # s for a new runner (`scripts/runner_checks.py warm`, docs/engines.md), at most 5%.
    restore_share = 0.05

    _unloaded: bool = False
    _restarted_at: float = -math.inf

    def __post_init__(self) -> None:
        self.name = self.spec.path.name
        self._restart_lock = threading.Lock()
        self._turn = Competitor()

    # -- lifecycle (the scheduler's) -----------------------------------------------------------

    def load(self) -> None:
        why = runner_cuda(self.spec.device) if self.spec.device != "cpu" else None
        if why is not None:
            raise ConfigError(f"{self.name}: device {self.spec.device} asked, but {why}")
        self._start()

    def _device_args(self) -> list[str]:
        """Where the weights go: every layer on the card, or none offloaded (a CUDA build's
        default, `-ngl auto`, would put a CPU model's layers on the card)."""
        if self.spec.device == "cpu":
            return ["--device", "none"]
        return ["--device", "CUDA" + (self.spec.device.partition(":")[2] or "0"),
                "--n-gpu-layers", "all"]

    def _mode_args(self, slots: int) -> list[str]:
        """What this kind of runner adds to the command line (its context, its mode)."""
        raise NotImplementedError

    def _start(self) -> None:
        """Start the runner and return once it serves; raises (with its log's tail) if it
        exits or is not serving within START_TIMEOUT_S."""
        exe = binary()
        self._dir = Path(tempfile.mkdtemp(prefix="packserve-runner-"))
        threads = self.spec.threads or usable_cores()
        slots = max(1, self.spec.parallel)
        args = [str(exe), "--model", str(self.spec.path), "--host", str(self._socket),
                "--parallel", str(slots), "--threads", str(threads),
                "--threads-batch", str(threads), "--alias", self.name,
                "--no-webui", "--no-slots", "--offline",
                # No trial load to fit the context to free device memory: the context is set,
                # and the trial read Gemma's 262k-token vocabulary a second time (a start took
                # 0.95 s with it, 0.59 s without, docs/engines.md).
                "--fit", "off",
                # warnings and errors only: a line per request would grow the log without end
                "--log-verbosity", "2", *self._device_args(), *self._mode_args(slots)]
        log = open(self._dir / "runner.log", "wb")  # noqa: SIM115 (the child writes it)
        try:
            self._proc = _SPAWNER.submit(
                subprocess.Popen, args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                preexec_fn=_die_with_parent, close_fds=True).result()
        finally:
            log.close()
        TURNS.spawned(self._turn, self._proc.pid)
        try:
            self._wait_ready()
            self.n_vocab = self._read_vocab()
        except BaseException:
            self._stop()
            raise

    def _read_vocab(self) -> int:
        """The model's vocabulary size, as the runner reports it (token ids are below it)."""
        # Not the health poll's 5 s: a start may be held for its turn (class Turns) meanwhile.
        conn = _UnixHTTP(str(self._socket), timeout=START_TIMEOUT_S)
        try:
            conn.request("GET", "/v1/models")
            rows = _json(conn.getresponse().read()).get("data") or [{}]
            return int((rows[0].get("meta") or {}).get("n_vocab", 0))
        finally:
            conn.close()

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        """Refuse token ids outside the model's vocabulary, naming the first."""
        for token in ids:
            if not 0 <= token < self.n_vocab:
                raise InvalidRequest(f"{param} has token id {token}, outside the vocabulary "
                                     f"of {self.name} (ids 0 to {self.n_vocab - 1})",
                                     param=param)

    def _wait_ready(self) -> None:
        # The time its turn holds it (docs of Turns) is not the start's: a start behind a
        # stream of earlier deadlines is slow, not failed.
        held = self._turn.held()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline + self._turn.held() - held:
            if self._proc is None or self._proc.poll() is not None:
                raise RuntimeError(f"llama-server for {self.name} exited while loading "
                                   f"({self._exit()}): {self._log_tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = _UnixHTTP(str(self._socket), timeout=5)
                try:
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        return
                finally:
                    conn.close()
            time.sleep(0.01)
        raise RuntimeError(f"llama-server for {self.name} was not serving after "
                           f"{START_TIMEOUT_S:.0f} s: {self._log_tail()}")

    def unload(self) -> None:
        self._unloaded = True
        self._stop()

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        TURNS.spawned(self._turn, None)  # let go if paused, never paused again
        if proc is not None and proc.poll() is None:
            # Killed, not asked: nothing of a runner outlives it (no request is in flight when
            # it is unloaded), and its own shutdown took 0.11-0.16 s that a model switch waited
            # for (`scripts/runner_checks.py start`); killed, it is gone in milliseconds.
            proc.kill()
            proc.wait()
        folder, self._dir = self._dir, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def release_weights(self) -> bool:
        """Hot -> warm: the runner drops its weights file's pages from its resident set and
        keeps running (its buffers, its slots' cache, its vocabulary). False if it is gone or
        could not: the scheduler unloads it."""
        if self.dead():
            return False
        TURNS.forget(self._turn)  # it is idle: if its turn had it stopped, it runs now
        try:
            done = self._pages("release")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            log.warning("the runner of %s could not release its weights (%s); it is unloaded",
                        self.name, exc)
            return False
        return bool(done.get("bytes")) and not done.get("errors")

    def restore_weights(self) -> None:
        """Warm -> hot: the runner reads its weights' pages back (from the page cache, or the
        file where the kernel took them), so the first request after does not fault them in.
        Raises RunnerGone if the runner died while warm: the scheduler loads it anew."""
        if self.dead():
            raise self._gone(None)
        try:
            self._pages("restore")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise self._gone(exc) from exc

    def _pages(self, action: str) -> dict[str, Any]:
        conn = _UnixHTTP(str(self._socket), timeout=PAGES_TIMEOUT_S)
        try:
            response = self._send(conn, "/packserve/pages", {"action": action})
            data = _json(response.read())
            if response.status != 200:
                raise ValueError(f"{response.status}: {data.get('error')}")
            return data
        finally:
            conn.close()

    def weight_bytes(self) -> int:
        """The runner's resident set: its weights' pages, its KV cache and buffers, and its
        code. Not its proportional share: a weights file another process maps too (another
        server, a second runner of the same file) would halve it, and the model could not be
        loaded again in the room that figure reserves once the other process is gone."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return 0
        if self.spec.device != "cpu":  # what the runner's pid holds on the card, by NVML
            return runner_device_bytes(proc.pid, self.spec.device)
        try:
            for line in Path(f"/proc/{proc.pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return 0
        return 0

    def working(self, deadline: float, slo_s: float) -> contextlib.AbstractContextManager[None]:
        if not TURNS.enabled or self.spec.device != "cpu":
            return contextlib.nullcontext()
        return TURNS.working(self._turn, deadline, slo_s)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def _socket(self) -> Path:
        assert self._dir is not None
        return self._dir / "llama.sock"

    def _exit(self) -> str:
        rc = self._proc.poll() if self._proc is not None else None
        if rc is None:
            return "stopped"
        return f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"

    def _log_tail(self, lines: int = 8) -> str:
        if self._dir is None:
            return ""
        try:
            text = (self._dir / "runner.log").read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(line for line in text.splitlines()[-lines:] if line.strip())

    # -- requests (a lease's) ---------------------------------------------------------------

    def _post(self, conn: _UnixHTTP, path: str, body: dict[str, Any], param: str
              ) -> http.client.HTTPResponse:
        """POST `body` as JSON; the response once it is a 200 (its body unread). A runner
        that was dying when `conn` was made (killed, not reaped yet) is started again and the
        request sent once more: nothing ran for it."""
        try:
            response = self._send(conn, path, body)
        except (OSError, http.client.HTTPException) as exc:
            proc = self._proc
            with contextlib.suppress(subprocess.TimeoutExpired):
                if proc is not None:
                    proc.wait(timeout=1)  # a dying runner is gone within this
            if not self.dead():
                raise self._gone(exc) from exc
            conn.close()
            self._revive()
            conn.retarget(str(self._socket))
            try:
                response = self._send(conn, path, body)
            except (OSError, http.client.HTTPException) as again:
                raise self._gone(again) from again
        if response.status != 200:
            data = _json(response.read())
            raise _error(data.get("error", {}), param, self.name)
        return response

    @staticmethod
    def _send(conn: _UnixHTTP, path: str, body: dict[str, Any]) -> http.client.HTTPResponse:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        return conn.getresponse()

    def _connect(self) -> _UnixHTTP:
        if self.dead():
            self._revive()
        return _UnixHTTP(str(self._socket), timeout=None)

    def _revive(self) -> None:
        """A request found the runner dead (it crashed after its load): start it again in
        place, once per RESTART_WINDOW_S; the bytes were the model's all along. Requests that
        were running in it have had their 503. A second death within the window stays dead:
        503s until the model is evicted or an operator reloads it."""
        with self._restart_lock:
            if not self.dead():
                return  # another request restarted it
            TURNS.spawned(self._turn, None)  # its pid may be another process's soon
            if self._unloaded:
                raise self._gone(None)
            now = time.monotonic()
            if now - self._restarted_at < RESTART_WINDOW_S:
                raise self._gone(None)
            gone = self._gone(None)
            self._restarted_at = now
            self._stop()
            try:
                self._start()
            except Exception as exc:
                raise gone from exc

    def _gone(self, exc: BaseException | None) -> RunnerGone:
        alive = self._proc is not None and self._proc.poll() is None
        why = f": {exc}" if exc is not None and alive else f" ({self._exit()})"
        return RunnerGone(f"the llama-server runner of {self.name} is gone{why}",
                          retry_after_s=1)

    def dead(self) -> bool:
        """The runner exited (or was killed) after it loaded."""
        return self._proc is None or self._proc.poll() is not None

    def _get(self, path: str) -> dict[str, Any]:
        conn = self._connect()
        try:
            conn.request("GET", path)
            return _json(conn.getresponse().read())
        finally:
            conn.close()

    def _post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        conn = self._connect()
        try:
            response = self._post(conn, path, body, "input")
            try:
                return _json(response.read())
            except (OSError, http.client.HTTPException) as exc:
                raise self._gone(exc) from exc
        finally:
            conn.close()



class LlamaServerBackend(_RunnerProcess):
    """A generation runner: chats and completions, `parallel` slots decoded together."""

    # Whether the model's chat template shows the tools it is given: llama.cpp's own probe of
    # the template it renders with (`/props`' `chat_template_caps`), read once per load.
    _renders_tools: bool = False

    def load(self) -> None:
        super().load()
        try:
            caps = self._get("/props").get("chat_template_caps") or {}
            self._renders_tools = bool(caps.get("supports_tools"))
        except BaseException:
            self.unload()
            raise

    def _mode_args(self, slots: int) -> list[str]:
        per_slot = self.spec.cache_per_slot
        args = ["--ctx-size", str(self.spec.context_length * (slots if per_slot else 1)),
                "--jinja",
                # No prompt cache in RAM beside the KV cache (llama-server keeps up to 8 GiB by
                # default, filled as requests come): a runner's bytes stay what the scheduler
                # measured after its load. Each slot still reuses its own cached prefix.
                "--cache-ram", "0"]
        # A cache per slot with flash attention: each sequence's answer is the one it gets
        # alone (docs/engines.md measured it); one shared cache is the leaner default.
        return args + (["--flash-attn", "on"] if per_slot else ["--kv-unified"])

    def renders_tools(self) -> bool:
        return self._renders_tools

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(self._post_json("/tokenize", {"content": t, "add_special": False,
                                                  "parse_special": False})["tokens"])
                for t in texts]

    def chat(self, messages: Sequence[Message], params: GenerationParams,
             on_text: OnText | None = None) -> Generated:
        body: dict[str, Any] = {"messages": [_message(m) for m in messages],
                                **self._sampling(params)}
        if params.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.parameters}}
                for t in params.tools]
        if params.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = params.logprobs
        return self._generate("/v1/chat/completions", body, on_text, "messages")

    def wire(self, request: GenerationRequest) -> Wire | None:
        """Plain chats and completions go to the runner as they are and its answer is relayed
        (`api.relay`): no thread, no decoding of each event in the worker. A dead runner
        answers None, so that the request takes `chat`/`complete`, which starts it again."""
        if self.dead() or self._dir is None:
            return None
        stream = request.stream
        body: dict[str, Any] = {**self._sampling(request.params), "stream": stream}
        completion = request.task is Task.COMPLETE
        if completion:
            body["prompt"], path = self._prompt(request.prompts[0]), "/v1/completions"
        else:
            body["messages"] = [_message(m) for m in request.messages]
            path = "/v1/chat/completions"
        if stream:
            body["stream_options"] = {"include_usage": True}  # counted on the lease
            if request.usage_per_chunk:
                body["timings_per_token"] = True  # api.relay makes them usage
        return Wire(socket=str(self._socket), path=path, body=json.dumps(body).encode(),
                    served_as=self.name, usage_per_chunk=stream and request.usage_per_chunk,
                    # llama-server names text completions as it names chats
                    id_prefix=("chatcmpl-", "cmpl-") if completion else None)

    def _prompt(self, prompt: str | Sequence[int]) -> str | list[int]:
        """A completion's prompt as the runner takes it: text, or token ids (checked against
        the vocabulary; taken as they are, no special token added)."""
        if isinstance(prompt, str):
            return prompt
        self.check_ids(prompt, "prompt")
        return list(prompt)

    def _sampling(self, params: GenerationParams) -> dict[str, Any]:
        body = _sampling(params)
        if params.logit_bias:
            self.check_ids([token for token, _ in params.logit_bias], "logit_bias")
            body["logit_bias"] = [[token, bias] for token, bias in params.logit_bias]
        return body

    def complete(self, prompt: str | Sequence[int], params: GenerationParams,
                 on_text: OnText | None = None) -> Generated:
        body: dict[str, Any] = {"prompt": self._prompt(prompt), **self._sampling(params)}
        if params.logprobs is not None:
            body["logprobs"] = params.logprobs
        return self._generate("/v1/completions", body, on_text, "prompt")

    def _generate(self, path: str, body: dict[str, Any], on_text: OnText | None,
                  param: str) -> Generated:
        text: list[str] = []
        tokens: list[TokenLogprob] = []
        finish: FinishReason = "stop"
        prompt_tokens = completion_tokens = 0
        with self._stream(path, body, param) as events:
            for event in events:
                if "error" in event:
                    raise _error(event["error"], param, self.name)
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") \
                        if "delta" in choice else choice.get("text")
                    lp = _logprobs(choice.get("logprobs"))
                    tokens.extend(lp)
                    if piece:
                        text.append(piece)
                        if on_text is not None and not on_text(piece, lp):
                            # The client left: closing the connection stops the slot at once.
                            return Generated(text="".join(text), finish_reason="stop",
                                             prompt_tokens=prompt_tokens,
                                             completion_tokens=len(tokens) or len(text),
                                             logprobs=tuple(tokens))
                    if choice.get("finish_reason"):
                        finish = "length" if choice["finish_reason"] == "length" else "stop"
                usage = event.get("usage")
                if usage:
                    prompt_tokens = int(usage.get("prompt_tokens", 0))
                    completion_tokens = int(usage.get("completion_tokens", 0))
        wanted = "logprobs" in body
        return Generated(text="".join(text), finish_reason=finish, prompt_tokens=prompt_tokens,
                         completion_tokens=completion_tokens,
                         logprobs=tuple(tokens) if wanted else None)

    @contextlib.contextmanager
    def _stream(self, path: str, body: dict[str, Any], param: str
                ) -> Iterator[Iterator[dict[str, Any]]]:
        """POST `body` with `stream` on; yields the decoded events. Closing the connection
        (leaving the block early) cancels the generation in the runner."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        conn = self._connect()
        try:
            yield _events(self._post(conn, path, body, param), self)
        finally:
            conn.close()



class LlamaEmbedBackend(_RunnerProcess):
    """An embedding runner (llama-server --embeddings): a GGUF encoder's pooled, normalised
    sentence vectors, and reranking by their cosine similarity (a bi-encoder, not a
    cross-encoder). Each input is tokenized by the runner first, so that an input over the
    model's context is refused by its index and every input's tokens are counted; the vectors
    are then computed from those token ids, `parallel` inputs in one batch."""

    def _mode_args(self, slots: int) -> list[str]:
        # A slot's context is the model's (capped by llama.cpp at the GGUF's context length,
        # which packserve's converter sets to the longest input the model was made for).
        # llama-server's own 512-token batch. Its compute buffers are touched by the requests,
        # not at load: the load is measured without them (~63 MiB for MiniLM), and what long
        # inputs add (70 MiB more for MiniLM's 256-token ones: scripts/runner_checks.py embed)
        # lives in the device's headroom, as any engine's activations do. Reserving them (a
        # 256-token batch, touched at load: 97 MiB) made the bursty trace evict MiniLM eleven
        # times a run where it had stayed (docs/engines.md).
        return ["--embeddings", "--ctx-size", str(self.spec.context_length * slots)]

    def embed_passes(self) -> int:
        return max(1, self.spec.parallel)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        conn = self._connect()
        try:
            return [len(self._tokens(conn, t, special=False)) for t in texts]
        finally:
            conn.close()

    def embed(self, texts: Sequence[str]) -> Embeddings:
        vectors, tokens = self._vectors(texts, "input")
        return Embeddings(vectors=vectors, tokens=tokens)

    def embed_ids(self, ids: Sequence[Sequence[int]]) -> Embeddings:
        """Vectors of inputs given as token ids, taken as they are (no [CLS] or [SEP] added)."""
        limit = self.spec.context_length
        for i, row in enumerate(ids):
            self.check_ids(row, f"input[{i}]" if len(ids) > 1 else "input")
            if len(row) > limit:
                raise InputTooLong(f"input[{i}] is {len(row)} tokens; {self.name} reads at "
                                   f"most {limit} tokens (shorten or split it)", param="input")
        conn = self._connect()
        try:
            vectors = self._embed_rows(conn, [list(row) for row in ids])
        finally:
            conn.close()
        return Embeddings(vectors=vectors, tokens=[len(row) for row in ids])

    def rerank(self, query: str, documents: Sequence[str]) -> Ranking:
        vectors, tokens = self._vectors([query, *documents], "documents", first="query")
        return Ranking(scores=[float(s) for s in vectors[1:] @ vectors[0]],
                       tokens=sum(tokens))

    def _vectors(self, texts: Sequence[str], what: str, first: str = ""
                 ) -> tuple[npt.NDArray[np.float32], list[int]]:

        limit = self.spec.context_length

        def named(i: int) -> str:
            return first if first and i == 0 else f"{what}[{i - bool(first)}]"

        for i, text in enumerate(texts):
            if len(text) > limit * _MAX_CHARS_PER_TOKEN:
                raise InputTooLong(f"{named(i)} has {len(text)} characters; {self.name} reads "
                                   f"at most {limit} tokens", param="input")
        conn = self._connect()
        try:
            ids = [self._tokens(conn, t, special=True) for t in texts]
            for i, row in enumerate(ids):
                if len(row) > limit:
                    raise InputTooLong(f"{named(i)} is {len(row)} tokens; {self.name} reads at "
                                       f"most {limit} tokens (shorten or split it)",
                                       param="input")
            vectors = self._embed_rows(conn, ids)
        finally:
            conn.close()
        return vectors, [len(row) for row in ids]

    def _embed_rows(self, conn: _UnixHTTP, ids: list[list[int]]) -> npt.NDArray[np.float32]:
        """The runner's vectors for token-id rows, in their order."""
        import numpy as np

        response = self._post(conn, "/v1/embeddings",
                              {"input": ids, "encoding_format": "base64"}, "input")
        try:
            data = _json(response.read()).get("data") or []
        except (OSError, http.client.HTTPException) as exc:
            raise self._gone(exc) from exc
        if len(data) != len(ids):
            raise RuntimeError(f"llama-server for {self.name} answered {len(data)} vectors "
                               f"for {len(ids)} inputs")
        rows = sorted(data, key=lambda d: int(d.get("index", 0)))
        return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.float32)
                         for d in rows])

    def _tokens(self, conn: _UnixHTTP, text: str, *, special: bool) -> list[int]:
        """`text`'s token ids as the runner reads it (with [CLS] and [SEP] when `special`),
        on `conn` (kept open between the calls of one request)."""
        # Special tokens written in the text ("[SEP]") are read as such, as BertTokenizer does.
        response = self._post(conn, "/tokenize", {"content": text, "add_special": special,
                                                  "parse_special": True}, "input")
        try:
            return list(_json(response.read()).get("tokens") or [])
        except (OSError, http.client.HTTPException) as exc:
            raise self._gone(exc) from exc


def _sampling(params: GenerationParams) -> dict[str, Any]:
    body: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                            "cache_prompt": True}
    if params.max_tokens is not None:
        body["max_tokens"] = params.max_tokens
    if params.stop:
        body["stop"] = list(params.stop)
    if params.seed is not None:
        body["seed"] = params.seed % 2**32
    if params.json_schema is not None:
        body["json_schema"] = params.json_schema
    elif params.json_object:
        body["json_schema"] = {"type": "object"}
    # Beyond OpenAI's, by llama.cpp's names; absent, llama-server's defaults hold.
    body["frequency_penalty"] = params.frequency_penalty
    body["presence_penalty"] = params.presence_penalty
    if params.top_k is not None:
        body["top_k"] = params.top_k
    if params.min_p is not None:
        body["min_p"] = params.min_p
    if params.repetition_penalty is not None:
        body["repeat_penalty"] = params.repetition_penalty
    if params.ignore_eos:
        body["ignore_eos"] = True  # every end-of-generation token banned (llama.cpp's list)
    if params.min_tokens:
        body["min_tokens"] = params.min_tokens  # scripts/patches/llama-server-min-tokens.patch
    return body


def _message(m: Message) -> dict[str, Any]:
    """A message as chat templates read it (Hugging Face's convention: a call's arguments as
    an object, a tool result with its call's id)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _object(c.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _object(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _events(response: http.client.HTTPResponse, backend: _RunnerProcess
            ) -> Iterator[dict[str, Any]]:
    while True:
        try:
            line = response.readline()
        except (OSError, http.client.HTTPException) as exc:
            raise backend._gone(exc) from exc
        if not line:  # the answer ended before its [DONE]: the runner died (it may not
            raise backend._gone(None)  # have been reaped yet, so do not ask whether it did)
        if not line.startswith(b"data: "):
            if line.startswith(b"error: "):
                yield {"error": _json(line[7:]).get("error", _json(line[7:]))}
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            return
        yield _json(payload)


def _json(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        return {"message": data.decode("utf-8", "replace")}
    return value if isinstance(value, dict) else {"value": value}


def _error(error: object, param: str, name: str) -> Exception:
    """A runner's error as packserve's: a prompt over the window is InputTooLong, any other
    400 InvalidRequest, anything else a failure of the engine (500)."""
    info = error if isinstance(error, dict) else {"message": str(error)}
    message = str(info.get("message", "")) or "llama-server refused the request"
    kind = str(info.get("type", ""))
    if kind == "exceed_context_size_error" or ("context" in message and "exceed" in message):
        return InputTooLong(f"{message} ({name})", param=param)
    if info.get("code") == 400 or kind == "invalid_request_error":
        return InvalidRequest(f"{name}: {message}", param=param)
    return RuntimeError(f"llama-server for {name} failed: {message}")


def _logprobs(shape: object) -> list[TokenLogprob]:
    """llama-server's OpenAI-shaped logprobs (`{"content": [...]}`) as TokenLogprobs."""
    if not isinstance(shape, dict):
        return []
    out = []
    for entry in shape.get("content") or ():
        out.append(TokenLogprob(
            token=entry.get("token", ""), bytes=bytes(entry.get("bytes") or b""),
            logprob=float(entry.get("logprob", 0.0)),
            top=tuple(Alternative(token=a.get("token", ""), bytes=bytes(a.get("bytes") or b""),
                                  logprob=float(a.get("logprob", 0.0)))
                      for a in entry.get("top_logprobs") or ())))
    return out


def _embed_context(requested: int | None, facts: ModelFacts | None) -> int:
    """The longest input: the entry's `context_length`, else the model's own."""
    return requested or (facts.context_length if facts is not None else 0) or 512


def _embed_size(facts: ModelFacts | None, load: LoadSpec, name: str, sequences: int
                ) -> Breakdown:
    assert facts is not None  # reads_files
    return llama_encoder_breakdown(shape_of(facts, name))


def _embed_source(path: Path) -> str | None:
    return None if path.suffix == ".gguf" else f"a .gguf file (or a BERT safetensors folder " \
        f"it converts), got {path}"


def _to_gguf(path: Path, models_dir: Path, announce: Callable[[str], None] | None) -> Path:
    """A sentence-transformers BERT folder, converted once into `models_dir`; a file as is."""
    from packserve.convert import gguf_for

    return gguf_for(path, models_dir, announce) if path.is_dir() else path


ENGINE = Engine(name="llama-server", tasks=frozenset({Task.CHAT, Task.COMPLETE}),
                default_concurrency=DEFAULT_PARALLEL, build=LlamaServerBackend, size=gguf.size,
                check_source=gguf.check_source, context=gguf.context,
                default_parallel=DEFAULT_PARALLEL,
                sampling=frozenset({*EXTENSIONS, "continuous_usage_stats"}), token_ids=True,
                cuda=runner_cuda, own_process=True)
# Embeddings and bi-encoder rerank from a GGUF encoder (the default catalog's MiniLM, converted
# from its safetensors folder): requests are batched (api/batching.py) into the runner's slots.
EMBED_ENGINE = Engine(name="llama-server-embed", tasks=frozenset({Task.EMBED, Task.RERANK}),
                      default_concurrency=32, build=LlamaEmbedBackend, size=_embed_size,
                      check_source=_embed_source, context=_embed_context, convert=_to_gguf,
                      default_parallel=DEFAULT_PARALLEL, token_ids=True, cuda=runner_cuda,
                      own_process=True)
ENGINES = (ENGINE, EMBED_ENGINE)
