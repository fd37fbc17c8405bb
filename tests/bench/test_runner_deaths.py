"""`python -m benchmarks.runner_deaths --quick`: one round against a real server, its results
well-formed. It checks the tooling and what the server answered, never the timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import runner_deaths
from benchmarks.common import CHAT_MODEL, EXTRACT_MODEL

pytestmark = [pytest.mark.real, pytest.mark.process]


def _seconds(value: object) -> bool:
    return isinstance(value, float) and value >= 0


def test_quick_round_reports_each_death_as_a_client_sees_it(tmp_path: Path) -> None:
    out = tmp_path / "runner-deaths.json"
    assert runner_deaths.main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text("utf-8"))
    assert data["scenario"] == "runner-deaths" and data["quick"] is True
    assert data["machine"]["cores"] >= 1 and "--quick" in data["command"]
    assert data["results"]["errors"] == []
    (r,) = data["results"]["rounds"]
    assert [p.split(":")[1] for p in r["process_chain"]] == ["runner", "worker", "front"]

    first = r["first"]
    assert first["stream_status"] == 200 and first["events_before_kill"] == 3
    assert first["stream_error_event"] is True and first["stream_error"]
    assert _seconds(first["stream_ended_after_kill_s"])
    assert _seconds(first["left_hot"]["after_kill_s"])
    assert first["left_hot"]["row"]["state"] != "hot"
    assert first["left_hot"]["row"]["last_crash"]["cause"] == "SIGKILL"
    assert _seconds(first["chat"]["after_kill_s"]) and "200" in first["chat"]["statuses"]

    second = r["second"]
    assert second["pid"] != first["pid"] and second["after_answer_s"] >= 2.0
    assert _seconds(second["chat"]["after_kill_s"]) and "200" in second["chat"]["statuses"]

    third = r["third"]
    assert third["pid"] not in (first["pid"], second["pid"])
    assert third["status"] == 503 and str(third["retry_after"]).isdigit()
    assert "quarantined" in third["reason"]

    assert [e["action"] for e in r["crash_events"]] == ["reload", "backoff", "quarantine"]
    for model in (CHAT_MODEL, EXTRACT_MODEL):
        assert r["crashes"][model] == {"SIGKILL": 3.0}
    logs = r["logs_cli"]
    assert logs["rc"] == 0 and logs["prints_log"] is True and logs["log_lines"] > 0
    assert len(r["kept_logs"]) == 3  # one log per runner, each kept after its death
    assert [load["after_kill"] for load in r["loads"]] == [0, 1, 2]

    for label, cells in data["results"]["summary"].items():
        assert len(cells["rounds"]) == 1, label
    for goal in data["goals"]:
        assert goal["op"] in (">=", "<=") and goal["met"] in (True, False, None)
        assert goal["value"] is not None or goal["note"]
