"""Stop and reload without losing requests: SIGTERM drains, SIGHUP and /v1/admin/reload reload."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from tests.factories import chat_body, fake_config, serve_process

CHAT = "/v1/chat/completions"




def test_sigterm_drains_in_flight_requests_then_exits(tmp_path: Path) -> None:
    with serve_process(fake_config(tmp_path, drain_s=20), tmp_path) as srv:
        slow = srv.post_later(CHAT, chat_body("@@sleep=3 done"))
        srv.wait_in_flight("gen")
        srv.proc.send_signal(signal.SIGTERM)
        # While draining: the socket accepts, /readyz says 503, new work gets 503 + Retry-After.
        deadline = time.monotonic() + 5
        while True:
            r = httpx.get(f"{srv.url}/readyz", timeout=5)
            if r.status_code == 503 or time.monotonic() > deadline:
                break
        assert r.status_code == 503 and r.json()["status"] == "draining"
        refused = httpx.post(f"{srv.url}{CHAT}", json=chat_body("new"), timeout=5)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "draining"
        url = urlparse(srv.url)
        with socket.create_connection((url.hostname, url.port), timeout=5):
            pass
        # The request in flight finished normally.
        r = slow.result(timeout=30)
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"].endswith("done")
        assert srv.proc.wait(timeout=20) == 0  # within drain_s, not waiting on anything more
        log = srv.log()
        assert "drained in" in log


def test_reload_adds_removes_and_refuses_bad_files(tmp_path: Path) -> None:
    config = fake_config(tmp_path)
    original = config.read_text("utf-8")
    with serve_process(config, tmp_path) as srv, srv.client() as c:
        # An invalid file is refused with its line and reason; the old config keeps serving.
        config.write_text(original.replace('max_concurrency = 8', 'max_concurrency = "lots"'),
                          "utf-8")
        r = c.post("/v1/admin/reload")
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "packserve.toml:" in message and "max_concurrency" in message
        assert c.post("/v1/embeddings", json={"model": "emb", "input": "x"}).status_code == 200
        # A key that needs a restart is named.
        config.write_text(original.replace("drain_s = 10", "drain_s = 11"), "utf-8")
        r = c.post("/v1/admin/reload")
        assert r.status_code == 400 and "server.drain_s" in r.json()["error"]["message"]
        # A valid one: emb removed while a request to it is in flight, gen2 added.
        slow = srv.post_later("/v1/embeddings", {"model": "emb", "input": "@@sleep=2"})
        srv.wait_in_flight("emb")
        emb_block = original[original.index('[[models]]\nname = "emb"'):]
        config.write_text(original.replace(emb_block, "") + """
[[models]]
name = "gen2"
tasks = ["chat"]
backend = "fake"
source = "fake:16MiB"
""", "utf-8")
        r = c.post("/v1/admin/reload")
        assert r.status_code == 200, r.text
        assert r.json()["added"] == ["gen2"] and r.json()["removed"] == ["emb"]
        assert slow.result(timeout=30).status_code == 200  # the removed model drained first
        names = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert "gen2" in names and "emb" not in names
        assert c.post(CHAT, json=chat_body("hi", model="gen2")).status_code == 200
        assert c.post("/v1/embeddings", json={"model": "emb", "input": "x"}).status_code == 404
        # SIGHUP does the same: bring emb back.
        config.write_text(original, "utf-8")
        srv.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            names = [m["id"] for m in c.get("/v1/models").json()["data"]]
            if "emb" in names:
                break
            time.sleep(0.05)
        assert "emb" in names and "gen2" not in names
        assert len(srv.events("reload")) == 2
        # A worker started after a crash starts from the reloaded config.
        config.write_text(original + """
[[models]]
name = "gen3"
tasks = ["chat"]
backend = "fake"
source = "fake:8MiB"
""", "utf-8")
        assert c.post("/v1/admin/reload").status_code == 200
        pid = srv.worker_pid()
        os.kill(pid, signal.SIGKILL)
        srv.wait_ready(other_than_pid=pid)
        assert c.post(CHAT, json=chat_body("hi", model="gen3")).status_code == 200
