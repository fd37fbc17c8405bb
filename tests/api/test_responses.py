"""/v1/responses through the real HTTP app and a fake engine (it echoes the last message): the
envelope, the input forms, refusals by name, and a stream that fails after it started.
The openai SDK against the real models: tests/api/test_clients.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.factories import Running, config_from, cpu_device, fake_model, serve

MODEL = "gen"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    toml = cpu_device("1GiB") + fake_model(MODEL, tasks='["chat"]', source="fake:16MiB")
    with serve(config_from(tmp_path_factory.mktemp("responses"), toml)) as running:
        yield running


def create(server: Running, **body: object) -> httpx.Response:
    with server.client() as c:
        return c.post("/v1/responses", json={"model": MODEL, **body})


def events(server: Running, **body: object) -> list[dict[str, Any]]:
    """The data of every event of a streamed response, checked against its `event:` name."""
    out = []
    with server.client() as c, c.stream("POST", "/v1/responses",
                                         json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                out.append(data)
    return out


def test_the_response_object_echoes_the_request(server: Running) -> None:
    r = create(server, input="one two three", instructions="be brief", temperature=0.5,
               max_output_tokens=2, metadata={"team": "search"}, store=True, user="u1")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "response" and out["status"] == "completed"
    assert out["id"].startswith("resp_") and isinstance(out["created_at"], int)
    [message] = out["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["id"].startswith("msg_") and message["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": "one two",
                                   "annotations": [], "logprobs": []}]
    assert out["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0},
                            "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": 5}
    assert (out["instructions"], out["temperature"], out["max_output_tokens"]) == (
        "be brief", 0.5, 2)
    assert out["metadata"] == {"team": "search"} and out["user"] == "u1"
    assert out["store"] is False and out["error"] is None and out["incomplete_details"] is None
    assert out["text"] == {"format": {"type": "text"}} and out["tools"] == []


def test_every_input_form_is_read(server: Running) -> None:
    """A response's own output, sent back as input (how a client keeps the conversation)."""
    first = create(server, input="hello").json()
    r = create(server, input=[
        {"role": "system", "content": "s"},
        *first["output"],
        {"type": "message", "role": "developer", "content": [{"type": "input_text",
                                                              "text": "d"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "last "},
                                     {"type": "input_text", "text": "words"}]}])
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == "last words"


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"input": []}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"$ref": "#"}}}},
     "text.format"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"service_tier": "gold"}, "service_tier"),
])
def test_what_is_not_served_is_refused_by_name(server: Running, body: dict[str, object],
                                               param: str) -> None:
    r = create(server, **{"input": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_stream_is_numbered_and_closes_its_message(server: Running) -> None:
    got = events(server, input="a b c")
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []
    final = got[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["id"] == got[2]["item"]["id"]
    assert final["output"][0]["content"][0]["text"] == got[7]["text"] == "a b c"


def test_a_stream_that_fails_after_it_started_says_so_in_band(server: Running) -> None:
    """The fake engine echoes, so JSON output is never met: the error comes as events."""
    got = events(server, input="not json", text={"format": {"type": "json_object"}})
    assert [e["type"] for e in got[-2:]] == ["error", "response.failed"]
    error, failed = got[-2], got[-1]["response"]
    assert error["code"] == "invalid_model_output" and "not JSON" in error["message"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "invalid_model_output", "message": error["message"]}
    assert [e["sequence_number"] for e in got] == list(range(len(got)))


def test_a_stream_refused_before_it_starts_keeps_its_status(server: Running) -> None:
    with server.client() as c:
        r = c.post("/v1/responses", json={"model": "nope", "input": "x", "stream": True})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
