"""`python -m benchmarks sim`: the scheduler's victim policies compared over hours of simulated
trace (`bench.simulator`), on the default catalog of this machine and on a 24 GiB GPU box.

Policies: packserve's cost-aware rule (`CostAware`), LRU by bytes (packserve's rule before
it), the Ray Serve rule (`lru_by_count(capacity // largest footprint)`), the Ollama rule
(shortest keep-alive first; 1800 s for chat models, 300 s otherwise) and Belady's choice (the
future known from the trace: a reference, not a policy). Each runs with compute priority off
(today's server) and on (generation yields to embeddings and reranks; loads get the leftover
cores); on the GPU box also with a host-RAM warm tier, on the CPU box with the server's warm
tier (copies kept inside the budget); on both, with three holds tried on top
of the cost-aware rule (a minimum residency after a load; a grace after a resident's last
request; a waiting load's turn, the server's `load_turn`), and the CPU box once more with a
budget that holds all its models. Traces (`bench.sim_catalog`): steady (Zipf 0.9, Poisson),
bursty (CV 4) and shifting (popularity ranks rotate over four phases).

The CPU box uses figures measured on this machine: `--calibrate` starts the real server
(`bench.sim_calibrate`) with a budget that holds everything, loads and unloads each set of
weights three times, sends each to warm and back three times, and times requests of the
trace's sizes alone. The calibration is saved (OUT/sim-calibration.json, and in the results)
and reused by later runs into the same folder; without one, a run uses the built-in figures
(the median of three such calibrations).

`--validate TRACE_JSON` replays a real `python -m benchmarks trace` run in the simulator (the same
trace from its parameters, its measured footprints and budget, its policies) and prints
simulated and real SLO attainment per type and loads side by side.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.baselines import lru_by_count, shortest_keep_alive_first
from benchmarks.common import (
    MIB,
    Goal,
    Options,
    Report,
    console,
    progress,
)
from benchmarks.sim_calibrate import calibrate
from benchmarks.sim_catalog import (
    BUILTIN_CALIBRATION,
    GIB,
    TRACES,
    cpu_box,
    cpu_popularity,
    gpu_box,
    gpu_popularity,
    sim_trace,
)
from benchmarks.simulator import (
    Belady,
    Box,
    SimClock,
    SimOptions,
    SimResult,
    future_arrivals,
    simulate,
)
from benchmarks.trace import POPULARITY
from packserve.core.policy import CostAware, VictimPolicy, lru_by_bytes
from packserve.replay import TraceRequest, make_trace

TASKS = ("embed", "rerank", "chat", "complete")
DEFAULT_SLO = "embed=0.5,rerank=0.5,chat=4,complete=4"
GPU_RATE = 0.25  # requests per second on the GPU box: its load channel is busy 40-55% of the
# time under Belady's choice and LRU; `--quick` and the sweep below show other rates
GPU_SWEEP = (0.1, 0.25, 0.5, 1.0)
CPU_RATE = 1.5  # `bench trace`'s default
COST = "packserve (cost-aware)"
LRU = "LRU by bytes (packserve before)"
RAY = "Ray Serve rule"
OLLAMA = "Ollama rule (keep-alive)"
BELADY = "Belady (knows the future)"
BELADY_SIZED = "Belady, sized (knows the future)"
# Commit 10c4f0f: from then on a load waiting for busy models lets the device lock go. A real
# run from before it is simulated with the lock held (`SimOptions.wait_holds_lock`).
LOCK_RELEASED_AT = "2026-12-01T06:40:22+00:00"
MIN_RESIDENCY_S = (10.0, 30.0)
GRACE_S = (1.0, 5.0)
LOAD_TURN = 0.5  # the server's default `load_turn`

PolicyMaker = Callable[[SimClock], VictimPolicy]


@dataclass(frozen=True)
class Run:
    """One simulated run: which box, trace, policy and options, and what came of it."""

    box: str
    trace: str
    policy: str
    options: SimOptions
    requests: int
    result: SimResult


def policies(box: Box, trace: Sequence[TraceRequest]) -> dict[str, PolicyMaker]:
    """The compared policies, each made fresh per run (Belady reads that run's clock)."""
    largest = max(w.bytes for w in box.weights)
    max_models = max(1, box.capacity_bytes // largest)
    chat = {m.name: 1800.0 for m in box.models if m.task == "chat"}
    future = future_arrivals(box, trace)
    return {
        COST: lambda _: CostAware(),
        LRU: lambda _: lru_by_bytes,
        f"{RAY} (max {max_models})": lambda _: lru_by_count(max_models),
        OLLAMA: lambda _: shortest_keep_alive_first(chat, default_s=300.0),
        BELADY: lambda clock: Belady(future, clock),
        BELADY_SIZED: lambda clock: Belady(future, clock, sized=True),
    }


def run_one(box: Box, shape: str, trace: Sequence[TraceRequest], label: str,
            make: PolicyMaker, options: SimOptions) -> Run:
    clock = SimClock()
    return Run(box.name, shape, label, options, len(trace),
               simulate(box, trace, make(clock), options, clock))


def summary(run: Run, slo: Mapping[str, float]) -> dict[str, Any]:
    r = run.result
    by_task: dict[str, Any] = {}
    for task in TASKS:
        lat = r.latencies(task)
        if lat:
            by_task[task] = {"requests": len(lat), "slo_attainment": r.attainment(slo, task),
                             "p95_s": float(np.percentile(lat, 95))}
    o = run.options
    return {
        "box": run.box, "trace": run.trace, "policy": run.policy, "priority": o.priority,
        "warm_tier": o.warm_tier, "min_residency_s": o.min_residency_s, "grace_s": o.grace_s,
        "load_turn": o.load_turn,
        "requests": run.requests, "loads": len(r.loads),
        "restores": sum(1 for x in r.loads if x.warm), "evictions": r.evictions,
        "offloads": r.offloads, "load_seconds": sum(x.seconds for x in r.loads),
        "bytes_loaded": sum(x.bytes for x in r.loads), "peak_bytes": r.peak_bytes,
        "slo_attainment": r.attainment(slo),
        "by_task": by_task,
    }


COLUMNS = ["box", "trace", "policy", "priority", "warm", "loads", "restores", "evictions",
           "load s", "GiB loaded", "SLO met", "SLO met e/r/c/x %", "p95 s e/r/c/x"]


def row(s: Mapping[str, Any], policy: str | None = None) -> list[object]:
    def per(key: str, fmt: str) -> str:
        return "/".join(fmt.format(100 * s["by_task"][t][key] if key == "slo_attainment"
                                   else s["by_task"][t][key])
                        if t in s["by_task"] else "-" for t in TASKS)

    return [s["box"], s["trace"], policy or s["policy"], "on" if s["priority"] else "off",
            "on" if s["warm_tier"] else "off", s["loads"], s["restores"], s["evictions"],
            round(s["load_seconds"]), round(s["bytes_loaded"] / GIB, 1),
            f"{100 * s['slo_attainment']:.1f}%", per("slo_attainment", "{:.0f}"),
            per("p95_s", "{:.2g}")]


def slo_targets(spec: str) -> dict[str, float]:
    return {k.strip(): float(v) for k, v in (p.split("=") for p in spec.split(","))}


# ------------------------------------------------------------------------------ scenario


def run(opts: Options) -> Report:
    x = opts.extra
    slo = slo_targets(x.get("slo", DEFAULT_SLO))
    seed = int(x.get("seed", 1))
    report = Report("sim")
    opts.out.mkdir(parents=True, exist_ok=True)
    calibration = _calibration(opts, report)
    gpu_s, cpu_s = (1800.0, 600.0) if opts.quick else (4 * 3600.0, 3600.0)
    gpu, cpu = gpu_box(), cpu_box(calibration)
    gpu_traces = {s.name: sim_trace(s, gpu_popularity(seed), seed=seed, duration_s=gpu_s,
                                    rate=GPU_RATE) for s in TRACES}
    cpu_traces = {s.name: sim_trace(s, cpu_popularity(), seed=seed, duration_s=cpu_s,
                                    rate=CPU_RATE) for s in TRACES}
    runs: list[dict[str, Any]] = []
    tables: list[dict[str, Any]] = []
    plans = _plans(gpu, gpu_traces, cpu, cpu_traces, quick=opts.quick)
    t0 = time.perf_counter()
    with progress(opts, "sim", len(plans)) as advance:
        for table, box, shape, trace, label, make, options in plans:
            s = summary(run_one(box, shape, trace, label, make, options), slo)
            s["table"] = table
            runs.append(s)
            advance(1)
    wall = time.perf_counter() - t0
    for title in dict.fromkeys(r["table"] for r in runs):
        tables.append({"title": title, "columns": COLUMNS,
                       "rows": [row(r) for r in runs if r["table"] == title]})
    sweep: list[dict[str, Any]] = []
    if not opts.quick:
        sweep = _sweep(gpu, seed, gpu_s, slo)
        tables.append({"title": "GPU box, steady trace, by arrival rate (priority on)",
                       "columns": ["rate /s", *COLUMNS],
                       "rows": [[s["rate"], *row(s)] for s in sweep]})
    validation = None
    if x.get("validate"):
        validation = validate(Path(x["validate"]), calibration)
        tables.append(validation["table"])
        report.notes += validation["notes"]
        report.goals += validation_goals(validation)
        print_validation(validation)
    report.results = {
        "slo_s": slo, "seed": seed, "wall_s": wall,
        "gpu": {"capacity_bytes": gpu.capacity_bytes, "host_bytes": gpu.host_bytes,
                "rate_per_s": GPU_RATE, "duration_s": gpu_s,
                "popularity": list(gpu_popularity(seed)),
                "catalog": [_weights_json(w) for w in gpu.weights]},
        "cpu": {"capacity_bytes": cpu.capacity_bytes, "rate_per_s": CPU_RATE,
                "duration_s": cpu_s, "popularity": list(cpu_popularity()),
                "catalog": [_weights_json(w) for w in cpu.weights]},
        "calibration": calibration, "runs": runs, "sweep": sweep, "validation": validation,
        "tables": tables,
    }
    report.goals += _goals(runs, gpu_traces)
    plot = opts.out / "sim-loads.png"
    _plot_loads(plot, gpu, gpu_traces, slo)
    report.plots.append(str(plot))
    report.notes.append(
        f"{len(runs) + len(sweep)} simulated runs in {wall:.0f} s of wall time; GPU box: "
        f"{len(gpu.weights)} models, {sum(w.bytes for w in gpu.weights) / GIB:.1f} GiB in all "
        f"on {gpu.capacity_bytes / GIB:.0f} GiB, {GPU_RATE}/s for {gpu_s / 3600:g} h per "
        f"trace; CPU box: the default catalog, {cpu.capacity_bytes / MIB:.0f} MiB of "
        f"{sum(w.bytes for w in cpu.weights) / MIB:.0f}, {CPU_RATE}/s for {cpu_s / 3600:g} h "
        f"per trace; seed {seed}")
    return report


Plan = tuple[str, Box, str, Sequence[TraceRequest], str, PolicyMaker, SimOptions]


def _plans(gpu: Box, gpu_traces: Mapping[str, Sequence[TraceRequest]], cpu: Box,
           cpu_traces: Mapping[str, Sequence[TraceRequest]], *, quick: bool) -> list[Plan]:
    out: list[Plan] = []
    on = SimOptions(priority=True)
    for box, traces in ((gpu, gpu_traces), (cpu, cpu_traces)):
        title = f"{box.name.upper()} box: policies, compute priority off and on"
        for shape, trace in traces.items():
            for label, make in policies(box, trace).items():
                out += [(title, box, shape, trace, label, make, SimOptions(priority=False)),
                        (title, box, shape, trace, label, make, on)]
    roomy = replace(cpu, name="cpu-all", capacity_bytes=sum(w.bytes for w in cpu.weights))
    for shape, trace in cpu_traces.items():
        for o in (SimOptions(priority=False), on):
            out.append(("CPU box: a budget that holds all three sets of weights", roomy,
                        shape, trace, COST, policies(roomy, trace)[COST], o))
    warm = SimOptions(priority=True, warm_tier=True)
    for shape, trace in gpu_traces.items():
        made = policies(gpu, trace)
        for label in (COST, LRU, BELADY_SIZED):
            out.append(("GPU box: host-RAM warm tier (priority on)", gpu, shape, trace, label,
                        made[label], warm))
    if all(w.restore_s is not None and w.keeps_bytes is not None for w in cpu.weights):
        # The server's CPU warm tier: a warm copy keeps its engine objects inside the budget.
        title = "CPU box: the warm tier, copies kept in the budget (priority off, as served)"
        for shape, trace in cpu_traces.items():
            made = policies(cpu, trace)
            for label in (COST, LRU, BELADY_SIZED):
                out.append((title, cpu, shape, trace, label, made[label],
                            SimOptions(warm_tier=True)))
            out.append((title, cpu, shape, trace,
                        f"{COST} + load turns ({LOAD_TURN:g} of the SLO)", made[COST],
                        SimOptions(warm_tier=True, load_turn=LOAD_TURN)))
    holds = [SimOptions(priority=True, min_residency_s=s) for s in MIN_RESIDENCY_S]
    holds += [SimOptions(priority=True, grace_s=s) for s in GRACE_S]
    if quick:
        holds = holds[:1] + holds[-1:]
    holds.append(SimOptions(priority=True, load_turn=LOAD_TURN))
    for box, traces in ((gpu, gpu_traces), (cpu, cpu_traces)):
        for shape, trace in traces.items():
            for o in holds:
                label = (f"{COST} + min residency {o.min_residency_s:g} s" if o.min_residency_s
                         else f"{COST} + grace {o.grace_s:g} s" if o.grace_s
                         else f"{COST} + load turns ({o.load_turn:g} of the SLO)")
                out.append((f"{box.name.upper()} box: holds tried on the cost-aware rule",
                            box, shape, trace, label, policies(box, trace)[COST], o))
    return out


def _sweep(gpu: Box, seed: int, duration_s: float,
           slo: Mapping[str, float]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for rate in GPU_SWEEP:
        trace = sim_trace(TRACES[0], gpu_popularity(seed), seed=seed, duration_s=duration_s,
                          rate=rate)
        for label, make in policies(gpu, trace).items():
            s = summary(run_one(gpu, "steady", trace, label, make, SimOptions(priority=True)),
                        slo)
            out.append({**s, "rate": rate})
    return out


def _weights_json(w: Any) -> dict[str, Any]:
    return {"key": w.key, "bytes": w.bytes, "load_s": w.load_s, "unload_s": w.unload_s,
            "restore_s": w.restore_s, "slots": w.slots}


def _goals(runs: Sequence[Mapping[str, Any]],
           traces: Mapping[str, Sequence[TraceRequest]]) -> list[Goal]:
    goals: list[Goal] = []
    for shape in traces:
        base = [r for r in runs if r["box"] == "gpu" and r["trace"] == shape and r["priority"]
                and not r["warm_tier"] and not r["min_residency_s"] and not r["grace_s"]
                and not r.get("load_turn")]
        by = {r["policy"]: r for r in base}
        cost = by[COST]
        goals.append(Goal(f"sim gpu {shape}: loads, packserve / Belady",
                          cost["loads"] / max(1, by[BELADY]["loads"]), 1.25, "<="))
        goals.append(Goal(f"sim gpu {shape}: loads, packserve / Belady, sized",
                          cost["loads"] / max(1, by[BELADY_SIZED]["loads"]), 1.25, "<=",
                          "a stronger reference than the issue's: it keeps unneeded victims"))
        for label, r in by.items():
            if label in (COST, BELADY, BELADY_SIZED):
                continue
            goals.append(Goal(f"sim gpu {shape}: loads, {label} / packserve",
                              r["loads"] / max(1, cost["loads"]), 1.0, ">=",
                              "above 1: packserve loads less"))
            goals.append(Goal(f"sim gpu {shape}: SLO attainment, packserve / {label}",
                              cost["slo_attainment"] / r["slo_attainment"]
                              if r["slo_attainment"] else None, 1.0, ">=",
                              "above 1: packserve meets the SLO more often"))
    return goals


def _plot_loads(path: Path, gpu: Box, traces: Mapping[str, Sequence[TraceRequest]],
                slo: Mapping[str, float]) -> None:
    """Cumulative loads over time per policy, one panel per GPU trace (priority on)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(4.2 * len(traces), 3.2), squeeze=False)
    for ax, (shape, trace) in zip(axes[0], traces.items(), strict=True):
        for label, make in policies(gpu, trace).items():
            r = run_one(gpu, shape, trace, label, make, SimOptions(priority=True)).result
            t = [x.at / 3600 for x in r.loads]
            ax.step(t, range(1, len(t) + 1), where="post", label=label)
        ax.set_title(f"GPU box, {shape}", fontsize=9)
        ax.set_xlabel("hours into the trace")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("loads so far")
    axes[0, -1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


# ------------------------------------------------------------------------------ validation


def validate(trace_json: Path, calibration: Mapping[str, Any]) -> dict[str, Any]:
    """A real `bench trace` run against the simulator: the same trace, footprints, budget and
    policies; SLO attainment per type and loads side by side."""
    data = json.loads(trace_json.read_text("utf-8"))
    res = data.get("results", {})
    p = res.get("trace", {})
    trace = make_trace(seed=int(p.get("seed", 1)), duration_s=float(p.get("duration_s", 60)),
                       rate=float(p.get("rate_per_s", 1.5)),
                       alpha=float(p.get("zipf_alpha", 0.9)),
                       cv=float(p.get("interarrival_cv", 1.0)), models=POPULARITY)
    slo = {**slo_targets(DEFAULT_SLO), **{k: float(v) for k, v in res.get("slo_s", {}).items()}}
    sizes = _measured_sizes(res)
    box = cpu_box(_with_run_warm_tier(calibration, res, sizes),
                  capacity_bytes=res.get("capacity_bytes"), sizes=sizes)
    rows: list[list[object]] = []
    out: dict[str, Any] = {"source": str(trace_json), "command": data.get("command"),
                           "date": data.get("date"), "requests": len(trace), "policies": {}}
    labels = list(res.get("policies", {}))
    held = str(data.get("date", "")) < LOCK_RELEASED_AT
    out["wait_holds_lock"] = held
    for label, real in res.get("policies", {}).items():
        make = _policy_from_spec(str(real.get("policy", "")))
        if make is None:
            continue
        on = _priority_of(label, real, labels)
        real_loads = _real_loads(real)
        warm, turn = _warm_tier_of(real), _load_turn_of(label, real, str(data.get("date", "")))
        sims = {prio: summary(run_one(box, "real trace", trace, label, make, SimOptions(
            priority=prio, wait_holds_lock=held, warm_tier=warm, load_turn=turn)), slo)
            for prio in (False, True)}
        # Loads compared as the real run counts them: from disk, restores apart.
        sim_loads = sims[on]["loads"] - sims[on]["restores"]
        entry: dict[str, Any] = {"real_loads": real_loads, "priority": on,
                                 "warm_tier": warm, "load_turn": turn,
                                 "sim_loads": sim_loads,
                                 "real_restores": int(real.get("restores") or 0),
                                 "sim_restores": sims[on]["restores"], "by_task": {}}
        for task in (*TASKS, "all"):
            real_att = _real_attainment(real, task)
            sim_att = {prio: sims[prio]["slo_attainment"] if task == "all"
                       else sims[prio]["by_task"].get(task, {}).get("slo_attainment")
                       for prio in (False, True)}
            real_p95 = real.get("by_task", {}).get(task, {}).get("p95_s")
            sim_p95 = sims[on]["by_task"].get(task, {}).get("p95_s")
            entry["by_task"][task] = {"real": real_att, "sim": sim_att[on],
                                      "sim_other_priority": sim_att[not on],
                                      "real_p95_s": real_p95, "sim_p95_s": sim_p95}
            rows.append([label, "on" if on else "off", task, _pct(real_att), _pct(sim_att[on]),
                         _points(sim_att[on], real_att), _pct(sim_att[not on]), real_p95,
                         sim_p95, real_loads if task == "all" else None,
                         sim_loads if task == "all" else None,
                         entry["real_restores"] if task == "all" else None,
                         entry["sim_restores"] if task == "all" else None])
        out["policies"][label] = entry
    out["table"] = {"title": f"validation against {trace_json}",
                    "columns": ["policy", "priority", "type", "real SLO met", "sim SLO met",
                                "sim - real", "sim, other priority", "real p95 s", "sim p95 s",
                                "real loads", "sim loads", "real restores",
                                "sim restores"], "rows": rows}
    within = [abs(t["sim"] - t["real"]) * 100 for e in out["policies"].values()
              for t in e["by_task"].values() if t["sim"] is not None and t["real"] is not None]
    # Loads from disk and restores together: with a warm tier, which of the two a switch
    # costs depends on a few MiB either side of the budget (below: `keeps_bytes`).
    loads = [(e["sim_loads"] + e["sim_restores"]) / (e["real_loads"] + e["real_restores"])
             for e in out["policies"].values() if e["real_loads"]]
    out["worst_points"] = max(within, default=None)
    out["worst_loads_ratio"] = max(loads, key=lambda v: abs(v - 1), default=None)
    out["notes"] = [
        f"validation: {trace_json} ({data.get('command')}, {data.get('date')}; simulated "
        f"with {'the device lock held' if held else 'the device lock let go'} while a load "
        f"waits for busy models): the worst SLO "
        f"difference is {_fmt(out['worst_points'], '{:.1f} points')} (goal <= 5) and the worst "
        f"ratio of loads and restores, sim/real, {_fmt(out['worst_loads_ratio'], '{:.2f}')} "
        f"(goal within 15%)"]
    return out


def validation_goals(validation: Mapping[str, Any]) -> list[Goal]:
    ratio = validation["worst_loads_ratio"]
    return [
        Goal("sim vs real: worst SLO attainment difference, points",
             validation["worst_points"], 5.0, "<=", "per type and policy"),
        Goal("sim vs real: worst ratio of loads and restores, larger of sim/real and real/sim",
             None if ratio is None else max(ratio, 1 / ratio), 1.15, "<=",
             "" if ratio is not None else "the real run counted no loads"),
    ]


def _policy_from_spec(spec: str) -> PolicyMaker | None:
    """The victim policy a real run's spec names (`policy_server`'s syntax, or `cost`)."""
    if spec.startswith("cost"):
        return lambda _: CostAware()
    from benchmarks.policy_server import parse_policy

    try:
        policy = parse_policy(spec)
    except (ValueError, IndexError):
        return None
    return lambda _: policy


def _measured_sizes(res: Mapping[str, Any]) -> dict[str, int]:
    """Bytes per set of weights as the real server counted them: the largest its load events
    measured (the scheduler counts the largest figure seen in the process), else the stored
    footprints the bench sized the budget from. They differ both ways: Gemma stored at 279 MiB
    measured 310-320 MiB in the process, which decides whether the embedder fits beside it;
    stored at 336 MiB it measured 330, which decides whether SmolLM2's warm copy does."""
    sizes = {k: int(v) for k, v in res.get("footprints_bytes", {}).items()}
    measured: dict[str, int] = {}
    for real in res.get("policies", {}).values():
        for e in real.get("load_events", ()):
            key = _key(e)
            if key in sizes and e.get("bytes_measured"):
                measured[key] = max(measured.get(key, 0), int(e["bytes_measured"]))
    return {**sizes, **measured}


def _real_attainment(real: Mapping[str, Any], task: str) -> float | None:
    """The real run's SLO attainment for `task` ("all": every request): with several runs
    (`bench trace --repeat`), the median of the runs' figures, as its goal rows give them;
    else the one run's."""
    runs = [r for r in real.get("runs", ()) if isinstance(r, Mapping)]
    each = [r.get("slo_attainment") if task == "all" else r.get("by_task", {}).get(task)
            for r in runs]
    found = [float(v) for v in each if isinstance(v, int | float)]
    if len(found) > 1:
        return float(np.median(found))
    if task == "all":
        value = real.get("slo_attainment")
    else:
        value = real.get("by_task", {}).get(task, {}).get("slo_attainment")
    return None if value is None else float(value)


def _with_run_warm_tier(calibration: Mapping[str, Any], res: Mapping[str, Any],
                        sizes: Mapping[str, int]) -> dict[str, Any]:
    """The calibration with the warm tier as the real run measured it, per set of weights:
    the median restore's seconds, the median eviction to warm's seconds, and what a warm copy
    kept (its measured footprint less what going warm freed)."""
    restores: dict[str, list[float]] = {}
    offloads: dict[str, list[float]] = {}
    freed: dict[str, list[int]] = {}
    for real in res.get("policies", {}).values():
        for e in real.get("restore_events", ()):
            restores.setdefault(_key(e), []).append(float(e["seconds"]))
        for e in real.get("evict_events", ()):
            if e.get("tier_to") == "warm":
                offloads.setdefault(_key(e), []).append(float(e["seconds"]))
                freed.setdefault(_key(e), []).append(int(e["bytes"]))
    weights = {k: dict(v) for k, v in calibration["weights"].items()}
    for key, w in weights.items():
        if restores.get(key) and freed.get(key) and key in sizes:
            w.update({"restore_s": float(np.median(restores[key])),
                      "offload_s": float(np.median(offloads[key])),
                      "keeps_bytes": max(0, sizes[key] - int(np.median(freed[key])))})
    return {**calibration, "weights": weights}


def _key(event: Mapping[str, Any]) -> str:
    """The weights key of a server event's model label ("a+b": the names sharing them)."""
    return str(event.get("model", "")).split("+")[0]


def _warm_tier_of(real: Mapping[str, Any]) -> bool:
    """Whether the real run kept evicted models warm: its own field, else whether it restored."""
    if isinstance(real.get("warm_tier"), bool):
        return bool(real["warm_tier"])
    return bool(real.get("restores"))


# The first committed `bench trace` run whose server gave a waiting load its turn
# (benchmarks/results/trace-turns); runs since record their `load_turn`.
TURNS_FROM = "2026-12-01T23:00:00+00:00"


def _load_turn_of(label: str, real: Mapping[str, Any], date: str) -> float:
    """The real run's `load_turn`: its own field, else the server's default for packserve's
    cost-aware rule with the warm tier since load turns exist (0 for the others)."""
    if isinstance(real.get("load_turn"), int | float):
        return float(real["load_turn"])
    cost = str(real.get("policy", "")).startswith("cost")
    if date >= TURNS_FROM and cost and "no load turns" not in label and _warm_tier_of(real):
        return LOAD_TURN
    return 0.0


def _priority_of(label: str, real: Mapping[str, Any], labels: Sequence[str]) -> bool:
    """Whether the real run had compute priority: its own field if it has one; else its label
    ("... priority off"); else on when another run of the file says it had it off (the bench
    names the exception), off otherwise (the server before compute priority)."""
    if isinstance(real.get("priority"), bool):
        return bool(real["priority"])
    if "priority on" in label:  # since compute priority is off by default
        return True
    if "priority off" in label:
        return False
    return any("priority off" in other for other in labels)


def _real_loads(real: Mapping[str, Any]) -> int | None:
    """Loads the real run counted: its `loads` field, else its `load` events."""
    loads = real.get("loads")
    if loads is None:
        events = real.get("events", {})
        loads = events.get("load") if isinstance(events, Mapping) else None
    return int(loads) if isinstance(loads, int | float) else None


def _pct(v: float | None) -> str | None:
    return None if v is None else f"{100 * v:.1f}%"


def _points(a: float | None, b: float | None) -> str | None:
    return None if a is None or b is None else f"{100 * (a - b):+.1f}"


def _fmt(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else fmt.format(v)


# ------------------------------------------------------------------------------ calibration


def _calibration(opts: Options, report: Report) -> dict[str, Any]:
    """The CPU box's figures: measured now (`--calibrate`), else the ones saved in the output
    folder by an earlier `--calibrate`, else the built-in ones (measured the same way)."""
    saved = opts.out / "sim-calibration.json"
    if not opts.extra.get("calibrate"):
        if saved.exists():
            report.notes.append(f"CPU box: calibration from {saved}")
            return dict(json.loads(saved.read_text("utf-8")))
        report.notes.append("CPU box: built-in calibration (sim_catalog.BUILTIN_CALIBRATION)")
        return {**BUILTIN_CALIBRATION, "source": "built-in"}
    calibration = calibrate(opts)
    saved.write_text(json.dumps(calibration, indent=1) + "\n", "utf-8")
    report.notes.append(f"CPU box: calibrated now, saved to {saved}")
    return calibration


def print_validation(validation: Mapping[str, Any]) -> None:
    from benchmarks.report import markdown_table

    table = validation["table"]
    console.print("\n".join(markdown_table(table["columns"], table["rows"])))
