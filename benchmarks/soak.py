"""`python -m benchmarks soak`: mixed traffic across every default model, with evictions, from
several API keys, for a bounded time, against one real `packserve serve` (front + worker).

What it answers: does a server that keeps loading and evicting models for hours hold its
memory, descriptors and threads, and answer every request it accepted without a 500?

- Keys: a keys file minted for the run (`packserve.auth.mint`): `search` (the embedder and the
  reranker), `assistant` (`smollm2-*`: chat and extraction), `docs` (Gemma completions and
  embeddings), `analytics` (`*`) and `ops` (admin, for `/v1/residency` only). Each client
  thread is a closed loop with its key: a request, then an exponential pause.
- Evictions: the budget (minus a 16 MiB headroom) is the largest load plus the mean of the two
  smallest, from the footprints packserve measured before (else its estimates): Gemma fits with
  MiniLM but not with SmolLM2, so chat and completion traffic keep swapping them.
- Memory: PSS (smaps_rollup) of every packserve process (the front, the worker, any other
  descendant), sampled every second when no model is loading or unloading and the same models
  are hot before and after the read, from the end of the warm-up (the first fifth of the
  traffic) on. Evictions move PSS by hundreds of MiB, so the slope is fitted within each
  resident set: one line per set, one shared slope (the pooled within-group least squares).
- Descriptors and threads (/proc/PID/fd, /proc/PID/task) per process: idle before any request,
  at the end of the warm-up (start) and after all the traffic (end), the last two with no
  request in flight: thread pools that grow with concurrency have grown by the start.
- Requests per type (embed, rerank, chat, extract = chat with a JSON schema, complete): sent,
  accepted (the connection was taken: all but connect errors), answered (an HTTP response, any
  status), lost (accepted, never answered), 500s, other statuses, p50/p95 of the 200s.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks import common
from benchmarks.common import (
    MIB,
    Goal,
    Options,
    Report,
    Server,
    logged_events,
    packserve_argv,
    progress,
    request_body,
    run_server,
    write_config,
)
from benchmarks.reliability import Tally, descendants, smaps_rollup
from benchmarks.trace import HEADROOM, footprints

KIND_OF = {**common.TASK_OF, common.EXTRACT_MODEL: "extract"}  # the request types reported
KINDS = tuple(dict.fromkeys(KIND_OF[m] for m in common.CATALOG))
WARMUP_FRACTION = 0.2
CLIENT_TIMEOUT_S = 600.0  # longer than the server's load_wait_s (300): the server answers first
MOVING = ("loading", "unloading")  # memory in motion: no sample


@dataclass(frozen=True)
class Client:
    """One closed loop: `models` in turn with `key`, an exponential pause of mean `think_s`."""

    key: str
    models: tuple[str, ...]
    think_s: float


KEYS: dict[str, tuple[tuple[str, ...], bool]] = {  # name -> (models it may call, admin)
    "search": ((common.EMBED_MODEL, common.RERANK_MODEL), False),
    "assistant": (("smollm2-*",), False),
    "docs": ((common.COMPLETE_MODEL, common.EMBED_MODEL), False),
    "analytics": (("*",), False),
    "ops": (("*",), True),
}
CLIENTS = (
    Client("search", (common.EMBED_MODEL, common.RERANK_MODEL), 0.2),
    Client("search", (common.RERANK_MODEL, common.EMBED_MODEL), 0.2),
    Client("assistant", (common.CHAT_MODEL, common.EXTRACT_MODEL), 0.5),
    Client("docs", (common.COMPLETE_MODEL, common.EMBED_MODEL), 1.0),
    Client("analytics", common.CATALOG, 1.0),
)


# ----------------------------------------------------------------------- pure figures


def pooled_slope(samples: Sequence[tuple[float, str, float]]) -> float | None:
    """The slope (value per second) shared by one line per group, fitted to `(t, group,
    value)` samples: each group keeps its own level, so jumps between groups add nothing.
    None when no group has two samples at different times."""
    by: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t, group, value in samples:
        by[group].append((t, value))
    num = den = 0.0
    for points in by.values():
        ts = np.array([p[0] for p in points])
        vs = np.array([p[1] for p in points])
        num += float(((ts - ts.mean()) * (vs - vs.mean())).sum())
        den += float(((ts - ts.mean()) ** 2).sum())
    return num / den if den > 0 else None


def budget_for(sizes: Sequence[int]) -> int:
    """Room for the largest load and half of the two smallest: pairs with the largest evict."""
    s = sorted(sizes)
    return s[-1] + (s[0] + s[1]) // 2 if len(s) >= 3 else s[-1]


# ----------------------------------------------------------------------- /proc and the server


def processes(server: Server, c: httpx.Client) -> dict[str, int]:
    """Every packserve process by role: the front, the worker, any other descendant."""
    worker = c.get("/healthz").json()["worker"]["pid"]
    pids = {"front": server.pid}
    if worker is not None:
        pids["worker"] = int(worker)
    for pid in descendants(server.pid):
        if pid != worker:
            pids[f"pid {pid}"] = pid
    return pids


def process_counts(pid: int) -> dict[str, int]:
    return {"pss_bytes": smaps_rollup(pid).get("Pss", 0),
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": len(os.listdir(f"/proc/{pid}/task"))}


def snapshot(server: Server, c: httpx.Client) -> dict[str, dict[str, int]]:
    out = {}
    for role, pid in processes(server, c).items():
        with contextlib.suppress(OSError):  # a process that just ended
            out[role] = {"pid": pid, **process_counts(pid)}
    return out


def resident(c: httpx.Client) -> tuple[tuple[str, ...], bool]:
    """(the hot models, whether any is loading or unloading), from /v1/residency."""
    rows = c.get("/v1/residency").json()["models"]
    return (tuple(sorted(r["name"] for r in rows if r["state"] == "hot")),
            any(r["state"] in MOVING for r in rows))


def sample_memory(server: Server, c: httpx.Client, interval_s: float, t0: float,
                  stop: threading.Event, out: list[dict[str, Any]], skipped: Counter[str]
                  ) -> None:
    """Every `interval_s` until `stop`: a sample when the resident set holds still."""
    while not stop.wait(interval_s):
        try:
            before, moving = resident(c)
            if moving:
                skipped["loading or unloading"] += 1
                continue
            procs = snapshot(server, c)
            after, moving = resident(c)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            skipped[f"error: {type(exc).__name__}"] += 1
            continue
        if after != before or moving:
            skipped["resident set changed during the read"] += 1
            continue
        out.append({"t": time.perf_counter() - t0, "resident": "+".join(before),
                    "pss_bytes": sum(p["pss_bytes"] for p in procs.values()),
                    "processes": procs})


def client_loop(server: Server, key: str, client: Client, seed: int,
                tallies: dict[str, Tally], stop: threading.Event, cover: bool = False) -> None:
    """Requests in turn until `stop`; with `cover`, also until each of the client's models was
    called once (a short run whose first answers wait on loads still reaches every model)."""
    rng = random.Random(seed)
    with server.client(timeout=CLIENT_TIMEOUT_S) as c:
        c.headers["Authorization"] = f"Bearer {key}"
        i = 0
        while not stop.is_set() or (cover and i < len(client.models)):
            model = client.models[i % len(client.models)]
            path, body = request_body(model, words=rng.choice((8, 24, 64)),
                                      max_tokens=rng.choice((8, 16, 24)),
                                      seed=rng.randrange(1 << 30))
            tallies[KIND_OF[model]].post(c, path, body)
            i += 1
            stop.wait(rng.expovariate(1.0 / client.think_s))


def residency_events(log: Path, offset: int) -> Counter[str]:
    """Counts of the event log's kinds (load, evict, failure, request >= 499) since `offset`."""
    kinds: Counter[str] = Counter()
    for event in logged_events(log, offset):
        kind = str(event.get("kind"))
        kinds[kind if kind != "request" else f"request {event.get('status')}"] += 1
    return kinds


# ----------------------------------------------------------------------- the scenario


@dataclass
class Soak:
    """What one run measured, for the report."""

    duration_s: float
    warmup_s: float
    interval_s: float
    sizes: dict[str, int]
    capacity: int
    tallies: dict[str, Tally] = field(default_factory=lambda: {k: Tally() for k in KINDS})
    samples: list[dict[str, Any]] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    procs: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    resident_at: dict[str, tuple[str, ...]] = field(default_factory=dict)
    workers: dict[str, Any] = field(default_factory=dict)
    events: Counter[str] = field(default_factory=Counter)
    traffic_s: float = 0.0
    stuck: int = 0  # client threads still waiting for an answer when the run ended


def drive(server: Server, keys: dict[str, str], soak: Soak, seconds: float, seed: int,
          advance: Any, cover: bool = False) -> None:
    """Every client of CLIENTS for `seconds` (with `cover`, until each also called each of its
    models once); then waits for their last answers."""
    stop = threading.Event()
    clients = [threading.Thread(target=client_loop, args=(
        server, keys[cl.key], cl, seed + i, soak.tallies, stop, cover), daemon=True)
        for i, cl in enumerate(CLIENTS)]
    for t in clients:
        t.start()
    t0 = time.perf_counter()
    while (left := seconds - (time.perf_counter() - t0)) > 0:
        time.sleep(min(1.0, left))
        advance(min(1.0, left), f"{len(soak.samples)} PSS samples")
    stop.set()
    for t in clients:
        t.join(CLIENT_TIMEOUT_S + 30)
    soak.traffic_s += time.perf_counter() - t0
    soak.stuck += sum(t.is_alive() for t in clients)


def quiet(server: Server, ops: httpx.Client, soak: Soak, when: str) -> None:
    """Descriptors, threads and PSS per process once no request is in flight."""
    time.sleep(2.0)  # the last answers' buffers and connections are let go
    soak.procs[when] = snapshot(server, ops)
    soak.resident_at[when] = resident(ops)[0]
    soak.workers[when] = ops.get("/healthz").json()["worker"]


def run(opts: Options) -> Report:
    duration = 12.0 if opts.quick else float(opts.extra.get("duration", 600))
    work = opts.out / "work"
    sizes = footprints(opts, write_config(work / "soak-probe.toml", opts))
    soak = Soak(duration_s=duration, warmup_s=duration * WARMUP_FRACTION,
                interval_s=0.5 if opts.quick else 1.0, sizes=sizes,
                capacity=budget_for(list(sizes.values())))
    keys_path = work / "soak-keys.toml"
    keys_path.unlink(missing_ok=True)
    from packserve.auth import mint

    keys = {name: mint(keys_path, name, models, admin)
            for name, (models, admin) in KEYS.items()}
    config = write_config(work / "soak.toml", opts, memory_budget=str(soak.capacity + HEADROOM),
                          headroom=str(HEADROOM), log_level="info", keys_file=keys_path.name)
    log = work / "soak-server.log"
    log_from = log.stat().st_size if log.exists() else 0
    with progress(opts, "soak", duration) as advance, run_server(
            packserve_argv("--config", str(config)), health="/readyz", log=log) as server, \
            server.client(timeout=60) as ops:
        ops.headers["Authorization"] = f"Bearer {keys['ops']}"
        soak.procs["idle"] = snapshot(server, ops)
        drive(server, keys, soak, soak.warmup_s, 100, advance, cover=True)  # every model loads
        quiet(server, ops, soak, "start")
        stop = threading.Event()
        sampler = threading.Thread(target=sample_memory, args=(
            server, ops, soak.interval_s, time.perf_counter(), stop, soak.samples,
            soak.skipped), daemon=True)
        sampler.start()
        drive(server, keys, soak, duration - soak.warmup_s, 200, advance)
        stop.set()
        sampler.join(60)
        quiet(server, ops, soak, "end")
    soak.events = residency_events(log, log_from)
    return _report(opts, soak)


def _report(opts: Options, soak: Soak) -> Report:
    def mib(n: float) -> float:
        return round(n / MIB, 1)

    # ---- requests
    by_type: dict[str, Any] = {}
    type_rows: list[list[object]] = []
    for kind, tally in soak.tallies.items():
        refused = sum(e.startswith("ConnectError") for e in tally.errors)
        accepted = tally.sent - refused
        ok = [t1 - t0 for t0, t1, status in tally.spans if status == 200]
        p50, p95 = (np.percentile(ok, [50, 95]).tolist() if ok else [None, None])
        others = {str(s): n for s, n in sorted(tally.statuses.items()) if s not in (200, 500)}
        by_type[kind] = {"sent": tally.sent, "accepted": accepted, "answered": tally.answered,
                         "lost": accepted - tally.answered, "status_200": tally.statuses[200],
                         "status_500": tally.statuses[500], "other_statuses": others,
                         "p50_s": p50, "p95_s": p95, "transport_errors": tally.errors[:10]}
        type_rows.append([kind, tally.sent, accepted, tally.answered, accepted - tally.answered,
                          tally.statuses[200], tally.statuses[500],
                          ", ".join(f"{s}: {n}" for s, n in others.items()) or "-", p50, p95])
    accepted_all = sum(t["accepted"] for t in by_type.values())
    answered_all = sum(t["answered"] for t in by_type.values())
    errors_500 = sum(t["status_500"] for t in by_type.values())

    # ---- memory: every sample is after the warm-up
    slope = pooled_slope([(s["t"], s["resident"], s["pss_bytes"]) for s in soak.samples])
    slope_mib_min = None if slope is None else slope * 60 / MIB
    sets: dict[str, Any] = {}
    set_rows: list[list[object]] = []
    for name in sorted({s["resident"] for s in soak.samples}):
        mine = [s for s in soak.samples if s["resident"] == name]
        pss = [s["pss_bytes"] for s in mine]
        one = pooled_slope([(s["t"], name, s["pss_bytes"]) for s in mine])
        one_mib = None if one is None else round(one * 60 / MIB, 3)
        sets[name] = {"samples": len(pss), "pss_mean_bytes": float(np.mean(pss)),
                      "pss_min_bytes": min(pss), "pss_max_bytes": max(pss),
                      "slope_mib_per_min": one_mib}
        set_rows.append([name or "(none)", len(pss), mib(float(np.mean(pss))),
                         f"{mib(min(pss))} to {mib(max(pss))}", one_mib])

    # ---- descriptors and threads
    whens = ("idle", "start", "end")
    roles = list(dict.fromkeys(r for w in whens for r in soak.procs[w]))
    proc_rows: list[list[object]] = []
    for role in roles:
        at = [soak.procs[w].get(role) for w in whens]
        seen = [s["processes"][role] for s in soak.samples if role in s["processes"]]
        proc_rows.append([role, *("/".join(str(p[key]) if p else "-" for p in at)
                                  for key in ("fds", "threads")),
                          *(f"{min(p[key] for p in seen)} to {max(p[key] for p in seen)}"
                            if seen else "-" for key in ("fds", "threads")),
                          "/".join(str(mib(p["pss_bytes"])) if p else "-" for p in at)])

    def total(when: str, key: str) -> int:
        return sum(p[key] for p in soak.procs[when].values())

    generations = {w: soak.workers[w].get("generation") for w in ("start", "end")}
    fig_rows: list[list[object]] = [
        ["traffic (s), of which warm-up", f"{soak.traffic_s:.0f}, {soak.warmup_s:.0f}"],
        ["PSS slope after warm-up, pooled over resident sets (MiB/min)",
         None if slope_mib_min is None else round(slope_mib_min, 3)],
        ["PSS samples kept / skipped (a model loading or unloading, or the set changed)",
         f"{len(soak.samples)} / {sum(soak.skipped.values())}"],
        ["budget - headroom (MiB); loads (MiB)", f"{mib(soak.capacity)}; " + ", ".join(
            f"{k} {mib(v)}" for k, v in soak.sizes.items())],
        ["loads, evictions, load failures (event log)",
         f"{soak.events['load']}, {soak.events['evict']}, {soak.events['failure']}"],
        ["resident at start / end", " / ".join("+".join(soak.resident_at[w]) or "-"
                                               for w in ("start", "end"))],
        ["worker generation at start / end", f"{generations['start']} / {generations['end']}"],
        ["requests accepted / answered / 500", f"{accepted_all} / {answered_all} / {errors_500}"],
    ]
    report = Report("soak")
    report.results = {
        "duration_s": soak.duration_s, "traffic_s": soak.traffic_s, "warmup_s": soak.warmup_s,
        "sample_interval_s": soak.interval_s, "footprints_bytes": soak.sizes,
        "capacity_bytes": soak.capacity, "headroom_bytes": HEADROOM,
        "keys": {k: {"models": list(m), "admin": a} for k, (m, a) in KEYS.items()},
        "clients": [{"key": c.key, "models": list(c.models), "think_s": c.think_s}
                    for c in CLIENTS],
        "by_type": by_type, "accepted": accepted_all, "answered": answered_all,
        "lost": accepted_all - answered_all, "status_500": errors_500,
        "clients_still_waiting": soak.stuck,
        "pss_slope_mib_per_min": slope_mib_min, "resident_sets": sets,
        "samples_skipped": dict(soak.skipped), "samples": soak.samples,
        "processes": soak.procs, "resident_at": soak.resident_at, "workers": soak.workers,
        "events": dict(soak.events),
        "tables": [
            {"columns": ["type", "sent", "accepted", "answered", "lost", "200", "500",
                         "other statuses", "p50 s", "p95 s"], "rows": type_rows},
            {"columns": ["process", "fds idle/start/end", "threads idle/start/end",
                         "fds under traffic", "threads under traffic",
                         "PSS MiB idle/start/end"], "rows": proc_rows},
            {"columns": ["resident set (after warm-up)", "samples", "PSS MiB mean",
                         "PSS MiB range", "slope MiB/min"], "rows": set_rows},
            {"columns": ["figure", "value"], "rows": fig_rows},
        ],
    }
    report.goals = [
        Goal("soak: PSS slope after warm-up / 1 MiB per minute", slope_mib_min, 1.0, "<=",
             "" if slope_mib_min is not None else "no resident set sampled twice"),
        Goal("soak: open descriptors, end / start (all packserve processes)",
             total("end", "fds") / total("start", "fds"), 1.0, "<="),
        Goal("soak: threads, end / start (all packserve processes)",
             total("end", "threads") / total("start", "threads"), 1.0, "<="),
        Goal("soak: requests answered / accepted",
             answered_all / accepted_all if accepted_all else None, 1.0, ">=",
             "" if accepted_all else "no request accepted"),
        Goal("soak: answers other than 500 / answered",
             (answered_all - errors_500) / answered_all if answered_all else None, 1.0, ">=",
             "" if answered_all else "no request answered"),
    ]
    report.notes += [
        f"{len(CLIENTS)} closed-loop clients, one key each: "
        + ", ".join(f"{c.key} ({'+'.join(c.models)}, pause {c.think_s} s)" for c in CLIENTS)
        + "; prompts of 8/24/64 words, max_tokens 8/16/24; p50/p95 over the 200s.",
        "idle = before any request; start = after the warm-up traffic, end = after all of it, "
        "both with no request in flight; PSS is sampled after the warm-up only with no model "
        "loading or unloading and the same hot set around the read, and its slope is one line "
        "per resident set with one shared slope.",
    ]
    if opts.quick:
        report.notes.append("--quick: a smoke test; its slope spans seconds and means nothing.")
    return report
