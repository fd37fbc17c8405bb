"""Fault injection through the real front and worker processes (fake engines that crash on cue).

Every test counts the requests it sent and the responses it got: the goal is none lost (no
connection error, no hang), whatever happened to the worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.factories import Served, chat_body, fake_config, serve_process
from tests.factories.sdk import assert_response_failed, openai_client

CHAT = "/v1/chat/completions"




def embed(text: str, model: str = "emb") -> dict[str, object]:
    return {"model": model, "input": text}


def stream_lines(srv: Served, body: dict[str, object]) -> list[str]:
    with srv.client() as c, c.stream("POST", CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]




@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with serve_process(fake_config(tmp_path), tmp_path) as srv:
        yield srv


def test_segv_fails_the_running_generation_and_serves_everything_else(served: Served) -> None:
    srv = served
    with srv.client() as c:
        assert c.post("/v1/embeddings", json=embed("warm")).status_code == 200
        assert c.post(CHAT, json=chat_body("warm")).status_code == 200
    pid = srv.worker_pid()
    answers: dict[str, object] = {}

    def run(key: str, fn: object) -> threading.Thread:
        def target() -> None:
            try:
                answers[key] = fn()  # type: ignore[operator]
            except Exception as exc:  # a lost request: the test fails below
                answers[key] = exc
        t = threading.Thread(target=target)
        t.start()
        return t

    def post(path: str, body: dict[str, object]) -> httpx.Response:
        with srv.client() as c:
            return c.post(path, json=body)

    threads = [
        run("stream", lambda: stream_lines(srv, chat_body("@@sleep=30"))),
        run("running_embed", lambda: post("/v1/embeddings", embed("@@sleep=2"))),
    ]
    srv.wait_in_flight("gen")
    srv.wait_in_flight("emb")
    os.kill(pid, signal.SIGSEGV)
    t_crash = time.monotonic()
    # Sent while the worker is down: queued in the front, served by the next worker.
    threads.append(run("during", lambda: post("/v1/embeddings", embed("during the outage"))))
    threads.append(run("chat_during", lambda: post(CHAT, chat_body("after the crash"))))
    # The port keeps answering all along.
    health_failures = 0
    while time.monotonic() - t_crash < 2:
        try:
            assert httpx.get(f"{srv.url}/healthz", timeout=5).status_code == 200
            assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            health_failures += 1
        time.sleep(0.02)
    for t in threads:
        t.join(timeout=60)
    assert health_failures == 0
    # Accepted 4, answered 4.
    assert all(not isinstance(v, Exception) for v in answers.values()), answers
    lines = answers["stream"]
    assert isinstance(lines, list)
    error = json.loads(lines[-2].removeprefix("data: "))
    assert lines[-1] == "data: [DONE]"
    assert error["error"]["code"] == "engine_crashed"
    assert "SIGSEGV" in error["error"]["message"] and "'gen'" in error["error"]["message"]
    for key in ("running_embed", "during", "chat_during"):
        r = answers[key]
        assert isinstance(r, httpx.Response) and r.status_code == 200, (key, r)
    assert srv.worker_pid() != pid
    crashes = srv.events("crash")
    assert len(crashes) == 1 and crashes[0]["signal"] == "SIGSEGV"
    assert set(crashes[0]["models"]) == {"gen", "emb"}  # both engines were running
    assert srv.metric("packserve_engine_crashes_total", model="gen", signal="SIGSEGV") == 1
    assert srv.metric("packserve_crash_requests_total", model="emb", outcome="retried") >= 1
    summary = httpx.get(f"{srv.url}/v1/metrics/summary", timeout=10).json()
    assert summary["crashes"][0]["signal"] == "SIGSEGV"


GEN_QUARANTINE = {"gen": "engine crashed: SIGILL while serving chat (3 times within "
                         "crash_window_s)"}


def quarantine_gen(srv: Served, c: httpx.Client) -> None:
    """Crash gen's engine three times (SIGILL): the front quarantines it (core.crashes: the
    second death within crash_window_s backs off, the third quarantines)."""
    for attempt in range(3):
        pid = srv.worker_pid()
        r = c.post(CHAT, json=chat_body("@@signal=ILL"))
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        message = r.json()["error"]["message"]
        assert "SIGILL" in message and "'gen'" in message
        srv.wait_ready(other_than_pid=pid)
        if attempt == 2:
            assert "now quarantined until crash_window_s has passed" in message
        else:
            assert srv.health()["worker"]["quarantined"] == {}  # type: ignore[index]
    assert srv.health()["worker"]["quarantined"] == GEN_QUARANTINE  # type: ignore[index]


def assert_quarantined(srv: Served, c: httpx.Client) -> None:
    assert srv.health()["worker"]["quarantined"] == GEN_QUARANTINE  # type: ignore[index]
    r = c.post(CHAT, json=chat_body("hello"))
    assert r.status_code == 503, r.text
    assert GEN_QUARANTINE["gen"] in r.json()["error"]["message"]


def test_a_model_charged_thrice_is_quarantined_until_an_operator_loads_it(
        served: Served) -> None:
    srv = served
    with srv.client() as c:
        quarantine_gen(srv, c)
        # The crash loop is broken: gen answers 503 at once, naming why; emb serves on.
        assert_quarantined(srv, c)
        assert c.post("/v1/embeddings", json=embed("still here")).status_code == 200
        # The worker reports the operator's load on its control pipe (`operator_loaded`); the
        # front lifts the quarantine on that.
        assert c.post("/v1/residency/gen/load").status_code == 200
        assert srv.health()["worker"]["quarantined"] == {}  # type: ignore[index]
        assert c.post(CHAT, json=chat_body("hello again")).json()["choices"][0]["message"][
            "content"] == "hello again"
        # Its charges went with it: the next worker starts it as any other model.
        pid = srv.worker_pid()
        os.kill(pid, signal.SIGKILL)  # nothing running: charged to nobody
        srv.wait_ready(other_than_pid=pid)
        assert c.post(CHAT, json=chat_body("still fine")).status_code == 200
        assert srv.health()["worker"]["quarantined"] == {}  # type: ignore[index]


def test_only_an_operators_load_that_succeeded_lifts_a_quarantine(
        served: Served, tmp_path: Path) -> None:
    """The front decides on the worker's report, not on a request's path or status: requests
    that look like the load (another verb, another method, another model) and an operator's
    load that fails leave the quarantine in place, in this worker and the next."""
    srv = served
    config = tmp_path / "packserve.toml"
    original = config.read_text("utf-8")
    with srv.client() as c:
        quarantine_gen(srv, c)
        assert c.get("/v1/residency/gen/load").status_code == 405
        assert c.post("/v1/residency/gen/load/").status_code != 200
        assert c.post("/v1/residency/gen/unload").status_code == 200  # a verb, not a load
        assert c.post("/v1/residency/emb/load").status_code == 200  # another model's load
        assert_quarantined(srv, c)

        # An operator's load that fails: gen's quota now holds less than its weights.
        config.write_text(original.replace("max_concurrency = 4",
                                           'max_concurrency = 4\nmax_memory = "1MiB"'), "utf-8")
        assert c.post("/v1/admin/reload").status_code == 200
        r = c.post("/v1/residency/gen/load")
        assert r.status_code == 507, r.text
        assert srv.health()["worker"]["quarantined"] == GEN_QUARANTINE  # type: ignore[index]
        # The front still owns it: the next worker starts with gen quarantined.
        config.write_text(original, "utf-8")
        assert c.post("/v1/admin/reload").status_code == 200
        pid = srv.worker_pid()
        os.kill(pid, signal.SIGKILL)  # nothing running: charged to nobody
        srv.wait_ready(other_than_pid=pid)
        assert_quarantined(srv, c)

        assert c.post("/v1/residency/gen/load").status_code == 200
        assert srv.health()["worker"]["quarantined"] == {}  # type: ignore[index]
        assert c.post(CHAT, json=chat_body("back")).status_code == 200


def test_a_responses_stream_cut_by_a_crash_ends_with_typed_events(served: Served) -> None:
    """/v1/responses streams end in their own shape, not chat's `data: {"error"}` + [DONE]:
    an `error` event and `response.failed` for the same response, numbered on from the last
    event relayed (api.stream_end, shared with the pool's entry point)."""
    srv = served
    with srv.client() as c:
        assert c.post(CHAT, json=chat_body("warm")).status_code == 200  # running, not loading
    pid = srv.worker_pid()
    lines: list[str] = []

    def read() -> None:
        with srv.client() as c, c.stream("POST", "/v1/responses", json={
                "model": "gen", "input": "streamed @@sleep=30", "stream": True}) as r:
            assert r.status_code == 200, r.read()
            lines.extend(line for line in r.iter_lines() if line)

    reader = threading.Thread(target=read)
    reader.start()
    srv.wait_in_flight("gen")
    os.kill(pid, signal.SIGSEGV)
    reader.join(timeout=60)
    assert not reader.is_alive()
    events = [json.loads(line.removeprefix("data: ")) for line in lines
              if line.startswith("data: ")]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names[0] == "response.created" and names[-2:] == ["error", "response.failed"], names
    assert "data: [DONE]" not in lines
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    error, failed = events[-2], events[-1]
    assert error["code"] == "engine_crashed" and "SIGSEGV" in error["message"]
    response = failed["response"]
    assert response["id"] == events[0]["response"]["id"] and response["status"] == "failed"
    assert response["error"] == {"code": "engine_crashed", "message": error["message"]}
    srv.wait_ready(other_than_pid=pid)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_worker_killed_mid_stream_is_an_api_error_in_the_openai_sdk(
        served: Served, route: str) -> None:
    """Chat and completions streams cut by the worker's death end with an error event in
    OpenAI's shape and [DONE]: the SDK raises APIError with its code and message (pool side:
    tests/pool/test_pool.py, a killed replica)."""
    srv = served
    with srv.client() as c:
        assert c.post(CHAT, json=chat_body("warm")).status_code == 200  # running, not loading
    text = "streamed @@sleep=30"
    chunks: Iterator[object]
    with openai_client(srv.url) as client:  # closed: a socket left to the collector is an error
        if route == "chat":
            chunks = iter(client.chat.completions.create(
                model="gen", messages=[{"role": "user", "content": text}], stream=True))
        else:
            chunks = iter(client.completions.create(model="gen", prompt=text, stream=True))
        next(chunks)  # it has started
        pid = srv.worker_pid()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError) as caught:
            for _ in chunks:
                pass
    assert caught.value.code == "engine_crashed", caught.value.body
    assert "SIGKILL" in caught.value.message and "'gen'" in caught.value.message
    assert isinstance(caught.value.body, dict) and caught.value.body["type"] == "model_unavailable"
    srv.wait_ready(other_than_pid=pid)


def test_a_worker_killed_mid_stream_is_a_failed_response_in_the_openai_sdk(
        served: Served) -> None:
    """A /v1/responses stream cut by the worker's death ends in-band: the SDK yields a typed
    `error` event and `response.failed` for the same response, and raises nothing."""
    srv = served
    with srv.client() as c:
        assert c.post(CHAT, json=chat_body("warm")).status_code == 200  # running, not loading
    with openai_client(srv.url) as client:
        events = iter(client.responses.create(model="gen", input="streamed @@sleep=30",
                                              stream=True))
        created = next(events)
        assert created.type == "response.created"
        pid = srv.worker_pid()
        os.kill(pid, signal.SIGKILL)
        error = assert_response_failed([created, *events], "engine_crashed")
    assert "SIGKILL" in error.message and "'gen'" in error.message
    srv.wait_ready(other_than_pid=pid)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGABRT])
def test_a_kill_from_outside_is_charged_and_recovered(served: Served,
                                                      sig: signal.Signals) -> None:
    """SIGKILL is what the OOM killer sends; SIGABRT what a failed assertion in C raises."""
    srv = served
    with srv.client() as c:
        assert c.post(CHAT, json=chat_body("warm")).status_code == 200  # running, not loading
    pid = srv.worker_pid()
    slow = srv.post_later(CHAT, chat_body("@@sleep=20"))
    srv.wait_in_flight("gen")
    os.kill(pid, sig)
    r = slow.result(timeout=60)
    assert r.status_code == 503
    assert sig.name in r.json()["error"]["message"]
    srv.wait_ready(other_than_pid=pid)
    with srv.client() as c:
        assert c.post(CHAT, json=chat_body("fine")).status_code == 200


def test_request_id_follows_the_request(served: Served) -> None:
    with served.client() as c:
        r = c.post("/v1/embeddings", json=embed("x"), headers={"X-Request-ID": "abc-123"})
        assert r.headers["x-request-id"] == "abc-123"
        r = c.post("/v1/embeddings", json=embed("x", model="nope"))
        assert r.status_code == 404
        assert re.fullmatch(r"req-[0-9a-f]{32}", r.headers["x-request-id"])
        r = c.post(CHAT, json=chat_body("@@signal=SEGV"), headers={"X-Request-ID": "will-crash"})
        assert r.status_code == 503 and r.headers["x-request-id"] == "will-crash"
    served.wait_ready()
    crash = served.events("crash")[0]
    assert crash["requests_running"] == ["will-crash"]


def test_the_front_holds_no_engine(served: Served) -> None:
    worker = served.worker_pid()
    with served.client() as c:
        assert c.post("/v1/embeddings", json=embed("x")).status_code == 200
    front_maps = Path(f"/proc/{served.proc.pid}/maps").read_text()
    assert "libtorch" not in front_maps and "llama" not in front_maps
    assert "numpy" not in front_maps
    assert "numpy" in Path(f"/proc/{worker}/maps").read_text()  # the check can see modules


def test_a_request_whose_client_left_before_its_load_loads_and_evicts_nothing(
        tmp_path: Path) -> None:
    # Room for one of the two models only: emb must wait for gen to go idle, then evict it.
    config = fake_config(tmp_path)
    config.write_text(config.read_text("utf-8").replace('memory_budget = "2GiB"',
                                                        'memory_budget = "80MiB"'), "utf-8")
    with serve_process(config, tmp_path) as srv:
        busy = srv.post_later(CHAT, chat_body("@@sleep=3 done"))
        srv.wait_in_flight("gen")
        with pytest.raises(httpx.ReadTimeout), srv.client(timeout=0.5) as c:
            c.post("/v1/embeddings", json=embed("nobody waits for me"))
        assert busy.result(timeout=30).status_code == 200
        with srv.client() as c:  # gen stays hot: nothing was evicted for the request that left
            models = {m["name"]: m for m in c.get("/v1/residency").json()["models"]}
        assert models["gen"]["state"] == "hot" and models["emb"]["state"] == "cold"
        assert not srv.events("evict")
        assert not [e for e in srv.events("load") if e["model"] == "emb"]
        assert srv.metric("packserve_requests_total", model="emb", code="499") == 1


def test_requests_sharing_a_client_id_are_charged_apart(served: Served) -> None:
    """Clients choose X-Request-ID: two in flight with the same one must not hide a crash."""
    srv = served
    with srv.client() as c:
        assert c.post(CHAT, json=chat_body("warm")).status_code == 200
    embedding = srv.post_later("/v1/embeddings", embed("@@sleep=0.5"),
                               headers={"X-Request-ID": "same"})
    srv.wait_in_flight("emb")
    with srv.client() as c:
        r = c.post(CHAT, json=chat_body("@@sleep=1 @@signal=SEGV"),
                   headers={"X-Request-ID": "same"})
    assert embedding.result(timeout=30).status_code == 200
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_crashed"
    assert r.headers["x-request-id"] == "same"
    served.wait_ready()
    crashes = srv.events("crash")
    assert len(crashes) == 1 and crashes[0]["models"] == ["gen"]  # the chat was not sent again


def test_a_request_whose_client_left_keeps_its_model_until_the_engine_call_returns(
        served: Served) -> None:
    """An engine call cannot be interrupted: the model may not be unloaded (or evicted) under
    it just because the client that asked for it went away."""
    srv = served
    with srv.client() as c:
        assert c.post("/v1/embeddings", json=embed("warm")).status_code == 200
    with pytest.raises(httpx.ReadTimeout), srv.client(timeout=0.5) as c:
        c.post("/v1/embeddings", json=embed("@@sleep=3"))
    with srv.client() as c:
        r = c.post("/v1/residency/emb/unload")
        assert r.status_code == 409 and "in flight" in r.json()["error"]["message"]
        deadline = time.monotonic() + 30
        while c.post("/v1/residency/emb/unload").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert srv.metric("packserve_requests_total", model="emb", code="499") == 1
