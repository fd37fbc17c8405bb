"""The parts of `python -m benchmarks sizes` with more than one model or more than one server
(issue 41): the runner beside llama-server run directly with the runner's own arguments, every
request switching between two files against llama.cpp's router at `--models-max 1`, several
models competing for one budget, and a file's pages dropped for a cold load.

Requests send token ids (the weights are random, answers are noise) and generate with
`ignore_eos` to fixed lengths; every timing is the client's.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import random
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks import router
from benchmarks.common import (
    MIB,
    descendants,
    median,
    packserve_argv,
    quantile,
    ratio,
    rss_bytes,
    run_server,
)

FIRST_ID = 300  # ids below this are the vocabulary's specials, bytes and letters


def prompt_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


# ---------------------------------------------------------------------- the page cache


def cached_share(path: Path) -> float:
    """The share of `path`'s pages in the page cache (mincore over a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with path.open("rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
    try:
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        return sum(b & 1 for b in bytes(vec)) / pages
    finally:
        libc.munmap(addr, size)


def drop_from_page_cache(path: Path) -> float:
    """Ask the kernel to drop `path`'s pages (posix_fadvise DONTNEED: unprivileged, effective
    once no process maps them and they are written back); the share still cached after."""
    with path.open("rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return cached_share(path)


# ---------------------------------------------------------------------- streamed timings


def stream_timing(url: str, path: str, body: dict[str, Any]) -> tuple[float, float]:
    """(seconds to the first token, decode tokens/s after it) of a streamed completion of
    `body["max_tokens"]` tokens (EOS ignored), as the client reads the events. A connection
    of its own: llama-server closes one after a stream without saying so, and a pooled one
    would fail the next request."""
    t0 = time.monotonic()
    first = last = None
    with httpx.Client(base_url=url, timeout=1800) as c, \
            c.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            if '"text":""' in line.replace(" ", ""):
                continue
            now = time.monotonic()
            first = first if first is not None else now
            last = now
    if first is None or last is None:
        raise RuntimeError(f"{path}: no token streamed")
    n = int(body["max_tokens"])
    return first - t0, (n - 1) / (last - first) if last > first else 0.0


def runner_argv(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


def direct_argv(argv: Sequence[str]) -> list[str]:
    """The runner's command line with its unix socket swapped for 127.0.0.1 (run_server adds
    the port): llama-server given exactly the runner's arguments."""
    out = list(argv)
    out[out.index("--host") + 1] = "127.0.0.1"
    return out


def versus_direct(c: httpx.Client, name: str, argv: Sequence[str], vocab: int, rounds: int,
                  prompt: int, decode: int, log: Path) -> dict[str, Any]:
    """Prefill and decode through packserve (its model hot) and through llama-server run
    directly with the runner's own arguments on the same file and cores, `rounds` alternating
    rounds (packserve first in odd ones), each round one new `prompt`-token prompt for both."""
    rng = random.Random(41)
    per: dict[str, dict[str, list[float]]] = {side: {"prefill_tps": [], "decode_tps": []}
                                              for side in ("packserve", "llama-server")}
    with run_server(direct_argv(argv), health="/health", log=log) as direct:
        urls = {"packserve": str(c.base_url), "llama-server": direct.url}
        for r in range(rounds):
            ids = prompt_ids(rng, prompt, vocab)
            order = ("packserve", "llama-server") if r % 2 == 0 else ("llama-server",
                                                                       "packserve")
            for side in order:
                try:
                    ttft, tps = stream_timing(urls[side], "/v1/completions", {
                        "model": name, "prompt": ids, "max_tokens": decode,
                        "ignore_eos": True, "temperature": 0})
                except Exception as exc:
                    raise RuntimeError(f"{side}, round {r + 1}: {exc}") from exc
                per[side]["prefill_tps"].append(prompt / ttft)
                per[side]["decode_tps"].append(tps)
    medians = {side: {k: median(v) for k, v in rows.items()} for side, rows in per.items()}
    return {"rounds": rounds, "prompt_tokens": prompt, "decode_tokens": decode,
            "per_round": per, "medians": medians,
            "prefill_ratio": ratio(medians["packserve"]["prefill_tps"],
                                   medians["llama-server"]["prefill_tps"]),
            "decode_ratio": ratio(medians["packserve"]["decode_tps"],
                                  medians["llama-server"]["decode_tps"])}


# ---------------------------------------------------------------------- several models


def config(path: Path, data: Path, models: Sequence[tuple[str, Path]], context: int,
           budget: str, headroom: str, *, cache: str = "shared", log_level: str = "info"
           ) -> Path:
    """A packserve config serving `models` (name, GGUF) as `complete` models at `context`
    tokens, one request at a time each, with `cache` ("shared" or "per_slot"), on a CPU
    `budget` less `headroom`; its events logged at `log_level` "info"."""
    entries = "".join(
        f'\n[[models]]\nname = "{name}"\ntasks = ["complete"]\nbackend = "llama-server"\n'
        f'source = "{gguf}"\ncontext_length = {context}\nmax_concurrency = 1\n'
        f'parallel_cache = "{cache}"\n' for name, gguf in models)
    roots = sorted({str(g.parent) for _, g in models})
    path.write_text(
        f'[server]\ndata_dir = "{data}"\nlog_level = "{log_level}"\nload_wait_s = 900\n'
        f'load_timeout_s = 900\nmodel_roots = {roots!r}\n'.replace("'", '"')
        + f'[devices.cpu]\nmemory_budget = "{budget}"\nheadroom = "{headroom}"\n' + entries,
        "utf-8")
    return path


def estimates(work: Path, models: Sequence[tuple[str, Path]], context: int) -> dict[str, int]:
    """Each model's estimate before any load (a server started for the question alone)."""
    data = work / "estimates-data"
    shutil.rmtree(data, ignore_errors=True)  # the header's arithmetic, nothing remembered
    data.mkdir(parents=True)
    cfg = config(work / "estimates.toml", data, models, context, "auto", "256MiB")
    with run_server(packserve_argv("--config", str(cfg)), health="/readyz",
                    log=work / "estimates.log") as s, s.client() as c:
        rows = c.get("/v1/residency").raise_for_status().json()["models"]
    return {r["name"]: int(r["bytes_estimated"]) for r in rows}


def complete(c: httpx.Client, name: str, ids: list[int], max_tokens: int) -> float:
    """Seconds the client waits for a completion of `max_tokens` (EOS ignored) after `ids`,
    from packserve or llama.cpp's router (both OpenAI's `/v1/completions`)."""
    t0 = time.monotonic()
    r = c.post("/v1/completions", json={"model": name, "prompt": ids, "max_tokens": max_tokens,
                                         "ignore_eos": True, "temperature": 0})
    waited = time.monotonic() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{name}: completion {r.status_code}: {r.text[:300]}")
    got = r.json()["usage"]["completion_tokens"]
    if got != max_tokens:
        raise RuntimeError(f"{name}: {got} tokens generated, asked {max_tokens}")
    return waited


def switching(work: Path, models: Sequence[tuple[str, Path]], vocab: int, context: int,
              rounds: int, cycles: int) -> dict[str, Any]:
    """Every request switches between the two `models`: packserve under a budget that holds
    the larger but not both (no headroom; its warm tier on), against llama.cpp's router at
    `--models-max 1` with the same files (a child per switch, its defaults and every core).
    A 16-token prompt and 8 tokens each; p50 and p90 of the client's time per request over
    `rounds` alternating rounds of `cycles` requests a side."""
    est = estimates(work, models, context)
    big, small = max(est.values()), min(est.values())
    budget = big + small // 2  # one fits, and a small warm copy beside it; not both hot
    data = work / "switch-data"
    shutil.rmtree(data, ignore_errors=True)  # no footprint remembered from an earlier run
    data.mkdir(parents=True)
    cfg = config(work / "switch.toml", data, models, context, f"{budget // MIB}MiB", "0")
    preset = router.write_preset(work / "switch-router.ini",
                                 {name: {"model": str(g)} for name, g in models})
    rng = random.Random(7)
    names = [name for name, _ in models]
    lat: dict[str, list[float]] = {"packserve": [], "router": []}
    log = work / "switch-packserve.log"
    with run_server(packserve_argv("--config", str(cfg)), health="/readyz", log=log) as ps, \
            run_server(router.argv(router.binary(), preset, work / "switch-llama-cache",
                                   models_max=1), health="/health",
                       log=work / "switch-router.log") as rs, \
            ps.client(timeout=1800) as pc, rs.client(timeout=1800) as rc:
        clients = {"packserve": pc, "router": rc}
        for client in clients.values():  # first loads out of the figures
            for name in names:
                complete(client, name, prompt_ids(rng, 16, vocab), 8)
        offset = log.stat().st_size
        for r in range(rounds):
            for side in (("packserve", "router") if r % 2 == 0 else ("router", "packserve")):
                for i in range(cycles):
                    name = names[(i + 1) % 2]  # the other one each time
                    lat[side].append(complete(clients[side], name,
                                              prompt_ids(rng, 16, vocab), 8))
    return switch_summary({"models": names, "estimates": est, "budget_bytes": budget,
                           "rounds": rounds, "cycles": cycles, "latency_s": lat,
                           "tiers": _tiers(log, offset)})


def switch_summary(out: dict[str, Any]) -> dict[str, Any]:
    """`switching`'s quantiles from its latencies: over every request, and apart for the
    switches to each model (request i of a side's `cycles` went to `models[(i + 1) % 2]`),
    because the two kinds of switch can differ by seconds and an overall p50 then falls
    between them."""
    names, lat = out["models"], out["latency_s"]
    pct = {side: {"p50": quantile(v, 0.5), "p90": quantile(v, 0.9)} for side, v in lat.items()}
    by_target = {side: {name: quantile([t for k, t in enumerate(v)
                                        if names[(k % out["cycles"] + 1) % 2] == name], 0.5)
                        for name in names} for side, v in lat.items()}
    return {**out, "quantiles_s": pct, "p50_by_target_s": by_target,
            "ratio_p50": ratio(pct["packserve"]["p50"], pct["router"]["p50"]),
            "ratio_p90": ratio(pct["packserve"]["p90"], pct["router"]["p90"])}


def _tiers(log: Path, offset: int) -> dict[str, int]:
    """How packserve's switches went, from its event log (peers' profile of them): loads from
    cold and warm, evictions to warm and cold, over every model."""
    from benchmarks.peers import switch_profile

    out: dict[str, int] = {}
    for kinds in switch_profile(log, offset)["seconds"].values():
        for kind, seconds in kinds.items():
            out[kind] = out.get(kind, 0) + len(seconds)
    return out


@contextlib.contextmanager
def _sampler(server_pid: int, c: httpx.Client, every_s: float) -> Iterator[dict[str, Any]]:
    """Sample, every `every_s`, the runners' resident set (every llama-server under the server,
    summed) and the scheduler's accounted bytes (`/v1/residency`'s cpu `used_bytes`)."""
    seen: dict[str, Any] = {"rss_max": 0, "accounted_max": 0, "samples": 0,
                            "accounted_samples": 0}
    stop = threading.Event()

    def runners() -> list[int]:
        out = []
        for p in descendants(server_pid):
            with contextlib.suppress(OSError):  # gone since: an eviction to cold
                if "llama-server" in Path(f"/proc/{p}/comm").read_text():
                    out.append(p)
        return out

    def sample() -> None:
        while not stop.wait(every_s):
            seen["rss_max"] = max(seen["rss_max"], sum(rss_bytes(p) for p in runners()))
            seen["samples"] += 1
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError, StopIteration):
                devices = c.get("/v1/residency").raise_for_status().json()["devices"]
                used = next(d["used_bytes"] for d in devices if d["name"] == "cpu")
                seen["accounted_max"] = max(seen["accounted_max"], int(used))
                seen["accounted_samples"] += 1

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()


def competing(work: Path, models: Sequence[tuple[str, Path]], vocab: int, context: int,
              budget: int, requests: int, weights: Sequence[int]) -> dict[str, Any]:
    """`models` behind one `budget` they do not fit in together: two clients send `requests`
    completions between them (a model drawn by `weights` each time, a 16-64-token prompt, 8
    tokens), while a sampler reads every runner's resident set and the accounted bytes. Every
    request answered, none over the budget, no runner died."""
    data = work / "budget-data"
    shutil.rmtree(data, ignore_errors=True)  # no footprint remembered from an earlier run
    data.mkdir(parents=True)
    cfg = config(work / "budget.toml", data, models, context, f"{budget // MIB}MiB", "256MiB")
    log = work / "budget-packserve.log"
    names = [name for name, _ in models]
    draws = random.Random(11)
    plan = [(draws.choices(names, weights)[0], draws.randrange(16, 65)) for _ in range(requests)]
    lat: dict[str, list[float]] = {name: [] for name in names}
    errors: list[str] = []
    with run_server(packserve_argv("--config", str(cfg)), health="/readyz", log=log) as ps, \
            ps.client(timeout=1800) as c, ps.client(timeout=30) as probe:
        est = {r["name"]: int(r["bytes_estimated"])
               for r in c.get("/v1/residency").raise_for_status().json()["models"]}

        def one(i: int) -> None:
            name, n = plan[i]
            try:
                lat[name].append(complete(c, name,
                                           prompt_ids(random.Random(i), n, vocab), 8))
            except Exception as exc:  # reported, never lost
                errors.append(f"{name}: {exc}")

        t0 = time.monotonic()
        with _sampler(ps.pid, probe, 0.2) as seen, ThreadPoolExecutor(2) as pool:
            list(pool.map(one, range(requests)))
        wall = time.monotonic() - t0
        metrics = c.get("/metrics").raise_for_status().text
    crashes = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("packserve_engine_crashes_total{"))
    per_model = {name: {"answered": len(v), "p50_s": quantile(v, 0.5), "p90_s": quantile(v, 0.9)}
                 for name, v in lat.items()}
    return {"models": names, "estimates": est, "budget_bytes": budget, "requests": requests,
            "wall_s": wall, "per_model": per_model, "errors": errors, "crashes": crashes,
            "rss_max_bytes": seen["rss_max"], "accounted_max_bytes": seen["accounted_max"],
            "samples": seen["samples"], "accounted_samples": seen["accounted_samples"],
            "tiers": _tiers(log, 0)}
