"""`packserve bench --url`: the trace, the results file it is read back from, and replays
against a real server with the real default models; a server it cannot use is an error
message and an exit code, never a traceback."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import httpx
import pytest

from packserve.cli import main
from packserve.replay import (
    ReplayError,
    TraceSpec,
    make_trace,
    read_spec,
    server_models,
    slo_targets,
    task_overrides,
)
from packserve.types import Task
from tests.factories import Running, free_port

EMBEDDER, RERANKER, CHAT = "all-minilm-l6-v2", "minilm-rerank", "smollm2-135m-instruct"
TINY = ["--rate", "3", "--duration", "3", "--seed", "5", "--no-progress"]


def test_trace_is_reproducible_and_shaped_by_its_parameters() -> None:
    models = ("a", "b", "c", "d", "e")
    a = make_trace(seed=3, duration_s=200, rate=2.0, alpha=0.9, cv=1.0, models=models)
    assert a == make_trace(seed=3, duration_s=200, rate=2.0, alpha=0.9, cv=1.0, models=models)
    assert a != make_trace(seed=4, duration_s=200, rate=2.0, alpha=0.9, cv=1.0, models=models)
    assert 300 < len(a) < 500  # about rate x duration
    assert all(0 <= r.at < 200 for r in a)
    counts = [sum(r.model == m for r in a) for m in dict.fromkeys(r.model for r in a)]
    assert max(counts) > min(counts)  # Zipf: not uniform
    bursty = make_trace(seed=3, duration_s=200, rate=2.0, alpha=0.9, cv=3.0, models=models)
    gaps = [y.at - x.at for x, y in itertools.pairwise(bursty)]
    poisson = [y.at - x.at for x, y in itertools.pairwise(a)]
    assert _cv(gaps) > 1.5 * _cv(poisson)


def _cv(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return float((sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5 / mean)


def test_a_results_file_gives_back_the_trace_it_records(tmp_path: Path) -> None:
    spec = TraceSpec(seed=7, duration_s=30.0, rate_per_s=2.0, zipf_alpha=0.9,
                     interarrival_cv=4.0, popularity=("b", "a"))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"results": {"trace": {**spec.as_json(), "requests": 3}}}))
    assert read_spec(path) == spec
    assert read_spec(path).requests() == spec.requests()


@pytest.mark.parametrize("text", ["not json", '{"results": {}}',
                                  '{"results": {"trace": {"seed": 1}}}'])
def test_a_file_without_a_trace_is_refused_with_what_it_needs(tmp_path: Path,
                                                               text: str) -> None:
    path = tmp_path / "other.json"
    path.write_text(text)
    with pytest.raises(ReplayError) as info:
        read_spec(path)
    assert info.value.exit_code == 2 and str(path) in str(info.value)
    with pytest.raises(ReplayError, match="cannot read"):
        read_spec(tmp_path / "missing.json")


def test_slo_targets_start_from_the_servers_defaults() -> None:
    assert slo_targets(None) == {"embed": 0.5, "rerank": 0.5, "chat": 4.0, "complete": 4.0}
    assert slo_targets("chat=2, embed=0.25")["chat"] == 2.0
    for bad in ("chat", "chat=fast", "chat=0", "vision=1"):
        with pytest.raises(ReplayError, match="TYPE=SECONDS"):
            slo_targets(bad)
    assert task_overrides("m=embed,n=rerank") == {"m": Task.EMBED, "n": Task.RERANK}
    with pytest.raises(ReplayError, match="NAME=TASK"):
        task_overrides("m=vision")


def test_each_model_is_sent_its_listed_task_else_chat_unless_told() -> None:
    rows = [{"id": "e", "tasks": ["embed"]}, {"id": "g", "tasks": ["vision", "complete"]},
            {"id": "plain"}, {"id": "told", "tasks": []}]
    transport = httpx.MockTransport(lambda _: httpx.Response(200, json={"data": rows}))
    with httpx.Client(transport=transport, base_url="http://x") as c:
        assert server_models(c, {"told": Task.RERANK}) == {
            "e": Task.EMBED, "g": Task.COMPLETE, "plain": Task.CHAT, "told": Task.RERANK}
    not_openai = httpx.MockTransport(lambda _: httpx.Response(200, text="<html>"))
    with httpx.Client(transport=not_openai, base_url="http://x") as c, \
            pytest.raises(ReplayError, match="not an OpenAI model list") as info:
        server_models(c, {})
    assert info.value.exit_code == 1


def test_replay_against_a_real_server_counts_every_request(
        default_server: Running, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "replay.json"
    models = f"{EMBEDDER},{RERANKER},{CHAT}"
    assert main(["bench", "--url", default_server.url, "--models", models, "--out", str(out),
                 *TINY]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text("utf-8"))
    r = data["results"]
    spec = TraceSpec(seed=5, duration_s=3.0, rate_per_s=3.0, zipf_alpha=0.9,
                     interarrival_cv=1.0, popularity=(EMBEDDER, RERANKER, CHAT))
    sent = spec.requests()
    assert len(sent) >= 3
    assert r["trace"]["requests"] == len(r["requests"]) == len(sent)
    assert sum(t["requests"] for t in r["by_task"].values()) == len(sent)
    assert sorted(q["at"] for q in r["requests"]) == [q.at for q in sent]
    assert {q["task"] for q in r["requests"]} <= {"embed", "rerank", "chat"}
    assert all(q["status"] == 200 and q["error"] is None for q in r["requests"]), r["errors"]
    rows = {line.split()[0]: line.split() for line in printed.splitlines()[1:]}
    for task, t in r["by_task"].items():
        assert t["errors"] == 0 and 0 < t["p50_s"] <= t["p95_s"], task
        assert t["slo_s"] == {"embed": 0.5, "rerank": 0.5, "chat": 4.0}[task]
        assert 0.0 <= t["slo_attainment"] <= 1.0
        assert rows[task][1:3] == [str(t["requests"]), "0"]  # requests, errors
    assert printed.startswith(f"{len(sent)} requests to {default_server.url} in ")
    assert rows["all"][1:3] == [str(len(sent)), "0"]
    # The results file is a trace file: replayed, it sends the same requests again.
    again = tmp_path / "again.json"
    assert main(["bench", "--url", default_server.url, "--trace", str(out), "--out",
                 str(again), "--no-progress"]) == 0
    second = json.loads(again.read_text("utf-8"))["results"]
    assert second["trace"] == r["trace"]
    assert sorted((q["at"], q["model"]) for q in second["requests"]) == \
        sorted((q["at"], q["model"]) for q in r["requests"])


def test_a_model_the_server_does_not_list_stops_it_before_any_request(
        default_server: Running, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--url", default_server.url, "--models", f"{EMBEDDER},nope",
                 *TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith("packserve bench: ") and "does not list nope" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("url", ["http://127.0.0.1:{port}", "127.0.0.1:{port}", "http://"])
def test_a_bad_url_is_a_message_and_exit_code_1(url: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    url = url.format(port=free_port())  # nothing listens there
    assert main(["bench", "--url", url, *TINY]) == 1
    err = capsys.readouterr().err
    assert err.startswith("packserve bench: cannot reach ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_the_moved_scenarios_and_a_missing_url_are_usage_errors(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "trace", "--cv", "4"])
    assert info.value.code == 2
    assert "python -m benchmarks trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--rate", "2"])
    assert "--url is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--url", "http://x", "--trace", "t.json", "--rate", "2"])
    assert "--rate would not apply" in capsys.readouterr().err
