"""`python -m benchmarks coldstart`: per model, seconds from cold and from warm to first answer
against the floor set by reading its weights, and the cost of switching between two resident
models.

"Cold" means unloaded from packserve and its files dropped from the page cache with
posix_fadvise(DONTNEED) (what an unprivileged process can do; if the file system ignores it
the read throughput shows it). The split: `read` is the measured cold sequential read of the
same files (the floor), `load` is the rest of packserve's load (its residency load_seconds
minus the read), `first inference` is the rest of the first request. The first of the repeats
also imports the engine's library; the goal on the load is on the median.

"Warm" means offloaded (`POST /v1/residency/NAME/offload`: the engine objects stay, the weights
go back) and its files dropped from the page cache the same way: `restore` is the residency's
restore_seconds, `first inference` the rest of the first request after it, and `warm MiB` what
the warm copy held.

Loads beside traffic: the largest model is loaded while one client keeps asking the resident
embedder, once with the load threads at nice 0 and once at packserve's default `load_nice`
(10): the load's seconds and the embedder's latency during it, side by side.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.common import (
    CHAT_MODEL,
    COMPLETE_MODEL,
    EMBED_MODEL,
    Goal,
    Options,
    Report,
    Server,
    loaded_files,
    median,
    packserve_argv,
    progress,
    request_body,
    run_server,
    write_config,
)

CHUNK = 16 << 20


def drop_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_seconds(files: list[Path]) -> float:
    """Sequential read of `files` from a dropped page cache."""
    drop_cache(files)
    t0 = time.perf_counter()
    for f in files:
        with f.open("rb", buffering=0) as fh:
            while fh.read(CHUNK):
                pass
    seconds = time.perf_counter() - t0
    drop_cache(files)
    return seconds


def _row(c: httpx.Client, name: str) -> dict[str, Any]:
    for m in c.get("/v1/residency").json()["models"]:
        if m["name"] == name:
            return dict(m)
    raise KeyError(name)


def _load_seconds(c: httpx.Client, name: str) -> float:
    return float(_row(c, name)["load_seconds"] or 0.0)


def _from_warm(c: httpx.Client, name: str, files: list[Path], seed: int
               ) -> dict[str, float] | None:
    """Offload `name`, drop its files from the page cache, and time the first answer; None
    when its engine keeps no warm state (a llama-server runner: the offload left it cold)."""
    offload = c.post(f"/v1/residency/{name}/offload")
    offload.raise_for_status()
    if offload.json()["state"] == "cold":
        return None
    if offload.json()["state"] != "warm":
        raise RuntimeError(f"{name} did not go warm: {offload.text}")
    held = _row(c, name)["bytes_warm"]
    drop_cache(files)
    total = _timed(c, name, seed=seed)
    restore = float(_row(c, name)["restore_seconds"])
    return {"restore_s": restore, "first_inference_s": total - restore,
            "first_answer_s": total, "warm_bytes": float(held)}


def _timed(c: httpx.Client, name: str, seed: int = 0) -> float:
    path, body = request_body(name, max_tokens=1, seed=seed)
    t0 = time.perf_counter()
    c.post(path, json=body).raise_for_status()
    return time.perf_counter() - t0


def run(opts: Options) -> Report:
    models = (EMBED_MODEL,) if opts.quick else (EMBED_MODEL, CHAT_MODEL, COMPLETE_MODEL)
    repeats = 1 if opts.quick else 5  # the floor moves 2-3x between runs (the disk)
    switches = 4 if opts.quick else 20
    config = write_config(opts.out / "work" / "coldstart.toml", opts)
    report = Report("coldstart")
    rows: list[list[object]] = []
    warm_rows: list[list[object]] = []
    per_model: dict[str, dict[str, object]] = {}
    with progress(opts, "coldstart", len(models) * repeats + 1) as advance, run_server(
            packserve_argv("--config", str(config), "--models", ",".join(models)),
            log=opts.out / "work" / "coldstart-server.log") as server, server.client() as c:
        for name in models:
            files = loaded_files(name, opts)
            size = sum(f.stat().st_size for f in files)
            runs, warm_runs = [], []
            for i in range(repeats):
                c.post(f"/v1/residency/{name}/unload")  # 409 when already cold: fine
                floor = read_seconds(files)
                total = _timed(c, name, seed=i)
                load = _load_seconds(c, name)
                hot = median([_timed(c, name, seed=i + 10 + k) for k in range(3)])
                runs.append({"read_floor_s": floor, "load_s": load, "first_answer_s": total,
                             "first_inference_s": total - load, "hot_request_s": hot})
                warmed = _from_warm(c, name, files, seed=i + 20)
                if warmed is not None:
                    warm_runs.append(warmed)
                advance(1, f"{name} #{i + 1}")
            med = {k: median([float(r[k]) for r in runs]) for k in runs[0]}
            warm = {k: median([r[k] for r in warm_runs]) for k in warm_runs[0]} \
                if warm_runs else None
            floor = med["read_floor_s"]
            hot_bytes = _row(c, name)["bytes_measured"]
            per_model[name] = {"file_bytes": size, "read_mib_per_s": size / floor / (1 << 20),
                               "runs": runs, "median": med,
                               "ratio_to_floor": med["first_answer_s"] / floor,
                               "warm_runs": warm_runs, "warm_median": warm,
                               "hot_bytes": hot_bytes}
            rows.append([name, round(size / (1 << 20), 1), round(size / floor / (1 << 20)),
                         floor, max(0.0, med["load_s"] - floor), med["first_inference_s"],
                         med["first_answer_s"], med["first_answer_s"] / floor])
            report.goals.append(Goal(f"coldstart: {name}, cold load / read floor",
                                     med["load_s"] / floor, 3.0, "<=",
                                     "median of the repeats; the first imports the engine"))
            if warm is None:  # a runner: an offload ends its process
                warm_rows.append([name, round(hot_bytes / (1 << 20), 1), "no warm state",
                                  floor, None, None, None, None, None])
                continue
            warm_rows.append([name, round(hot_bytes / (1 << 20), 1),
                              round(warm["warm_bytes"] / (1 << 20), 1), floor,
                              warm["restore_s"], warm["restore_s"] / floor,
                              warm["first_inference_s"], warm["first_answer_s"],
                              warm["first_answer_s"] / floor])
            report.goals.append(Goal(f"coldstart: {name}, warm restore / read floor",
                                     warm["restore_s"] / floor, 1.5, "<="))
        # Switching between two resident models: latency of A after B against A after A.
        a, b = models[0], models[-1] if len(models) > 1 else models[0]
        same, switched = [], []
        for i in range(switches):
            _timed(c, a, seed=i)
            same.append(_timed(c, a, seed=i + 1))
            _timed(c, b, seed=i)
            switched.append(_timed(c, a, seed=i + 2))
        advance(1, "switching")
    switch: dict[str, Any] = {
              "a": a, "b": b, "a_after_a_s": median(same), "a_after_b_s": median(switched),
              "cost_s": median(switched) - median(same),
              "ratio": median(switched) / median(same)}
    report.results = {
        "models": per_model, "switch": switch,
        "cold": "unloaded, then posix_fadvise(DONTNEED) on its files",
        "tables": [{"columns": ["model", "file MiB", "read MiB/s", "read (floor) s",
                                "load s (beyond read)", "first inference s",
                                "cold to first answer s", "÷ floor"], "rows": rows},
                   {"columns": ["model", "hot MiB", "warm MiB", "read (floor) s", "restore s",
                                "restore ÷ floor", "first inference s",
                                "warm to first answer s", "÷ floor"], "rows": warm_rows}],
    }
    report.goals.append(Goal(f"coldstart: switch {b} -> {a}, latency after switch / after same",
                             switch["ratio"], 1.1, "<=", "should be nothing: 1.0"))
    beside = loads_beside_traffic(opts, 1 if opts.quick else 3)
    report.results["loads_beside_traffic"] = beside
    report.results["tables"].append({
        "columns": ["load_nice", "load of", "load s (median)", "embed p50 s during loads",
                    "embed p95 s during loads", "embed p50 s alone"],
        "rows": [[r["load_nice"], r["model"], r["load_s"], r["embed_p50_s"], r["embed_p95_s"],
                  r["embed_alone_p50_s"]] for r in beside]})
    return report


def loads_beside_traffic(opts: Options, repeats: int) -> list[dict[str, Any]]:
    """For load_nice 0 and 10: load the largest model `repeats` times while one client asks
    the resident embedder; the loads' seconds and the embedder's latency meanwhile."""
    big = EMBED_MODEL if opts.quick else COMPLETE_MODEL
    out = []
    for nice in (0, 10):
        config = write_config(opts.out / "work" / f"coldstart-nice{nice}.toml", opts,
                              server_extra=f"load_nice = {nice}")
        models = sorted({EMBED_MODEL, big})
        with run_server(packserve_argv("--config", str(config), "--models", ",".join(models)),
                        log=opts.out / "work" / f"coldstart-nice{nice}.log") as server, \
                server.client() as c:
            alone = [_timed(c, EMBED_MODEL, seed=k) for k in range(10)]
            during: list[float] = []
            loads = []
            for _ in range(repeats):
                c.post(f"/v1/residency/{big}/unload")
                if big == EMBED_MODEL:  # --quick: the embedder reloads itself; nothing beside
                    c.post(f"/v1/residency/{big}/load").raise_for_status()
                    loads.append(_load_seconds(c, big))
                    continue
                stop = threading.Event()
                asker = threading.Thread(target=_ask_until, args=(server, stop, during))
                asker.start()
                try:
                    c.post(f"/v1/residency/{big}/load").raise_for_status()
                finally:
                    stop.set()
                    asker.join(60)
                loads.append(_load_seconds(c, big))
        out.append({"load_nice": nice, "model": big, "load_s": median(loads), "loads_s": loads,
                    "embed_alone_p50_s": median(alone),
                    "embed_p50_s": median(during) if during else None,
                    "embed_p95_s": float(np.percentile(during, 95)) if during else None})
    return out


def _ask_until(server: Server, stop: threading.Event, latencies: list[float]) -> None:
    """One client asking the embedder, one request after another, until `stop`."""
    with server.client() as c:
        while not stop.is_set():
            latencies.append(_timed(c, EMBED_MODEL, seed=len(latencies)))
