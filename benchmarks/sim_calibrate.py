"""`python -m benchmarks sim --calibrate`: the CPU box's figures, measured through the real server
(`benchmarks.policy_server`, with a budget that holds every model): loads, unloads and the
stall before a GGUF load, each request type alone at the trace's sizes, the warm-up of a first
request, and an embedding beside a generation. `bench.sim` saves what it returns and
`bench.sim_catalog.cpu_box` reads it.

Every request has a text of its own (a new seed), as in a trace: llama.cpp reuses the cached
prefix of a prompt it has just seen, and a repeated request would be faster.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import httpx
import numpy as np

from benchmarks.common import (
    CATALOG,
    CHAT_MODEL,
    COMPLETE_MODEL,
    EMBED_MODEL,
    TASK_OF,
    Options,
    checkout_env,
    machine,
    progress,
    request_body,
    run_server,
    write_config,
)
from packserve.replay import MAX_TOKENS, PROMPT_WORDS

REPEATS = 3  # loads and unloads per set of weights; samples per request size
CONTENTION_ROUNDS = 2


def calibrate(opts: Options) -> dict[str, Any]:
    """Measure the default catalog on this machine through the real server: loads, unloads,
    each request type alone at the trace's sizes, and one embedding beside a generation."""
    work = opts.out / "work"
    config = write_config(work / "sim-calibrate.toml", opts, memory_budget="3GiB",
                          headroom="16MiB")
    argv = [sys.executable, "-m", "benchmarks.policy_server", "--config", str(config),
            "--policy", "lru_by_bytes"]
    words = [w for w, _ in PROMPT_WORDS]
    tokens = [t for t, _ in MAX_TOKENS]
    keys = (EMBED_MODEL, CHAT_MODEL, COMPLETE_MODEL)
    steps = 2 * len(keys) * REPEATS + REPEATS * sum(
        len(words) * (len(tokens) if TASK_OF[m] in ("chat", "complete") else 1)
        for m in CATALOG) + 1
    seeds = itertools.count(1000)
    weights: dict[str, Any] = {}
    service: dict[str, Any] = {}
    samples: list[dict[str, Any]] = []
    with run_server(argv, log=work / "sim-calibrate.log", env=checkout_env()) as server, \
            server.client() as c, progress(opts, "sim calibrate", steps) as advance:
        for key in keys:
            loads, unloads, extra = [], [], []
            for _ in range(REPEATS):
                c.post(f"/v1/residency/{key}/load").raise_for_status()
                row = _row(c, key)
                loads.append(float(row["load_seconds"]))
                unloads.append(_wall(c, f"/v1/residency/{key}/unload"))
                # A request to the cold model: the load, then its first request; beyond the
                # load's own seconds and a request of the same size once hot, a warm-up.
                cold = _timed(c, key, 32, 16, next(seeds))
                hot = _timed(c, key, 32, 16, next(seeds))
                extra.append(cold - hot - float(_row(c, key)["load_seconds"]))
                c.post(f"/v1/residency/{key}/unload").raise_for_status()
                advance(1)
            weights[key] = {"bytes": int(row["bytes_measured"] or row["bytes_estimated"]),
                            "load_s": statistics.median(loads), "loads_s": loads,
                            "unload_s": statistics.median(unloads),
                            "warmup_s": max(0.0, statistics.median(extra)), "warmups_s": extra}
        for key in keys:  # the warm tier: to warm (offload), back (restore), to cold
            offloads, restores, drops, kept = [], [], [], []
            for _ in range(REPEATS):
                c.post(f"/v1/residency/{key}/load").raise_for_status()
                offloads.append(_wall(c, f"/v1/residency/{key}/offload"))
                kept.append(int(_row(c, key)["bytes_warm"] or 0))
                c.post(f"/v1/residency/{key}/load").raise_for_status()
                restores.append(float(_row(c, key)["restore_seconds"]))
                c.post(f"/v1/residency/{key}/offload").raise_for_status()
                drops.append(_wall(c, f"/v1/residency/{key}/unload"))
                advance(1)
            weights[key].update({"restore_s": statistics.median(restores),
                                 "restores_s": restores,
                                 "offload_s": statistics.median(offloads),
                                 "keeps_bytes": int(statistics.median(kept)),
                                 "drop_s": statistics.median(drops)})
        for key in keys:
            c.post(f"/v1/residency/{key}/load").raise_for_status()
        for model in CATALOG:
            generates = TASK_OF[model] in ("chat", "complete")
            _timed(c, model, 8, 8, next(seeds))  # its first request: the warm-up, above
            for _ in range(REPEATS):
                for w in words:
                    for t in (tokens if generates else [16]):
                        samples.append({"model": model, "words": w, "max_tokens": t,
                                        "seconds": _timed(c, model, w, t, next(seeds))})
                        advance(1)
            service[model] = _fit([s for s in samples if s["model"] == model], generates)
        contention = _contention(c, seeds)
        for key in (CHAT_MODEL, COMPLETE_MODEL):
            stall = _stall(c, key, seeds)
            weights[key]["stall_s"] = stall["stall_s"]
            weights[key]["stall"] = stall
            # What a cold request paid beyond the load included the stall: not twice.
            weights[key]["warmup_s"] = max(0.0, statistics.median(weights[key]["warmups_s"])
                                           - stall["stall_s"])
        advance(1)
    return {"source": "measured", "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine(), "weights": weights, "service": service,
            "samples": samples, "contention": contention}


def _row(c: httpx.Client, name: str) -> dict[str, Any]:
    return dict(next(m for m in c.get("/v1/residency").json()["models"] if m["name"] == name))


def _wall(c: httpx.Client, path: str) -> float:
    """Seconds an admin POST takes, through the HTTP API."""
    t0 = time.perf_counter()
    c.post(path).raise_for_status()
    return time.perf_counter() - t0


def _timed(c: httpx.Client, model: str, words: int, max_tokens: int, seed: int) -> float:
    path, body = request_body(model, words=words, max_tokens=max_tokens, seed=seed)
    t0 = time.perf_counter()
    c.post(path, json=body).raise_for_status()
    return time.perf_counter() - t0


def _fit(rows: Sequence[Mapping[str, Any]], generates: bool) -> dict[str, float]:
    """Least squares: seconds = base + per_word * words (+ per_token * max_tokens)."""
    cols = [[1.0, float(r["words"])] + ([float(r["max_tokens"])] if generates else [])
            for r in rows]
    coef = np.linalg.lstsq(np.array(cols), np.array([r["seconds"] for r in rows]),
                           rcond=None)[0].tolist()
    return {"base_s": round(coef[0], 5), "per_word_s": round(max(coef[1], 0.0), 6),
            "per_token_s": round(max(coef[2], 0.0), 6) if generates else 0.0}


def _contention(c: httpx.Client, seeds: Iterator[int]) -> dict[str, Any]:
    """A 96-word embedding alone, then while a 64-token completion runs; that completion alone,
    then beside the embeddings (the simulator, without loss, predicts 2/3 speed for both)."""
    alone = [_timed(c, EMBED_MODEL, 96, 16, next(seeds)) for _ in range(5)]
    gen_alone: list[float] = []
    gen_beside: list[float] = []
    beside: list[float] = []
    for _ in range(CONTENTION_ROUNDS):
        gen_alone.append(_timed(c, COMPLETE_MODEL, 32, 64, next(seeds)))
        seed = next(seeds)

        def generate(seed: int = seed) -> None:
            with httpx.Client(base_url=str(c.base_url), timeout=300) as other:
                gen_beside.append(_timed(other, COMPLETE_MODEL, 32, 64, seed))

        thread = threading.Thread(target=generate)
        thread.start()
        time.sleep(0.2)
        for _ in _until(thread):
            beside.append(_timed(c, EMBED_MODEL, 96, 16, next(seeds)))
        thread.join()
    return {"embed_alone_s": statistics.median(alone),
            "embed_beside_generation_s": statistics.median(beside) if beside else None,
            "embeds_beside": len(beside), "generation_alone_s": statistics.median(gen_alone),
            "generation_beside_embeds_s": statistics.median(gen_beside) if gen_beside
            else None}


def _stall(c: httpx.Client, key: str, seeds: Iterator[int]) -> dict[str, Any]:
    """Embeddings sent back to back while `key` loads: one of them waits for the load's
    Python-side start (its GGUF header check holds the interpreter lock); the others run
    beside the load. The stall is the slowest one less the median."""
    rounds: list[list[float]] = []
    for _ in range(CONTENTION_ROUNDS):
        c.post(f"/v1/residency/{key}/unload").raise_for_status()

        def load() -> None:
            with httpx.Client(base_url=str(c.base_url), timeout=300) as other:
                other.post(f"/v1/residency/{key}/load").raise_for_status()

        thread = threading.Thread(target=load)
        thread.start()
        rounds.append([_timed(c, EMBED_MODEL, 32, 16, next(seeds)) for _ in _until(thread)])
        thread.join()
    stalls = [max(r) - statistics.median(r) for r in rounds if len(r) >= 3]
    return {"stall_s": statistics.median(stalls) if stalls else 0.0,
            "embeds_beside_load_s": rounds}


def _until(thread: threading.Thread) -> Iterator[int]:
    i = 0
    while thread.is_alive() and i < 50:
        yield i
        i += 1
