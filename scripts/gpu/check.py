"""The prepared GPU check's steps on the card (scripts/gpu-check.sh --prepared runs this with the
virtual environment it made): one JSON report and one table.

Each step is independent: a step that fails is recorded with its error and the next one runs.
The whole run keeps within `--deadline` seconds (6 minutes); a step that would start after it is
recorded as skipped. Only the standard library and nvidia-ml-py (`pynvml`) are imported here;
the tiny models come from tiny_models.py next to this file (numpy, gguf; the BERT with torch and
sentence-transformers, which the GPU machine has).

    python check.py --out OUT --llama-server BIN --packserve BIN [--device cuda:0] [--tests DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import http.client
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MiB = 1 << 20
LLAMA, BERT = "tiny-llama", "tiny-bert"
PROMPT = [{"role": "user", "content": "hello world, what is the answer to this question"}]
GEN_TOKENS = 128


# -- the report -------------------------------------------------------------------------------

@dataclass
class Report:
    """Steps in the order they ran, each {ok, seconds, result | error}; written after every
    step, so a run cut short still leaves what it had."""

    path: Path
    deadline: float
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def run(self, name: str, fn: Callable[[], Any], *, needs: float = 0.0) -> Any:
        left = self.deadline - time.monotonic()
        if left < needs:
            self.steps[name] = {"ok": False, "skipped": f"time: {left:.0f} s left of the "
                                f"deadline, the step needs about {needs:.0f} s"}
            self.write()
            return None
        start = time.monotonic()
        print(f"gpu-check: {name} ...", file=sys.stderr, flush=True)
        try:
            result = fn()
        except Exception as exc:  # one failing step is recorded; the others go on
            self.steps[name] = {"ok": False, "seconds": round(time.monotonic() - start, 2),
                                "error": f"{type(exc).__name__}: {exc}",
                                "trace": traceback.format_exc(limit=4)}
            print(f"gpu-check: {name} FAILED: {exc}", file=sys.stderr, flush=True)
            result = None
        else:
            self.steps[name] = {"ok": True, "seconds": round(time.monotonic() - start, 2),
                                "result": result}
        self.write()
        return result

    def write(self) -> None:
        body = {"check": "packserve prepared GPU check (scripts/gpu-check.sh)", **self.meta,
                "steps": self.steps}
        tmp = self.path.with_suffix(".partial")
        tmp.write_text(json.dumps(body, indent=2, default=str) + "\n", "utf-8")
        tmp.replace(self.path)


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- HTTP (standard library only) ---------------------------------------------------------------

def call(port: int, method: str, path: str, body: object | None = None,
         timeout: float = 120.0) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
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
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    start = time.monotonic()
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
    return {"first_token_s": round(first - start, 4), "tokens": tokens,
            "total_s": round(last - start, 4),
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
        LLAMA: (models / "tiny-llama.gguf", 'tasks = ["chat", "complete"]\n'
                'backend = "llama-server"\ncontext_length = 2048\nparallel = 4\n'),
        BERT: (models / "tiny-bert", 'tasks = ["embed"]\nbackend = "sentence-transformers"\n'),
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
    with log.open("ab") as out:
        proc = subprocess.Popen([packserve, "serve", "--config", str(config)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    served = Served(proc, port, log)
    try:
        try:
            wait_healthy(port, proc, 90, "/healthz")
        except (RuntimeError, TimeoutError) as exc:
            tail = log.read_text("utf-8", errors="replace")[-1200:]
            raise RuntimeError(f"packserve serve: {exc}; its log ends:\n{tail}") from exc
        yield served
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def settle(until: Callable[[], bool], seconds: float = 20.0) -> bool:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if until():
            return True
        time.sleep(0.2)
    return until()


# -- the steps ----------------------------------------------------------------------------------

class Check:
    def __init__(self, args: argparse.Namespace, report: Report) -> None:
        self.args = args
        self.report = report
        self.out: Path = args.out
        self.models = self.out / "models"
        self.device: str = args.device
        self.nvml: Nvml | None = None
        self.footprint: dict[str, dict[str, Any]] = {}
        self.planned: dict[str, int] = {}

    # environment and models
    def environment(self) -> dict[str, Any]:
        env: dict[str, Any] = {"python": sys.version.split()[0], "host": platform.node(),
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
        if not self.device.startswith("cuda"):
            return env  # a rehearsal on the CPU (--device cpu): no NVML, no CUDA0
        self.nvml = Nvml(int(self.device.partition(":")[2] or 0))
        env["gpu"] = self.nvml.describe()
        if "CUDA0" not in devices.stdout + devices.stderr:
            raise RuntimeError(f"llama-server lists no CUDA0: {env['llama_server_devices']}")
        return env

    def tiny_model(self, name: str) -> dict[str, Any]:
        import tiny_models

        self.models.mkdir(parents=True, exist_ok=True)
        if name == LLAMA:
            path = tiny_models.write_gguf(self.models / "tiny-llama.gguf")
        else:
            path = tiny_models.write_bert(self.models / "tiny-bert")
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        return {"path": str(path), "bytes": sum(f.stat().st_size for f in files)}

    def plan(self) -> dict[str, Any]:
        config = write_config(self.out / "plan.toml", self.models, free_port(), self.device)
        run = subprocess.run([self.args.packserve, "plan", "--config", str(config), "--json"],
                             capture_output=True, text=True, timeout=120, check=False)
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
    def main_server(self) -> None:
        port = free_port()
        config = self.out / "packserve.toml"
        cm = serving(self.args.packserve, config, self.out / "packserve-serve.log", port)

        def start() -> Served:
            write_config(config, self.models, port, self.device)
            return cm.__enter__()

        served: Served | None = self.report.run("serve", start, needs=60)
        if served is None:  # it failed, and its process is stopped
            return
        try:
            for name in (LLAMA, BERT):
                self.report.run(f"footprint:{name}",
                                functools.partial(self.footprint_of, served, name), needs=30)
            self.report.run("cuda_contexts", lambda: self.contexts(served))
            self.report.run("audit", lambda: self.audit(served, config), needs=20)
            for name in (LLAMA, BERT):
                self.report.run(f"warm_vs_cold:{name}",
                                functools.partial(self.warm_vs_cold, served, name), needs=30)
            self.report.run("sigkill_runner", lambda: self.sigkill(served), needs=40)
            self.report.run("chats_packserve", lambda: chats(port, LLAMA, 4), needs=30)
        finally:
            cm.__exit__(None, None, None)

    def footprint_of(self, served: Served, name: str) -> dict[str, Any]:
        """Load `name`: the scheduler's estimate and measurement, the planner's prediction,
        and NVML's figure for the process that holds it (the runner, or the worker)."""
        nvml = self.nvml
        before_used = nvml.used() if nvml else 0
        before = nvml.processes() if nvml else {}
        t0 = time.monotonic()
        served.admin(name, "load")
        seconds = time.monotonic() - t0
        after = nvml.processes() if nvml else {}
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
        return {**self.footprint[name], "device_row": device}

    def contexts(self, served: Served) -> dict[str, Any]:
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

    def audit(self, served: Served, config: Path) -> dict[str, Any]:
        run = subprocess.run([self.args.packserve, "audit", "--server",
                              f"http://127.0.0.1:{served.port}", "--config", str(config),
                              "--json"], capture_output=True, text=True, timeout=120, check=False)
        if run.returncode != 0:
            raise RuntimeError(f"audit exited {run.returncode}: {run.stderr[-800:]}")
        body: dict[str, Any] = json.loads(run.stdout)
        body["processes"] = [p for p in body.get("processes", []) if p.get("device") != "cpu"]
        return body

    def warm_vs_cold(self, served: Served, name: str) -> dict[str, Any]:
        """Client-side seconds to the first answer from cold (unloaded) and from warm
        (offloaded), each after one answer while hot."""
        first_answer(served.port, name)
        served.admin(name, "unload")
        cold = first_answer(served.port, name)
        served.admin(name, "offload")
        warm_state = served.model(name)["state"]
        warm = first_answer(served.port, name)
        row = served.model(name)
        return {"cold_first_answer_s": round(cold, 4), "warm_first_answer_s": round(warm, 4),
                "state_after_offload": warm_state, "server_load_seconds": row["load_seconds"],
                "server_restore_seconds": row["restore_seconds"],
                "bytes_warm": row["bytes_warm"]}

    def sigkill(self, served: Served) -> dict[str, Any]:
        nvml = self.nvml
        used: Callable[[], int] = nvml.used if nvml else (lambda: 0)
        served.admin(LLAMA, "unload")
        settle(lambda: served.runner_pid() is None, 10)
        base = used()
        served.admin(LLAMA, "load")
        pid = served.runner_pid()
        if pid is None:
            raise RuntimeError("no llama-server runner process found after the load")
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
        with serving(self.args.packserve, config, self.out / "packserve-tight.log", port) as s:
            steps: list[tuple[str, dict[str, str]]] = []
            for name in (LLAMA, BERT, LLAMA):
                first_answer(port, name)
                steps.append((name, {m["name"]: m["state"] for m in s.residency()["models"]}))
        # each answer had to move the other model out (warm or cold): both cannot be hot
        evicted = all(states[BERT if asked == LLAMA else LLAMA] != "hot"
                      for asked, states in steps[1:])
        return {"budget_bytes": budget, "headroom_bytes": headroom, "sizes": size,
                "steps": [{"asked": a, "states": st} for a, st in steps], "evicted": evicted}

    def direct(self) -> dict[str, Any]:
        port = free_port()
        log = self.out / "llama-server-direct.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [self.args.llama_server, "--model", str(self.models / "tiny-llama.gguf"),
                 "--host", "127.0.0.1", "--port", str(port),
                 *(["--device", "CUDA0", "--n-gpu-layers", "all"] if self.nvml
                   else ["--device", "none"]), "--parallel", "4", "--ctx-size", "2048",
                 "--kv-unified", "--jinja", "--no-webui", "--offline"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(port, proc, 60, "/health")
            held = self.nvml.processes().get(proc.pid) if self.nvml else None
            result = chats(port, None, 4)
            result["process_bytes"] = held
            return result
        finally:
            proc.kill()
            proc.wait(10)

    def pytest_gpu(self) -> dict[str, Any]:
        tests = self.args.tests
        if tests is None or not Path(tests).is_dir():
            raise RuntimeError("no tests folder in the prepared folder")
        files = sorted(str(p) for p in Path(tests, "tests").rglob("test_*.py")
                       if "mark.gpu" in p.read_text("utf-8", errors="replace"))
        if not files:
            return {"files": [], "note": "no test is marked gpu"}
        run = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p",
                              "no:cacheprovider", *files], cwd=tests, capture_output=True,
                             text=True, timeout=150, check=False,
                             env={**os.environ, "PACKSERVE_TEST_DEVICE": self.device})
        tail = (run.stdout + run.stderr).strip().splitlines()[-15:]
        if run.returncode not in (0, 5):
            raise RuntimeError(f"pytest exited {run.returncode}: " + "\n".join(tail))
        return {"files": files, "returncode": run.returncode, "tail": tail}


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
                         f"{_mib(r['nvml_process_bytes']):>11}  {r['nvml_process']}")
    ctx = (steps.get("cuda_contexts") or {}).get("result")
    if ctx:
        lines += ["", "CUDA contexts (NVML's process list):"]
        lines += [f"  pid {p['pid']:<8} {_mib(p['bytes']):>11}  {p['role']}"
                  for p in ctx["processes"]]
    wc = {n: steps[f"warm_vs_cold:{n}"]["result"] for n in (LLAMA, BERT)
          if (steps.get(f"warm_vs_cold:{n}") or {}).get("ok")}
    if wc:
        lines += ["", f"{'first answer':<12} {'cold s':>8} {'warm s':>8}"]
        lines += [f"{n:<12} {r['cold_first_answer_s']:>8} {r['warm_first_answer_s']:>8}"
                  for n, r in wc.items()]
    kill = (steps.get("sigkill_runner") or {}).get("result")
    if kill:
        lines.append(f"\nSIGKILL of the runner: device memory back within 64 MiB: "
                     f"{kill['back_where_it_was']} ({_mib(kill['difference_bytes'])} off, "
                     f"{kill['seconds_until_back']} s); next answer {kill['next_answer_s']} s")
    ev = (steps.get("eviction") or {}).get("result")
    if ev:
        lines.append(f"eviction under {_mib(ev['budget_bytes'])}: evicted={ev['evicted']}; "
                     + "; ".join(f"{s['asked']} -> {s['states']}" for s in ev["steps"]))
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
    return "\n".join(lines) + "\n"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="report folder")
    parser.add_argument("--llama-server", required=True, help="the CUDA llama-server binary")
    parser.add_argument("--packserve", required=True, help="the packserve command")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tests", help="a packserve source tree whose gpu-marked tests to run")
    parser.add_argument("--deadline", type=float, default=360.0, help="seconds for everything")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = HERE.parent / "MANIFEST.txt"  # the prepared folder's: what was built, from what
    report = Report(args.out / "report.json", time.monotonic() + args.deadline,
                    meta={"device": args.device, "deadline_s": args.deadline,
                          "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "prepared": (manifest.read_text("utf-8").splitlines()[:2]
                                       if manifest.is_file() else None)})
    check = Check(args, report)
    t0 = time.monotonic()
    report.run("environment", check.environment)
    report.run(f"model:{LLAMA}", lambda: check.tiny_model(LLAMA), needs=10)
    report.run(f"model:{BERT}", lambda: check.tiny_model(BERT), needs=30)
    report.run("plan", check.plan, needs=10)
    check.main_server()
    report.run("eviction", check.eviction, needs=60)
    report.run("chats_llama_server", check.direct, needs=30)
    report.run("pytest_gpu", check.pytest_gpu, needs=30)
    report.meta["seconds"] = round(time.monotonic() - t0, 1)
    report.meta["failed"] = [n for n, s in report.steps.items() if not s["ok"]]
    report.write()
    text = table(json.loads(report.path.read_text("utf-8")))
    (args.out / "report.txt").write_text(text, "utf-8")
    print(text)
    return 1 if report.meta["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
