"""`packserve bench SCENARIO --quick` for each scenario: results are produced and well-formed.

These check the tooling, never the figures: benchmarks report, they are not timed tests.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from packserve.bench.trace import make_trace
from packserve.cli import main

pytestmark = pytest.mark.real


@pytest.mark.parametrize("scenario", ["overhead", "packing", "coldstart", "trace", "peers",
                                      "reliability"])
def test_quick_run_writes_well_formed_results(scenario: str, tmp_path: Path,
                                              models_dir: Path) -> None:
    out = tmp_path / "out"
    docs = tmp_path / "benchmarks.md"
    rc = main(["bench", scenario, "--quick", "--no-progress", "--out", str(out),
               "--docs", str(docs), "--data-dir", str(models_dir)])
    assert rc == 0
    data = json.loads((out / f"{scenario}.json").read_text("utf-8"))
    assert data["scenario"] == scenario
    assert data["quick"] is True
    assert data["machine"]["cores"] >= 1
    assert data["goals"], "every scenario reports ratios against goals"
    for goal in data["goals"]:
        assert goal["op"] in (">=", "<=")
        assert goal["value"] is None or goal["value"] > 0
        assert goal["met"] in (True, False, None)
        if goal["value"] is None:
            assert goal["note"], "a ratio not measured says why"
    for plot in data["plots"]:
        assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = docs.read_text("utf-8")
    assert f"### `{scenario}`" in text and "| ratio | measured | goal | verdict |" in text


def test_trace_is_reproducible_and_shaped_by_its_parameters() -> None:
    a = make_trace(seed=3, duration_s=200, rate=2.0, alpha=0.9, cv=1.0)
    assert a == make_trace(seed=3, duration_s=200, rate=2.0, alpha=0.9, cv=1.0)
    assert a != make_trace(seed=4, duration_s=200, rate=2.0, alpha=0.9, cv=1.0)
    assert 300 < len(a) < 500  # about rate x duration
    assert all(0 <= r.at < 200 for r in a)
    counts = [sum(r.model == m for r in a) for m in dict.fromkeys(r.model for r in a)]
    assert max(counts) > min(counts)  # Zipf: not uniform
    bursty = make_trace(seed=3, duration_s=200, rate=2.0, alpha=0.9, cv=3.0)
    gaps = [y.at - x.at for x, y in itertools.pairwise(bursty)]
    poisson = [y.at - x.at for x, y in itertools.pairwise(a)]
    assert _cv(gaps) > 1.5 * _cv(poisson)


def _cv(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return float((sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5 / mean)
