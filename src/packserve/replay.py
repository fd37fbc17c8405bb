"""`packserve bench --url URL`: a trace replayed against a running server, and its report.

The trace is open loop: each request goes at its arrival time whether or not the earlier ones
were answered, as independent clients send them. Arrivals have Gamma inter-arrival times of a
given coefficient of variation (1 is a Poisson process, above 1 bursty); models are drawn with
Zipf(alpha) popularity over the server's models (`/v1/models`, in its order, or `--models`),
prompts and output lengths from small tables. A `TraceSpec` generates it: the same spec gives
the same requests, so a results file that records one (`python -m benchmarks trace`'s
trace.json, or this command's own `--out`) replays the same trace (`--trace`).

Each request goes to the endpoint of its model's task: the first of the `tasks` packserve lists
for it at `/v1/models`, chat for a model listed without any (another OpenAI-compatible server;
`--tasks NAME=TASK` says otherwise). The report, per type: requests, errors, p50 and p95 of the
answered, and the share answered within the type's SLO (packserve's `[server.slo]` defaults,
or `--slo`). Only httpx and numpy, both packserve's own dependencies: the command needs no
extra.

The benchmarks (benchmarks/ in a checkout) share this module's trace, requests and summary;
they also start their own servers, which this command never does.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from packserve.config import SloConfig
from packserve.types import Task

# (value, probability): words per prompt, and max_tokens per generation.
PROMPT_WORDS = ((8, 0.5), (32, 0.35), (96, 0.15))
MAX_TOKENS = ((8, 0.4), (16, 0.4), (32, 0.2))
RERANK_DOCUMENTS = 8
PATHS = {Task.EMBED: "/v1/embeddings", Task.RERANK: "/v1/rerank",
         Task.CHAT: "/v1/chat/completions", Task.COMPLETE: "/v1/completions"}
NO_ANSWER = -1  # an Outcome's status when no response came (connection refused, reset, timeout)


class ReplayError(Exception):
    """What stops a replay before it sends a request, in words for the command line:
    `exit_code` 1 when the server cannot be read, 2 when the inputs cannot be used."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it is sent, to which model, and how large it is."""

    at: float  # seconds after the start
    model: str
    words: int
    max_tokens: int
    seed: int


@dataclass(frozen=True)
class TraceSpec:
    """What generates a trace. Its fields are the keys of a results file's `results.trace`
    (`as_json`, `read_spec`), which `python -m benchmarks trace` writes too."""

    seed: int
    duration_s: float
    rate_per_s: float
    zipf_alpha: float
    interarrival_cv: float
    popularity: tuple[str, ...]  # the models, most popular first (`run`: empty, the server's)

    def requests(self) -> list[TraceRequest]:
        return make_trace(seed=self.seed, duration_s=self.duration_s, rate=self.rate_per_s,
                          alpha=self.zipf_alpha, cv=self.interarrival_cv,
                          models=self.popularity)

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "popularity": list(self.popularity),
                "prompt_words": PROMPT_WORDS, "max_tokens": MAX_TOKENS}


def make_trace(*, seed: int, duration_s: float, rate: float, alpha: float, cv: float,
               models: Sequence[str]) -> list[TraceRequest]:
    """The same arguments give the same trace. Pure: no clock, no I/O."""
    rng = np.random.default_rng(seed)
    weights = np.array([1.0 / (i + 1) ** alpha for i in range(len(models))])
    weights /= weights.sum()
    shape = 1.0 / (cv * cv)  # Gamma(k, theta): mean k*theta = 1/rate, CV = 1/sqrt(k)
    out: list[TraceRequest] = []
    t = 0.0
    while True:
        t += float(rng.gamma(shape, 1.0 / (rate * shape)))
        if t >= duration_s:
            return out
        model = models[int(rng.choice(len(models), p=weights))]
        words = _pick(rng, PROMPT_WORDS)
        out.append(TraceRequest(at=t, model=model, words=words,
                                max_tokens=_pick(rng, MAX_TOKENS),
                                seed=int(rng.integers(1_000_000_000))))


def _pick(rng: np.random.Generator, table: tuple[tuple[int, float], ...]) -> int:
    values, probs = zip(*table, strict=True)
    return int(values[int(rng.choice(len(values), p=np.array(probs) / sum(probs)))])


def read_spec(path: Path) -> TraceSpec:
    """The trace a results file records in `results.trace` (raises ReplayError if none)."""
    try:
        data = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise ReplayError(f"cannot read the trace file {path}: {exc}") from exc
    try:
        p = data["results"]["trace"]
        return TraceSpec(seed=int(p["seed"]), duration_s=float(p["duration_s"]),
                         rate_per_s=float(p["rate_per_s"]), zipf_alpha=float(p["zipf_alpha"]),
                         interarrival_cv=float(p["interarrival_cv"]),
                         popularity=tuple(str(m) for m in p["popularity"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ReplayError(
            f"{path} records no trace: results.trace needs seed, duration_s, rate_per_s, "
            f"zipf_alpha, interarrival_cv and popularity (missing or wrong: {exc})") from exc


# ----------------------------------------------------------------------- requests


_WORDS = (  # noqa: SIM905 (one sentence reads better than 60 strings)
    "the quick brown fox jumps over a lazy dog while seven engineers measure memory "
    "latency tokens models packing servers under load across two small cores and one "
    "budget each request waits queues evict warm cold paris river mountain coffee "
    "library window garden music silver train morning").split()


def sentences(n: int, *, words: int = 12, seed: int = 0) -> list[str]:
    """`n` deterministic, varied English-looking sentences of `words` words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."
            for _ in range(n)]


def request_for(task: Task, model: str, *, words: int = 12, max_tokens: int = 16,
                seed: int = 0, docs: int = RERANK_DOCUMENTS) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one request of `task` to `model`: greedy, `max_tokens` at most."""
    text = sentences(1, words=words, seed=seed)[0]
    if task is Task.EMBED:
        return PATHS[task], {"model": model, "input": text}
    if task is Task.RERANK:
        return PATHS[task], {"model": model, "query": text,
                             "documents": sentences(docs, words=words, seed=seed + 1)}
    if task is Task.COMPLETE:
        return PATHS[task], {"model": model, "prompt": text, "max_tokens": max_tokens,
                             "temperature": 0}
    return PATHS[task], {"model": model, "max_tokens": max_tokens, "temperature": 0,
                         "seed": seed, "messages": [{"role": "user", "content": text}]}


def server_models(client: httpx.Client, tasks: Mapping[str, Task]) -> dict[str, Task]:
    """Each model the server lists at /v1/models, in its order, with the task it is sent:
    `tasks`' if named there, else the first of those it lists that this module knows, else
    chat. Raises ReplayError (exit code 1) when the list cannot be read."""
    try:
        r = client.get("/v1/models")
        r.raise_for_status()
        rows = r.json()["data"]
        listed = {str(m["id"]): [str(t) for t in m.get("tasks") or ()] for m in rows}
    except httpx.HTTPStatusError as exc:
        raise ReplayError(f"{exc.request.url} answered {exc.response.status_code}: "
                          f"{_brief(exc.response)}", exit_code=1) from exc
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise ReplayError(f"cannot reach {client.base_url}: {str(exc) or type(exc).__name__}",
                          exit_code=1) from exc
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ReplayError(f"{client.base_url}/v1/models is not an OpenAI model list "
                          f"({type(exc).__name__}: {exc})", exit_code=1) from exc
    known = {t.value: t for t in Task}
    return {name: tasks.get(name) or next((known[t] for t in own if t in known), Task.CHAT)
            for name, own in listed.items()}


# ----------------------------------------------------------------------- the replay


@dataclass(frozen=True)
class Outcome:
    """One request of a replay, as the client saw it."""

    at: float  # when it was due, seconds after the start
    model: str
    task: str
    status: int  # the HTTP status, or NO_ANSWER
    latency_s: float
    error: str | None = None  # why it was not a 200, in short


RequestMaker = Callable[[TraceRequest], tuple[str, dict[str, Any]]]


async def replay(url: str, trace: Sequence[TraceRequest], tasks: Mapping[str, Task], *,
                 make: RequestMaker | None = None, headers: Mapping[str, str] | None = None,
                 on_done: Callable[[Outcome], None] | None = None,
                 timeout_s: float = 600.0) -> list[Outcome]:
    """Send every request of `trace` at its time (open loop) and wait for all of them.

    `tasks`: each model's task; `make`: a request's path and body (default `request_for` its
    model's task); `on_done` is called as each finishes. A request that gets no answer is an
    Outcome with status NO_ANSWER, never an exception. Outcomes come in the order they finish.
    """
    def default(r: TraceRequest) -> tuple[str, dict[str, Any]]:
        return request_for(tasks[r.model], r.model, words=r.words, max_tokens=r.max_tokens,
                           seed=r.seed)

    build = make or default
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    results: list[Outcome] = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits,
                                 headers=dict(headers or {})) as c:
        start = time.perf_counter()

        async def one(r: TraceRequest) -> None:
            await asyncio.sleep(max(0.0, start + r.at - time.perf_counter()))
            path, body = build(r)
            t0 = time.perf_counter()
            error: str | None = None
            try:
                response = await c.post(path, json=body)
                status = response.status_code
                if status != 200:
                    error = f"{status}: {_brief(response)}"
            except httpx.HTTPError as exc:
                status, error = NO_ANSWER, f"no answer: {type(exc).__name__} {exc}".strip()
            done = Outcome(at=r.at, model=r.model, task=tasks[r.model].value, status=status,
                           latency_s=time.perf_counter() - t0, error=error)
            results.append(done)
            if on_done is not None:
                on_done(done)

        await asyncio.gather(*(one(r) for r in trace))
    return results


def _brief(response: httpx.Response) -> str:
    """An error answer in one short line: its OpenAI-style message, else its text."""
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = response.text
    return " ".join(message.split())[:160]


def by_task(outcomes: Sequence[Outcome], slo: Mapping[str, float],
            wall_s: float) -> dict[str, dict[str, Any]]:
    """Per type (sorted): requests, errors, p50/p90/p95/p99 of the answered (None when none
    were), the SLO, the share answered (200) within it, goodput (those per second of
    `wall_s`) and the answered latencies."""
    stats: dict[str, dict[str, Any]] = {}
    for task in sorted({o.task for o in outcomes}):
        rs = [o for o in outcomes if o.task == task]
        ok = [o.latency_s for o in rs if o.status == 200]
        p50, p90, p95, p99 = (np.percentile(ok, [50, 90, 95, 99]).tolist() if ok
                              else [None] * 4)
        met = sum(1 for o in rs if o.status == 200 and o.latency_s <= slo[task])
        stats[task] = {"requests": len(rs), "errors": len(rs) - len(ok), "p50_s": p50,
                       "p90_s": p90, "p95_s": p95, "p99_s": p99, "slo_s": slo[task],
                       "slo_attainment": met / len(rs), "goodput_rps": met / wall_s,
                       "latencies_s": ok}
    return stats


def attainment(stats: Mapping[str, Mapping[str, Any]]) -> float:
    """The share of all requests answered within their type's SLO, from `by_task`'s stats."""
    met = sum(float(s["slo_attainment"]) * int(s["requests"]) for s in stats.values())
    return met / max(1, sum(int(s["requests"]) for s in stats.values()))


def slo_targets(spec: str | None) -> dict[str, float]:
    """Seconds per type: packserve's `[server.slo]` defaults, overridden by `spec`
    ("embed=0.5,chat=4"). Raises ReplayError for a type or number it cannot read."""
    defaults = SloConfig()
    slo = {t.value: defaults.of(t) for t in Task}
    for item in filter(None, (i.strip() for i in (spec or "").split(","))):
        task, _, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = 0.0
        if task.strip() not in slo or not value > 0:
            raise ReplayError(f"--slo {item!r}: want TYPE=SECONDS with TYPE one of "
                              f"{', '.join(slo)} and SECONDS > 0")
        slo[task.strip()] = value
    return slo


def task_overrides(spec: str | None) -> dict[str, Task]:
    """`--tasks` ("NAME=TASK,..."): the task to send each named model."""
    out: dict[str, Task] = {}
    for item in filter(None, (i.strip() for i in (spec or "").split(","))):
        name, _, task = item.rpartition("=")
        try:
            out[name.strip()] = Task(task.strip())
        except ValueError:
            raise ReplayError(f"--tasks {item!r}: want NAME=TASK with TASK one of "
                              f"{', '.join(t.value for t in Task)}") from None
    return out


# ----------------------------------------------------------------------- the command


@dataclass(frozen=True)
class Report:
    """A replay's results: what `packserve bench` prints, and writes with `--out`."""

    url: str
    spec: TraceSpec
    slo: dict[str, float]
    wall_s: float
    outcomes: list[Outcome]

    @property
    def stats(self) -> dict[str, dict[str, Any]]:
        return by_task(self.outcomes, self.slo, self.wall_s)

    def errors(self) -> Counter[str]:
        return Counter(o.error for o in self.outcomes if o.error is not None)

    def as_json(self, command: str) -> dict[str, Any]:
        stats = self.stats
        return {"command": command, "url": self.url,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "results": {"trace": {**self.spec.as_json(), "requests": len(self.outcomes)},
                            "slo_s": self.slo, "wall_s": self.wall_s,
                            "slo_attainment": attainment(stats), "by_task": stats,
                            "errors": dict(self.errors()),
                            "requests": [asdict(o) for o in self.outcomes]}}

    def lines(self) -> list[str]:
        """The report as text: a line per type and one for all, then the errors."""
        s = self.spec
        head = (f"{len(self.outcomes)} requests to {self.url} in {self.wall_s:.1f} s "
                f"(seed {s.seed}, {s.rate_per_s:g}/s for {s.duration_s:g} s, CV "
                f"{s.interarrival_cv:g}, Zipf {s.zipf_alpha:g} over {len(s.popularity)} "
                f"models)")
        rows = [("type", "requests", "errors", "p50 s", "p95 s", "SLO s", "within SLO")]
        stats = self.stats
        for task, t in stats.items():
            rows.append((task, str(t["requests"]), str(t["errors"]), _seconds(t["p50_s"]),
                         _seconds(t["p95_s"]), f"{t['slo_s']:g}",
                         f"{100 * t['slo_attainment']:.1f}%"))
        rows.append(("all", str(len(self.outcomes)),
                     str(sum(t["errors"] for t in stats.values())), "", "", "",
                     f"{100 * attainment(stats):.1f}%"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        table = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                 for r in rows]
        errors = [f"  {n} x {e}" for e, n in self.errors().most_common(10)]
        return [head, *table, *(["errors:", *errors] if errors else [])]


def _seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def run(url: str, spec: TraceSpec, *, tasks: Mapping[str, Task], slo: Mapping[str, float],
        headers: Mapping[str, str], progress: Callable[[int, int], None] | None = None
        ) -> Report:
    """Read the server's models, replay the trace `spec` generates (over the server's models,
    in its order, when `spec.popularity` is empty) and return the report. Raises ReplayError
    before sending anything when the server cannot be read or does not serve the trace's
    models. `progress(done, total)` is called as requests finish."""
    with httpx.Client(base_url=url, timeout=30, headers=dict(headers)) as client:
        served = server_models(client, tasks)
    if not spec.popularity:
        if not served:
            raise ReplayError(f"{url} lists no models at /v1/models", exit_code=1)
        spec = replace(spec, popularity=tuple(served))
    missing = [m for m in spec.popularity if m not in served]
    if missing:
        raise ReplayError(f"{url} does not list {', '.join(missing)} at /v1/models "
                          f"(it lists {', '.join(served) or 'none'})")
    trace = spec.requests()
    done = 0

    def advance(_: Outcome) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(trace))

    t0 = time.perf_counter()
    outcomes = asyncio.run(replay(url, trace, served, headers=headers, on_done=advance))
    return Report(url=url, spec=spec, slo=dict(slo), wall_s=time.perf_counter() - t0,
                  outcomes=outcomes)
