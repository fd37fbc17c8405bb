"""`python -m benchmarks SCENARIO --quick` for each scenario: results are produced and well-formed.

These check the tooling, never the figures: benchmarks report, they are not timed tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import main
from benchmarks.soak import KINDS, budget_for, pooled_slope
from packserve.replay import read_spec

pytestmark = pytest.mark.real


@pytest.mark.parametrize("scenario", ["overhead", "packing", "coldstart", "trace", "peers",
                                      "reliability"])
def test_quick_run_writes_well_formed_results(scenario: str, tmp_path: Path,
                                              models_dir: Path) -> None:
    out = tmp_path / "out"
    docs = tmp_path / "benchmarks.md"
    rc = main([scenario, "--quick", "--no-progress", "--out", str(out),
               "--docs", str(docs), "--data-dir", str(models_dir)])
    assert rc == 0
    data = json.loads((out / f"{scenario}.json").read_text("utf-8"))
    assert data["scenario"] == scenario
    assert data["quick"] is True
    assert data["machine"]["cores"] >= 1
    if scenario == "peers":  # setup builds the router; packserve converts MiniLM: every row runs
        ratios = data["results"]["router"]["ratios"]
        assert ratios and all(isinstance(v, float) and v > 0 for v in ratios.values()), ratios
        assert {"switch_p50_ms", "switch_p90_ms"} <= set(ratios)
        switching = data["results"]["router"]["switching"]
        assert switching["requests"] >= 3 and switching["packserve_evictions"] >= 1
        # where the switches went, from the server's own events: every model came back
        profile = switching["profile"]["seconds"]
        assert {"all-minilm-l6-v2", "smollm2-135m-instruct", "gemma-3-270m"} <= set(profile)
        assert all(k.get("from cold") or k.get("from warm") for k in profile.values())
    assert data["goals"], "every scenario reports ratios against goals"
    for goal in data["goals"]:
        assert goal["op"] in (">=", "<=")
        assert goal["value"] is None or goal["value"] >= 0  # an SLO met 0% of the time is 0
        assert goal["met"] in (True, False, None)
        if goal["value"] is None:
            assert goal["note"], "a ratio not measured says why"
    for plot in data["plots"]:
        assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = docs.read_text("utf-8")
    assert f"### `{scenario}`" in text and "| ratio | measured | goal | verdict |" in text
    results = data["results"]
    if scenario == "trace":
        for label, p in results["policies"].items():
            assert p["loads"] == len(p["load_events"]) >= 1, label  # everything starts cold
            assert p["bytes_loaded"] >= min(results["footprints_bytes"].values())
            assert p["reload_s"] > 0 and p["runs"], label
        assert results["offline"]["belady"]["loads"] <= results["offline"]["lru"]["loads"]
        # `packserve bench --trace` reads the trace back from the results file.
        assert len(read_spec(out / "trace.json").requests()) == results["trace"]["requests"]
    if scenario == "packing":  # the bare engines ran beside the servers, MiniLM's once
        assert len(results["bare_pss_bytes"]) == 1 and results["ratio_bare_engines"] > 0
    if scenario == "reliability":
        assert results["at_rest"]["healthz_s"] > 0
        assert results["at_rest"]["idle"]["total_pss_bytes"] > 0
    if scenario == "coldstart":
        assert [r["load_nice"] for r in results["loads_beside_traffic"]] == [0, 10]


def test_quick_soak_answers_every_request_it_accepts_without_a_500(tmp_path: Path,
                                                                    models_dir: Path) -> None:
    out, docs = tmp_path / "out", tmp_path / "benchmarks.md"
    rc = main(["soak", "--quick", "--no-progress", "--out", str(out),
               "--docs", str(docs), "--data-dir", str(models_dir)])
    assert rc == 0
    data = json.loads((out / "soak.json").read_text("utf-8"))
    assert data["scenario"] == "soak" and data["quick"] is True
    r = data["results"]
    assert tuple(r["by_type"]) == KINDS == ("embed", "rerank", "chat", "extract", "complete")
    for kind, t in r["by_type"].items():
        assert t["sent"] > 0, f"no {kind} traffic"
        assert t["sent"] == t["accepted"] == t["answered"], (kind, t["transport_errors"])
        assert t["lost"] == 0 and t["status_500"] == 0, (kind, t)
    assert r["lost"] == r["status_500"] == r["clients_still_waiting"] == 0
    assert r["events"].get("evict", 0) > 0, "the budget must make models leave"
    assert set(r["keys"]) == {c["key"] for c in r["clients"]} | {"ops"}
    for when in ("idle", "start", "end"):
        procs = r["processes"][when]
        assert {"front", "worker"} <= set(procs)
        assert all(p["fds"] > 0 and p["threads"] > 0 and p["pss_bytes"] > 0
                   for p in procs.values())
    for sample in r["samples"]:
        assert sample["resident"] and sample["pss_bytes"] > 0
        assert sample["pss_bytes"] == sum(p["pss_bytes"] for p in sample["processes"].values())
    goals = {g["name"]: g for g in data["goals"]}
    assert goals["soak: requests answered / accepted"]["met"] is True
    assert goals["soak: answers other than 500 / answered"]["met"] is True
    slope = goals["soak: PSS slope after warm-up / 1 MiB per minute"]
    assert slope["value"] is not None or slope["note"]
    assert "### `soak`" in docs.read_text("utf-8")


def test_soak_slope_is_fitted_within_each_resident_set() -> None:
    # Two resident sets 300 MiB apart, swapped every 10 s: the jumps are not a slope.
    def level(t: int) -> tuple[str, float]:
        return ("gemma", 300.0) if (t // 10) % 2 else ("smollm2", 0.0)

    flat = [(float(t), *level(t)) for t in range(600)]
    assert pooled_slope(flat) == pytest.approx(0.0)
    growing = [(t, group, value + t / 60) for t, group, value in flat]  # 1 MiB a minute
    assert pooled_slope(growing) == pytest.approx(1 / 60)
    assert pooled_slope([(0.0, "a", 1.0), (1.0, "b", 2.0)]) is None  # no set sampled twice


def test_soak_budget_fits_the_largest_load_with_the_smallest_only() -> None:
    minilm, smollm2, gemma = 87, 160, 319
    capacity = budget_for([gemma, minilm, smollm2])
    assert gemma + minilm <= capacity < gemma + smollm2
    assert minilm + smollm2 <= capacity
