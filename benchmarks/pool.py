"""`python -m benchmarks pool`: routers of a `packserve pool`, side by side, and the entry point's
cost.

Routing. One mixed trace at a time is replayed on a pool of N replicas (one per node of a local
Ray cluster, `ray.cluster_utils.Cluster`, started once for the whole bench) under each router:
packserve's residency-aware router, Ray Serve's own routing (power of two choices preferring
the replicas whose multiplexed models include the request's, `ray_models_per_replica` models
kept per replica), and round robin as a floor. Every run gets a fresh pool (and a fresh data
dir, so no footprint measured in one run is known to the next) with the same replicas, budgets
and trace. Counted per router: requests answered, non-200s, SLO attainment (overall and per
task), loads, evictions and bytes loaded (from the entry point's `/metrics`, every replica's
counters) and how many replicas served each model (the `x-packserve-replica` header).

Three real weights files on two shared cores cannot tell routers apart, so the routers serve a
catalog of twelve fake models (`backend = "fake"`) that declare a size, a load time and, in
each request (`@@sleep=S`), a service time taken from real models: MiniLM, SmolLM2-135M and
Gemma-3-270M as measured on this machine (90, 170 and 400 MiB; loads of 0.4, 0.3 and 0.8 s;
an embedding in ~10 ms, a chat answer in 1-2 s), and nine common serving models at their
published download sizes (Ollama's GGUF sizes; the reranker's safetensors), whose loads take
their bytes at the Gemma load's rate (500 MiB/s) and whose answers take as long as those of the
measured model of their task. Sizes and load times are then multiplied by one factor, `SCALE` =
1/2, so that traces of seconds see many loads: the largest (Llama 3.2 3B, 1.9 GiB, 3.8 s)
becomes 954 MiB and 1.9 s. Per-request service times are not scaled (the SLOs are in real
seconds). The catalog stops at 3B: one 8B model (4.9 GB) would need a replica budget that puts
the whole catalog on three replicas, and no routing could then matter. Each replica's
budget is the larger of the largest model and the pool's share of half the catalog's bytes, so
the whole catalog never fits on the pool at once and routing decides how often models load.
Traces (seeded): steady (Poisson arrivals, Zipf(0.9) popularity), bursty (arrival CV 4) and
shifting (the popularity order reversed halfway). SLOs as `bench trace` (`--slo`): embed and
rerank 0.5 s, chat and complete 4 s.

Entry point. With the real MiniLM embedder only: p50 latency of single-sentence embeddings,
sequential, through one `packserve serve` and through the pool's entry point (one replica),
alternating request by request in one run; the figure is the ratio pool / single.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from benchmarks.common import (
    EMBED_MODEL,
    MIB,
    Goal,
    Options,
    Report,
    Server,
    catalog_models_toml,
    console,
    median,
    packserve_argv,
    progress,
    ratio,
    run_server,
)
from packserve.replay import TraceRequest, make_trace, sentences

SCALE = 0.5  # sizes and load times of the catalog below, one factor for both
LOAD_MIB_PER_S = 500.0  # Gemma-3-270M's 400 MiB GGUF loads in 0.8 s on this machine
POOL_FRACTION = 0.5  # the pool's budgets together hold about this share of the catalog
ALPHA = 0.9
SLO_S = {"embed": 0.5, "rerank": 0.5, "chat": 4.0, "complete": 4.0}  # `--slo`'s default
ROUTERS = {"packserve": "packserve router", "ray": "Ray Serve multiplexed",
           "round_robin": "round robin"}
RERANK_DOCS = 8
NODE_CPUS = 2
REPORT_WAIT_S = 60.0


@dataclass(frozen=True)
class FakeModel:
    """One catalog model as the fake engine plays it, from real (unscaled) figures."""

    name: str
    task: str  # embed, rerank, chat or complete
    real_mib: float  # measured here, or the published download size
    real_load_s: float | None  # measured here; None: real_mib at LOAD_MIB_PER_S
    service_s: tuple[float, float]  # per request, drawn uniformly between the two
    origin: str

    @property
    def mib(self) -> int:
        return max(1, round(self.real_mib * SCALE))

    @property
    def load_s(self) -> float:
        real = self.real_load_s if self.real_load_s is not None \
            else self.real_mib / LOAD_MIB_PER_S
        return round(real * SCALE, 3)

    @property
    def source(self) -> str:
        return f"fake:{self.mib}MiB?load_s={self.load_s}"


_MEASURED = "measured here"
_OLLAMA = "published size (Ollama GGUF)"
_HF = "published size (safetensors)"
CATALOG = (
    FakeModel("all-minilm-l6-v2", "embed", 90, 0.4, (0.008, 0.012), _MEASURED),
    FakeModel("smollm2-135m", "chat", 170, 0.3, (1.0, 2.0), _MEASURED),
    FakeModel("gemma-3-270m", "complete", 400, 0.8, (0.5, 1.5), _MEASURED),
    FakeModel("nomic-embed-text", "embed", 261, None, (0.01, 0.02), _OLLAMA),
    FakeModel("mxbai-embed-large", "embed", 639, None, (0.015, 0.03), _OLLAMA),
    FakeModel("bge-m3", "embed", 1144, None, (0.02, 0.04), _OLLAMA),
    FakeModel("bge-reranker-base", "rerank", 1060, None, (0.03, 0.06), _HF),
    FakeModel("qwen2.5-0.5b-instruct", "chat", 380, None, (1.0, 2.0), _OLLAMA),
    FakeModel("qwen2.5-1.5b-instruct", "chat", 940, None, (1.0, 2.0), _OLLAMA),
    FakeModel("llama3.2-1b-instruct", "chat", 1240, None, (1.0, 2.0), _OLLAMA),
    FakeModel("gemma2-2b-instruct", "chat", 1526, None, (1.0, 2.0), _OLLAMA),
    FakeModel("llama3.2-3b-instruct", "chat", 1907, None, (1.0, 2.0), _OLLAMA),
)
BY_NAME = {m.name: m for m in CATALOG}


@dataclass(frozen=True)
class TraceShape:
    name: str
    cv: float  # coefficient of variation of inter-arrival times (1: Poisson)
    shift: bool  # the popularity order is reversed halfway


TRACES = (TraceShape("steady", 1.0, False), TraceShape("bursty", 4.0, False),
          TraceShape("shifting", 1.0, True))


# ----------------------------------------------------------------------- pure parts


def replica_budget_mib(replicas: int, catalog: Sequence[FakeModel] = CATALOG) -> int:
    """Each replica's budget: its share of POOL_FRACTION of the catalog, and never less than
    the largest model (which must fit somewhere)."""
    total = sum(m.mib for m in catalog)
    return max(max(m.mib for m in catalog), math.ceil(total * POOL_FRACTION / replicas))


def models_per_replica(budget_mib: int, catalog: Sequence[FakeModel] = CATALOG) -> int:
    """Ray Serve's multiplexing counts models: as many as fit the budget at the mean size."""
    return max(1, int(budget_mib // (sum(m.mib for m in catalog) / len(catalog))))


def popularity(seed: int) -> tuple[str, ...]:
    """The catalog in Zipf rank order, most popular first: a seeded shuffle."""
    order = np.random.default_rng(seed).permutation(len(CATALOG))
    return tuple(CATALOG[int(i)].name for i in order)


def pool_trace(shape: TraceShape, *, seed: int, duration_s: float, rate: float
               ) -> list[TraceRequest]:
    """The same arguments give the same trace. A shifting trace's second half draws from the
    reversed popularity order."""
    order = popularity(seed)
    if not shape.shift:
        return make_trace(seed=seed, duration_s=duration_s, rate=rate, alpha=ALPHA,
                          cv=shape.cv, models=order)
    half = duration_s / 2
    first = make_trace(seed=seed, duration_s=half, rate=rate, alpha=ALPHA, cv=shape.cv,
                       models=order)
    second = make_trace(seed=seed + 1, duration_s=half, rate=rate, alpha=ALPHA, cv=shape.cv,
                        models=order[::-1])
    return [*first, *(replace(r, at=r.at + half) for r in second)]


def request_for(r: TraceRequest) -> tuple[str, dict[str, Any], float]:
    """(path, JSON body, service seconds) of one trace request to a fake catalog model."""
    model = BY_NAME[r.model]
    service = random.Random(r.seed).uniform(*model.service_s)
    text = f"{sentences(1, words=r.words, seed=r.seed)[0]} @@sleep={service:.3f}"
    if model.task == "embed":
        return "/v1/embeddings", {"model": r.model, "input": text}, service
    if model.task == "rerank":
        return "/v1/rerank", {"model": r.model, "query": text, "documents": sentences(
            RERANK_DOCS, words=12, seed=r.seed + 1)}, service
    if model.task == "complete":
        return "/v1/completions", {"model": r.model, "prompt": text,
                                   "max_tokens": r.max_tokens}, service
    return "/v1/chat/completions", {"model": r.model, "max_tokens": r.max_tokens,
                                    "messages": [{"role": "user", "content": text}]}, service


def slo_targets(spec: str | None) -> dict[str, float]:
    """`--slo` ("embed=0.5,chat=4,..."), over SLO_S for the tasks it leaves out."""
    pairs = (item.split("=", 1) for item in (spec or "").split(",") if item.strip())
    return {**SLO_S, **{task.strip(): float(seconds) for task, seconds in pairs}}


def attainment(results: Sequence[dict[str, Any]], slo: dict[str, float]) -> dict[str, Any]:
    """SLO attainment (a 200 within its task's SLO) overall and per task, latency percentiles."""
    def met(rs: Sequence[dict[str, Any]]) -> float | None:
        ok = sum(1 for r in rs if r["status"] == 200 and r["latency_s"] <= slo[r["task"]])
        return ok / len(rs) if rs else None

    by_task = {}
    for task in SLO_S:
        rs = [r for r in results if r["task"] == task]
        if rs:
            lat = [r["latency_s"] for r in rs if r["status"] == 200]
            p50, p95 = np.percentile(lat, [50, 95]).tolist() if lat else (None, None)
            by_task[task] = {"requests": len(rs), "slo_s": slo[task],
                             "slo_attainment": met(rs), "p50_s": p50, "p95_s": p95}
    return {"slo_attainment": met(results), "by_task": by_task}


def residency_counts(metrics_text: str) -> dict[str, Any]:
    """Loads, evictions and bytes loaded, from the entry point's merged `/metrics`."""
    loads: dict[str, int] = {}
    evictions: dict[str, int] = {}
    per_replica: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name != "packserve_model_events_total" or s.value <= 0:
                continue
            event, model = s.labels.get("event"), s.labels.get("model", "")
            if event not in ("load", "evict"):
                continue
            counts = loads if event == "load" else evictions
            counts[model] = counts.get(model, 0) + int(s.value)
            row = per_replica.setdefault(s.labels.get("replica", ""), {"load": 0, "evict": 0})
            row[event] += int(s.value)
    bytes_loaded = sum(n * BY_NAME[m].mib * MIB for m, n in loads.items() if m in BY_NAME)
    return {"loads": sum(loads.values()), "evictions": sum(evictions.values()),
            "bytes_loaded": bytes_loaded, "loads_by_model": loads,
            "evictions_by_model": evictions, "by_replica": per_replica}


# ----------------------------------------------------------------------- configs and pools


def pool_config(path: Path, *, data_dir: Path, address: str, replicas: int, router: str,
                budget_mib: int, models_toml: str, ray_models: int = 1) -> Path:
    """A pool of `replicas` (one per `packserve_node`, none asking for a CPU: the nodes' cores
    are shared as one machine's are) on the cluster at `address`, each on `budget_mib`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f'[server]\ndata_dir = "{data_dir}"\nlog_level = "warning"\nload_wait_s = 120\n'
        f'drain_s = 5\n\n'
        f'[devices.cpu]\nmemory_budget = "{budget_mib}MiB"\nheadroom = "0B"\n\n'
        f'[pool]\naddress = "{address}"\nmin_replicas = {replicas}\n'
        f'max_replicas = {replicas}\nreplica_cpus = 0\n'
        f'replica_resources = {{packserve_node = 1}}\nstats_period_s = 0.3\n'
        f'router = "{router}"\nray_models_per_replica = {ray_models}\n\n' + models_toml,
        "utf-8")
    return path


def fake_models_toml(catalog: Sequence[FakeModel] = CATALOG) -> str:
    """The `[[models]]` entries of the fake catalog."""
    return "".join(f'[[models]]\nname = "{m.name}"\ntasks = ["{m.task}"]\nbackend = "fake"\n'
                   f'source = "{m.source}"\n\n' for m in catalog)


@contextlib.contextmanager
def running_pool(config: Path, log: Path, replicas: int) -> Iterator[Server]:
    """`packserve pool --config CONFIG` on a free port, once every replica has reported to
    the router (`/readyz` answers 200 as soon as one replica per group has: the router puts
    replicas it has no report of last, so a trace started then would begin on one replica)."""
    argv = [sys.executable, "-m", "packserve.cli", "pool", "--config", str(config)]
    with run_server(argv, health="/readyz", log=log) as server, server.client(10) as c:
        deadline = time.monotonic() + REPORT_WAIT_S
        while True:
            view = c.get("/v1/pool").json()["replicas"]
            if len(view) >= replicas and all(r["reported_at"] for r in view):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(view)} pool replicas, "
                                   f"{sum(1 for r in view if r['reported_at'])} reported, "
                                   f"{replicas} expected after {REPORT_WAIT_S:.0f}s; see {log}")
            time.sleep(0.1)
        yield server


@contextlib.contextmanager
def ray_cluster(nodes: int) -> Iterator[str]:
    """A local Ray cluster of `nodes` nodes of NODE_CPUS CPUs each, one `packserve_node`
    resource per node (one replica each); yields its address and shuts it down on exit."""
    from ray.cluster_utils import Cluster

    args: dict[str, Any] = {"num_cpus": NODE_CPUS, "resources": {"packserve_node": 1},
            "object_store_memory": 80 * MIB}
    cluster = Cluster(initialize_head=True,
                      head_node_args={**args, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**args)
        cluster.wait_for_nodes()
        yield str(cluster.address)
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]


# ----------------------------------------------------------------------- replay


async def replay(url: str, trace: Sequence[TraceRequest], advance: Callable[[int], None]
                 ) -> list[dict[str, Any]]:
    """Open loop: each request leaves at its time, whatever the ones before it are doing."""
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        start = time.perf_counter()

        async def one(r: TraceRequest) -> None:
            await asyncio.sleep(max(0.0, start + r.at - time.perf_counter()))
            path, body, service = request_for(r)
            t0 = time.perf_counter()
            status, replica = -1, ""
            try:
                response = await c.post(path, json=body)
                status = response.status_code
                replica = response.headers.get("x-packserve-replica", "")
            except httpx.HTTPError:
                pass  # status -1: no answer
            results.append({"at": r.at, "model": r.model, "task": BY_NAME[r.model].task,
                            "status": status, "replica": replica, "service_s": service,
                            "latency_s": time.perf_counter() - t0})
            advance(1)

        await asyncio.gather(*(one(r) for r in trace))
    return results


@dataclass(frozen=True)
class Setup:
    """What every router's pool shares in one bench: the cluster, replicas, budgets, SLOs."""

    address: str
    replicas: int
    budget_mib: int
    ray_models: int
    slo: dict[str, float]


def run_policy(opts: Options, setup: Setup, router: str, name: str,
               trace: Sequence[TraceRequest], advance: Callable[[int], None]
               ) -> dict[str, Any]:
    """One fresh pool (and data dir) under `router`, trace `name` replayed on it; the counts."""
    work = opts.out / "work"
    data = Path(tempfile.mkdtemp(prefix=f"pool-{name}-{router}-"))
    try:
        config = pool_config(work / f"pool-{name}-{router}.toml", data_dir=data,
                             address=setup.address, replicas=setup.replicas, router=router,
                             budget_mib=setup.budget_mib, models_toml=fake_models_toml(),
                             ray_models=setup.ray_models)
        with running_pool(config, work / f"pool-{name}-{router}.log", setup.replicas) as pool:
            t0 = time.perf_counter()
            results = asyncio.run(replay(pool.url, trace, advance))
            wall = time.perf_counter() - t0
            with pool.client(timeout=60) as c:
                counts = residency_counts(c.get("/metrics").text)
                view = c.get("/v1/pool").json()
    finally:
        shutil.rmtree(data, ignore_errors=True)
    served: dict[str, set[str]] = {}
    for r in results:
        if r["status"] == 200 and r["replica"]:
            served.setdefault(r["model"], set()).add(r["replica"])
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {
        "router": router, "sent": len(trace),
        "answered": sum(1 for r in results if r["status"] > 0),
        "non_200": sum(1 for r in results if r["status"] != 200), "statuses": statuses,
        **attainment(results, setup.slo), **counts,
        "replicas_per_model": {m: len(s) for m, s in sorted(served.items())},
        "mean_replicas_per_model": (sum(len(s) for s in served.values()) / len(served)
                                    if served else None),
        "replicas": sorted(r["replica"] for r in view["replicas"]),
        "wall_s": wall, "requests": results,
    }


# ----------------------------------------------------------------------- the entry's cost


def minilm_toml() -> str:
    """The built-in catalog's embedder entry, as it is there."""
    chunks = catalog_models_toml().split("[[models]]")
    (chunk,) = [c for c in chunks if f'name = "{EMBED_MODEL}"' in c]
    return "[[models]]" + chunk


def entry_cost(opts: Options, address: str, n: int, advance: Callable[[int], None]
               ) -> dict[str, Any]:
    """p50 of sequential single-sentence embeddings: one `packserve serve` against a pool of one
    replica, same node config, alternating request by request (who goes first alternates)."""
    work = opts.out / "work"
    config = pool_config(work / "pool-entry.toml", data_dir=opts.data_dir, address=address,
                         replicas=1, router="packserve", budget_mib=1024,
                         models_toml=minilm_toml())
    texts = sentences(n + 10, seed=11)
    times: dict[str, list[float]] = {"single": [], "pool": []}
    with run_server(packserve_argv("--config", str(config)),
                    log=work / "pool-entry-single.log") as single, \
            running_pool(config, work / "pool-entry-pool.log", 1) as pool, \
            single.client() as a, pool.client() as b:
        clients = {"single": a, "pool": b}

        def embed(side: str, text: str) -> float:
            t0 = time.perf_counter()
            clients[side].post("/v1/embeddings", json={"model": EMBED_MODEL, "input": text}
                               ).raise_for_status()
            return time.perf_counter() - t0

        for text in texts[:10]:  # warm: the load, first-call allocations, connections
            embed("single", text)
            embed("pool", text)
        for i, text in enumerate(texts[10:]):
            for side in (("single", "pool") if i % 2 == 0 else ("pool", "single")):
                times[side].append(embed(side, text))
            advance(1)
    p50 = {side: median(ts) for side, ts in times.items()}
    return {"requests": n, "warmup": 10, "p50_s": p50,
            "p95_s": {side: float(np.percentile(ts, 95)) for side, ts in times.items()},
            "ratio_pool_over_single": ratio(p50["pool"], p50["single"]), "latencies_s": times}


# ----------------------------------------------------------------------- the scenario


def run(opts: Options) -> Report:
    x = opts.extra
    nodes = 2 if opts.quick else 3
    duration = 12.0 if opts.quick else float(x.get("duration", 30))
    rate = 2.0 if opts.quick else 4.0
    seed = int(x.get("seed", 1))
    n_latency = 30 if opts.quick else 200
    shapes = TRACES[:1] if opts.quick else TRACES
    budget = replica_budget_mib(nodes)
    ray_models = models_per_replica(budget)
    slo = slo_targets(x.get("slo"))
    traces = {s.name: pool_trace(s, seed=seed, duration_s=duration, rate=rate) for s in shapes}
    report = Report("pool")
    results: dict[str, Any] = {}
    total = sum(len(t) for t in traces.values()) * len(ROUTERS) + n_latency
    with progress(opts, "pool", total) as advance, ray_cluster(nodes) as address:
        setup = Setup(address, nodes, budget, ray_models, slo)
        for shape in shapes:
            trace = traces[shape.name]
            per_router = {}
            for router in ROUTERS:
                advance(0, f"{shape.name}, {ROUTERS[router]}")
                per_router[router] = run_policy(opts, setup, router, shape.name, trace,
                                                advance)
            results[shape.name] = {"shape": asdict(shape), "requests": len(trace),
                                   "policies": per_router}
        advance(0, "entry point cost (real MiniLM)")
        cost = entry_cost(opts, address, n_latency, advance)
    catalog_mib = sum(m.mib for m in CATALOG)
    report.results = {
        "nodes": nodes, "node_cpus": NODE_CPUS, "replicas": nodes,
        "budget_bytes_per_replica": budget * MIB, "catalog_bytes": catalog_mib * MIB,
        "pool_holds_fraction_of_catalog": nodes * budget / catalog_mib,
        "ray_models_per_replica": ray_models, "scale": SCALE,
        "load_mib_per_s": LOAD_MIB_PER_S, "slo_s": slo,
        "catalog": [{**asdict(m), "mib": m.mib, "load_s": m.load_s, "source": m.source}
                    for m in CATALOG],
        "trace": {"seed": seed, "duration_s": duration, "rate_per_s": rate,
                  "zipf_alpha": ALPHA, "popularity": list(popularity(seed))},
        "traces": results, "entry_cost": cost,
        "tables": [_routing_table(results), _cost_table(cost)],
    }
    for shape in shapes:
        by = results[shape.name]["policies"]
        pk, ray = by["packserve"], by["ray"]
        report.goals.append(Goal(
            f"pool {shape.name}: loads, packserve router / Ray Serve's routing",
            ratio(pk["loads"], ray["loads"]), 1.0, "<=",
            "" if ray["loads"] else "Ray Serve's routing loaded nothing"))
        report.goals.append(Goal(
            f"pool {shape.name}: SLO attainment, packserve router / Ray Serve's routing",
            ratio(pk["slo_attainment"], ray["slo_attainment"]), 1.0, ">=",
            "" if ray["slo_attainment"] else "Ray Serve's routing met no SLO"))
    report.goals.append(Goal("pool: p50 single-sentence embedding, entry point / one server",
                             cost["ratio_pool_over_single"], 1.2, "<="))
    report.notes += [
        f"{nodes} Ray nodes of {NODE_CPUS} CPUs each, all on this machine; one replica per "
        f"node, each a whole packserve node with a budget of {budget} MiB (the pool holds "
        f"{nodes * budget / catalog_mib:.0%} of the catalog's {catalog_mib} MiB); Ray Serve's "
        f"multiplexing keeps {ray_models} models per replica",
        f"fake catalog: real sizes and load times x {SCALE} (loads at {LOAD_MIB_PER_S:.0f} "
        f"MiB/s before scaling), per-request service times unscaled; "
        + ", ".join(f"{m.name} {m.mib} MiB {m.load_s} s" for m in CATALOG),
        f"traces: {duration:.0f} s at {rate}/s, Zipf alpha {ALPHA}, seed {seed}; "
        + ", ".join(f"{s.name} ({len(traces[s.name])} requests, CV {s.cv}"
                    + (", popularity reversed halfway)" if s.shift else ")") for s in shapes),
    ]
    wide = Console(stderr=True, width=max(console.width, 140))  # every column, even in a log
    for shape in shapes:
        wide.print(_rich(shape.name, results[shape.name]["policies"]))
    console.print(f"entry point cost: p50 pool {cost['p50_s']['pool'] * 1000:.1f} ms, single "
                  f"server {cost['p50_s']['single'] * 1000:.1f} ms, ratio "
                  f"{cost['ratio_pool_over_single']:.2f}")
    return report


_COLUMNS = ["trace", "router", "requests", "non-200", "SLO met", "embed", "rerank", "chat",
            "complete", "loads", "evictions", "GiB loaded", "replicas/model"]


def _row(trace: str, router: str, p: dict[str, Any]) -> list[object]:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    return [trace, ROUTERS[router], p["sent"], p["non_200"], pct(p["slo_attainment"]),
            *(pct(p["by_task"][t]["slo_attainment"]) if t in p["by_task"] else "-"
              for t in SLO_S),
            p["loads"], p["evictions"], round(p["bytes_loaded"] / (1 << 30), 2),
            None if p["mean_replicas_per_model"] is None
            else round(p["mean_replicas_per_model"], 2)]


def _routing_table(results: dict[str, Any]) -> dict[str, Any]:
    return {"columns": _COLUMNS, "rows": [_row(t, r, p) for t, v in results.items()
                                          for r, p in v["policies"].items()]}


def _cost_table(cost: dict[str, Any]) -> dict[str, Any]:
    return {"columns": ["single-sentence embedding (MiniLM)", "requests", "p50 ms", "p95 ms"],
            "rows": [[side, cost["requests"], round(cost["p50_s"][side] * 1000, 2),
                      round(cost["p95_s"][side] * 1000, 2)] for side in ("single", "pool")]}


def _rich(trace: str, policies: dict[str, Any]) -> Table:
    table = Table(title=f"bench pool: {trace} trace")
    for column in _COLUMNS[1:]:
        table.add_column(column, justify="left" if column == "router" else "right",
                         no_wrap=True)
    for router, p in policies.items():
        table.add_row(*(str("-" if v is None else v) for v in _row(trace, router, p)[1:]))
    return table
