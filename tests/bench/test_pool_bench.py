"""`python -m benchmarks pool`: the traces and the fake catalog it builds, and a `--quick` run on a
local Ray cluster whose report must be whole and consistent.

These check the tooling, never the figures: no timing, and no router is required to win.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import main
from benchmarks.pool import (
    BY_NAME,
    CATALOG,
    ROUTERS,
    SLO_S,
    TRACES,
    models_per_replica,
    pool_trace,
    popularity,
    replica_budget_mib,
    request_for,
    residency_counts,
    slo_targets,
)


def test_traces_are_reproducible_and_the_shifting_one_reverses_popularity() -> None:
    steady, bursty, shifting = TRACES
    for shape in TRACES:
        a = pool_trace(shape, seed=2, duration_s=120, rate=3.0)
        assert a == pool_trace(shape, seed=2, duration_s=120, rate=3.0)
        assert a != pool_trace(shape, seed=3, duration_s=120, rate=3.0)
        assert all(0 <= r.at < 120 for r in a) and {r.model for r in a} <= set(BY_NAME)
    order = popularity(2)
    trace = pool_trace(shifting, seed=2, duration_s=600, rate=3.0)

    def top(half: list[str]) -> str:
        return max(set(half), key=half.count)

    first = [r.model for r in trace if r.at < 300]
    second = [r.model for r in trace if r.at >= 300]
    assert top(first) == order[0] and top(second) == order[-1]
    assert bursty.cv > steady.cv == shifting.cv == 1.0


def test_sources_are_distinct_so_no_two_models_share_a_load() -> None:
    assert len({m.source for m in CATALOG}) == len(CATALOG) == 12
    assert {m.task for m in CATALOG} == set(SLO_S)


@pytest.mark.parametrize("replicas", [2, 3])
def test_budgets_fit_the_largest_model_but_never_the_whole_catalog(replicas: int) -> None:
    budget = replica_budget_mib(replicas)
    assert max(m.mib for m in CATALOG) <= budget
    assert replicas * budget < sum(m.mib for m in CATALOG)
    assert 1 <= models_per_replica(budget) < len(CATALOG)


def test_every_request_carries_its_service_time_for_its_task() -> None:
    paths = {"embed": "/v1/embeddings", "rerank": "/v1/rerank", "chat": "/v1/chat/completions",
             "complete": "/v1/completions"}
    for r in pool_trace(TRACES[0], seed=1, duration_s=300, rate=3.0):
        path, body, service = request_for(r)
        model = BY_NAME[r.model]
        assert path == paths[model.task] and body["model"] == r.model
        low, high = model.service_s
        assert low <= service <= high
        assert f"@@sleep={service:.3f}" in json.dumps(body)


def test_slo_targets_default_per_task_and_take_the_command_line() -> None:
    assert slo_targets(None) == SLO_S == {"embed": 0.5, "rerank": 0.5, "chat": 4.0,
                                          "complete": 4.0}
    assert slo_targets("embed=1, chat=2.5") == {**SLO_S, "embed": 1.0, "chat": 2.5}


def test_loads_and_evictions_are_summed_over_replicas() -> None:
    a, b = CATALOG[0], CATALOG[1]
    text = (
        "# TYPE packserve_model_events counter\n"
        f'packserve_model_events_total{{event="load",model="{a.name}",replica="r1"}} 2.0\n'
        f'packserve_model_events_total{{event="load",model="{a.name}",replica="r2"}} 1.0\n'
        f'packserve_model_events_total{{event="evict",model="{a.name}",replica="r1"}} 1.0\n'
        f'packserve_model_events_total{{event="load",model="{b.name}",replica="r2"}} 1.0\n'
        f'packserve_model_events_total{{event="failure",model="{b.name}",replica="r2"}} 4.0\n')
    counts = residency_counts(text)
    assert counts["loads"] == 4 and counts["evictions"] == 1
    assert counts["bytes_loaded"] == (3 * a.mib + b.mib) << 20
    assert counts["by_replica"] == {"r1": {"load": 2, "evict": 1}, "r2": {"load": 2, "evict": 0}}


@pytest.mark.real
def test_quick_run_reports_every_router_and_every_request(tmp_path: Path,
                                                          models_dir: Path) -> None:
    pytest.importorskip("ray.serve")
    out, docs = tmp_path / "out", tmp_path / "benchmarks.md"
    rc = main(["pool", "--quick", "--no-progress", "--out", str(out),
               "--docs", str(docs), "--data-dir", str(models_dir)])
    assert rc == 0
    data = json.loads((out / "pool.json").read_text("utf-8"))
    assert data["scenario"] == "pool" and data["quick"] is True
    r = data["results"]
    assert set(r["traces"]) == {"steady"}
    for trace in r["traces"].values():
        assert set(trace["policies"]) == set(ROUTERS)
        for router, p in trace["policies"].items():
            assert p["sent"] == trace["requests"] > 0, router
            assert len(p["requests"]) == p["sent"], router  # every request is reported
            # packserve's router answers every one; a baseline's lost request (a fresh clone's
            # run once saw Ray Serve's drop one connection) is a result, counted as status -1
            assert p["answered"] == p["sent"] or (
                router != "packserve" and p["statuses"].get("-1", 0) == p["sent"] - p["answered"]
            ), (router, p["statuses"])
            assert p["loads"] >= 1 and p["bytes_loaded"] > 0, router
            assert p["evictions"] >= 0
            assert 0 <= p["slo_attainment"] <= 1, router
            for task in p["by_task"].values():
                assert 0 <= task["slo_attainment"] <= 1
            assert len(p["replicas"]) == r["replicas"] == 2
            assert set(p["replicas_per_model"].values()) <= {1, 2}
    cost = r["entry_cost"]
    assert cost["ratio_pool_over_single"] > 0
    assert len(cost["latencies_s"]["single"]) == len(cost["latencies_s"]["pool"]) == 30
    goals = {g["name"]: g for g in data["goals"]}
    assert len(goals) == 3
    for g in goals.values():
        assert g["value"] is None or g["value"] > 0
        assert g["value"] is not None or g["note"]
    assert "### `pool`" in docs.read_text("utf-8")
