"""The default chat and completion models through the HTTP app, in llama-server runners: a plain
stream relayed from the runner (the catalog's name in it, its tokens counted, usage only when
asked), a client that leaves stops the runner's generation, and a runner killed mid-stream ends
that stream with `engine_crashed` while the next request is served by a new runner."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from packserve.core.events import RequestEvent
from tests.factories import Running, default_config, serve
from tests.factories.processes import cpu_ticks, runner_of

pytestmark = pytest.mark.real

CHAT = "smollm2-135m-instruct"
LONG = {"model": CHAT, "max_tokens": 1500, "temperature": 0.8, "stream": True, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}]}


@pytest.fixture(scope="module")
def server(models_dir: Path) -> Iterator[Running]:
    with serve(default_config(models_dir, only_models=[CHAT, "gemma-3-270m"])) as running:
        yield running


def _completion_tokens(server: Running) -> int:
    return sum(e.completion_tokens for e in server.events
               if isinstance(e, RequestEvent) and e.model == CHAT)


def test_a_plain_stream_is_the_runners_with_the_catalogs_name(server: Running) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120) as sdk:
        before = _completion_tokens(server)
        chunks = list(sdk.chat.completions.create(
            model=CHAT, max_tokens=6, temperature=0, stream=True,
            messages=[{"role": "user", "content": "Name a colour."}]))
        assert chunks and {c.model for c in chunks} == {CHAT}
        assert all(c.usage is None for c in chunks)  # not asked for
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        with_usage = list(sdk.chat.completions.create(
            model=CHAT, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "Name a colour."}]))
        usage = with_usage[-1].usage
        assert usage is not None and usage.completion_tokens == 6 and usage.prompt_tokens > 0
        assert "".join(c.choices[0].delta.content or "" for c in with_usage
                       if c.choices) == text
        # both counted on the lease, from the runner's usage (the last one's request event
        # comes when its stream has closed, a moment after the client read its end)
        deadline = time.monotonic() + 30
        while _completion_tokens(server) - before < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _completion_tokens(server) - before == 12
        whole = sdk.completions.create(model="gemma-3-270m", prompt="Once upon a time",
                                       max_tokens=4, temperature=0)
        assert whole.model == "gemma-3-270m" and whole.usage is not None
        assert whole.usage.completion_tokens == 4 and whole.id.startswith("cmpl-")
        streamed = list(sdk.completions.create(model="gemma-3-270m", prompt="Once upon a time",
                                               max_tokens=4, temperature=0, stream=True))
        assert {c.id for c in streamed} == {streamed[0].id} and streamed[0].id.startswith("cmpl-")
        assert "".join(c.choices[0].text for c in streamed if c.choices) == \
            whole.choices[0].text


def test_a_client_that_leaves_stops_the_runners_generation(server: Running) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as c, \
            c.stream("POST", "/v1/chat/completions", json=LONG) as r:
        assert r.status_code == 200
        events: list[str] = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) >= 5:
                break
    runner = runner_of("SmolLM2")
    time.sleep(0.5)  # the runner sees the closed connection at its next token
    start = cpu_ticks(runner)
    time.sleep(1.0)
    # Generating, its threads take most of both cores (~100+ ticks/s); stopped, next to none.
    assert cpu_ticks(runner) - start < 15


def test_a_runner_killed_mid_stream_ends_that_stream_and_the_next_is_served(
        server: Running) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        with c.stream("POST", "/v1/chat/completions", json=LONG) as r:
            assert r.status_code == 200
            events: list[str] = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if len(events) == 3:
                    os.kill(runner_of("SmolLM2"), signal.SIGKILL)
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "engine_crashed" and CHAT in error["message"]
        again = c.post("/v1/chat/completions", json={**LONG, "stream": False,
                                                     "max_tokens": 4})
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["completion_tokens"] == 4
