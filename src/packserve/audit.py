"""`packserve audit`: the Monday checklist in one command.

1. Who holds memory: every process on each GPU (NVML, through nvidia-ml-py) or, on a CPU box,
   the resident memory of processes that look like inference servers; engines holding far
   more than their model needs are flagged.
2. Weights loaded twice: identical weight files (content hash) and models sharing a base,
   across configs (`--config`, repeatable: one process each) and running servers (`--server`).
3. What if these run at the same time: the pinned models plus a named set (`--together a,b`)
   against the device budget, with the verdict and the numbers.

The decisions are pure functions over small dataclasses; NVML and /proc come in as seams.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from packserve.core import memory
from packserve.units import format_bytes

MIB = 1 << 20

# Command lines that look like an inference server (lower-cased substrings).
ENGINE_PATTERNS = ("vllm", "text-generation-launcher", "text-generation-router",
                   "text-embeddings-router", "ollama", "llama-server", "llama_cpp.server",
                   "sglang", "infinity_emb", "tritonserver", "lmdeploy", "packserve serve",
                   "packserve.cli serve", "packserve.worker", "tabbyapi", "koboldcpp",
                   "localai")
WASTE_FACTOR = 3.0  # an engine holding more than 3x its model's need is flagged
GREEDY_SHARE = 0.8  # ... or more than 80% of a card when its model is unknown


# ------------------------------------------------------------------ processes and memory

@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    total_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    command: str
    device: str  # "cuda:N" or "cpu"
    bytes: int
    device_total: int | None
    waste: str | None  # why this holds more than it needs, or None


class Nvml(Protocol):
    """The slice of NVML the audit uses; `NvmlProbe` is the real one, tests inject a fake."""

    def devices(self) -> list[GpuDevice]: ...

    def processes(self, index: int) -> list[tuple[int, int]]:
        """(pid, bytes of device memory) for every process on GPU `index`."""
        ...


class NvmlProbe:
    """The audit's view of NVML (`core.memory.Nvml`, the one reader of it). Construct with
    `open()`; None where there is no GPU."""

    def __init__(self, nvml: memory.GpuList) -> None:
        self._nvml = nvml

    @classmethod
    def open(cls) -> NvmlProbe | None:
        try:
            return cls(memory.Nvml())
        except Exception:  # no package, no driver, no GPU: all mean "no NVML here"
            return None

    def devices(self) -> list[GpuDevice]:
        out = []
        for i in range(self._nvml.count()):
            total, used = self._nvml.memory(i)
            out.append(GpuDevice(index=i, name=self._nvml.name(i), total_bytes=total,
                                 used_bytes=used))
        return out

    def processes(self, index: int) -> list[tuple[int, int]]:
        return [(pid, used or 0) for pid, used in
                self._nvml.processes(index, graphics=True) or []]


def command_of(pid: int, proc: Path = Path("/proc")) -> str:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip() or "?"


def looks_like_engine(command: str) -> bool:
    low = command.lower()
    return any(p in low for p in ENGINE_PATTERNS)


def cpu_engines(proc: Path = Path("/proc")) -> list[tuple[int, str, int]]:
    """(pid, command, RSS bytes) of every process whose command looks like an inference server."""
    page = os.sysconf("SC_PAGE_SIZE")
    out = []
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        command = command_of(int(entry.name), proc)
        if not looks_like_engine(command):
            continue
        try:
            rss = int((entry / "statm").read_text("ascii").split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
        out.append((int(entry.name), command, rss))
    return sorted(out)


def model_params_in(command: str) -> int | None:
    """A parameter count named in a command line (`Qwen3-0.6B`, `llama-3-70b`), if any."""
    m = re.search(r"(?<![\w.])?[-_/:](\d+(?:\.\d+)?)[bB](?![a-zA-Z])", command)
    return round(float(m.group(1)) * 1e9) if m else None


def waste_reason(held: int, device_total: int | None, command: str) -> str | None:
    """Why a process holds far more than its model needs, or None.

    With a parameter count in its command line the need is that model at FP16 (2 bytes per
    parameter) plus 20% and 1 GiB of runtime; a process over `WASTE_FACTOR` times that is
    flagged. Without one, a process holding more than `GREEDY_SHARE` of a card is flagged as
    preallocating (vLLM's gpu_memory_utilization defaults to 0.9).
    """
    params = model_params_in(command)
    share = f" ({held / device_total:.0%} of the card)" if device_total else ""
    if params:
        need = int(params * 2 * 1.2) + (1 << 30)
        if held > WASTE_FACTOR * need:
            return (f"holds {format_bytes(held, decimal=True)}{share} for a "
                    f"~{params / 1e9:g}B model that needs about "
                    f"{format_bytes(need, decimal=True)} at FP16: it preallocates; cap it "
                    f"(e.g. vLLM --gpu-memory-utilization) or serve it from a shared process")
        return None
    if device_total and held > GREEDY_SHARE * device_total:
        return (f"holds {format_bytes(held, decimal=True)}{share}: a preallocating engine "
                f"leaves nothing to "
                f"its neighbours; check what its model needs (`packserve plan`)")
    return None


def audit_processes(nvml: Nvml | None, proc: Path = Path("/proc")) -> list[ProcessMemory]:
    if nvml is not None:
        rows = []
        for dev in nvml.devices():
            for pid, used in nvml.processes(dev.index):
                command = command_of(pid, proc)
                rows.append(ProcessMemory(pid=pid, command=command, device=f"cuda:{dev.index}",
                                          bytes=used, device_total=dev.total_bytes,
                                          waste=waste_reason(used, dev.total_bytes, command)))
        return rows
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return [ProcessMemory(pid=pid, command=command, device="cpu", bytes=rss, device_total=total,
                          waste=waste_reason(rss, total, command))
            for pid, command, rss in cpu_engines(proc)]


# ------------------------------------------------------------------ duplicated weights

@dataclass(frozen=True)
class Load:
    """One catalog name of one process (a config or a server) and the weights it uses."""

    where: str  # the config file or the server URL: one process
    model: str
    load_key: str  # names with equal keys in one process share one load
    path: str
    digest: str  # content hash of the weight files
    bytes: int
    base: str  # the base model the weights derive from ("" unknown)


@dataclass(frozen=True)
class Duplicate:
    kind: str  # "shared" (loaded once), "duplicated" (loaded more than once), "same-base"
    digest: str
    bytes: int  # of one copy
    loads: int  # copies in memory
    wasted_bytes: int
    holders: tuple[str, ...]  # "where: model"
    note: str


def find_duplicates(loads: Sequence[Load]) -> list[Duplicate]:
    """Group loads by content hash: one copy in memory is `shared`, more are `duplicated`;
    different weights with the same base are `same-base`."""
    out: list[Duplicate] = []
    by_digest: dict[str, list[Load]] = {}
    for load in loads:
        by_digest.setdefault(load.digest, []).append(load)
    for digest, group in sorted(by_digest.items(), key=lambda kv: kv[1][0].model):
        if len(group) < 2:
            continue
        copies = len({(g.where, g.load_key) for g in group})
        holders = tuple(f"{g.where}: {g.model}" for g in group)
        size = group[0].bytes
        if copies == 1:
            out.append(Duplicate("shared", digest, size, 1, 0, holders,
                                 f"{len(group)} names share one load in {group[0].where}"))
        else:
            paths = sorted({g.path for g in group})
            out.append(Duplicate(
                "duplicated", digest, size, copies, (copies - 1) * size, holders,
                f"the same weights ({', '.join(paths)}) are loaded {copies} times; serve "
                f"them from one process, or give the names the same load settings"))
    by_base: dict[str, set[str]] = {}
    for load in loads:
        if load.base:
            by_base.setdefault(load.base, set()).add(load.digest)
    for base, digests in sorted(by_base.items()):
        if len(digests) > 1:
            holders = tuple(sorted({f"{g.where}: {g.model}" for g in loads if g.base == base}))
            out.append(Duplicate("same-base", "", 0, len(digests), 0, holders,
                                 f"{len(digests)} different weight files derive from {base}; "
                                 f"one base plus adapters may replace them"))
    return out


def content_digest(path: Path, cache: dict[Path, str] | None = None) -> str:
    """sha256 over a weight file, or over a model directory's weight files in name order."""
    if cache is not None and path in cache:
        return cache[path]
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.suffix in (".safetensors", ".gguf", ".bin", ".pt"))
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    if cache is not None:
        cache[path] = digest
    return digest


def base_of(path: Path) -> str:
    """The base a model declares: a PEFT adapter's `base_model_name_or_path`, else ""."""
    cfg = path / "adapter_config.json" if path.is_dir() else None
    if cfg is None or not cfg.exists():
        return ""
    try:
        data = json.loads(cfg.read_text("utf-8"))
    except (OSError, ValueError):
        return ""
    return str(data.get("base_model_name_or_path") or "")


def config_loads(config_path: str | None, only: Iterable[str] | None = None,
                 where: str | None = None, cache: dict[Path, str] | None = None) -> list[Load]:
    """The loads of every (or `only` the named) model of a config, as one process would."""
    from packserve import backends
    from packserve.config import load_config
    from packserve.server import build_entries

    config = load_config(config_path)
    names = set(only) if only is not None else None
    label = where or (config_path or "<built-in catalog>")
    out = []
    for entry in build_entries(config):
        if not backends.get(entry.load.backend).reads_files or (
                names is not None and entry.spec.name not in names):
            continue
        path = entry.load.path
        out.append(Load(where=label, model=entry.spec.name, load_key=entry.load.key,
                        path=str(path), digest=content_digest(path, cache),
                        bytes=entry.bytes_estimated, base=base_of(path)))
    return out


def server_loads(url: str, config_path: str | None,
                 cache: dict[Path, str] | None = None) -> list[Load]:
    """Hot models of a running server, matched to weight files through its config."""
    import httpx

    data = httpx.get(f"{url.rstrip('/')}/v1/residency", timeout=10).json()
    hot = {m["name"]: m for m in data["models"] if m["state"] == "hot"}
    loads = config_loads(config_path, only=hot, where=url, cache=cache)
    return [Load(**{**asdict(ld), "bytes": hot[ld.model]["bytes_measured"] or ld.bytes})
            for ld in loads]


# ------------------------------------------------------------------ what runs together

@dataclass(frozen=True)
class Together:
    device: str
    models: tuple[str, ...]  # pinned + named
    need_bytes: int  # shared loads counted once
    capacity_bytes: int  # budget - headroom
    fits: bool
    detail: tuple[str, ...]  # "name: N MiB (measured|estimated)"


def together_verdict(device: str, rows: Sequence[tuple[str, str, int, bool]],
                     capacity: int) -> Together:
    """`rows`: (model, load key, bytes, measured?) for one device; equal keys count once."""
    seen: dict[str, str] = {}
    need = 0
    detail = []
    for name, key, size, measured in rows:
        if key in seen:
            detail.append(f"{name}: shares the load of {seen[key]}")
            continue
        seen[key] = name
        need += size
        how = "measured" if measured else "estimated"
        detail.append(f"{name}: {format_bytes(size, compact=True)} ({how})")
    return Together(device=device, models=tuple(r[0] for r in rows), need_bytes=need,
                    capacity_bytes=capacity, fits=need <= capacity, detail=tuple(detail))


def audit_together(config_path: str | None, named: Sequence[str],
                   measured: dict[str, int] | None = None) -> list[Together]:
    from packserve.config import load_config
    from packserve.core.memory import SystemProbe
    from packserve.errors import ConfigError
    from packserve.server import build_entries, device_budgets

    config = load_config(config_path)
    known = {m.name for m in config.models}
    missing = [n for n in named if n not in known]
    if missing:
        raise ConfigError(f"--together names {', '.join(missing)}, not in the config "
                          f"(it has: {', '.join(sorted(known))})")
    entries = [e for e in build_entries(config) if e.spec.pin or e.spec.name in named]
    budgets = {b.name: b for b in device_budgets(config, {e.load.device for e in entries},
                                                 SystemProbe())}
    measured = measured or {}
    out = []
    for device in sorted({e.load.device for e in entries}):
        rows = [(e.spec.name, e.load.key, measured.get(e.spec.name, e.bytes_estimated),
                 e.spec.name in measured) for e in entries if e.load.device == device]
        b = budgets[device]
        out.append(together_verdict(device, rows, b.budget_bytes - b.headroom_bytes))
    return out


# ------------------------------------------------------------------ the command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", help="a packserve config (repeat for several "
                                                     "processes); default: the built-in catalog")
    p.add_argument("--server", action="append", default=[],
                   help="a running packserve, e.g. http://127.0.0.1:8000 (repeatable)")
    p.add_argument("--together", action="append", default=[],
                   help="models that must run at the same time, comma-separated (repeatable)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def build_audit(args: argparse.Namespace, nvml: Nvml | None = None,
                proc: Path = Path("/proc")) -> dict[str, object]:
    configs: list[str | None] = list(args.config or [None])
    cache: dict[Path, str] = {}
    loads: list[Load] = []
    measured: dict[str, int] = {}
    if args.server:
        for url in args.server:
            loads += server_loads(url, configs[0], cache)
        for ld in loads:
            measured[ld.model] = ld.bytes
    else:
        for c in configs:
            loads += config_loads(c, cache=cache)
    togethers = [audit_together(configs[0], [n.strip() for n in group.split(",") if n.strip()],
                                measured)
                 for group in (args.together or [""])]
    return {
        "gpu": nvml is not None,
        "processes": [asdict(p) for p in audit_processes(nvml, proc)],
        "duplicates": [asdict(d) for d in find_duplicates(loads)],
        "together": [asdict(t) for group in togethers for t in group],
    }


def run_audit(args: argparse.Namespace) -> int:
    from packserve.errors import ConfigError

    try:
        report = build_audit(args, NvmlProbe.open())
    except (ConfigError, OSError) as exc:
        print(f"packserve audit: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # an unreachable --server surfaces as httpx errors
        print(f"packserve audit: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_audit(report)
    together = report["together"]
    assert isinstance(together, list)
    return 0 if all(t["fits"] for t in together) else 3  # 3: a named set does not fit


def print_audit(report: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120)
    procs = report["processes"]
    assert isinstance(procs, list)
    where = "GPU processes (NVML)" if report["gpu"] else "inference-like processes (RSS, no GPU)"
    t = Table("PID", "DEVICE", "HOLDS", "COMMAND", "FLAG", title=f"1. who holds memory: {where}")
    for p in procs:
        t.add_row(str(p["pid"]), p["device"], f"{format_bytes(p['bytes'], compact=True)}",
                  p["command"][:60], p["waste"] or "")
    console.print(t)
    dups = report["duplicates"]
    assert isinstance(dups, list)
    console.print("[bold]2. weights loaded twice[/]" + ("" if dups else ": none"))
    for d in dups:
        console.print(f"  {d['kind']}: {d['note']}"
                      + (f" (wastes {format_bytes(d['wasted_bytes'], compact=True)})"
                         if d["wasted_bytes"] else ""))
        for h in d["holders"]:
            console.print(f"    - {h}")
    together = report["together"]
    assert isinstance(together, list)
    console.print("[bold]3. what if these run at the same time[/]")
    for g in together:
        verdict = "fits" if g["fits"] else "DOES NOT FIT"
        console.print(f"  {g['device']}: {', '.join(g['models']) or '(nothing pinned)'} -> "
                      f"{verdict}: needs {format_bytes(g['need_bytes'], compact=True)} of "
                      f"{format_bytes(g['capacity_bytes'], compact=True)} (budget - headroom)")
        for line in g["detail"]:
            console.print(f"    - {line}")
