"""Telemetry: scheduler events and snapshots -> Prometheus metrics, a JSON summary, a sampler.

Who calls what: the scheduler calls `on_event` (it is an event sink) on the event loop; the
app's background task calls `sample` every `sample_interval_s`; `/metrics` calls `render` and
`/v1/metrics/summary` calls `summary`. Everything runs on the event loop thread.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from packserve.core.events import (
    Event,
    EvictEvent,
    LoadEvent,
    LoadFailedEvent,
    RequestEvent,
    RequestStartEvent,
)
from packserve.core.scheduler import Scheduler
from packserve.metrics.cost import CostMeter
from packserve.types import State, Task

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25,
                 0.5, 1.0)
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
EMBEDDING_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
RECENT_LATENCIES = 1000  # per model and task, for the summary's p50/p95
RECENT_EVENTS = 50


class Telemetry:
    def __init__(
        self,
        scheduler: Scheduler,
        *,
        prices: Mapping[str, float],
        default_price: float,
        currency: str,
        window_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._scheduler = scheduler
        self._clock = clock
        self._wall = wall_clock
        self.currency = currency
        self.window_s = window_s
        self.cost = CostMeter(prices, clock, default_price)
        self._recent: dict[tuple[str, str], deque[_Done]] = defaultdict(
            lambda: deque(maxlen=RECENT_LATENCIES))
        self._started = clock()
        self._events: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        self._headroom: dict[str, deque[tuple[float, int]]] = defaultdict(deque)

        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "packserve_requests", "Requests that reached a model, by HTTP status code",
            ["model", "task", "code"], registry=self.registry)
        self._duration = Histogram(
            "packserve_request_duration_seconds",
            "Request latency by phase: queue (quota wait), load (waiting for the model to "
            "load), inference, total", ["model", "task", "phase"], buckets=LATENCY_BUCKETS,
            registry=self.registry)
        self._ttft = Histogram(
            "packserve_time_to_first_token_seconds",
            "Streams: from the request's arrival at its model to its first text (queue, load or "
            "restore, and prompt)", ["model", "task"], buckets=LATENCY_BUCKETS,
            registry=self.registry)
        self._itl = Histogram(
            "packserve_inter_token_latency_seconds",
            "Streams: the mean time between tokens after the first, one observation per request",
            ["model", "task"], buckets=TOKEN_BUCKETS, registry=self.registry)
        self._within_slo = Counter(
            "packserve_requests_within_slo", "Successful requests within their SLO (a stream: "
            "its first token; otherwise its whole answer); per second, this is goodput",
            ["model", "task"], registry=self.registry)
        self._tokens = Counter(
            "packserve_tokens", "Tokens by direction: prompt and completion for generation, "
            "input for embed and rerank", ["model", "direction"], registry=self.registry)
        self._load_seconds = Histogram(
            "packserve_model_load_seconds", "Seconds to bring a model's weights onto its device",
            ["model", "tier"], buckets=LOAD_BUCKETS, registry=self.registry)
        self._residency_events = Counter(
            "packserve_model_events", "Residency events: load, restore (from warm), offload (to "
            "warm), evict (to cold), failure",
            ["model", "event"], registry=self.registry)
        self._evictions = Counter(
            "packserve_evictions", "Evictions by cause (make_room, memory_retry, budget_shrank, "
            "overshoot, operator, retired, idle) and the victim policy that chose the victim "
            "(cost, lru; none when no policy chose); the policy's reasons are in /v1/residency's "
            "recent events",
            ["model", "device", "cause", "policy"], registry=self.registry)
        self._compute_wait = Counter(
            "packserve_compute_wait_seconds", "Seconds requests' engine calls waited for their "
            "device's compute turn (other models computing, earliest deadline first)",
            ["model", "task"], registry=self.registry)
        self._responses = Counter(
            "packserve_http_responses", "HTTP responses by route and status code, including "
            "requests refused before reaching a model", ["route", "code"], registry=self.registry)
        self._key_requests = Counter(
            "packserve_key_requests", "Requests by API key name (never the key) and model, by "
            "HTTP status code; only when keys are configured", ["key", "model", "code"],
            registry=self.registry)
        self._key_tokens = Counter(
            "packserve_key_tokens", "Tokens by API key name and model (prompt + completion, or "
            "input): multiply by the model's cost per million tokens to split cost by team",
            ["key", "model"], registry=self.registry)
        self._embedding_batch = Histogram(
            "packserve_embedding_batch_inputs", "Inputs per embedding forward pass: concurrent "
            "requests merged by the batcher, up to the model's max_batch", ["model"],
            buckets=EMBEDDING_BATCH_BUCKETS, registry=self.registry)
        self._tokens_by_key: dict[tuple[str, str], int] = defaultdict(int)
        self.registry.register(_SnapshotCollector(self))

    # ---------------------------------------------------------------- inputs

    def count_embedding_pass(self, model: str, inputs: int) -> None:
        """One embedding forward pass of `inputs` texts (the batcher's hook)."""
        self._embedding_batch.labels(model=model).observe(inputs)

    def on_event(self, event: Event) -> None:
        """The scheduler's event sink."""
        if isinstance(event, RequestStartEvent):
            self.cost.start(event.model, event.device)
        elif isinstance(event, RequestEvent):
            self._on_request(event)
        elif isinstance(event, LoadEvent):
            self._load_seconds.labels(event.model, event.tier_from).observe(event.seconds)
            restored = event.tier_from == "warm"
            self._residency_events.labels(event.model, "restore" if restored else "load").inc()
            self._remember(event)
        elif isinstance(event, EvictEvent):
            offloaded = event.tier_to == "warm"
            self._residency_events.labels(event.model, "offload" if offloaded else "evict").inc()
            self._evictions.labels(event.model, event.device, event.cause,
                                   event.policy or "none").inc()
            self._remember(event)
        elif isinstance(event, LoadFailedEvent):
            self._residency_events.labels(event.model, "failure").inc()
            self._remember(event)

    def count_compute_wait(self, model: str, task: Task, seconds: float) -> None:
        """Called by the HTTP layer once per request that held a lease."""
        self._compute_wait.labels(model, task.value).inc(seconds)

    def count_response(self, route: str, code: int) -> None:
        """Called by the HTTP layer once per response."""
        self._responses.labels(route, str(code)).inc()

    def _on_request(self, e: RequestEvent) -> None:
        self._requests.labels(e.model, e.task, str(e.status)).inc()
        if e.key:
            self._key_requests.labels(e.key, e.model, str(e.status)).inc()
            if e.prompt_tokens + e.completion_tokens:
                self._key_tokens.labels(e.key, e.model).inc(e.prompt_tokens + e.completion_tokens)
                self._tokens_by_key[(e.key, e.model)] += e.prompt_tokens + e.completion_tokens
        if e.started:
            self.cost.end(e.model, e.device, e.prompt_tokens + e.completion_tokens)
        if e.task in (Task.EMBED, Task.RERANK):
            if e.prompt_tokens:
                self._tokens.labels(e.model, "input").inc(e.prompt_tokens)
        else:
            if e.prompt_tokens:
                self._tokens.labels(e.model, "prompt").inc(e.prompt_tokens)
            if e.completion_tokens:
                self._tokens.labels(e.model, "completion").inc(e.completion_tokens)
        if e.status != 200:
            return
        total = e.queue_seconds + e.load_seconds + e.inference_seconds
        for phase, seconds in (("queue", e.queue_seconds), ("load", e.load_seconds),
                               ("inference", e.inference_seconds), ("total", total)):
            self._duration.labels(e.model, e.task, phase).observe(seconds)
        done = _Done.of(e, self._clock())
        if done.ttft is not None:
            self._ttft.labels(e.model, e.task).observe(done.ttft)
        if done.itl is not None:
            self._itl.labels(e.model, e.task).observe(done.itl)
        if done.within_slo:
            self._within_slo.labels(e.model, e.task).inc()
        self._recent[(e.model, e.task)].append(done)

    def _remember(self, event: LoadEvent | EvictEvent | LoadFailedEvent) -> None:
        self._events.append({"ts": self._wall(), **asdict(event)})
        self.sample()

    def sample(self) -> None:
        """Record each device's headroom now, and forget samples older than the window."""
        now = self._clock()
        for d in self._scheduler.devices():
            samples = self._headroom[d.name]
            samples.append((now, d.budget_bytes - d.used_bytes))
            while samples and samples[0][0] < now - self.window_s:
                samples.popleft()

    # ---------------------------------------------------------------- outputs

    def headroom_min(self, device: str, current: int) -> int:
        return min([current, *(h for _, h in self._headroom.get(device, ()))])

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def summary(self) -> dict[str, Any]:
        """The figures an operator decides with, as JSON (the status page and `ps` read it)."""
        devices = []
        for d in self._scheduler.devices():
            headroom = d.budget_bytes - d.used_bytes
            devices.append({
                "name": d.name, "budget_bytes": d.budget_bytes, "used_bytes": d.used_bytes,
                "headroom_bytes": headroom, "headroom_min_bytes": self.headroom_min(d.name,
                                                                                     headroom),
                "price_per_hour": self.cost.price(d.name)})
        by_model, by_task = [], []
        tasks: dict[str, list[_Done]] = defaultdict(list)
        now = self._clock()
        span = max(1e-9, min(self.window_s, now - self._started))
        for (model, task), window in sorted(self._recent.items()):
            done = list(window)
            tasks[task].extend(done)
            by_model.append({"model": model, "task": task, **_figures(done, now, span)})
        for task, done in sorted(tasks.items()):
            by_task.append({"task": task, **_figures(done, now, span)})
        models, mix = self.cost.report()
        per_million = {m.model: m.cost_per_million_tokens for m in models}
        by_key = [{"key": key, "model": model, "tokens": tokens,
                   "cost": None if per_million.get(model) is None
                   else round(tokens * (per_million[model] or 0.0) / 1e6, 6)}
                  for (key, model), tokens in sorted(self._tokens_by_key.items())]
        return {
            "currency": self.currency,
            "window_seconds": self.window_s,
            "devices": devices,
            "latency": {"by_model": by_model, "by_task": by_task,
                        "note": f"over the last {RECENT_LATENCIES} successful requests per "
                                f"model: end-to-end seconds (p50_seconds...), streams' time "
                                f"to first token split into queue, load (or restore) and "
                                f"prompt, their inter-token latency, the share within the "
                                f"SLO, and goodput (requests within their SLO per second, "
                                f"over the last {self.window_s:.0f} s); /metrics has the "
                                f"full histograms"},
            "cost": {"models": [asdict(m) for m in models], "mix": asdict(mix),
                     "by_key": by_key},
            "events": list(reversed(self._events)),
        }


@dataclass(frozen=True)
class _Done:
    """One successful request, as the summary's figures need it."""

    at: float  # when it ended (the telemetry's clock)
    total: float
    ttft: float | None  # streams only
    itl: float | None  # streams of two tokens or more
    queue: float
    load: float
    within_slo: bool

    @staticmethod
    def of(e: RequestEvent, now: float) -> _Done:
        total = e.queue_seconds + e.load_seconds + e.inference_seconds
        ttft = e.first_token_seconds
        itl = None
        if ttft is not None and e.completion_tokens > 1:
            itl = max(0.0, total - ttft) / (e.completion_tokens - 1)
        measured = ttft if ttft is not None else total
        return _Done(at=now, total=total, ttft=ttft, itl=itl, queue=e.queue_seconds,
                     load=e.load_seconds, within_slo=e.slo_s > 0 and measured <= e.slo_s)


def _figures(done: list[_Done], now: float, span: float) -> dict[str, Any]:
    """End-to-end percentiles, streams' time to first token (split) and inter-token latency,
    the share within the SLO, and goodput over the last `span` seconds."""
    streams = [d for d in done if d.ttft is not None]
    first = _percentiles([d.ttft for d in streams if d.ttft is not None])
    if streams:
        first["split_p50_seconds"] = {
            "queue": percentile(sorted(d.queue for d in streams), 50),
            "load": percentile(sorted(d.load for d in streams), 50),
            "prompt": percentile(sorted(max(0.0, (d.ttft or 0.0) - d.queue - d.load)
                                        for d in streams), 50)}
    recent = [d for d in done if d.at >= now - span]
    return {**_percentiles([d.total for d in done]),
            "time_to_first_token": first,
            "inter_token": _percentiles([d.itl for d in done if d.itl is not None]),
            "within_slo": sum(d.within_slo for d in done) / len(done) if done else None,
            "goodput_rps": sum(d.within_slo for d in recent) / span}


def _percentiles(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0, **{f"p{q}_seconds": None for q in (50, 90, 95, 99)}}
    ordered = sorted(values)
    return {"count": len(values), **{f"p{q}_seconds": percentile(ordered, q)
                                     for q in (50, 90, 95, 99)}}


def percentile(ordered: list[float], q: float) -> float:
    """The `q`th percentile of sorted values, interpolated linearly between the two nearest
    ranks (numpy's default), without numpy: an idle server does not import it (16 MiB)."""
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (at - low))


class _SnapshotCollector(Collector):
    """Gauges read from the scheduler at scrape time: memory, bytes per model, queues, cost."""

    def __init__(self, telemetry: Telemetry) -> None:
        self._t = telemetry

    def collect(self) -> Iterator[Metric]:
        t = self._t
        scheduler = t._scheduler
        budget = GaugeMetricFamily("packserve_device_budget_bytes",
                                   "Memory the scheduler may fill on the device", labels=["device"])
        used = GaugeMetricFamily("packserve_device_used_bytes",
                                 "Bytes held by hot and loading models and warm copies",
                                 labels=["device"])
        headroom = GaugeMetricFamily("packserve_device_headroom_bytes",
                                     "Budget minus used bytes, now", labels=["device"])
        low = GaugeMetricFamily("packserve_device_headroom_min_bytes",
                                f"Lowest headroom over the last {t.window_s:.0f} s",
                                labels=["device"])
        capacity = GaugeMetricFamily(
            "packserve_device_capacity_bytes", "What the device's models may hold now: the "
            "budget after headroom, less other processes' bytes (GPU) and warm copies of GPU "
            "models in host RAM (cpu)", labels=["device"])
        others = GaugeMetricFamily("packserve_device_others_bytes",
                                   "Bytes other processes hold on the device (NVML; GPU only)",
                                   labels=["device"])
        for d in scheduler.devices():
            free = d.budget_bytes - d.used_bytes
            budget.add_metric([d.name], d.budget_bytes)
            used.add_metric([d.name], d.used_bytes)
            headroom.add_metric([d.name], free)
            low.add_metric([d.name], t.headroom_min(d.name, free))
            if d.capacity_bytes is not None:
                capacity.add_metric([d.name], d.capacity_bytes)
            if d.others_bytes is not None:
                others.add_metric([d.name], d.others_bytes)
        yield from (budget, used, headroom, low, capacity, others)

        model_bytes = GaugeMetricFamily("packserve_model_bytes",
                                        "Bytes a model's weights hold, by tier", labels=[
                                            "model", "tier"])
        queued = GaugeMetricFamily("packserve_model_queue_depth",
                                   "Requests waiting for a concurrency slot", labels=["model"])
        running = GaugeMetricFamily("packserve_model_in_flight",
                                    "Requests holding a concurrency slot", labels=["model"])
        seen: set[str] = set()
        for row in scheduler.models():
            queued.add_metric([row.name], row.queued)
            running.add_metric([row.name], row.in_flight)
            label = "+".join(sorted({row.name, *row.shares_weights_with},
                                    key=scheduler.model_names().index))
            if label in seen or row.state not in (State.HOT, State.WARM):
                continue
            seen.add(label)
            size = row.bytes_measured if row.bytes_measured is not None else row.bytes_estimated
            if row.state is State.WARM:
                size = row.bytes_warm or 0  # its engine objects: the weights were given back
            model_bytes.add_metric([label, row.state.value], size)
        yield from (model_bytes, queued, running)

        models, mix = t.cost.report()
        seconds = CounterMetricFamily("packserve_model_device_seconds",
                                      "Device-seconds attributed to the model by busy share",
                                      labels=["model", "device"])
        per_model = GaugeMetricFamily("packserve_model_cost_per_million_tokens",
                                      "Attributed device cost per million tokens",
                                      labels=["model", "currency"])
        for m in models:
            seconds.add_metric([m.model, m.device], m.device_seconds)
            if m.cost_per_million_tokens is not None:
                per_model.add_metric([m.model, t.currency], m.cost_per_million_tokens)
        mix_cost = GaugeMetricFamily("packserve_mix_cost_per_million_tokens",
                                     "Whole device cost, idle included, per million tokens of "
                                     "the mix", labels=["currency"])
        if mix.cost_per_million_tokens is not None:
            mix_cost.add_metric([t.currency], mix.cost_per_million_tokens)
        idle = CounterMetricFamily("packserve_idle_device_seconds",
                                   "Device-seconds with no request in flight")
        idle.add_metric([], mix.idle_seconds)
        yield from (seconds, per_model, mix_cost, idle)
