"""`python -m benchmarks trace`: one mixed trace, replayed under packserve's victim policy and two
baselines built as alternative victim-choice functions of the same scheduler.

The trace: arrivals with Gamma inter-arrival times of a given coefficient of variation (1 is a
Poisson process; above 1 bursty), model popularity Zipf(alpha) over the default catalog,
prompt and output lengths drawn from small distributions. The memory budget is a fraction of
the sum of the models' footprints, so some must leave for others to load. Each policy gets a
fresh server (`benchmarks.policy_server`, through the real HTTP app) and the same trace.

Baselines (benchmarks/baselines.py):
- Ray Serve multiplexing: `lru_by_count(N)` with N the largest count that can never overcommit
  the budget, i.e. budget // the largest footprint: a count limit has to be sized for the
  largest models, since it cannot see bytes.
- Ollama: `shortest_keep_alive_first` with its default keep-alive (300 s) and 1800 s for the
  chat models, as an operator keeping the interactive model warm would set it.
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.common import (
    CATALOG,
    CHAT_MODEL,
    COMPLETE_MODEL,
    EMBED_MODEL,
    EXTRACT_MODEL,
    MIB,
    RERANK_MODEL,
    TASK_OF,
    Goal,
    Options,
    Report,
    checkout_env,
    progress,
    request_body,
    rss_bytes,
    run_server,
    write_config,
)
from benchmarks.report import (
    plot_latency_cdfs,
    plot_loads_over_time,
    plot_memory_timeline,
)
from packserve.config import ServerConfig
from packserve.replay import TraceRequest, TraceSpec, attainment, by_task, replay
from packserve.types import Task

# Popularity rank (Zipf): the embedder is the most used, the extractor the least.
POPULARITY = (EMBED_MODEL, CHAT_MODEL, RERANK_MODEL, COMPLETE_MODEL, EXTRACT_MODEL)
HEADROOM = 16 * MIB
TASKS = {m: Task(TASK_OF[m]) for m in CATALOG}


def footprints(opts: Options, config: Path) -> dict[str, int]:
    """Bytes per distinct set of weights (keyed by its first catalog name): measured if
    packserve has measured it before (its footprint store), else its estimate."""
    from packserve.config import load_config
    from packserve.core.loader import FootprintStore
    from packserve.server import build_entries

    cfg = load_config(config)
    store = FootprintStore(cfg.data_path / "footprints.json")
    out: dict[str, int] = {}
    seen: set[str] = set()
    for e in build_entries(cfg):
        if e.load.key in seen:
            continue
        seen.add(e.load.key)
        out[e.spec.name] = store.get(e.load) or e.bytes_estimated
    return out


def _request(r: TraceRequest) -> tuple[str, dict[str, Any]]:
    return request_body(r.model, words=r.words, max_tokens=r.max_tokens, seed=r.seed)


def _events(url: str) -> dict[str, int]:
    text = httpx.get(url + "/metrics", timeout=10).text
    counts: dict[str, int] = {}
    for m in re.finditer(r'^packserve_model_events_total\{[^}]*event="(\w+)"[^}]*\} (\S+)$',
                         text, re.M):
        counts[m.group(1)] = counts.get(m.group(1), 0) + int(float(m.group(2)))
    return counts


def _sample(url: str, pid: int, stop: threading.Event, keys: dict[str, str],
            out: list[dict[str, Any]], events: dict[tuple[Any, ...], dict[str, Any]]) -> None:
    """Every half second: memory by model (for the timeline) and the server's recent residency
    events (loads with their seconds and bytes, evictions with their cause), deduplicated."""
    t0 = time.perf_counter()
    wall0 = time.time()
    with httpx.Client(base_url=url, timeout=10) as c:
        while not stop.is_set():
            try:
                data = c.get("/v1/residency").json()
                recent = c.get("/v1/metrics/summary").json()["events"]
            except (httpx.HTTPError, ValueError, KeyError):
                stop.wait(0.5)  # a slow answer under load: look again (events are kept)
                continue
            row: dict[str, Any] = {"t": time.perf_counter() - t0, "rss": rss_bytes(pid),
                                   "used": sum(d["used_bytes"] for d in data["devices"])}
            # Hot only: a "loading" model may still be waiting for admission, holding nothing.
            for m in data["models"]:
                name = keys.get(m["name"])
                if name is not None and m["state"] == "hot":
                    row[name] = m["bytes_measured"] or m["bytes_estimated"]
            out.append(row)
            for e in recent:
                if e["kind"] in ("load", "evict"):
                    events.setdefault((e["ts"], e["kind"], e["model"]),
                                      {**e, "t": e["ts"] - wall0})
            stop.wait(0.5)


def offline_loads(sequence: list[str], sizes: dict[str, int], capacity: int,
                  belady: bool) -> tuple[int, int]:
    """Loads and bytes loaded when `sequence` (the weights each request needs, in arrival
    order) is served one at a time within `capacity`, evicting the least recently used, or with
    `belady` the resident needed furthest in the future. No timing: a reference for counts."""
    resident: dict[str, int] = {}  # key -> position of its last use
    loads = loaded = 0
    for i, key in enumerate(sequence):
        if key in resident:
            resident[key] = i
            continue
        while sum(sizes[k] for k in resident) + sizes[key] > capacity and resident:
            if belady:
                later = sequence[i + 1:]
                victim = max(resident, key=lambda k: later.index(k) if k in later
                             else len(later))
            else:
                victim = min(resident, key=lambda k: resident[k])
            del resident[victim]
        resident[key] = i
        loads, loaded = loads + 1, loaded + sizes[key]
    return loads, loaded


def _policy_spec(name: str, max_models: int) -> tuple[str, str]:
    """The label and the policy_server spec of the policy `name` of `--policies`."""
    return {
        "cost": ("packserve (cost-aware)", "cost"),
        "cost_priority": ("packserve (cost-aware, compute priority on)", "cost"),
        "cost_no_turn": ("packserve (cost-aware, no load turns)", "cost"),
        "lru": ("packserve 0.11 (LRU by bytes)", "lru_by_bytes"),
        "ray": (f"Ray Serve rule (LRU, max {max_models} models)", f"lru_by_count:{max_models}"),
        "ollama": ("Ollama rule (shortest keep-alive first)",
                   f"keep_alive:300,{CHAT_MODEL}=1800,{EXTRACT_MODEL}=1800"),
    }[name]


POLICIES = ("cost", "lru", "ray", "ollama")  # the default set; also these variants:
VARIANTS = ("cost_priority", "cost_no_turn")
# Only packserve's own rule keeps evicted models warm and gives a waiting load its turn: the
# peers' rules (and packserve 0.11's) unload them and let requests for a busy model go first
# (warm_tier = false, load_turn = 0), as those engines do.
WARM = frozenset({"cost", *VARIANTS})


def _load_turn(name: str) -> float:
    """The server's `load_turn` in the run of policy `name` (what `bench sim --validate` reads)."""
    if name not in WARM or name == "cost_no_turn":
        return 0.0
    return float(ServerConfig.model_fields["load_turn"].default)


def _one_run(opts: Options, config: Path, spec: str, trace: list[TraceRequest],
             slo: dict[str, float], keys: dict[str, str], log: Path,
             advance: Any) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    events: dict[tuple[Any, ...], dict[str, Any]] = {}
    stop = threading.Event()
    argv = [sys.executable, "-m", "benchmarks.policy_server", "--config", str(config),
            "--policy", spec]
    with run_server(argv, log=log, env=checkout_env()) as server:
        sampler = threading.Thread(target=_sample,
                                   args=(server.url, server.pid, stop, keys, samples, events))
        sampler.start()
        t0 = time.perf_counter()
        outcomes = asyncio.run(replay(server.url, trace, TASKS, make=_request,
                                      on_done=lambda _: advance(1)))
        wall = time.perf_counter() - t0
        time.sleep(1.0)  # one more sample: the last events
        stop.set()
        sampler.join(timeout=30)
        counts = _events(server.url)
    stats = by_task(outcomes, slo, wall)
    loaded = sorted((e for e in events.values() if e["kind"] == "load"), key=lambda e: e["t"])
    loads = [e for e in loaded if e.get("tier_from", "cold") == "cold"]
    restores = [e for e in loaded if e.get("tier_from") == "warm"]
    evicts = sorted((e for e in events.values() if e["kind"] == "evict"), key=lambda e: e["t"])
    return {"policy": spec, "by_task": stats, "events": counts,
            "slo_attainment": attainment(stats), "wall_s": wall,
            "loads": len(loads), "evictions": len(evicts), "restores": len(restores),
            "reload_s": sum(e["seconds"] for e in loaded),
            "bytes_loaded": sum(e["bytes_measured"] for e in loaded),
            "load_events": loads, "restore_events": restores, "evict_events": evicts,
            "peak_rss_bytes": max((s["rss"] for s in samples), default=0),
            "requests": [asdict(o) for o in outcomes], "memory": samples}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose overall SLO attainment is the median (the lower middle for even counts)."""
    ranked = sorted(runs, key=lambda r: r["slo_attainment"])
    return {**ranked[(len(ranked) - 1) // 2],
            "runs": [{"slo_attainment": r["slo_attainment"], "loads": r["loads"],
                      "by_task": {t: s["slo_attainment"] for t, s in r["by_task"].items()}}
                     for r in runs]}


def run(opts: Options) -> Report:
    x = opts.extra
    duration = 10.0 if opts.quick else float(x.get("duration", 120))
    rate = 1.0 if opts.quick else float(x.get("rate", 1.5))
    alpha, cv, seed = float(x.get("alpha", 0.9)), float(x.get("cv", 1.0)), int(x.get("seed", 1))
    repeat = max(1, int(x.get("repeat", 1)))
    # --quick: packserve's rule against its predecessor only, to keep it short.
    chosen = x.get("policies", "cost,lru" if opts.quick else ",".join(POLICIES)).split(",")
    unknown = [p for p in chosen if p not in (*POLICIES, *VARIANTS)]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from "
                         f"{', '.join((*POLICIES, *VARIANTS))}")
    slo = {k: float(v) for k, v in (p.split("=") for p in
                                    x.get("slo", "embed=0.5,rerank=0.5,chat=4,complete=4")
                                    .split(","))}
    work = opts.out / "work"
    probe_config = write_config(work / "trace-probe.toml", opts)
    sizes = footprints(opts, probe_config)
    total = sum(sizes.values())
    capacity = max(max(sizes.values()), int(total * float(x.get("budget_fraction", 0.75))))
    config = write_config(work / "trace.toml", opts, memory_budget=str(capacity + HEADROOM),
                          headroom=str(HEADROOM))
    cold_config = write_config(work / "trace-no-warm.toml", opts,
                               memory_budget=str(capacity + HEADROOM), headroom=str(HEADROOM),
                               device_extra="warm_tier = false", server_extra="load_turn = 0")
    max_models = max(1, capacity // max(sizes.values()))
    trace_spec = TraceSpec(seed=seed, duration_s=duration, rate_per_s=rate, zipf_alpha=alpha,
                           interarrival_cv=cv, popularity=POPULARITY)
    trace = trace_spec.requests()
    # Which weights a catalog name uses: shared weights are loaded, counted and drawn once.
    keys = {EMBED_MODEL: "MiniLM (embed+rerank)", RERANK_MODEL: "MiniLM (embed+rerank)",
            CHAT_MODEL: "SmolLM2 (chat+extract)", EXTRACT_MODEL: "SmolLM2 (chat+extract)",
            COMPLETE_MODEL: "Gemma 3 270M (complete)"}
    first = {EMBED_MODEL: EMBED_MODEL, RERANK_MODEL: EMBED_MODEL, CHAT_MODEL: CHAT_MODEL,
             EXTRACT_MODEL: CHAT_MODEL, COMPLETE_MODEL: COMPLETE_MODEL}
    report = Report("trace")
    per_policy: dict[str, Any] = {}
    rows: list[list[object]] = []
    with progress(opts, "trace", len(trace) * len(chosen) * repeat) as advance:
        for name in chosen:
            label, spec = _policy_spec(name, max_models)
            used = config if name in WARM else cold_config
            if name == "cost_priority":  # compute turns by deadline (off by default)
                used = write_config(work / "trace-priority.toml", opts,
                                    memory_budget=str(capacity + HEADROOM),
                                    headroom=str(HEADROOM), server_extra="compute_priority = true")
            if name == "cost_no_turn":  # requests for a busy model go ahead of a waiting load
                used = write_config(work / "trace-no-turn.toml", opts,
                                    memory_budget=str(capacity + HEADROOM),
                                    headroom=str(HEADROOM), server_extra="load_turn = 0")
            runs = [_one_run(opts, used, spec, trace, slo, keys,
                             work / f"trace-{name}-{i + 1}.log", advance)
                    for i in range(repeat)]
            per_policy[label] = {**_median_run(runs), "warm_tier": name in WARM,
                                 "load_turn": _load_turn(name),
                                 "priority": name == "cost_priority"}
    sequence = [first[r.model] for r in trace]
    belady = offline_loads(sequence, sizes, capacity, belady=True)
    lru_offline = offline_loads(sequence, sizes, capacity, belady=False)
    for label, p in per_policy.items():
        for task, s in p["by_task"].items():
            rows.append([label, task, s["requests"], s["p50_s"], s.get("p90_s"), s["p95_s"],
                         s["p99_s"], s["slo_s"], f"{100 * s['slo_attainment']:.0f}%",
                         s.get("goodput_rps"), None, None, None, None, None])
        rows.append([label, "all", len(trace), None, None, None, None, None,
                     f"{100 * p['slo_attainment']:.0f}%", None, p["loads"],
                     p.get("restores", 0), p["evictions"], round(p["reload_s"], 1),
                     round(p["bytes_loaded"] / MIB)])
    for label, (n, loaded) in (("Belady (offline, in arrival order)", belady),
                               ("LRU (offline, in arrival order)", lru_offline)):
        rows.append([label, "all", len(trace), None, None, None, None, None, None, None, n,
                     None, None, None, round(loaded / MIB)])
    _plots(opts, report, per_policy, keys, capacity, duration)
    report.results = {
        # What `packserve bench --trace` and `sim --validate` read back.
        "trace": {**trace_spec.as_json(), "requests": len(trace)},
        "footprints_bytes": sizes, "budget_bytes": capacity + HEADROOM,
        "headroom_bytes": HEADROOM, "capacity_bytes": capacity, "slo_s": slo,
        "repeat": repeat, "policies": per_policy,
        "offline": {"belady": {"loads": belady[0], "bytes_loaded": belady[1]},
                    "lru": {"loads": lru_offline[0], "bytes_loaded": lru_offline[1]}},
        "tables": [{"columns": ["policy", "type", "requests", "p50 s", "p90 s", "p95 s",
                                "p99 s", "SLO s", "SLO met", "goodput req/s", "loads (cold)",
                                "restores (warm)", "evictions", "reload s", "MiB loaded"],
                    "rows": rows}],
    }
    ours = next((p for label, p in per_policy.items() if label.startswith("packserve (")), None)
    if ours is not None:
        for task, s in ours["by_task"].items():
            # Per type, the median of the runs' attainments: the median run (the tables)
            # is the middle one by all requests, and its types need not be each type's middle.
            each = [r["by_task"][task] for r in ours["runs"] if task in r["by_task"]]
            report.goals.append(Goal(
                f"trace: packserve meets the {task} SLO ({s['slo_s']:g} s)",
                float(np.median(each)) if each else s["slo_attainment"], 0.97, ">=",
                f"per type, the median of {repeat} run(s): "
                + ", ".join(f"{100 * v:.1f}%" for v in each)))
    report.notes.append(
        f"budget - headroom {capacity / MIB:.0f} MiB for models of "
        + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in sizes.items())
        + f"; {len(trace)} requests, seed {seed}, rate {rate}/s, Zipf alpha {alpha}, CV {cv}; "
        f"{repeat} run(s) per policy, the median shown; packserve's rule keeps evicted models "
        f"warm and gives a load waiting for busy models its turn (its defaults), the others "
        f"unload them and let requests for busy models go first (warm_tier = false, "
        f"load_turn = 0); reload s and MiB loaded count restores too")
    report.notes.append(
        "Belady and LRU offline: the trace's requests served one at a time in arrival order "
        "(no timing); a real server that lets requests for a resident model go first while a "
        "load waits for busy models can make fewer loads than that, so it is a reference for "
        "counts, not a bound. `python -m benchmarks sim` computes Belady's choice with timing.")
    return report


def _plots(opts: Options, report: Report, per_policy: dict[str, Any], keys: dict[str, str],
           capacity: int, duration: float) -> None:
    opts.out.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(keys.values()))
    timelines = {label: {"t": [s["t"] for s in p["memory"]],
                         "models": {n: [s.get(n, 0) / MIB for s in p["memory"]] for n in names}}
                 for label, p in per_policy.items()}
    latencies = {label: {t: s["latencies_s"] for t, s in p["by_task"].items()}
                 for label, p in per_policy.items()}
    mem_png, cdf_png = opts.out / "trace-memory.png", opts.out / "trace-latency-cdf.png"
    loads_png = opts.out / "trace-loads.png"
    plot_memory_timeline(mem_png, timelines, capacity / MIB)
    plot_latency_cdfs(cdf_png, latencies)
    plot_loads_over_time(loads_png, {label: [e["t"] for e in p["load_events"]]
                                     for label, p in per_policy.items()}, duration)
    report.plots = [str(mem_png), str(cdf_png), str(loads_png)]
