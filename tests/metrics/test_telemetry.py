"""Known traffic gives known figures, through the real HTTP app (fake and real models)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from packserve.config import ModelSpec
from packserve.core.backend import LoadSpec
from packserve.core.catalog import DeviceBudget, Entry
from packserve.core.events import RequestEvent
from packserve.core.scheduler import Scheduler
from packserve.metrics.telemetry import Telemetry, percentile
from packserve.types import Task
from tests.factories import FakeProbe, Running

MIB = 1 << 20


def scrape(client: httpx.Client) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(metrics: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)






def test_n_requests_give_a_histogram_count_of_n(fake: Running) -> None:
    with fake.client() as c:
        before = scrape(c)
        for i in range(7):
            r = c.post("/v1/embeddings", json={"model": "emb", "input": f"text {i}"})
            assert r.status_code == 200
        assert c.post("/v1/embeddings", json={"model": "nope", "input": "x"}).status_code == 404
        after = scrape(c)
    for phase in ("queue", "load", "inference", "total"):
        key = dict(model="emb", task="embed", phase=phase)
        assert (value(after, "packserve_request_duration_seconds_count", **key)
                - value(before, "packserve_request_duration_seconds_count", **key)) == 7
    assert (value(after, "packserve_requests_total", model="emb", task="embed", code="200")
            - value(before, "packserve_requests_total", model="emb", task="embed", code="200")
            ) == 7
    # Refused before reaching a model: only the HTTP counter sees it.
    assert value(after, "packserve_http_responses_total", route="/v1/embeddings",
                 code="404") >= 1


def test_tokens_match_the_usage_returned_to_clients(fake: Running) -> None:
    with fake.client() as c:
        before = scrape(c)
        e = c.post("/v1/embeddings", json={"model": "emb", "input": ["a b c", "d e"]}).json()
        r = c.post("/v1/rerank", json={"model": "emb", "query": "a b",
                                       "documents": ["a", "b c d"]}).json()
        g = c.post("/v1/completions", json={"model": "gen", "prompt": "one two three four",
                                            "max_tokens": 2}).json()
        after = scrape(c)

    def delta(**labels: str) -> float:
        return (value(after, "packserve_tokens_total", **labels)
                - value(before, "packserve_tokens_total", **labels))

    assert delta(model="emb", direction="input") == (e["usage"]["prompt_tokens"]
                                                     + r["usage"]["total_tokens"])
    assert delta(model="gen", direction="prompt") == g["usage"]["prompt_tokens"] == 4
    assert delta(model="gen", direction="completion") == g["usage"]["completion_tokens"] == 2


def test_forced_eviction_moves_the_counter_and_the_headroom(fake: Running) -> None:
    with fake.client() as c:
        c.post("/v1/residency/gen/unload")
        c.post("/v1/embeddings", json={"model": "emb", "input": "load me"}).raise_for_status()
        before = scrape(c)
        measured = next(m["bytes_measured"] for m in c.get("/v1/residency").json()["models"]
                        if m["name"] == "emb")
        assert c.post("/v1/residency/emb/unload").json()["state"] == "cold"
        after = scrape(c)
        summary = c.get("/v1/metrics/summary").json()
    evicts = ("packserve_model_events_total", dict(model="emb", event="evict"))
    assert value(after, evicts[0], **evicts[1]) - value(before, evicts[0], **evicts[1]) == 1
    headroom = ("packserve_device_headroom_bytes", dict(device="cpu"))
    assert (value(after, headroom[0], **headroom[1]) - value(before, headroom[0], **headroom[1])
            ) == measured
    # The lowest headroom of the window still remembers the model being there.
    low = value(after, "packserve_device_headroom_min_bytes", device="cpu")
    assert low <= value(before, headroom[0], **headroom[1])
    assert summary["devices"][0]["headroom_min_bytes"] == low
    assert summary["events"][0]["kind"] == "evict" and summary["events"][0]["model"] == "emb"


def test_what_models_may_hold_is_a_gauge_and_others_only_on_a_gpu(fake: Running) -> None:
    with fake.client() as c:
        (cpu,) = c.get("/v1/residency").json()["devices"]
        metrics = scrape(c)
    assert cpu["capacity_bytes"] == cpu["budget_bytes"] - cpu["headroom_bytes"]  # no GPU here
    assert value(metrics, "packserve_device_capacity_bytes", device="cpu") == cpu[
        "capacity_bytes"]
    assert cpu["others_bytes"] is None
    assert not any(name == "packserve_device_others_bytes" for name, _ in metrics)


def test_eviction_for_room_and_load_seconds(fake: Running) -> None:
    with fake.client() as c:
        c.post("/v1/embeddings", json={"model": "emb", "input": "x"}).raise_for_status()
        before = scrape(c)
        c.post("/v1/completions", json={"model": "gen", "prompt": "hi"}).raise_for_status()
        after = scrape(c)
    assert (value(after, "packserve_model_events_total", model="emb", event="evict")
            - value(before, "packserve_model_events_total", model="emb", event="evict")) == 1
    assert (value(after, "packserve_model_load_seconds_count", model="gen", tier="cold")
            - value(before, "packserve_model_load_seconds_count", model="gen", tier="cold")) == 1
    assert value(after, "packserve_model_bytes", model="gen", tier="hot") == 100 * MIB
    assert value(after, "packserve_device_budget_bytes", device="cpu") == 150 * MIB


def test_cost_figures_are_exported_and_consistent(fake: Running) -> None:
    with fake.client() as c:
        c.post("/v1/completions", json={"model": "gen", "prompt": "a b c"}).raise_for_status()
        metrics = scrape(c)
        summary = c.get("/v1/metrics/summary").json()
    assert summary["currency"] == "EUR"
    gen = next(m for m in summary["cost"]["models"] if m["model"] == "gen")
    assert gen["tokens"] > 0 and gen["device_seconds"] > 0
    assert gen["cost"] == pytest.approx(3.6 / 3600 * gen["device_seconds"])
    assert value(metrics, "packserve_model_cost_per_million_tokens", model="gen",
                 currency="EUR") > 0
    assert value(metrics, "packserve_mix_cost_per_million_tokens", currency="EUR") > 0


def test_refused_requests_are_counted_but_not_timed(tmp_path: Path) -> None:
    spec = ModelSpec(name="m", tasks=[Task.EMBED], backend="fake", source="fake:1MiB")
    load = LoadSpec(backend="fake", path=Path("fake:1MiB"), device="cpu", context_length=0)
    scheduler = Scheduler([Entry(spec=spec, load=load, bytes_estimated=MIB)],
                          [DeviceBudget("cpu", 10 * MIB, 0)], factory=lambda s: None,  # type: ignore[arg-type,return-value]
                          probe=FakeProbe(), sinks=())
    t = Telemetry(scheduler, prices={"cpu": 1.0}, default_price=1.0, currency="EUR")
    t.on_event(RequestEvent(model="m", task="embed", device="cpu", queue_seconds=0,
                            load_seconds=0, inference_seconds=0, status=429,
                            outcome="QueueFull"))
    text = t.render().decode()
    assert 'packserve_requests_total{code="429",model="m",task="embed"} 1.0' in text
    assert "packserve_request_duration_seconds_count{" not in text


def _telemetry(clock: list[float]) -> Telemetry:
    spec = ModelSpec(name="m", tasks=[Task.CHAT], backend="fake", source="fake:1MiB")
    load = LoadSpec(backend="fake", path=Path("fake:1MiB"), device="cpu", context_length=0)
    scheduler = Scheduler([Entry(spec=spec, load=load, bytes_estimated=MIB)],
                          [DeviceBudget("cpu", 10 * MIB, 0)], factory=lambda s: None,  # type: ignore[arg-type,return-value]
                          probe=FakeProbe(), sinks=())
    return Telemetry(scheduler, prices={"cpu": 1.0}, default_price=1.0, currency="EUR",
                     window_s=100.0, clock=lambda: clock[0])


def test_streams_give_time_to_first_token_inter_token_latency_and_goodput() -> None:
    """Known streams: first tokens at 0.5 s and 3 s (SLO 2 s), 11 tokens over 1.5 s; and an
    answer sent whole within its SLO. Figures in the industry's terms, by model and by type."""
    clock = [1000.0]
    t = _telemetry(clock)
    clock[0] += 40.0  # the summary's goodput is over the 40 s since the start
    for queue, load, first, total in ((0.1, 0.0, 0.5, 1.5), (0.5, 2.0, 3.0, 4.0)):
        t.on_event(RequestEvent(model="m", task="chat", device="cpu", queue_seconds=queue,
                                load_seconds=load, inference_seconds=total - queue - load,
                                status=200, outcome="ok", prompt_tokens=5,
                                completion_tokens=11, first_token_seconds=first, slo_s=2.0))
    t.on_event(RequestEvent(model="m", task="chat", device="cpu", queue_seconds=0.0,
                            load_seconds=0.0, inference_seconds=1.0, status=200, outcome="ok",
                            completion_tokens=4, slo_s=2.0))
    (row,) = t.summary()["latency"]["by_model"]
    assert row["count"] == 3 and row["p50_seconds"] == pytest.approx(1.5)
    assert row["p99_seconds"] == pytest.approx(percentile([1.0, 1.5, 4.0], 99))
    first = row["time_to_first_token"]
    assert first["count"] == 2 and first["p50_seconds"] == pytest.approx(1.75)
    assert first["split_p50_seconds"] == pytest.approx({"queue": 0.3, "load": 1.0,
                                                        "prompt": 0.45})
    assert row["inter_token"]["count"] == 2
    assert row["inter_token"]["p50_seconds"] == pytest.approx(0.1)  # 1.0 s / 10 tokens
    assert row["within_slo"] == pytest.approx(2 / 3)  # the second stream's first token: 3 s
    assert row["goodput_rps"] == pytest.approx(2 / 40)
    text = t.render().decode()
    assert 'packserve_time_to_first_token_seconds_count{model="m",task="chat"} 2.0' in text
    assert 'packserve_inter_token_latency_seconds_count{model="m",task="chat"} 2.0' in text
    assert 'packserve_requests_within_slo_total{model="m",task="chat"} 2.0' in text
    clock[0] += 200.0  # past the window: no goodput now, the percentiles stay
    (row,) = t.summary()["latency"]["by_task"]
    assert row["goodput_rps"] == 0 and row["count"] == 3


@pytest.mark.real
def test_real_model_tokens_match_usage(default_server: Running) -> None:
    with default_server.client() as c:
        before = scrape(c)
        chat = c.post("/v1/chat/completions", json={
            "model": "smollm2-135m-instruct", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]}).json()
        emb = c.post("/v1/embeddings", json={"model": "all-minilm-l6-v2",
                                             "input": ["one sentence", "another one"]}).json()
        streamed = []
        with c.stream("POST", "/v1/completions", json={
                "model": "gemma-3-270m", "prompt": "Once upon a time", "max_tokens": 6,
                "stream": True, "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:]))
        after = scrape(c)
    usage = next(e["usage"] for e in streamed if e.get("usage"))

    def delta(model: str, direction: str) -> float:
        return (value(after, "packserve_tokens_total", model=model, direction=direction)
                - value(before, "packserve_tokens_total", model=model, direction=direction))

    assert delta("smollm2-135m-instruct", "prompt") == chat["usage"]["prompt_tokens"]
    assert delta("smollm2-135m-instruct", "completion") == chat["usage"]["completion_tokens"]
    assert delta("all-minilm-l6-v2", "input") == emb["usage"]["prompt_tokens"]
    assert delta("gemma-3-270m", "completion") == usage["completion_tokens"]
    assert delta("gemma-3-270m", "prompt") == usage["prompt_tokens"]


@pytest.mark.parametrize("n", [1, 2, 3, 20, 101])
def test_percentiles_match_numpys_linear_interpolation(n: int) -> None:
    values = sorted((i * 7919 % 101) / 13 for i in range(n))
    for q in (50, 95):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
