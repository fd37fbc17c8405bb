"""Telemetry: scheduler events and snapshots -> Prometheus metrics, a JSON summary, a sampler.

Who calls what: the scheduler calls `on_event` (it is an event sink) on the event loop; the
app's background task calls `sample` every `sample_interval_s`; `/metrics` calls `render` and
`/v1/metrics/summary` calls `summary`. Everything runs on the event loop thread.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
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
        self._latency: dict[tuple[str, str], deque[float]] = defaultdict(
            lambda: deque(maxlen=RECENT_LATENCIES))
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
            "operator, retired) and the victim policy that chose the victim (cost, lru; none "
            "when no policy chose); the policy's reasons are in /v1/residency's recent events",
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
        self._latency[(e.model, e.task)].append(total)

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
        tasks: dict[str, list[float]] = defaultdict(list)
        for (model, task), window in sorted(self._latency.items()):
            values = list(window)
            tasks[task].extend(values)
            by_model.append({"model": model, "task": task, **_percentiles(values)})
        for task, values in sorted(tasks.items()):
            by_task.append({"task": task, **_percentiles(values)})
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
                                f"model; /metrics has the full histograms"},
            "cost": {"models": [asdict(m) for m in models], "mix": asdict(mix),
                     "by_key": by_key},
            "events": list(reversed(self._events)),
        }


def _percentiles(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "p50_seconds": None, "p95_seconds": None}
    ordered = sorted(values)
    return {"count": len(values), "p50_seconds": percentile(ordered, 50),
            "p95_seconds": percentile(ordered, 95)}


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
        for d in scheduler.devices():
            free = d.budget_bytes - d.used_bytes
            budget.add_metric([d.name], d.budget_bytes)
            used.add_metric([d.name], d.used_bytes)
            headroom.add_metric([d.name], free)
            low.add_metric([d.name], t.headroom_min(d.name, free))
        yield from (budget, used, headroom, low)

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
