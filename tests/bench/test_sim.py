"""`benchmarks.simulator`, `benchmarks.sim_catalog` and `python -m benchmarks sim`: the
simulated scheduler follows the real one's rules on hand-made traces whose outcome can be
worked out by hand, and the scenario's report is whole. No real model, no timing: simulated
seconds only."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from benchmarks import main
from benchmarks.common import MIB
from benchmarks.sim import _load_turn_of, _with_run_warm_tier, policies, validate
from benchmarks.sim_calibrate import _fit
from benchmarks.sim_catalog import (
    BUILTIN_CALIBRATION,
    GPU_MODELS,
    TRACES,
    cpu_box,
    gpu_box,
    gpu_popularity,
    oversubscribed,
    sim_trace,
)
from benchmarks.simulator import (
    LOAD,
    Belady,
    Box,
    ServiceModel,
    SimClock,
    SimModel,
    SimOptions,
    SimResult,
    Weights,
    future_arrivals,
    simulate,
)
from packserve.core.policy import CostAware, ResidentView, lru_by_bytes
from packserve.replay import TraceRequest
from packserve.types import State

SLO = {"embed": 0.5, "rerank": 0.5, "chat": 4.0, "complete": 4.0}


def make_box(*models: tuple[str, str, float], capacity: int = 200, load_s: float = 1.0,
             unload_s: float = 0.0, cores: float = 2.0, slots: int = 1, max_batch: int = 1,
             restore_s: float | None = None, host_bytes: int = 0,
             keeps_bytes: int | None = None,
             merge_marginal: float = 0.5) -> Box:
    """One set of weights of 100 bytes per (name, task, service seconds)."""
    weights = tuple(Weights(name, 100, load_s, unload_s, restore_s=restore_s, host_bytes=100,
                            keeps_bytes=keeps_bytes, slots=slots, max_batch=max_batch)
                    for name, _, _ in models)
    sims = tuple(SimModel(name, task, name, ServiceModel(seconds))
                 for name, task, seconds in models)
    threads = {"embed": 2.0, "rerank": 2.0, "chat": 1.0, "complete": 1.0, LOAD: 0.0}
    return Box("dev", capacity, cores, threads, weights, sims, host_bytes=host_bytes,
               merge_marginal=merge_marginal)


def requests(*pairs: tuple[float, str]) -> list[TraceRequest]:
    return [TraceRequest(at=at, model=m, words=0, max_tokens=0, seed=0) for at, m in pairs]


def latency(result: SimResult, at: float, model: str) -> float:
    return next(s.latency_s for s in result.served if s.at == at and s.model == model)


ABC = (("a", "chat", 1.0), ("b", "chat", 1.0), ("c", "chat", 1.0))


# ----------------------------------------------------------------------------- compute


def test_jobs_that_want_more_threads_than_cores_share_them() -> None:
    box = make_box(("e", "embed", 1.0), ("g", "chat", 1.0), load_s=0.0)
    both = simulate(box, requests((0.0, "e"), (0.0, "g")), lru_by_bytes)
    # 2 + 1 threads on 2 cores: each at 2/3 speed.
    assert latency(both, 0.0, "e") == pytest.approx(1.5)
    assert latency(both, 0.0, "g") == pytest.approx(1.5)
    alone = simulate(box, requests((0.0, "e")), lru_by_bytes)
    assert latency(alone, 0.0, "e") == pytest.approx(1.0)


def test_with_priority_generation_waits_while_an_embedding_runs() -> None:
    box = make_box(("e", "embed", 1.0), ("g", "chat", 1.0), load_s=0.0)
    r = simulate(box, requests((0.0, "e"), (0.0, "g")), lru_by_bytes,
                 SimOptions(priority=True))
    assert latency(r, 0.0, "e") == pytest.approx(1.0)
    assert latency(r, 0.0, "g") == pytest.approx(2.0)


def test_queued_embeddings_merge_into_one_pass() -> None:
    box = make_box(("e", "embed", 1.0), load_s=0.0, max_batch=8, merge_marginal=0.5)
    r = simulate(box, requests((0.0, "e"), (0.1, "e"), (0.2, "e"), (0.3, "e")), lru_by_bytes)
    assert latency(r, 0.0, "e") == pytest.approx(1.0)
    # The three that queued run together: 1 s + half of 1 s for each of the other two.
    assert [latency(r, t, "e") for t in (0.1, 0.2, 0.3)] == pytest.approx([2.9, 2.8, 2.7])


def test_a_continuously_batched_model_serves_its_slots_at_once() -> None:
    box = make_box(("g", "chat", 1.0), load_s=0.0, slots=8)
    r = simulate(box, requests((0.0, "g"), (0.0, "g"), (0.5, "g")), lru_by_bytes)
    assert sorted(s.latency_s for s in r.served) == pytest.approx([1.0, 1.0, 1.0])


def test_the_first_request_after_a_load_pays_the_warmup() -> None:
    w = Weights("g", 100, 1.0, 0.0, warmup_s=0.5)
    box = Box("dev", 100, 2.0, {"chat": 1.0, LOAD: 0.0}, (w,),
              (SimModel("g", "chat", "g", ServiceModel(1.0)),))
    r = simulate(box, requests((0.0, "g"), (5.0, "g")), lru_by_bytes)
    assert latency(r, 0.0, "g") == pytest.approx(2.5)
    assert latency(r, 5.0, "g") == pytest.approx(1.0)


# ----------------------------------------------------------------------------- residency


def test_eviction_follows_the_policy_and_never_overcommits() -> None:
    box = make_box(*ABC, capacity=200)
    trace = requests((0.0, "a"), (2.0, "b"), (4.0, "c"), (6.0, "a"))
    lru = simulate(box, trace, lru_by_bytes)
    assert [x.key for x in lru.loads] == ["a", "b", "c", "a"]  # c evicted a, a evicted b
    assert lru.evictions == 2
    clock = SimClock()
    belady = simulate(box, trace, Belady(future_arrivals(box, trace), clock), clock=clock)
    assert [x.key for x in belady.loads] == ["a", "b", "c"]  # b is never needed again
    for r in (lru, belady):
        assert r.peak_bytes <= box.capacity_bytes
        assert all(s.latency_s < float("inf") for s in r.served)


def test_a_busy_model_is_never_evicted_the_load_waits_for_it() -> None:
    box = make_box(("a", "chat", 10.0), ("b", "chat", 1.0), capacity=100)
    r = simulate(box, requests((0.0, "a"), (1.0, "b")), lru_by_bytes)
    assert latency(r, 0.0, "a") == pytest.approx(11.0)  # load 1 s, then 10 s of work
    # b loads once a is done (t=11): 1 s of load and 1 s of work.
    assert latency(r, 1.0, "b") == pytest.approx(12.0)


def test_a_waiting_load_gets_its_turn_when_load_turns_are_on() -> None:
    """a is asked every 0.9 s and each request takes 1 s, so it is never idle until the
    stream ends; b's load waits for it. With load turns, once b's request has waited half its
    4 s SLO (at 3.5), the requests for a that arrive are held (up to half theirs) and a
    drains."""
    box = make_box(("a", "chat", 1.0), ("b", "chat", 1.0), capacity=100)
    trace = requests(*[(0.9 * i, "a") for i in range(7)], (1.5, "b"))
    off = simulate(box, trace, lru_by_bytes)
    on = simulate(box, trace, lru_by_bytes, SimOptions(load_turn=0.5))
    # Off: a serves 1-8 without a gap; b loads 8-9 and serves until 10.
    assert latency(off, 1.5, "b") == pytest.approx(8.5)
    # On: a@0, a@0.9, a@1.8 and a@2.7 (before 3.5) serve 1-5; a@3.6 and a@4.5 are held;
    # b loads 5-6 and serves until 7.
    assert latency(on, 1.5, "b") == pytest.approx(5.5)
    assert [x.key for x in on.loads] == ["a", "b", "a"]
    # Every request is served, and none of a's waits beyond what the hold and b cost it.
    assert len(on.served) == len(trace)
    assert all(s.latency_s < float("inf") for s in on.served)


def test_a_request_during_an_unload_loads_the_model_again_afterwards() -> None:
    box = make_box(("a", "chat", 1.0), ("b", "chat", 1.0), capacity=100, unload_s=1.0)
    r = simulate(box, requests((0.0, "a"), (2.5, "b"), (3.0, "a")), lru_by_bytes)
    assert [x.key for x in r.loads] == ["a", "b", "a"]
    assert r.evictions == 2
    # a unloads 2.5-3.5, b loads 3.5-4.5 and serves until 5.5, unloads until 6.5, a loads
    # until 7.5 and serves until 8.5.
    assert latency(r, 3.0, "a") == pytest.approx(5.5)


def test_a_model_larger_than_the_device_is_never_served() -> None:
    box = make_box(("a", "chat", 1.0), capacity=50)
    r = simulate(box, requests((0.0, "a")), lru_by_bytes)
    assert r.loads == [] and latency(r, 0.0, "a") == float("inf")
    assert r.attainment(SLO) == 0.0


def test_the_warm_tier_restores_an_evicted_model_at_its_restore_time() -> None:
    box = make_box(("a", "chat", 1.0), ("b", "chat", 1.0), capacity=100, restore_s=0.1,
                   host_bytes=1000)
    trace = requests((0.0, "a"), (5.0, "b"), (10.0, "a"))
    cold = simulate(box, trace, lru_by_bytes)
    warm = simulate(box, trace, lru_by_bytes, SimOptions(warm_tier=True))
    assert latency(cold, 10.0, "a") == pytest.approx(2.0)
    assert latency(warm, 10.0, "a") == pytest.approx(1.1)
    assert [x.warm for x in warm.loads] == [False, False, True]
    assert warm.offloads == 2


def test_the_warm_tier_keeps_only_what_host_ram_holds() -> None:
    box = make_box(*ABC, capacity=100, restore_s=0.1, host_bytes=100)
    r = simulate(box, requests((0.0, "a"), (5.0, "b"), (10.0, "c"), (15.0, "a")),
                 lru_by_bytes, SimOptions(warm_tier=True))
    # a went warm, then b took its place in host RAM: a comes back from disk.
    assert [x.warm for x in r.loads] == [False, False, False, False]


def test_a_warm_copy_kept_on_the_device_holds_its_bytes_in_the_budget() -> None:
    # The CPU form: a and b (100 bytes each) take turns in 110; each warm copy keeps 10.
    box = make_box(("a", "chat", 1.0), ("b", "chat", 1.0), capacity=110, restore_s=0.1,
                   keeps_bytes=10)
    trace = requests((0.0, "a"), (5.0, "b"), (10.0, "a"), (15.0, "b"))
    r = simulate(box, trace, CostAware(), SimOptions(warm_tier=True))
    assert [x.warm for x in r.loads] == [False, False, True, True]
    assert latency(r, 10.0, "a") == pytest.approx(1.1)
    assert r.offloads == 3 and r.peak_bytes == 110  # one hot, one warm copy: never more
    # Without the warm tier every switch is a load from disk.
    cold = simulate(box, trace, CostAware())
    assert [x.warm for x in cold.loads] == [False] * 4


@pytest.mark.parametrize(("capacity", "keeps", "restored", "latency_s"), [
    # As the scheduler counts a MiniLM warm copy (its unmapped weights freed it all): a and b
    # take turns in exactly their size, a's return a restore.
    (100, 0, True, 1.1),
    # In 105 bytes a's 10-byte copy does not fit beside b: the policy drops it, and a's next
    # load is from disk.
    (105, 10, False, 2.0),
])
def test_a_warm_copy_stays_while_it_fits_in_the_budget(
        capacity: int, keeps: int, restored: bool, latency_s: float) -> None:
    box = make_box(("a", "chat", 1.0), ("b", "chat", 1.0), capacity=capacity, restore_s=0.1,
                   keeps_bytes=keeps)
    r = simulate(box, requests((0.0, "a"), (5.0, "b"), (10.0, "a")), CostAware(),
                 SimOptions(warm_tier=True))
    assert [x.warm for x in r.loads] == [False, False, restored]
    assert r.peak_bytes <= capacity
    assert latency(r, 10.0, "a") == pytest.approx(latency_s)


def test_a_minimum_residency_holds_a_fresh_load() -> None:
    box = make_box(("a", "chat", 0.1), ("b", "chat", 1.0), capacity=100)
    trace = requests((0.0, "a"), (1.2, "b"))
    plain = simulate(box, trace, lru_by_bytes)
    held = simulate(box, trace, lru_by_bytes, SimOptions(min_residency_s=5.0))
    assert latency(plain, 1.2, "b") == pytest.approx(2.0)
    assert latency(held, 1.2, "b") == pytest.approx(6.8)  # a loaded at 1: held until 6


def test_a_grace_after_the_last_request_serves_a_burst_without_a_reload() -> None:
    box = make_box(("a", "chat", 0.1), ("b", "chat", 1.0), capacity=100)
    trace = requests((0.0, "a"), (1.2, "b"), (2.0, "a"))
    plain = simulate(box, trace, lru_by_bytes)
    grace = simulate(box, trace, lru_by_bytes, SimOptions(grace_s=2.0))
    assert [x.key for x in plain.loads] == ["a", "b", "a"]
    assert [x.key for x in grace.loads] == ["a", "b"]
    # b waits no longer than the grace: it loads at 3.2 (1 s), then serves (1 s).
    assert latency(grace, 1.2, "b") == pytest.approx(4.0)


# ----------------------------------------------------------------------------- Belady


def view(key: str, last_used: float = 0.0, in_flight: int = 0) -> ResidentView:
    return ResidentView(key=key, device="dev", state=State.HOT, bytes=100,
                        in_flight=in_flight, last_used=last_used)


def test_belady_evicts_the_model_needed_furthest_in_the_future_never_again_first() -> None:
    clock = SimClock()
    clock.now = 10.0
    belady = Belady({"a": [5.0, 20.0], "b": [11.0], "c": [1.0], "d": [30.0]}, clock)
    residents = [view("a"), view("b"), view("c"), view("d", in_flight=1)]
    assert belady(residents, 100, 0) == ("c",)
    assert belady(residents, 200, 0) == ("c", "a")
    assert belady(residents, 400, 0) is None  # d is busy
    assert belady(residents, 50, 60) == ()
    big = [view("a"), ResidentView(key="b", device="dev", state=State.HOT, bytes=300)]
    assert belady(big, 300, 0) == ("a", "b")  # a's next use is the furthest
    sized = Belady({"a": [20.0], "b": [11.0]}, clock, sized=True)
    assert sized(big, 300, 0) == ("b",)  # b alone makes room: a stays


# ----------------------------------------------------------------------------- catalogs


def test_the_gpu_box_is_a_dozen_models_that_do_not_all_fit() -> None:
    box = gpu_box()
    assert len(box.models) >= 12 and len(GPU_MODELS) == len(box.weights)
    assert {m.task for m in box.models} == set(SLO)
    assert all(w.bytes <= box.capacity_bytes for w in box.weights)
    assert sum(w.bytes for w in box.weights) > 1.5 * box.capacity_bytes
    for w in box.weights:
        assert w.restore_s is not None and w.restore_s < w.load_s
    small = next(w for w in box.weights if w.key == "qwen2.5-0.5b-instruct")
    assert small.restore_s is not None and small.restore_s < 0.5  # vLLM: 0.26 s for 0.6B


def test_the_cpu_box_shares_weights_as_the_default_catalog_does() -> None:
    box = cpu_box(BUILTIN_CALIBRATION)
    assert len(box.models) == 5 and len(box.weights) == 3
    sizes = [w.bytes for w in box.weights]
    assert max(sizes) <= box.capacity_bytes < sum(sizes)
    assert 0.5 <= box.oversubscribed <= 1.0
    assert oversubscribed({}) == 1.0
    assert cpu_box(BUILTIN_CALIBRATION, capacity_bytes=400 * MIB).capacity_bytes == 400 * MIB


def test_traces_are_reproducible_and_the_shifting_one_rotates_popularity() -> None:
    models = gpu_popularity(1)
    assert models == gpu_popularity(1) and sorted(models) == sorted(m.name for m in GPU_MODELS)
    steady, bursty, shifting = TRACES
    for shape in TRACES:
        a = sim_trace(shape, models, seed=2, duration_s=400, rate=2.0)
        assert a == sim_trace(shape, models, seed=2, duration_s=400, rate=2.0)
        assert all(0 <= r.at < 400 for r in a)
    trace = sim_trace(shifting, models, seed=2, duration_s=4000, rate=2.0)

    def top(lo: float, hi: float) -> str:
        names = [r.model for r in trace if lo <= r.at < hi]
        return max(set(names), key=names.count)

    step = -(-len(models) // shifting.phases)
    assert [top(i * 1000, (i + 1) * 1000) for i in range(4)] == [
        models[(i * step) % len(models)] for i in range(4)]
    assert bursty.cv > steady.cv


def test_every_policy_runs_safely_on_both_boxes() -> None:
    for box in (gpu_box(), cpu_box(BUILTIN_CALIBRATION)):
        trace = sim_trace(TRACES[1], [m.name for m in box.models], seed=3, duration_s=300,
                          rate=1.0)
        for make in policies(box, trace).values():
            clock = SimClock()
            r = simulate(box, trace, make(clock), SimOptions(priority=True), clock)
            assert len(r.served) == len(trace)
            assert r.peak_bytes <= box.capacity_bytes
            assert r.attainment(SLO) is not None


def test_fit_recovers_a_linear_service_time() -> None:
    rows = [{"words": w, "max_tokens": t, "seconds": 0.1 + 0.01 * w + 0.02 * t}
            for w in (8, 32, 96) for t in (8, 16, 32)]
    fit = _fit(rows, generates=True)
    assert fit == pytest.approx({"base_s": 0.1, "per_word_s": 0.01, "per_token_s": 0.02},
                                abs=1e-4)


# ----------------------------------------------------------------------------- validation


def write_trace_json(path: Path, policies_json: dict[str, object]) -> Path:
    box = cpu_box(BUILTIN_CALIBRATION)
    path.write_text(json.dumps({"command": "packserve bench trace", "results": {
        "trace": {"seed": 1, "duration_s": 30.0, "rate_per_s": 1.5, "zipf_alpha": 0.9,
                  "interarrival_cv": 1.0},
        "footprints_bytes": {w.key: w.bytes for w in box.weights},
        "capacity_bytes": box.capacity_bytes, "slo_s": SLO, "policies": policies_json}}))
    return path


def test_validation_sets_simulated_and_real_side_by_side(tmp_path: Path) -> None:
    path = write_trace_json(tmp_path / "trace.json", {
        "lru": {"policy": "lru_by_bytes", "events": {"load": 10}, "slo_attainment": 0.9,
                "by_task": {"embed": {"slo_attainment": 0.8, "p95_s": 1.0}}},
        "cost": {"policy": "cost", "slo_attainment": 0.95},  # no events, no types: fine
        "someone else's": {"policy": "mystery:3"},  # unknown: left out
    })
    v = validate(path, BUILTIN_CALIBRATION)
    assert set(v["policies"]) == {"lru", "cost"}
    lru = v["policies"]["lru"]
    assert lru["real_loads"] == 10 and lru["sim_loads"] > 0
    assert lru["by_task"]["embed"]["real"] == 0.8
    assert 0 <= lru["by_task"]["embed"]["sim"] <= 1
    assert v["policies"]["cost"]["real_loads"] is None
    assert v["worst_points"] is not None and v["worst_loads_ratio"] is not None
    assert len(v["table"]["rows"]) == 2 * 5  # four types and "all" per policy
    assert lru["priority"] is False


def test_validation_replays_the_warm_tier_and_the_turns_the_real_run_had(
        tmp_path: Path) -> None:
    sizes = {w.key: w.bytes for w in cpu_box(BUILTIN_CALIBRATION).weights}
    restores = [{"model": f"{key}+other", "seconds": s} for key in sizes for s in (0.04, 0.06)]
    to_warm = [{"model": key, "tier_to": "warm", "seconds": 0.02, "bytes": size - 10 * MIB}
               for key, size in sizes.items()]
    path = write_trace_json(tmp_path / "trace.json", {
        "cost": {"policy": "cost", "loads": 3, "restores": 5, "warm_tier": True,
                 "load_turn": 0.5, "restore_events": restores, "evict_events": to_warm},
        "lru": {"policy": "lru_by_bytes", "loads": 8, "warm_tier": False, "load_turn": 0.0},
    })
    v = validate(path, BUILTIN_CALIBRATION)
    cost, lru = v["policies"]["cost"], v["policies"]["lru"]
    assert (cost["warm_tier"], cost["load_turn"], lru["warm_tier"]) == (True, 0.5, False)
    assert cost["sim_restores"] > 0 and lru["sim_restores"] == 0
    assert cost["real_restores"] == 5
    # What the run measured replaces the calibration: a copy keeps what going warm left.
    runs = json.loads(path.read_text())["results"]
    warm = _with_run_warm_tier(BUILTIN_CALIBRATION, runs, sizes)["weights"]
    assert all(w["keeps_bytes"] == 10 * MIB and w["restore_s"] == pytest.approx(0.05)
               for w in warm.values())


def test_validation_takes_each_types_median_over_the_real_runs(tmp_path: Path) -> None:
    runs = [{"slo_attainment": a, "loads": 3, "by_task": {"complete": c}}
            for a, c in ((0.998, 1.0), (0.984, 0.98), (0.987, 0.94))]
    path = write_trace_json(tmp_path / "trace.json", {"cost": {
        "policy": "cost", "loads": 3, "slo_attainment": 0.987, "runs": runs,
        "by_task": {"complete": {"slo_attainment": 0.94}}}})  # the median run's
    cost = validate(path, BUILTIN_CALIBRATION)["policies"]["cost"]
    assert cost["by_task"]["complete"]["real"] == 0.98
    assert cost["by_task"]["all"]["real"] == 0.987


@pytest.mark.parametrize(("label", "real", "date", "turn"), [
    ("packserve (cost-aware)", {"policy": "cost", "load_turn": 0.25}, "2026-12-01", 0.25),
    ("packserve (cost-aware)", {"policy": "cost", "restores": 4}, "2026-12-02", 0.5),
    ("packserve (cost-aware, no load turns)", {"policy": "cost", "restores": 4}, "2026-12-02",
     0.0),
    ("packserve (cost-aware)", {"policy": "cost", "restores": 4}, "2026-12-01T17:00", 0.0),
    ("packserve 0.11 (LRU by bytes)", {"policy": "lru_by_bytes"}, "2026-12-02", 0.0),
])
def test_a_real_run_without_its_load_turn_on_record_is_dated(
        label: str, real: dict[str, object], date: str, turn: float) -> None:
    assert _load_turn_of(label, real, date) == turn


def test_cost_aware_keeps_the_expensive_model_that_returns() -> None:
    # a is slow to reload and used every 10 s; b is cheap and was used last, so LRU evicts a
    # for c and loads it again at 110 s.
    box = Box("dev", 200, 2.0, {"chat": 1.0, LOAD: 0.0},
              (Weights("a", 100, 5.0, 0.0), Weights("b", 100, 0.5, 0.0),
               Weights("c", 100, 0.5, 0.0)),
              tuple(SimModel(k, "chat", k, ServiceModel(0.1)) for k in "abc"))
    trace = requests(*[(10.0 * i, "a") for i in range(12)], (101.0, "b"), (105.0, "c"),
                     (122.0, "b"))
    cost = simulate(box, sorted_trace(trace), CostAware())
    lru = simulate(box, sorted_trace(trace), lru_by_bytes)
    assert [x.key for x in cost.loads] == ["a", "b", "c", "b"]
    assert [x.key for x in lru.loads] == ["a", "b", "c", "a", "b"]


def sorted_trace(trace: Sequence[TraceRequest]) -> list[TraceRequest]:
    return sorted(trace, key=lambda r: r.at)


# ----------------------------------------------------------------------------- the scenario


def test_quick_sim_run_writes_a_whole_report(tmp_path: Path) -> None:
    out, docs = tmp_path / "out", tmp_path / "benchmarks.md"
    rc = main(["sim", "--quick", "--no-progress", "--out", str(out),
               "--docs", str(docs)])
    assert rc == 0
    data = json.loads((out / "sim.json").read_text("utf-8"))
    assert data["scenario"] == "sim" and data["quick"] is True
    r = data["results"]
    assert r["calibration"]["source"] == "built-in"
    labels = {run["policy"] for run in r["runs"] if run["box"] == "gpu"}
    assert {"packserve (cost-aware)", "Belady (knows the future)"} <= labels
    for box in ("gpu", "cpu"):
        for shape in ("steady", "bursty", "shifting"):
            mine = [x for x in r["runs"] if x["box"] == box and x["trace"] == shape]
            assert {x["priority"] for x in mine} == {False, True}
            for x in mine:
                assert x["loads"] >= 1 and x["bytes_loaded"] > 0
                assert x["peak_bytes"] <= r[box]["capacity_bytes"]
                assert 0 <= x["slo_attainment"] <= 1
                assert set(x["by_task"]) <= set(SLO)
    assert any(x["warm_tier"] and x["restores"] > 0 for x in r["runs"])
    assert len(data["goals"]) == 3 * 8  # per GPU trace: vs 2 Beladys, 2 against each of 3
    assert all(g["met"] in (True, False) for g in data["goals"])
    for plot in data["plots"]:
        assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "### `sim`" in docs.read_text("utf-8")


def test_a_load_from_disk_first_stalls_the_device() -> None:
    w = (Weights("e", 100, 0.0, 0.0), Weights("g", 100, 1.0, 0.0, stall_s=0.5))
    box = Box("dev", 200, 2.0, {"embed": 2.0, "chat": 1.0, LOAD: 0.0}, w,
              (SimModel("e", "embed", "e", ServiceModel(0.2)),
               SimModel("g", "chat", "g", ServiceModel(1.0))))
    r = simulate(box, requests((0.0, "e"), (1.0, "e"), (1.0, "g")), lru_by_bytes)
    assert latency(r, 1.0, "e") == pytest.approx(0.7)  # 0.5 s stalled, then 0.2 s
    assert latency(r, 1.0, "g") == pytest.approx(2.5)  # stall, load, request
    assert [x.seconds for x in r.loads if x.key == "g"] == pytest.approx([1.5])


def test_a_load_that_fits_goes_ahead_of_one_waiting_for_busy_models() -> None:
    box = Box("dev", 200, 2.0, {"chat": 1.0, LOAD: 0.0},
              (Weights("a", 100, 1.0, 0.0), Weights("big", 200, 1.0, 0.0),
               Weights("b", 100, 1.0, 0.0)),
              tuple(SimModel(k, "chat", k, ServiceModel(s))
                    for k, s in (("a", 10.0), ("big", 1.0), ("b", 1.0))))
    r = simulate(box, requests((0.0, "a"), (1.0, "big"), (2.0, "b")), lru_by_bytes)
    # big waits for a (busy until 11 s) outside the lock: b, which fits beside a, loads at once.
    assert latency(r, 2.0, "b") == pytest.approx(2.0)
    assert latency(r, 1.0, "big") == pytest.approx(12.0)  # a and b leave at 11 s, then 1 + 1 s
    before = simulate(box, requests((0.0, "a"), (1.0, "big"), (2.0, "b")), lru_by_bytes,
                      SimOptions(wait_holds_lock=True))
    assert latency(before, 2.0, "b") > 10.0  # the scheduler before 10c4f0f: b waited behind big
