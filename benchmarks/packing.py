"""`python -m benchmarks packing`: the default mix in one packserve server, against two baselines,
all running at the same time, every model loaded by one request:

- one packserve server per catalog entry (`packserve serve --models NAME`);
- one bare engine process per distinct weights file, no packserve: sentence-transformers for
  MiniLM (the embedder and the reranker share it; no HTTP server at all), and for each GGUF
  (SmolLM2's two entries share one) llama.cpp's own `llama-server` run directly on it, the
  binary packserve's runners run (`router.direct_argv`: the catalog's context, every core, its
  default slots), each after one inference, so that its weights are paged in.

Memory is PSS (the sum of `Pss` in /proc/PID/smaps_rollup) of each setup's processes, the
server's worker and any other child included. Everything compared runs at once, so a page that
several processes share (libpython, torch's libraries, the one llama-server binary that
packserve's runners run too) is split between all of them the same way; a sum of RSS would
count it once per process. On a GPU the same comparison would read device memory; this machine
has none, so it is skipped.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks import router
from benchmarks.common import (
    CATALOG,
    EMBED_MODEL,
    MIB,
    RERANK_MODEL,
    Goal,
    Options,
    Report,
    Server,
    model_path,
    packserve_argv,
    progress,
    ratio,
    request_body,
    run_server,
    write_config,
)
from benchmarks.overhead import N_CTX  # the catalog's context, for bare GGUF loads too
from benchmarks.reliability import descendants, process_memory

BARE_TORCH = """
import sys
from sentence_transformers import SentenceTransformer
SentenceTransformer(sys.argv[1], device="cpu").encode(["a sentence to embed"])
print("ready", flush=True)
sys.stdin.read()  # until the bench closes it
"""


def _label(weights: Path) -> str:
    """A GGUF by its file name; a model directory by its package too (`.../NAME/model`)."""
    return f"{weights.parent.name}/{weights.name}" if weights.is_dir() else weights.name


def _pss(pid: int) -> int:
    """PSS of `pid` and all its descendants, in bytes."""
    total = 0
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError):
            total += process_memory(p)["pss_bytes"]
    return total


@contextlib.contextmanager
def _bare(path: Path, log: Path) -> Iterator[int]:
    """A bare engine process holding `path`, loaded and warmed; yields its pid."""
    if path.suffix == ".gguf":
        with _bare_llama_server(path, log) as pid:
            yield pid
        return
    with log.open("ab") as sink:
        proc = subprocess.Popen([sys.executable, "-c", BARE_TORCH, str(path)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if b"ready" not in line:
            raise RuntimeError(f"the bare engine for {path} did not start; see {log}")
        yield proc.pid
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def _bare_llama_server(path: Path, log: Path) -> Iterator[int]:
    """llama-server run directly on the GGUF `path` (raises router.Unavailable without one),
    having answered one completion; yields its pid."""
    with run_server(router.direct_argv(router.binary(), path, N_CTX), health="/health",
                    log=log) as server, server.client() as c:
        c.post("/completion", json={"prompt": "Hello", "n_predict": 4}).raise_for_status()
        yield server.pid


def _server(stack: contextlib.ExitStack, opts: Options, models: tuple[str, ...],
            name: str) -> Server:
    config = write_config(opts.out / "work" / "packing.toml", opts)
    server = stack.enter_context(run_server(
        packserve_argv("--config", str(config), "--models", ",".join(models)),
        log=opts.out / "work" / f"{name}.log"))
    with server.client() as c:
        for m in models:
            path, body = request_body(m, max_tokens=4)
            c.post(path, json=body).raise_for_status()
    return server


def run(opts: Options) -> Report:
    models = (EMBED_MODEL, RERANK_MODEL) if opts.quick else CATALOG
    weights = sorted({model_path(m, opts) for m in models})
    report = Report("packing")
    with progress(opts, "packing", 1 + len(models) + len(weights)) as advance, \
            contextlib.ExitStack() as stack:
        packed = _server(stack, opts, models, "packing-packed")
        advance(1, "one server, all models")
        separate: dict[str, Server] = {}
        for m in models:
            separate[m] = _server(stack, opts, (m,), f"packing-{m}")
            advance(1, f"own server: {m}")
        bare: dict[Path, int] = {}
        for w in weights:
            bare[w] = stack.enter_context(_bare(w, opts.out / "work" / "packing-bare.log"))
            advance(1, f"bare engine: {w.name}")
        time.sleep(1.0)  # every process idle, every model loaded: read them all together
        packed_pss = _pss(packed.pid)
        separate_pss = {m: _pss(s.pid) for m, s in separate.items()}
        bare_pss = {w: _pss(pid) for w, pid in bare.items()}
    total_separate, total_bare = sum(separate_pss.values()), sum(bare_pss.values())
    rows: list[list[object]] = [
        ["one packserve server, all models (front + worker)", len(models),
         round(packed_pss / MIB, 1)],
        *[[f"own packserve server: {m}", 1, round(v / MIB, 1)] for m, v in separate_pss.items()],
        ["sum of the per-model servers", len(models), round(total_separate / MIB, 1)],
        *[[f"bare engine process: {_label(w)}", sum(model_path(m, opts) == w for m in models),
           round(v / MIB, 1)] for w, v in bare_pss.items()],
        ["sum of the bare engine processes", len(models), round(total_bare / MIB, 1)],
    ]
    report.results = {
        "models": list(models), "weights": [str(w) for w in weights],
        "packed_pss_bytes": packed_pss, "separate_pss_bytes": separate_pss,
        "bare_pss_bytes": {str(w): v for w, v in bare_pss.items()},
        "ratio_per_model_servers": ratio(packed_pss, total_separate),
        "ratio_bare_engines": ratio(packed_pss, total_bare),
        "gpu": "no GPU on this machine: device memory and card count not measured",
        "tables": [{"columns": ["setup", "models", "PSS, all loaded, all running (MiB)"],
                    "rows": rows}],
    }
    report.goals = [
        Goal("packing: PSS, one server / one server per model", ratio(packed_pss, total_separate),
             0.5, "<="),
        Goal("packing: PSS, one server / one bare engine process per weights file",
             ratio(packed_pss, total_bare), 1.05, "<="),
    ]
    report.notes += [
        "every setup runs at the same time when memory is read (PSS splits shared pages "
        "between all of them)",
        "GPU part (device memory, cards needed with default preallocation): not measured, no "
        "GPU on this machine",
    ]
    return report
