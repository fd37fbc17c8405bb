"""Quota, memory and pin refusals through the real HTTP app (fake engines): 429 with
Retry-After, 507, and a pin whose load fails."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from packserve.backends.fake import DEFAULT_CONTROL
from tests.factories import Running, config_from, serve

TOML = """
[server]
failure_cooldown_s = 0

[devices.cpu]
memory_budget = "1GiB"
headroom = "64MiB"

[[models]]
name = "one-at-a-time"
tasks = ["chat"]
backend = "fake"
source = "fake:16MiB"
max_concurrency = 1
max_queue = 0

[[models]]
name = "too-big"
tasks = ["embed"]
backend = "fake"
source = "fake:3GiB"

[[models]]
name = "pin-me"
tasks = ["embed"]
backend = "fake"
source = "fake:8MiB"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with serve(config_from(tmp_path_factory.mktemp("quotas"), TOML)) as running:
        yield running


def error_of(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


def test_a_full_queue_is_429_with_retry_after(server: Running) -> None:
    box: dict[str, httpx.Response] = {}
    started = threading.Event()

    def slow() -> None:
        with server.client() as c:
            started.set()
            box["r"] = c.post("/v1/chat/completions", json={
                "model": "one-at-a-time", "messages": [{"role": "user", "content": "@@sleep=2"}]})

    t = threading.Thread(target=slow)
    t.start()
    started.wait(10)
    with server.client() as c:
        deadline = time.monotonic() + 30
        while not any(m["name"] == "one-at-a-time" and m["in_flight"] == 1
                      for m in c.get("/v1/residency").json()["models"]):
            assert time.monotonic() < deadline, "the slow request never started"
        r = c.post("/v1/chat/completions", json={
            "model": "one-at-a-time", "messages": [{"role": "user", "content": "me too"}]})
    err = error_of(r, 429)
    assert err["code"] == "queue_full" and "max_concurrency=1" in str(err["message"])
    assert int(r.headers["retry-after"]) >= 1
    t.join(timeout=30)
    assert box["r"].status_code == 200


def test_a_model_that_can_never_fit_is_507_naming_the_numbers(server: Running) -> None:
    with server.client() as c:
        r = c.post("/v1/embeddings", json={"model": "too-big", "input": "x"})
        err = error_of(r, 507)
        assert err["code"] == "model_too_large"
        assert "too-big" in str(err["message"]) and "MiB" in str(err["message"])
        # Nothing was loaded or evicted for it, and the others serve on.
        assert c.post("/v1/embeddings", json={"model": "pin-me", "input": "x"}).status_code \
            == 200


def test_a_pin_whose_load_fails_is_rolled_back(server: Running) -> None:
    with server.client() as c:
        assert c.post("/v1/residency/pin-me/unload").status_code == 200
        DEFAULT_CONTROL.fail_next = 2  # out of memory, and again on the one retry
        try:
            r = c.post("/v1/residency/pin-me/pin")
        finally:
            DEFAULT_CONTROL.fail_next = 0
        err = error_of(r, 503)
        assert "pin-me" in str(err["message"])
        row = next(m for m in c.get("/v1/residency").json()["models"] if m["name"] == "pin-me")
        assert row["pinned"] is False
        assert c.get("/readyz").status_code == 200  # no pin left waiting
        assert c.post("/v1/residency/pin-me/pin").json()["pinned"] is True
        assert c.post("/v1/residency/pin-me/unpin").json()["pinned"] is False


@pytest.fixture(autouse=True)
def _fresh_control() -> Iterator[None]:
    yield
    DEFAULT_CONTROL.fail_next = 0

