"""A runner's death, through the HTTP app and real llama-server runners: the scheduler sees it at
once (its reaper), takes the model out of service, counts it and loads it again through its one
load path by the crash rule (core.crashes: at once, after a back-off, quarantined on the third
within crash_window_s); the requests the runner had not begun are sent again once; its log
survives; a runner that never serves is killed at load_timeout_s and charged. Waits are bounded
by deadlines and never asserted as timings (the scenario's figures: docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from packserve.core.events import CrashEvent
from packserve.types import State
from tests.factories import Running, catalog_path, config_from, default_config, serve
from tests.factories.processes import runner_of

pytestmark = pytest.mark.real

CHAT, EMBED = "smollm2-135m-instruct", "all-minilm-l6-v2"
LONG = {"model": CHAT, "max_tokens": 1500, "temperature": 0.8, "seed": 3, "stream": True,
        "messages": [{"role": "user", "content": "Write a very long story about a lighthouse "
                      "keeper, with many chapters."}]}
SHORT = {"model": CHAT, "max_tokens": 4, "temperature": 0,
         "messages": [{"role": "user", "content": "Say hi."}]}


def _row(c: httpx.Client, name: str) -> dict[str, Any]:
    rows = c.get("/v1/residency").json()["models"]
    row: dict[str, Any] = next(m for m in rows if m["name"] == name)
    return row


def _until(check: Callable[[], bool], what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture(scope="module")
def server(models_dir: Path) -> Iterator[Running]:
    config = default_config(models_dir, only_models=[CHAT, "smollm2-extract", EMBED])
    with serve(config) as running:
        yield running


def _kill_mid_stream(c: httpx.Client, pid: int) -> list[str]:
    """A long stream, its runner SIGKILLed after its third event: the events it got."""
    events: list[str] = []
    with c.stream("POST", "/v1/chat/completions", json=LONG) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 3:
                    os.kill(pid, signal.SIGKILL)
    return events


def test_a_runner_killed_three_times(server: Running) -> None:
    smol = "SmolLM2"
    with server.client() as c:
        assert c.post("/v1/chat/completions", json=SHORT).status_code == 200
        first = runner_of(smol)
        # 1. Mid-stream: that stream ends at once with its error; the model leaves hot with no
        # request for it, its death counted and explained; the next request loads it again.
        events = _kill_mid_stream(c, first)
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "engine_crashed"
        _until(lambda: _row(c, CHAT)["state"] != "hot", "the death was never seen")
        row = _row(c, CHAT)
        assert row["state"] == "cold" and row["in_flight"] == 0
        crash = row["last_crash"]
        assert crash["cause"] == "SIGKILL" and crash["pid"] == first
        assert "next request" in crash["verdict"]
        assert Path(crash["log"]).is_file() and "llama-server" in Path(crash["log"]).read_text()
        assert _row(c, "smollm2-extract")["last_crash"] == crash  # the same runner
        again = c.post("/v1/chat/completions", json=SHORT)
        assert again.status_code == 200, again.text
        second = runner_of(smol)
        assert second != first
        # 2. Dead again soon after: loaded again after a back-off, which requests wait out.
        os.kill(second, signal.SIGKILL)
        _until(lambda: _row(c, CHAT)["state"] != "hot", "the second death was never seen")
        row = _row(c, CHAT)
        assert row["restart_in_s"] is not None and row["restart_in_s"] > 0, row
        assert "back-off" in row["last_crash"]["verdict"]
        assert c.post("/v1/chat/completions", json=SHORT).status_code == 200
        # 3. The third within crash_window_s: quarantined, a 503 naming why, with Retry-After.
        os.kill(runner_of(smol), signal.SIGKILL)
        _until(lambda: _row(c, CHAT)["state"] == "failed", "the third death never quarantined")
        refused = c.post("/v1/chat/completions", json=SHORT)
        assert refused.status_code == 503, refused.text
        # the model asked for, and the one its runner serves too
        assert refused.json()["error"]["message"].startswith(
            f"model {CHAT} (one load with smollm2-extract) is quarantined: "), refused.text
        assert int(refused.headers["retry-after"]) > 60  # the rest of crash_window_s
        assert _row(c, CHAT)["restart_in_s"] > 60  # the status says when too
        # Its log survived each death; the admin route reads it.
        log = c.get(f"/v1/residency/{CHAT}/log", params={"lines": 5}).json()
        assert log["state"] == "failed" and log["last_crash"]["cause"] == "SIGKILL"
        assert 0 < len(log["lines"]) <= 5 and Path(log["log"]).is_file()
        # An operator's load lifts the quarantine and forgets the deaths.
        assert c.post(f"/v1/residency/{CHAT}/load").json()["state"] == "hot"
        assert c.post("/v1/chat/completions", json=SHORT).status_code == 200
    crashes = [e for e in server.events if isinstance(e, CrashEvent)]
    assert [(e.signal, e.action, e.deaths) for e in crashes] == [
        ("SIGKILL", "reload", 1), ("SIGKILL", "backoff", 2), ("SIGKILL", "quarantine", 3)]
    # the second and third died with no request; the first mid-stream, where the stream's own
    # end may have released its lease before the reaper's report came
    assert crashes[0].doing in ("serving", "idle")
    assert [e.doing for e in crashes[1:]] == ["idle", "idle"]
    assert all(e.model == f"{CHAT}+smollm2-extract" for e in crashes)


def test_an_embedding_the_runner_had_not_answered_is_sent_again(server: Running) -> None:
    with server.client() as c:
        body = {"model": EMBED, "input": ["a sentence", "another one"]}
        before = c.post("/v1/embeddings", json=body).json()["data"]
        pid = runner_of("minilm")
        os.kill(pid, signal.SIGSTOP)  # it takes the request and never answers it
        try:
            answers: list[httpx.Response] = []
            sent = threading.Thread(target=lambda: answers.append(
                httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=120)))
            sent.start()
            _until(lambda: _row(c, EMBED)["in_flight"] == 1, "the embedding never started")
        finally:
            os.kill(pid, signal.SIGKILL)
        sent.join(120)
        (answer,) = answers
        assert answer.status_code == 200, answer.text
        assert answer.json()["data"] == before  # from the runner loaded again
        assert _row(c, EMBED)["last_crash"]["cause"] == "SIGKILL"
        assert runner_of("minilm") != pid


def _stand_in(tmp_path: Path, body: str) -> Path:
    """A llama-server that lists no device and then does `body`."""
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n"
                   'case "$*" in *--list-devices*) echo "Available devices:"; exit 0;; esac\n'
                   f"{body}\n")
    exe.chmod(0o755)
    return exe


def test_a_runner_that_never_serves_is_killed_at_load_timeout_s_and_charged(
        models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACKSERVE_LLAMA_SERVER", str(_stand_in(
        tmp_path, 'echo "pretending to load" >&2\nexec sleep 600')))
    config = default_config(models_dir, only_models=[CHAT])
    config = config.model_copy(update={"server": config.server.model_copy(
        update={"load_timeout_s": 2.0})})
    with serve(config) as srv, srv.client() as c:
        r = c.post("/v1/chat/completions", json=SHORT)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "was not serving after 2 s" in message and "pretending to load" in message
        crash = _row(c, CHAT)["last_crash"]
        assert crash["cause"] == "hung"
        assert not Path(f"/proc/{crash['pid']}").exists() or \
            "Z" in Path(f"/proc/{crash['pid']}/stat").read_text().split(")")[-1].split()[0]
    (event,) = [e for e in srv.events if isinstance(e, CrashEvent)]
    assert (event.signal, event.doing) == ("hung", "loading")


def test_a_runner_that_fails_to_start_says_why_from_its_log(
        models_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    data = bytearray(catalog_path(CHAT, tmp_path).read_bytes())
    at = data.index(b"general.architecture")
    value = data.index(b"llama", at)
    data[value:value + 5] = b"llamx"
    broken.write_bytes(bytes(data))
    config = config_from(tmp_path, f"""
[server]
data_dir = "{models_dir}"

[[models]]
name = "broken"
tasks = ["chat"]
backend = "llama-server"
source = "broken.gguf"
device = "cpu"
""")
    with serve(config) as srv, srv.client() as c:
        r = c.post("/v1/chat/completions", json={**SHORT, "model": "broken"})
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "exited while loading (exit status" in message and "llamx" in message
        row = _row(c, "broken")
        assert row["state"] == State.FAILED.value and "llamx" in row["last_crash"]["log_tail"]
        log = c.get("/v1/residency/broken/log").json()
        assert any("llamx" in line for line in log["lines"])
