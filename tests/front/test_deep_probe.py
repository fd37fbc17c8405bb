"""The deep probe through the real front (`packserve serve`, fake engines): `/healthz` stays
cheap and answers whatever the scheduler does; `/healthz/deep` reads the scheduler, says when a
load has hung past load_timeout_s, and the watchdog then restarts the worker."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.factories import fake_config, fake_model, serve_process


def test_healthz_deep_sees_a_hung_load_that_healthz_does_not(tmp_path: Path) -> None:
    config = fake_config(tmp_path, fake_model("hung", source="fake:16MiB?load_s=3600"),
                         load_timeout_s=1.0)
    with serve_process(config, tmp_path) as srv:
        deep = httpx.get(f"{srv.url}/healthz/deep", timeout=10)
        assert deep.status_code == 200, deep.text
        body = deep.json()
        assert body["status"] == "ok" and body["load_timeout_s"] == 1.0
        assert body["worker"]["state"] == "up" and body["stuck"] == []
        hung = srv.post_later("/v1/embeddings", {"model": "hung", "input": "x"})
        deadline = time.monotonic() + 60  # bounds the wait; asserts no time
        while True:
            assert time.monotonic() < deadline, "the deep probe never saw the hung load"
            assert httpx.get(f"{srv.url}/healthz", timeout=10).status_code == 200
            deep = httpx.get(f"{srv.url}/healthz/deep", timeout=10)
            if deep.status_code == 503 and deep.json().get("wedged"):
                break
            time.sleep(0.1)
        body = deep.json()
        assert body["wedged"] == ["hung"] and body["restart"] is True
        assert {s["kind"] for s in body["stuck"]} >= {"load", "lock"}
        # The watchdog reads the same probe: the worker is replaced and the hung model charged.
        # The front sends the request again to the new worker (it died unanswered), where the
        # load hangs again: the second charge backs the model off (core.crashes: the third
        # would quarantine it) and the client gets 503.
        answer = hung.result(timeout=60)
        assert answer.status_code == 503, answer.text
        assert "hung past load_timeout_s" in answer.json()["error"]["message"]
        worker = srv.health()["worker"]
        assert isinstance(worker, dict)
        assert worker["crashes"] == 2 and worker["quarantined"] == {}
        assert list(worker["backing_off"]) == ["hung"]
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            while c.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert c.post("/v1/embeddings", json={"model": "emb", "input": "x"}).is_success
            assert c.get("/healthz/deep").json()["status"] == "ok"
        log = srv.log()
        assert log.count("charged: hung (loading)") == 2 and "is wedged: " in log
