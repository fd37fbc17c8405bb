"""The prepared GPU check's steps on the card (scripts/gpu-check.sh --prepared runs this with the
virtual environment it made): one JSON report and one table.

Each step has its seconds (`needs`: not started with less left; `cap`: stopped past it) and a
rank, the skip order: when time runs short, a step is skipped rather than eat into the needs of
a later step of a lower rank (`allot`), so the check always ends with a report inside its
`--deadline`. A step that fails is recorded with its error and the next one runs, except
`environment`, which is fatal (nothing after it would measure the card); on a CUDA device a
skipped step is a failure. SIGTERM or SIGINT stops the check: its servers are ended and the
report written. Only the standard library and nvidia-ml-py (`pynvml`) are imported here; the
models come from tiny_models.py next to this file (numpy, gguf; the BERT with torch and
sentence-transformers, which the GPU machine has).

    python check.py --out WORK --report DIR --logs DIR --llama-server BIN --packserve BIN
                    [--device cuda:0] [--tests DIR] [--deadline S] [--llama-shape 1b|tiny]
                    [--only STEP,...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# benchmarks/router.py (llama.cpp's router as packserve's peer): shipped in the prepared folder's
# gpu/benchmarks/, or the checkout's own
sys.path.append(str(HERE if (HERE / "benchmarks").is_dir() else HERE.parents[1]))

MiB = 1 << 20
LLAMA, BERT = "llama", "bert"
PROMPT = [{"role": "user", "content": "hello world, what is the answer to this question"}]
GEN_TOKENS = 128


# -- the budget and the report --------------------------------------------------------------

class Stopped(BaseException):
    """SIGTERM or SIGINT: not an Exception, so no step records it; main ends every process the
    check started and writes the report."""


class StepTimeout(Exception):
    """A step ran past its cap (SIGALRM): recorded as that step's error."""


# the end of the running step (monotonic): HTTP timeouts never outlive it
_step_end = [float("inf")]


def step_left(default: float) -> float:
    """Seconds an operation inside the running step may wait: `default`, or less near its cap."""
    return max(1.0, min(default, _step_end[0] - time.monotonic()))


@dataclass(frozen=True)
class Step:
    """One step: `needs` seconds at the least (it is not started with less), `cap` at the most
    (it is stopped past it), and its `rank` in the skip order (0: kept longest). `after`: a step
    that must have passed first."""

    name: str
    fn: Callable[[], Any]
    needs: float
    cap: float
    rank: int
    after: str | None = None
    fatal: bool = False


def allot(left: float, step: Step, later: Sequence[Step]) -> float | None:
    """Seconds `step` may run now with `left` seconds to the deadline, or None to skip it: it
    keeps every later step of a lower rank its `needs`. Pure: tests/test_gpu_check.py holds its
    table."""
    reserved = sum(s.needs for s in later if s.rank < step.rank)
    room = left - reserved
    if room < step.needs:
        return None
    return min(step.cap, room)


@dataclass
class Report:
    """Steps in the order they ran, each {ok, seconds, result | error | skipped}; written after
    every step, so a run cut short still leaves what it had."""

    path: Path
    deadline: float
    cuda: bool = False
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def run_all(self, steps: Sequence[Step], only: set[str] | None = None) -> None:
        for i, step in enumerate(steps):
            if only is not None and step.name not in only:
                self.skip(step.name, "not selected (--only)")
                continue
            if step.after and not (self.steps.get(step.after) or {}).get("ok"):
                self.skip(step.name, f"needs {step.after}, which did not pass")
                continue
            left = self.deadline - time.monotonic()
            cap = allot(left, step, [s for s in steps[i + 1:]
                                     if only is None or s.name in only])
            if cap is None:
                self.skip(step.name, f"time: {left:.0f} s left, the step needs {step.needs:.0f} "
                          "s and keeps the later steps of a lower rank theirs")
                continue
            self.run(step, cap)
            if step.fatal and not self.steps[step.name]["ok"]:
                for rest in steps[i + 1:]:
                    self.skip(rest.name, f"{step.name} failed: the check stops there")
                return

    def skip(self, name: str, why: str) -> None:
        self.steps[name] = {"ok": False, "skipped": why}
        self.write()

    def run(self, step: Step, cap: float) -> Any:
        start = time.monotonic()
        print(f"gpu-check: {step.name} (at most {cap:.0f} s) ...", file=sys.stderr, flush=True)
        _step_end[0] = start + cap
        signal.setitimer(signal.ITIMER_REAL, cap)
        try:
            result = step.fn()
        except Exception as exc:  # one failing step is recorded; the others go on
            signal.setitimer(signal.ITIMER_REAL, 0)
            self.steps[step.name] = {"ok": False, "seconds": round(time.monotonic() - start, 2),
                                     "error": f"{type(exc).__name__}: {exc}",
                                     "trace": traceback.format_exc(limit=4)}
            print(f"gpu-check: {step.name} FAILED: {exc}", file=sys.stderr, flush=True)
            result = None
        else:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self.steps[step.name] = {"ok": True, "seconds": round(time.monotonic() - start, 2),
                                     "result": result}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            _step_end[0] = float("inf")
        self.write()
        return result

    def failed(self) -> list[str]:
        """On a CUDA device every step not passed, skipped ones too; elsewhere (a rehearsal) the
        steps that ran and failed."""
        return [n for n, s in self.steps.items()
                if not s["ok"] and (self.cuda or "skipped" not in s)]

    def write(self) -> None:
        body = {"check": "packserve prepared GPU check (scripts/gpu-check.sh)", **self.meta,
                "steps": self.steps}
        tmp = self.path.with_suffix(".partial")
        tmp.write_text(json.dumps(body, indent=2, default=str) + "\n", "utf-8")
        tmp.replace(self.path)


def _on_alarm(signum: int, frame: object) -> None:
    raise StepTimeout(f"stopped at its cap ({_step_end[0] - time.monotonic():+.0f} s)")


def _on_stop(signum: int, frame: object) -> None:
    # a second signal while the check cleans up is ignored: the cleanup is bounded
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Stopped(signal.Signals(signum).name)


# -- the processes the check starts: every one ends with it -------------------------------------

STARTED: list[subprocess.Popen[bytes]] = []
SEEN: set[int] = set()  # descendants seen while their parent lived (runners in own sessions)


def start(cmd: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    """`cmd` in its own session, output to `log`, remembered until it is stopped."""
    with log.open("ab") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    STARTED.append(proc)
    return proc


def stop(proc: subprocess.Popen[bytes], grace: float = 20.0) -> None:
    """SIGTERM to `proc`'s group, SIGKILL after `grace` seconds, then to every descendant
    (packserve's runners run in sessions of their own) still there."""
    tree = set(children(proc.pid)) | SEEN
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    for pid in tree:
        if alive(pid) and any(k in cmdline(pid) for k in ("llama-server", "packserve")):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    if proc in STARTED:
        STARTED.remove(proc)


def note_descendants() -> None:
    for proc in STARTED:
        if proc.poll() is None:
            SEEN.update(children(proc.pid))


def stop_all() -> None:
    for proc in list(STARTED):
        stop(proc, grace=5)


# -- NVML ---------------------------------------------------------------------------------------

class Nvml:
    """The card through nvidia-ml-py: used memory and the per-process list."""

    def __init__(self, index: int) -> None:
        import pynvml  # type: ignore[import-untyped]

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def used(self) -> int:
        return int(self.nv.nvmlDeviceGetMemoryInfo(self.handle).used)

    def total(self) -> int:
        return int(self.nv.nvmlDeviceGetMemoryInfo(self.handle).total)

    def processes(self) -> dict[int, int | None]:
        """pid -> bytes it holds on the card (None where NVML gives no figure)."""
        out: dict[int, int | None] = {}
        for p in self.nv.nvmlDeviceGetComputeRunningProcesses(self.handle):
            out[int(p.pid)] = (int(p.usedGpuMemory) if p.usedGpuMemory is not None
                               and int(p.usedGpuMemory) < (1 << 62) else None)
        return out

    def describe(self) -> dict[str, Any]:
        nv = self.nv
        name = nv.nvmlDeviceGetName(self.handle)
        return {"name": name.decode() if isinstance(name, bytes) else name,
                "driver": _text(nv.nvmlSystemGetDriverVersion()),
                "cuda_driver_version": nv.nvmlSystemGetCudaDriverVersion(),
                "memory_total": self.total(), "memory_used": self.used(),
                "compute_capability": list(nv.nvmlDeviceGetCudaComputeCapability(self.handle))}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- processes ----------------------------------------------------------------------------------

def children(pid: int) -> list[int]:
    """Every descendant of `pid`, from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, parent in parents.items() if parent == p]
        found += kids
        frontier += kids
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped by its parent, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def role(pid: int, serve_pid: int | None) -> str:
    cmd = cmdline(pid)
    if pid == serve_pid:
        return "packserve serve (front)"
    if "packserve.worker" in cmd:
        return "packserve worker"
    if "llama-server" in cmd:
        return "llama-server runner" if "packserve-runner" in cmd else "llama-server"
    return cmd[:80] or "(gone)"


def argv_of(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


# where a runner listens and how much it logs: the direct run and the router choose their own
_NOT_COPIED = {"--host": 1, "--port": 1, "--log-verbosity": 1}


def runner_args(argv: Sequence[str]) -> list[str]:
    """A packserve runner's options (its argv less the binary), without where it listens and its
    log verbosity (a runner logs warnings only; the buffer lines are info)."""
    out: list[str] = []
    i = 1
    while i < len(argv):
        if argv[i] in _NOT_COPIED:
            i += 1 + _NOT_COPIED[argv[i]]
            continue
        out.append(argv[i])
        i += 1
    return out


def preset_keys(args: Sequence[str]) -> dict[str, str]:
    """Options as a router preset's keys (llama-server's long names without dashes; a flag is
    `true`), less what the router itself or the preset's section sets (model, alias, the web
    UI, the slots endpoint, offline)."""
    keys: dict[str, str] = {}
    i = 0
    while i < len(args):
        name = args[i].lstrip("-")
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            keys[name], i = args[i + 1], i + 2
        else:
            keys[name], i = "true", i + 1
    for router_own in ("model", "alias", "no-webui", "no-slots", "offline"):
        keys.pop(router_own, None)
    return keys


def runner_log(pid: int) -> Path | None:
    """A packserve runner's log: runner.log in the folder of its socket (packserve-runner-*),
    named on its command line."""
    for word in cmdline(pid).split():
        if "packserve-runner-" in word:
            log = Path(word).parent / "runner.log"
            if log.is_file():
                return log
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# llama.cpp's buffer lines at its default verbosity, e.g.
#   load_tensors:        CUDA0 model buffer size =  1252.41 MiB
#   llama_kv_cache:      CUDA0 KV buffer size =    64.00 MiB
#   llama_context:       CUDA0 compute buffer size =   258.50 MiB
_BUFFER = re.compile(r"\b(CUDA\d+)\s+(\w+) buffer size\s*=\s*([\d.]+) MiB")


def llama_buffers(log: str, device: str = "CUDA0") -> dict[str, int]:
    """Bytes llama.cpp says it allocated on `device`, by kind (model, KV, compute, ...); the
    host's buffers (CUDA_Host, CPU) are not the card's."""
    found: dict[str, int] = {}
    for dev, kind, mib in _BUFFER.findall(log):
        if dev == device:
            found[kind] = found.get(kind, 0) + int(float(mib) * MiB)
    return found


# -- HTTP (standard library only) ---------------------------------------------------------------

def call(port: int, method: str, path: str, body: object | None = None,
         timeout: float = 120.0) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=step_left(timeout))
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, raw.decode(errors="replace")[:500]
    finally:
        conn.close()


def wait_healthy(port: int, proc: subprocess.Popen[bytes], seconds: float, path: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before answering {path}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if call(port, "GET", path, timeout=2)[0] == 200:
                return time.monotonic() - start
        time.sleep(0.2)
    raise TimeoutError(f"no answer on {path} after {seconds:.0f} s")


def stream_chat(port: int, model: str | None, max_tokens: int = GEN_TOKENS) -> dict[str, float]:
    """One streamed chat: seconds to the first token, tokens, and decode tokens/s."""
    body: dict[str, Any] = {"messages": PROMPT, "max_tokens": max_tokens, "stream": True,
                            "temperature": 0.0, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=step_left(120))
    began = time.monotonic()
    first = last = None
    chunks = 0
    usage: dict[str, Any] = {}
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            event = json.loads(payload)
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    now = time.monotonic()
                    first = first if first is not None else now
                    last = now
                    chunks += 1
    finally:
        conn.close()
    if first is None or last is None:
        raise RuntimeError("the stream carried no text")
    tokens = int(usage.get("completion_tokens") or chunks)
    decode = last - first
    return {"first_token_s": round(first - began, 4), "tokens": tokens,
            "total_s": round(last - began, 4),
            "decode_tokens_per_s": round((tokens - 1) / decode, 1) if decode > 0 else 0.0}


def embed(port: int, model: str) -> float:
    start = time.monotonic()
    status, body = call(port, "POST", "/v1/embeddings", {"model": model, "input": "hello world"})
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body}")
    return time.monotonic() - start


def first_answer(port: int, model: str) -> float:
    """Client-side seconds to the first answer: the first token of a stream, or an embedding."""
    if model == LLAMA:
        return stream_chat(port, model, max_tokens=4)["first_token_s"]
    return embed(port, model)


def chats(port: int, model: str | None, n: int) -> dict[str, Any]:
    """One stream alone, then `n` at once: each one's tokens/s and the sum."""
    one = stream_chat(port, model)
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        start = time.monotonic()
        many = list(pool.map(lambda _: stream_chat(port, model), range(n)))
        wall = time.monotonic() - start
    return {"one": one, "concurrent": many, "concurrent_n": n,
            "concurrent_total_tokens_per_s": round(sum(m["tokens"] for m in many) / wall, 1)}


def burst(port: int, model: str | None, n: int) -> dict[str, Any]:
    """`n` streams at once: seconds to each one's first token (p50, p95) and the tokens/s of
    all of them together."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        start_s = time.monotonic()
        got = list(pool.map(lambda _: stream_chat(port, model), range(n)))
        wall = time.monotonic() - start_s
    first = sorted(g["first_token_s"] for g in got)
    return {"n": n, "first_token_p50_s": _rank(first, 0.5),
            "first_token_p95_s": _rank(first, 0.95), "wall_s": round(wall, 3),
            "tokens_per_s": round(sum(g["tokens"] for g in got) / wall, 1)}


def _rank(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank quantile of an ordered list."""
    return ordered[max(0, min(len(ordered) - 1, -(-round(q * 100) * len(ordered) // 100) - 1))]


# -- the server under test ----------------------------------------------------------------------

@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def residency(self) -> dict[str, Any]:
        status, body = call(self.port, "GET", "/v1/residency")
        if status != 200:
            raise RuntimeError(f"/v1/residency: HTTP {status}: {body}")
        return dict(body)

    def model(self, name: str) -> dict[str, Any]:
        return next(m for m in self.residency()["models"] if m["name"] == name)

    def admin(self, name: str, verb: str) -> dict[str, Any]:
        status, body = call(self.port, "POST", f"/v1/residency/{name}/{verb}", timeout=180)
        if status != 200:
            raise RuntimeError(f"{verb} {name}: HTTP {status}: {body}")
        return dict(body)

    def runner_pid(self) -> int | None:
        pids = [p for p in children(self.proc.pid) if "packserve-runner" in cmdline(p)
                or ("llama-server" in cmdline(p) and "--model" in cmdline(p))]
        return pids[0] if pids else None

    def worker_pid(self) -> int | None:
        pids = [p for p in children(self.proc.pid) if "packserve.worker" in cmdline(p)]
        return pids[0] if pids else None


def write_config(path: Path, models: Path, port: int, device: str, *,
                 budget: str = "auto", headroom: str = "256MiB") -> Path:
    """A packserve config serving the tiny models on `device`: those whose files were made (a
    config naming a missing file is refused, and one model's failure must not stop the other)."""
    entries = {
        LLAMA: (models / "llama.gguf", 'tasks = ["chat", "complete"]\n'
                'backend = "llama-server"\ncontext_length = 2048\nparallel = 4\n'),
        BERT: (models / "bert", 'tasks = ["embed"]\nbackend = "sentence-transformers"\n'),
    }
    text = f"""# written by scripts/gpu/check.py
[server]
port = {port}
data_dir = "{models / 'data'}"
model_roots = ["{models}"]
log_level = "info"
access_log = false

[devices."{device}"]
memory_budget = "{budget}"
headroom = "{headroom}"
"""
    made = [name for name, (source, _) in entries.items() if source.exists()]
    if not made:
        raise RuntimeError(f"no tiny model in {models} (the model steps failed)")
    for name in made:
        source, keys = entries[name]
        text += f'\n[[models]]\nname = "{name}"\nsource = "{source}"\ndevice = "{device}"\n{keys}'
    path.write_text(text, "utf-8")
    return path


@contextlib.contextmanager
def serving(packserve: str, config: Path, log: Path, port: int) -> Iterator[Served]:
    proc = start([packserve, "serve", "--config", str(config)], log)
    served = Served(proc, port, log)
    try:
        try:
            wait_healthy(port, proc, step_left(90), "/healthz")
        except (RuntimeError, TimeoutError) as exc:
            tail = log.read_text("utf-8", errors="replace")[-1200:]
            raise RuntimeError(f"packserve serve: {exc}; its log ends:\n{tail}") from exc
        yield served
    finally:
        stop(proc, grace=30)


def settle(until: Callable[[], bool], seconds: float = 20.0) -> bool:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if until():
            return True
        time.sleep(0.2)
    return until()


# -- the steps ----------------------------------------------------------------------------------

class Check:
    """The steps, each a method; `steps()` lists them with their seconds and ranks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.logs: Path = args.logs
        self.models = self.out / "models"
        self.device: str = args.device
        self.cuda = self.device.startswith("cuda")
        self.nvml: Nvml | None = None
        self.footprint: dict[str, dict[str, Any]] = {}
        self.planned: dict[str, int] = {}
        self.served: Served | None = None
        self._serving: contextlib.AbstractContextManager[Served] | None = None
        self.config = self.out / "packserve.toml"

    def steps(self) -> list[Step]:
        """The order they run in, each with its seconds on the card (`needs`, `cap`) and its
        rank in the skip order: 0 the footprint of the 1B model and what stops the server,
        1 tokens/s and the contexts, 2 the BERT and the eviction, 3 the timings of
        warm/cold and SIGKILL and the gpu tests, 4 the audit."""
        served = "serve"
        return [
            Step("environment", self.environment, 5, 90, 0, fatal=True),
            Step(f"model:{LLAMA}", lambda: self.make_model(LLAMA), 10, 90, 0),
            Step(f"model:{BERT}", lambda: self.make_model(BERT), 15, 90, 2),
            Step("plan", self.plan, 5, 60, 3),
            Step(served, self.serve, 20, 90, 0),
            Step(f"footprint:{LLAMA}", lambda: self.footprint_of(LLAMA), 10, 90, 0, served),
            Step(f"footprint:{BERT}", lambda: self.footprint_of(BERT), 10, 90, 2, served),
            Step("cuda_contexts", self.contexts, 2, 20, 1, served),
            Step("chats_packserve", lambda: chats(self.port, LLAMA, 4), 20, 90, 1, served),
            Step("router_vs_packserve", self.router, 40, 150, 2, served),
            Step("audit", self.audit, 10, 60, 4, served),
            Step(f"warm_vs_cold:{LLAMA}", lambda: self.warm_vs_cold(LLAMA), 15, 60, 3, served),
            Step(f"warm_vs_cold:{BERT}", lambda: self.warm_vs_cold(BERT), 15, 60, 3, served),
            Step("sigkill_runner", self.sigkill, 20, 60, 3, served),
            Step("stop_server", self.stop_server, 5, 45, 0, served),
            Step("eviction", self.eviction, 40, 120, 2),
            Step("chats_llama_server", self.direct, 20, 90, 1),
            Step("pytest_gpu", self.pytest_gpu, 30, 150, 3),
        ]

    @property
    def port(self) -> int:
        if self.served is None:
            raise RuntimeError("packserve is not serving (the serve step failed)")
        return self.served.port

    # environment and models
    def environment(self) -> dict[str, Any]:
        """What runs the check, and whether it can measure the card: on a CUDA device NVML must
        answer and llama-server must list CUDA0 (a failure here is fatal)."""
        import packserve

        env: dict[str, Any] = {
            "python": sys.version.split()[0], "prefix": sys.prefix,
            "base_prefix": sys.base_prefix, "host": platform.node(),
            "site_dirs": [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))],
            "packserve": packserve.__file__,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            import torch

            env["torch"] = torch.__version__
            env["torch_cuda"] = torch.version.cuda
            env["torch_sees_cuda"] = torch.cuda.is_available()
        except Exception as exc:
            env["torch"] = f"not importable: {exc}"
        devices = subprocess.run([self.args.llama_server, "--list-devices"], capture_output=True,
                                 text=True, timeout=60, check=False)
        env["llama_server_devices"] = (devices.stdout + devices.stderr).strip()[-1500:]
        if not self.cuda:
            return env  # a rehearsal on the CPU (--device cpu): no NVML, no CUDA0
        self.nvml = Nvml(int(self.device.partition(":")[2] or 0))
        env["gpu"] = self.nvml.describe()
        if "CUDA0" not in devices.stdout + devices.stderr:
            raise RuntimeError(f"llama-server lists no CUDA0: {env['llama_server_devices']}")
        return env

    def make_model(self, name: str) -> dict[str, Any]:
        import tiny_models

        self.models.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        if name == LLAMA:
            shape = tiny_models.LLAMA_3_2_1B if self.args.llama_shape == "1b" \
                else tiny_models.LlamaShape()
            quant = "q8_0" if self.args.llama_shape == "1b" else "f16"
            path = tiny_models.write_llama_gguf(self.models / "llama.gguf", shape, quant)
            about: dict[str, Any] = {"shape": self.args.llama_shape, "quant": quant,
                                     "params": shape.params()}
        else:
            path = tiny_models.write_bert(self.models / "bert")
            about = {}
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        return {"path": str(path), "bytes": sum(f.stat().st_size for f in files),
                "write_s": round(time.monotonic() - t0, 2), **about}

    def plan(self) -> dict[str, Any]:
        config = write_config(self.out / "plan.toml", self.models, free_port(), self.device)
        run = subprocess.run([self.args.packserve, "plan", "--config", str(config), "--json"],
                             capture_output=True, text=True, timeout=step_left(120), check=False)
        if run.returncode != 0:
            raise RuntimeError(f"packserve plan exited {run.returncode}: {run.stderr[-800:]}")
        body = json.loads(run.stdout)
        self.planned = {m["name"]: int(m["total_bytes"]) for m in body["models"]}
        return {"models": {m["name"]: {k: m[k] for k in ("weights_bytes", "kv_cache_bytes",
                                                          "overhead_bytes", "total_bytes")}
                           for m in body["models"]},
                "runtime_bytes": body.get("runtime_bytes"), "total_bytes": body.get("total_bytes"),
                "command": f"packserve plan --config {config} --json"}

    # one server: footprints, contexts, audit, warm/cold, SIGKILL, chats
    def serve(self) -> dict[str, Any]:
        port = free_port()
        write_config(self.config, self.models, port, self.device)
        cm = serving(self.args.packserve, self.config, self.logs / "packserve-serve.log", port)
        t0 = time.monotonic()
        self.served = cm.__enter__()  # its process is stopped if this fails
        self._serving = cm
        note_descendants()
        return {"port": port, "healthy_after_s": round(time.monotonic() - t0, 2),
                "config": self.config.read_text("utf-8")}

    def stop_server(self) -> dict[str, Any]:
        t0 = time.monotonic()
        cm, self._serving, self.served = self._serving, None, None
        if cm is not None:
            cm.__exit__(None, None, None)
        return {"stopped_after_s": round(time.monotonic() - t0, 2),
                "device_used_after": self.nvml.used() if self.nvml else None}

    def footprint_of(self, name: str) -> dict[str, Any]:
        """Load `name`: the scheduler's estimate and measurement, the planner's prediction,
        and NVML's figure for the process that holds it (the runner, or the worker)."""
        served = self._served()
        nvml = self.nvml
        before_used = nvml.used() if nvml else 0
        before = nvml.processes() if nvml else {}
        t0 = time.monotonic()
        served.admin(name, "load")
        seconds = time.monotonic() - t0
        after = nvml.processes() if nvml else {}
        note_descendants()
        row = served.model(name)
        holder = served.runner_pid() if name == LLAMA else served.worker_pid()
        held = after.get(holder) if holder is not None else None
        grew = (held or 0) - (before.get(holder) or 0) if holder is not None else None
        self.footprint[name] = {
            "state": row["state"], "load_seconds_client": round(seconds, 3),
            "estimated_bytes": row["bytes_estimated"],
            "measured_bytes": row["bytes_measured"],
            "planned_bytes": self.planned.get(name),
            "nvml_process": role(holder, served.proc.pid) if holder else None,
            "nvml_process_bytes": held,
            "nvml_process_growth_bytes": grew,
            "device_used_growth_bytes": nvml.used() - before_used if nvml else None,
        }
        device = next((d for d in served.residency()["devices"] if d["name"] == self.device),
                      None)
        if name == LLAMA and holder is not None:
            self.footprint[name]["runner_argv"] = argv_of(holder)
            # the runner's context: its process bytes less llama.cpp's buffers on the card
            log = runner_log(holder)
            buffers = llama_buffers(log.read_text("utf-8", errors="replace")) if log else {}
            self.footprint[name]["runner_log"] = str(log) if log else None
            self.footprint[name]["device_buffers"] = buffers
            self.footprint[name]["cuda_context_bytes"] = (
                held - sum(buffers.values()) if held is not None and buffers else None)
        else:  # the worker's context is packserve's own measure of it: the device's base
            self.footprint[name]["cuda_context_bytes"] = (device or {}).get("base_bytes")
        return {**self.footprint[name], "device_row": device}

    def _served(self) -> Served:
        if self.served is None:
            raise RuntimeError("packserve is not serving (the serve step failed)")
        return self.served

    def contexts(self) -> dict[str, Any]:
        served = self._served()
        if self.nvml is None:
            raise RuntimeError("no NVML: not on a CUDA device")
        ours = {served.proc.pid, *children(served.proc.pid)}
        procs = self.nvml.processes()
        listed = [{"pid": pid, "bytes": held, "role": role(pid, served.proc.pid),
                   "packserve": pid in ours} for pid, held in sorted(procs.items())]
        mine = sum(1 for p in listed if p["packserve"])
        note = "each process listed holds one CUDA context on the card"
        if listed and not mine:
            note += ("; none of the pids NVML lists is packserve's: NVML reports the host's "
                     "pids (a container's PID namespace), so per-process figures cannot be "
                     "matched here")
        return {"processes": listed, "packserve_contexts": mine, "note": note}

    def audit(self) -> dict[str, Any]:
        run = subprocess.run([self.args.packserve, "audit", "--server",
                              f"http://127.0.0.1:{self.port}", "--config", str(self.config),
                              "--json"], capture_output=True, text=True, timeout=step_left(120),
                             check=False)
        if run.returncode != 0:
            raise RuntimeError(f"audit exited {run.returncode}: {run.stderr[-800:]}")
        body: dict[str, Any] = json.loads(run.stdout)
        body["processes"] = [p for p in body.get("processes", []) if p.get("device") != "cpu"]
        return body

    def warm_vs_cold(self, name: str) -> dict[str, Any]:
        """Client-side seconds to the first answer from cold (unloaded: for the GGUF a new
        runner, its CUDA context and its load) and from warm (offloaded: the runner asleep,
        its wake; the BERT parked in host RAM, its copy back), each after one answer while hot;
        and what the process holds on the card by NVML hot, warm and after the warm answer.
        Issue 43's goals for the runner: asleep it holds at most 10% of its hot bytes, and its
        wake answers in at most half a new runner's time."""
        served = self._served()
        nvml = self.nvml

        def held() -> tuple[int | None, int | None]:
            pid = served.runner_pid() if name == LLAMA else served.worker_pid()
            return pid, (nvml.processes().get(pid) if nvml and pid is not None else None)

        first_answer(served.port, name)
        served.admin(name, "unload")
        cold = first_answer(served.port, name)
        pid_hot, hot = held()
        served.admin(name, "offload")
        warm_state = served.model(name)["state"]
        pid_warm, warm_bytes = held()
        warm = first_answer(served.port, name)
        pid_after, after = held()
        row = served.model(name)
        out: dict[str, Any] = {
            "cold_first_answer_s": round(cold, 4), "warm_first_answer_s": round(warm, 4),
            "state_after_offload": warm_state, "server_load_seconds": row["load_seconds"],
            "server_restore_seconds": row["restore_seconds"], "bytes_warm": row["bytes_warm"],
            "nvml_hot_bytes": hot, "nvml_warm_bytes": warm_bytes, "nvml_after_bytes": after,
            "same_process": pid_hot is not None and pid_hot == pid_warm == pid_after}
        if warm_state != "warm" or not out["same_process"]:
            # the warm tier did not keep it (a copy too big to keep, host RAM for the BERT):
            # the timing would be a cold one's; the figures say why
            raise RuntimeError(f"{name} was not kept warm: {json.dumps(out)}")
        if name == LLAMA and hot and warm_bytes is not None:
            out["warm_share_of_hot"] = round(warm_bytes / hot, 4)
            out["wake_share_of_cold"] = round(warm / cold, 4)
            out["goals_met"] = {"asleep_at_most_10pct": warm_bytes <= 0.1 * hot,
                                "wake_at_most_half_a_new_runner": warm <= 0.5 * cold}
        return out

    def sigkill(self) -> dict[str, Any]:
        served = self._served()
        nvml = self.nvml
        used: Callable[[], int] = nvml.used if nvml else (lambda: 0)
        served.admin(LLAMA, "unload")
        settle(lambda: served.runner_pid() is None, 10)
        base = used()
        served.admin(LLAMA, "load")
        pid = served.runner_pid()
        if pid is None:
            raise RuntimeError("no llama-server runner process found after the load")
        note_descendants()
        loaded = used()
        held = nvml.processes().get(pid) if nvml else None
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        gone = settle(lambda: (pid not in nvml.processes() if nvml else not alive(pid))
                      and used() <= base + 64 * MiB, 20)
        back_s = time.monotonic() - t0
        after = used()
        t1 = time.monotonic()
        recovered = first_answer(served.port, LLAMA)
        return {"runner_pid": pid, "runner_held_bytes": held, "device_used_before_load": base,
                "device_used_loaded": loaded, "device_used_after_kill": after,
                "back_where_it_was": gone, "seconds_until_back": round(back_s, 3),
                "difference_bytes": after - base,
                "next_answer_s": round(recovered, 3),
                "next_answer_wall_s": round(time.monotonic() - t1, 3),
                "state_after": served.model(LLAMA)["state"]}

    def eviction(self) -> dict[str, Any]:
        size = {n: max(int(r.get("measured_bytes") or 0), int(r.get("estimated_bytes") or 0))
                for n, r in self.footprint.items()}
        if len(size) < 2:
            raise RuntimeError("needs both models' footprints (a footprint step failed)")
        headroom = 16 * MiB
        budget = headroom + max(size.values()) + min(size.values()) // 2
        port = free_port()
        config = write_config(self.out / "tight.toml", self.models, port, self.device,
                              budget=str(budget), headroom=str(headroom))
        used: Callable[[], int | None] = self.nvml.used if self.nvml else (lambda: None)
        with serving(self.args.packserve, config, self.logs / "packserve-tight.log", port) as s:
            steps: list[dict[str, Any]] = [{"asked": None, "device_used": used()}]
            for name in (LLAMA, BERT, LLAMA):
                first_answer(port, name)
                note_descendants()
                steps.append({"asked": name, "device_used": used(),
                              "states": {m["name"]: m["state"] for m in s.residency()["models"]}})
        after = used()
        # each answer had to move the other model out (warm or cold): both cannot be hot
        evicted = all(st["states"][BERT if st["asked"] == LLAMA else LLAMA] != "hot"
                      for st in steps[2:])
        return {"budget_bytes": budget, "headroom_bytes": headroom, "sizes": size,
                "steps": steps, "device_used_after_stop": after, "evicted": evicted}

    def llama_args(self) -> tuple[list[str], str]:
        """The runner's options as packserve started it (from its footprint step), or, where
        that step failed, what they are assumed to be."""
        argv = (self.footprint.get(LLAMA) or {}).get("runner_argv")
        if argv:
            return runner_args(argv), "the runner's own"
        return ["--model", str(self.models / "llama.gguf"),
                *(["--device", "CUDA0", "--n-gpu-layers", "all"] if self.cuda
                  else ["--device", "none"]), "--parallel", "4", "--ctx-size", "2048",
                "--kv-unified", "--jinja", "--no-webui", "--offline"], "assumed (no runner seen)"

    def direct(self) -> dict[str, Any]:
        """The same binary and file run directly with the runner's options (slots, context,
        cache, --fit, device: on a CUDA device every layer on CUDA0, whatever NVML said), at
        llama.cpp's default verbosity, whose buffer lines give the runner's CUDA context."""
        port = free_port()
        args, source = self.llama_args()
        proc = start([self.args.llama_server, *args, "--host", "127.0.0.1", "--port", str(port)],
                     self.logs / "llama-server-direct.log")
        try:
            wait_healthy(port, proc, step_left(60), "/health")
            held = self.nvml.processes().get(proc.pid) if self.nvml else None
            buffers = llama_buffers(
                (self.logs / "llama-server-direct.log").read_text("utf-8", errors="replace"))
            result = chats(port, None, 4)
            result["args"], result["args_from"] = args, source
            result["process_bytes"] = held
            result["device_buffers"] = buffers
            # the runner's CUDA context: what NVML charges its process less what llama.cpp
            # says it allocated there (weights, KV cache, compute); the figure the planner's
            # assumed GPU_RUNTIME_BYTES (512 MiB) is to be checked against
            result["cuda_context_bytes"] = (held - sum(buffers.values())
                                            if held is not None and buffers else None)
            return result
        finally:
            stop(proc, grace=5)

    def router(self) -> dict[str, Any]:
        """llama.cpp's router (benchmarks/router.py's preset and command line) serving the
        same file with the runner's options, against packserve, alternating: 1, 4 and 16
        streams at once, two rounds each."""
        from benchmarks import router as peer

        served = self._served()
        args, source = self.llama_args()
        model = args[args.index("--model") + 1]
        preset = peer.write_preset(self.out / "router-preset.ini",
                                   {LLAMA: {"model": model, **preset_keys(args)}})
        port = free_port()
        proc = start([*peer.argv(Path(self.args.llama_server), preset, self.out / "router-cache"),
                      "--port", str(port)], self.logs / "llama-server-router.log")
        try:
            wait_healthy(port, proc, step_left(60), "/health")
            stream_chat(port, LLAMA, max_tokens=4)  # its child starts on a first request
            note_descendants()
            child = next((c for c in children(proc.pid) if "llama-server" in cmdline(c)), None)
            rounds = [{"round": r, "server": who, **{f"streams_{n}": burst(at, LLAMA, n)
                                                     for n in (1, 4, 16)}}
                      for r in range(2)
                      for who, at in (("packserve", served.port), ("router", port))]
            return {"args_from": source, "preset": preset.read_text("utf-8"),
                    "router_child_bytes": (self.nvml.processes().get(child)
                                           if self.nvml and child else None),
                    "runner_bytes": (self.footprint.get(LLAMA) or {}).get("nvml_process_bytes"),
                    "rounds": rounds}
        finally:
            stop(proc, grace=5)

    def pytest_gpu(self) -> dict[str, Any]:
        """The tests marked gpu in the shipped source; on a CUDA device a skipped one, or none
        collected, is a failure (a skip there means the card was not reached)."""
        tests = self.args.tests
        if tests is None or not Path(tests).is_dir():
            raise RuntimeError("no tests folder in the prepared folder")
        files = sorted(str(p) for p in Path(tests, "tests").rglob("test_*.py")
                       if "mark.gpu" in p.read_text("utf-8", errors="replace"))
        if not files:
            raise RuntimeError("no test is marked gpu in the shipped source")
        junit = self.out / "pytest-gpu.xml"
        log = self.logs / "pytest-gpu.log"
        with log.open("wb") as out:
            run = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p",
                                  "no:cacheprovider", f"--junitxml={junit}", *files], cwd=tests,
                                 stdout=out, stderr=subprocess.STDOUT,
                                 timeout=step_left(150), check=False,
                                 env={**os.environ, "PACKSERVE_TEST_DEVICE": self.device,
                                      "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                                      "HF_HUB_OFFLINE": "1"})
        tail = log.read_text("utf-8", errors="replace").strip().splitlines()[-15:]
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if junit.exists():
            root = ElementTree.parse(junit).getroot()
            suite = root if root.tag == "testsuite" else root.find("testsuite")
            if suite is not None:
                counts = {k: int(suite.get(k) or 0) for k in counts}
        result = {"files": files, "returncode": run.returncode, **counts, "tail": tail}
        if run.returncode not in (0, 5) or (self.cuda and (run.returncode == 5
                                                           or counts["skipped"])):
            raise RuntimeError(f"pytest exited {run.returncode} with {counts}"
                               + (" (a skip on a card is a failure)" if counts["skipped"] else "")
                               + ": " + "\n".join(tail))
        return result


# -- the table ----------------------------------------------------------------------------------

def table(report: dict[str, Any]) -> str:
    steps = report["steps"]
    lines = ["packserve prepared GPU check", ""]
    lines.append(f"{'step':<24} {'ok':<5} {'seconds':>8}  note")
    for name, step in steps.items():
        note = step.get("error") or step.get("skipped") or ""
        lines.append(f"{name:<24} {'yes' if step['ok'] else 'NO':<5} "
                     f"{step.get('seconds', ''):>8}  {str(note)[:90]}")
    fp = {"models": {n: steps[f"footprint:{n}"]["result"] for n in (LLAMA, BERT)
                     if (steps.get(f"footprint:{n}") or {}).get("ok")}}
    if fp["models"]:
        lines += ["", f"{'model':<12} {'estimated':>11} {'measured':>11} {'planned':>11} "
                  f"{'NVML/proc':>11}  process"]
        for name, r in fp["models"].items():
            lines.append(f"{name:<12} {_mib(r['estimated_bytes']):>11} "
                         f"{_mib(r['measured_bytes']):>11} {_mib(r['planned_bytes']):>11} "
                         f"{_mib(r['nvml_process_bytes']):>11}  {r['nvml_process']}"
                         + (f", CUDA context {_mib(r['cuda_context_bytes'])}"
                            if r.get("cuda_context_bytes") is not None else ""))
    ctx = (steps.get("cuda_contexts") or {}).get("result")
    if ctx:
        lines += ["", "CUDA contexts (NVML's process list):"]
        lines += [f"  pid {p['pid']:<8} {_mib(p['bytes']):>11}  {p['role']}"
                  for p in ctx["processes"]]
    wc = {n: steps[f"warm_vs_cold:{n}"]["result"] for n in (LLAMA, BERT)
          if (steps.get(f"warm_vs_cold:{n}") or {}).get("ok")}
    if wc:
        lines += ["", f"{'first answer':<12} {'cold s':>8} {'warm s':>8} {'NVML hot':>11} "
                  f"{'warm':>11} {'after':>11}"]
        lines += [f"{n:<12} {r['cold_first_answer_s']:>8} {r['warm_first_answer_s']:>8} "
                  f"{_mib(r.get('nvml_hot_bytes')):>11} {_mib(r.get('nvml_warm_bytes')):>11} "
                  f"{_mib(r.get('nvml_after_bytes')):>11}"
                  + (f"  goals {r['goals_met']}" if r.get("goals_met") else "")
                  for n, r in wc.items()]
    kill = (steps.get("sigkill_runner") or {}).get("result")
    if kill:
        lines.append(f"\nSIGKILL of the runner: device memory back within 64 MiB: "
                     f"{kill['back_where_it_was']} ({_mib(kill['difference_bytes'])} off, "
                     f"{kill['seconds_until_back']} s); next answer {kill['next_answer_s']} s")
    ev = (steps.get("eviction") or {}).get("result")
    if ev:
        lines.append(f"eviction under {_mib(ev['budget_bytes'])}: evicted={ev['evicted']}; "
                     + "; ".join(f"{s['asked']} -> {s['states']} ({_mib(s['device_used'])} used)"
                                 for s in ev["steps"][1:]))
    chat_p = (steps.get("chats_packserve") or {}).get("result")
    chat_d = (steps.get("chats_llama_server") or {}).get("result")
    if chat_p or chat_d:
        lines += ["", f"{'tokens/s':<22} {'packserve':>10} {'llama-server':>13}"]
        def one(r: dict[str, Any] | None) -> str:
            return str(r["one"]["decode_tokens_per_s"]) if r else "-"
        def four(r: dict[str, Any] | None) -> str:
            return str(r["concurrent_total_tokens_per_s"]) if r else "-"
        lines.append(f"{'one stream':<22} {one(chat_p):>10} {one(chat_d):>13}")
        lines.append(f"{'four at once (sum)':<22} {four(chat_p):>10} {four(chat_d):>13}")
    peer = (steps.get("router_vs_packserve") or {}).get("result")
    if peer:
        lines += ["", "packserve against llama.cpp's router (same file, the runner's options; "
                  "median of the rounds)",
                  f"{'streams':<8} {'server':<10} {'1st token p50':>14} {'p95':>8} "
                  f"{'tokens/s':>9}"]
        for n in (1, 4, 16):
            for who in ("packserve", "router"):
                runs = [r[f"streams_{n}"] for r in peer["rounds"] if r["server"] == who]
                if runs:
                    def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
                        return sorted(r[key] for r in runs)[len(runs) // 2]
                    lines.append(f"{n:<8} {who:<10} {med('first_token_p50_s'):>14} "
                                 f"{med('first_token_p95_s'):>8} {med('tokens_per_s'):>9}")
    if chat_d and chat_d.get("cuda_context_bytes") is not None:
        buffers = ", ".join(f"{k} {_mib(v)}" for k, v in chat_d["device_buffers"].items())
        lines.append(f"\nllama-server's CUDA context: {_mib(chat_d['cuda_context_bytes'])} "
                     f"(NVML's {_mib(chat_d['process_bytes'])} for its process less {buffers})")
    return "\n".join(lines) + "\n"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="work folder: models, configs")
    parser.add_argument("--report", type=Path, help="report.json and report.txt (--out)")
    parser.add_argument("--logs", type=Path, help="the servers' and pytest's logs (--out)")
    parser.add_argument("--llama-server", required=True, help="the CUDA llama-server binary")
    parser.add_argument("--packserve", required=True, help="the packserve command")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tests", help="a packserve source tree whose gpu-marked tests to run")
    parser.add_argument("--deadline", type=float, default=360.0, help="seconds for everything")
    parser.add_argument("--llama-shape", choices=("1b", "tiny"), default="1b",
                        help="the GGUF: Llama-3.2-1B's shape in Q8_0, or 4 layers of 512 in f16")
    parser.add_argument("--only", help="comma-separated steps to run (the rest are skipped)")
    args = parser.parse_args(argv)
    args.report = args.report or args.out
    args.logs = args.logs or args.out
    for folder in (args.out, args.report, args.logs):
        folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    manifest = HERE.parent / "MANIFEST.txt"  # the prepared folder's: what was built, from what
    # 15 s of the deadline are kept for stopping what is left and writing the table
    report = Report(args.report / "report.json", t0 + args.deadline - 15,
                    cuda=args.device.startswith("cuda"),
                    meta={"device": args.device, "deadline_s": args.deadline,
                          "llama_shape": args.llama_shape,
                          "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "prepared": (manifest.read_text("utf-8").splitlines()[:2]
                                       if manifest.is_file() else None)})
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGTERM, _on_stop)
    signal.signal(signal.SIGINT, _on_stop)
    check = Check(args)
    only = set(args.only.split(",")) if args.only else None
    try:
        report.run_all(check.steps(), only)
    except Stopped as stopped:
        report.meta["stopped"] = f"by {stopped} after {time.monotonic() - t0:.0f} s"
        print(f"gpu-check: stopped by {stopped}: ending the servers", file=sys.stderr)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        check.served = None
        stop_all()
        report.meta["seconds"] = round(time.monotonic() - t0, 1)
        report.meta["failed"] = report.failed()
        report.write()
        text = table(json.loads(report.path.read_text("utf-8")))
        (args.report / "report.txt").write_text(text, "utf-8")
        print(text)
    return 1 if report.meta["failed"] or "stopped" in report.meta else 0


if __name__ == "__main__":
    sys.exit(main())
