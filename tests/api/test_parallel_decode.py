"""Four chats to one llama.cpp load at once, through the real HTTP app: decoded together in its
runner's parallel slots, each with its own stop strings, grammar and usage; a
client that leaves mid-stream gives its slot back."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.factories import TIMEOUT, Running, default_config, serve

pytestmark = pytest.mark.real

CHAT, EXTRACT = "smollm2-135m-instruct", "smollm2-extract"  # one load, two catalog names


@pytest.fixture(scope="module")
def server(models_dir: Path) -> Iterator[Running]:
    config = default_config(models_dir, only_models=[CHAT, EXTRACT])
    config = config.model_copy(update={"models": [  # four slots, whatever the default
        m.model_copy(update={"parallel": 4}) for m in config.models]})
    with serve(config) as running:
        yield running


def _body(model: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}],
            "temperature": 0, "max_tokens": 40, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


BODIES = [
    _body(CHAT, "List three fruits, one per line.", stop=["\n3"]),
    _body(CHAT, "Count from one to ten.", stop=["\n5"]),
    _body(CHAT, "Write one sentence about the moon.", stop="!"),
    _body(EXTRACT, "Give the name and age of: Bo is 31.",
          response_format={"type": "json_object"}),
]


def _stream(url: str, body: dict[str, Any]) -> tuple[str, str, dict[str, int]]:
    """The streamed text, finish reason and usage of one chat."""
    text, finish, usage = [], "", {}
    with httpx.Client(base_url=url, timeout=120) as c, \
            c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
    return "".join(text), finish, usage


def test_four_concurrent_streams_keep_their_own_stops_grammar_and_usage(
        server: Running) -> None:
    with ThreadPoolExecutor(len(BODIES)) as pool:
        answers = list(pool.map(lambda b: _stream(server.url, b), BODIES))
    with server.client() as c:
        whole = [c.post("/v1/chat/completions", json={**b, "stream": False}).json()
                 for b in BODIES]
    for (text, finish, usage), body, one in zip(answers, BODIES, whole, strict=True):
        stops = body.get("stop") or []
        assert not any(s in text for s in ([stops] if isinstance(stops, str) else stops))
        assert finish in ("stop", "length")
        assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"] > 10
        assert 0 < usage["completion_tokens"] <= 40
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert answers[1][1] == "stop"
    json.loads(answers[3][0])


def test_a_client_that_leaves_mid_stream_gives_its_slot_back(server: Running) -> None:
    got_two = threading.Event()
    with httpx.Client(base_url=server.url, timeout=120) as c, \
            c.stream("POST", "/v1/chat/completions",
                     json=_body(CHAT, "Tell me a very long story.", max_tokens=1000)) as r:
        pieces = 0
        for line in r.iter_lines():
            pieces += line.startswith("data: {")
            if pieces >= 3:
                got_two.set()
                break  # leaving: the connection closes with the stream
    assert got_two.is_set()
    # Four more at once still get four slots, so all of them finish.
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda b: _stream(server.url, b), BODIES))
    assert all(finish in ("stop", "length") for _, finish, _ in answers)
    deadline = time.monotonic() + TIMEOUT  # leases go back as each stream's thread ends
    with server.client() as c:
        while True:
            rows = c.get("/v1/residency").json()["models"]
            busy = [m["in_flight"] for m in rows if m["name"] in (CHAT, EXTRACT)]
            if not any(busy) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert not any(busy), rows
