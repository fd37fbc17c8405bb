"""`packserve plan` end to end: the JSON contract, the table, a config, overrides."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from packserve.cli import main
from packserve.config import default_catalog_text, load_config
from packserve.planner.sizing import GPU_RUNTIME_BYTES
from packserve.server import resolve_models

GB = 1_000_000_000


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def catalog_config(tmp_path: Path, models_dir: Path, extra: str = "") -> Path:
    text = default_catalog_text().replace("[server]", f'[server]\ndata_dir = "{models_dir}"', 1)
    path = tmp_path / "catalog.toml"
    path.write_text(text + extra, "utf-8")
    return path


def test_json_has_total_and_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(capsys, "--params", "70B", "--precision", "int4")
    assert isinstance(report["total_bytes"], int) and 38 * GB < report["total_bytes"] < 44 * GB
    gpus = report["gpus"]
    assert isinstance(gpus, list) and len(gpus) == 7
    by_name = {g["name"]: g for g in gpus}
    for g in gpus:
        assert isinstance(g["memory_bytes"], int) and isinstance(g["count"], int)
    assert by_name["L40S"]["count"] == 1 and by_name["L4"]["count"] == 2
    assert by_name["L4"]["nvlink_needed"] and not by_name["L4"]["nvlink"]
    assert by_name["H200"]["host_ram_bytes"] == 2 * 141 * GB
    assert by_name["H100"]["cost"]["per_hour"] > 0


def test_the_readable_table_names_cards_costs_and_assumptions(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "70B", "--precision", "int4"]) == 0
    out = capsys.readouterr().out
    for word in ("70B int4", "L40S", "H200", "EUR", "assumption", "llama-3.1-70b"):
        assert word in out


def test_overrides_flow_into_the_cost(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(capsys, "--params", "7B", "--gpu", "l4", "--price-per-hour", "1.0",
                       "--flat-monthly", "365", "--tokens-per-second", "500",
                       "--purchase-price", "7300")
    (l4,) = report["gpus"]
    cost = l4["cost"]
    assert l4["count"] == 1 and cost["per_hour"] == 1.0
    assert cost["per_million_tokens"] == pytest.approx(1.0 / 1.8, abs=0.01)
    assert cost["break_even_months"] == pytest.approx(10.0, abs=0.01)  # 7300 / (24 x 30.42)
    assert cost["flat_rate_beats_per_second_above_hours_per_day"] == pytest.approx(12.0, abs=0.01)


def test_training_tasks_report_gradients_and_optimizer(
        capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(capsys, "--params", "7B", "--precision", "bf16", "--task", "full",
                       "--context", "512")
    (m,) = report["models"]
    assert m["optimizer_bytes"] == 2 * m["gradients_bytes"] > 0
    assert {g["name"]: g["count"] for g in report["gpus"]}["H100"] == 1


def test_bad_inputs_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "7B", "--precision", "int3"]) == 2
    assert "unknown precision" in capsys.readouterr().err
    assert main(["plan", "--params", "7B", "--family", "nope"]) == 2
    assert main(["plan", "--params", "7B", "--gpu", "TPU"]) == 2


@pytest.mark.real
def test_plan_of_the_default_catalog_uses_the_admission_estimate(
        tmp_path: Path, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = catalog_config(tmp_path, models_dir)
    report = plan_json(capsys, "--config", str(config))
    models = {m["name"]: m for m in report["models"]}
    # shared loads count once, as in the server
    assert set(models) == {"all-minilm-l6-v2", "smollm2-135m-instruct", "gemma-3-270m"}
    admission = {r.spec.name: r.breakdown() for r in resolve_models(load_config(config))}
    for name, m in models.items():
        # The server's estimate here (the CPU) less the copies only the CPU's kernels repack
        # (Gemma's Q4_K matrices), and on a card each runner's own CUDA context.
        here = admission[name]
        assert m["total_bytes"] == here.total - here.repacked + GPU_RUNTIME_BYTES
    assert admission["gemma-3-270m"].repacked > 0
    assert report["total_bytes"] == sum(m["total_bytes"] for m in models.values()) \
        + report["runtime_bytes"]
    assert all(g["count"] == 1 for g in report["gpus"])


@pytest.mark.real
def test_price_set_on_a_cuda_device_in_the_config_is_used(
        tmp_path: Path, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = catalog_config(tmp_path, models_dir,
                            '\n[devices."cuda:0"]\nprice_per_hour = 0.9\n')
    from packserve.config import DeviceConfig

    if "price_per_hour" not in DeviceConfig.model_fields:
        pytest.skip("this config schema has no price_per_hour")
    report = plan_json(capsys, "--config", str(config), "--gpu", "L4")
    assert report["gpus"][0]["cost"]["per_hour"] == 0.9
