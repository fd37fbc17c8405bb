"""Bad input through the real HTTP app: a 4xx in OpenAI's error shape, never a 500, and the
server keeps serving. Also the admin routes, health, and the official `openai` client."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from packserve.backends.fake import FakeBackend, FakeControl
from packserve.core.backend import Backend, LoadSpec
from tests.factories import Running, config_from, serve

EMBED = "fake-embed"  # embed + rerank
CHAT = "fake-chat"  # chat + complete
ADMIN = "fake-admin"  # only the admin tests change its residency

TOML = f"""
[server]
max_request_bytes = "1MiB"

[devices.cpu]
memory_budget = "2GiB"
headroom = "64MiB"

[[models]]
name = "{EMBED}"
tasks = ["embed", "rerank"]
backend = "fake"
source = "fake:64MiB"
device = "cpu"

[[models]]
name = "{CHAT}"
tasks = ["chat", "complete"]
backend = "fake"
source = "fake:48MiB"
device = "cpu"

[[models]]
name = "{ADMIN}"
tasks = ["embed"]
backend = "fake"
source = "fake:32MiB"
device = "cpu"
"""

LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with serve(config_from(tmp_path_factory.mktemp("bad_input"), TOML)) as running:
        yield running


@pytest.fixture
def client(server: Running) -> Iterator[httpx.Client]:
    with server.client(timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    """`r` is a `status` in OpenAI's error shape whose message contains every one of `words`."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str | int), err
    for word in words:
        assert word.lower() in err["message"].lower(), (word, err["message"])
    return err


def assert_serving(c: httpx.Client) -> None:
    """The next request, on every kind of endpoint, is served normally."""
    r = c.post("/v1/embeddings", json={"model": EMBED, "input": ["still here"]})
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 1
    r = c.post("/v1/chat/completions", json={
        "model": CHAT, "messages": [{"role": "user", "content": "echo this"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "echo this"


GOOD: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"model": EMBED, "input": ["hello"]},
    "/v1/rerank": {"model": EMBED, "query": "q", "documents": ["a", "b"]},
    "/v1/chat/completions": {"model": CHAT, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": CHAT, "prompt": "once upon"},
}


def good(path: str, **changes: object) -> dict[str, object]:
    return {**GOOD[path], **changes}


def test_good_requests_are_served(client: httpx.Client) -> None:
    for path, body in GOOD.items():
        r = client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)


# ---------------------------------------------------------------- unknown model, wrong task


@pytest.mark.parametrize("path", list(GOOD))
def test_unknown_model_is_404(client: httpx.Client, path: str) -> None:
    r = client.post(path, json=good(path, model="no-such-model"))
    err = assert_error(r, 404, "no-such-model")
    assert err["code"] == "model_not_found"
    assert err["param"] == "model"
    assert_serving(client)


@pytest.mark.parametrize(("path", "body", "task"), [
    ("/v1/embeddings", good("/v1/embeddings", model=CHAT), "embed"),
    ("/v1/rerank", good("/v1/rerank", model=CHAT), "rerank"),
    ("/v1/chat/completions", good("/v1/chat/completions", model=EMBED), "chat"),
    ("/v1/completions", good("/v1/completions", model=EMBED), "complete"),
])
def test_task_the_model_lacks_is_400(
    client: httpx.Client, path: str, body: dict[str, object], task: str,
) -> None:
    err = assert_error(client.post(path, json=body), 400, task)
    assert err["code"] == "task_not_supported"
    assert_serving(client)


# ---------------------------------------------------------------- malformed bodies


@pytest.mark.parametrize("path", list(GOOD))
def test_malformed_json_is_400(client: httpx.Client, path: str) -> None:
    r = client.post(path, content=b'{"model": "fake-embed", "input": ',
                    headers={"content-type": "application/json"})
    assert_error(r, 400, "not valid JSON")
    assert_serving(client)


@pytest.mark.parametrize("path", list(GOOD))
def test_body_not_an_object_is_400(client: httpx.Client, path: str) -> None:
    r = client.post(path, json=[GOOD[path]])
    assert_error(r, 400)
    assert_serving(client)


@pytest.mark.parametrize("path", list(GOOD))
def test_empty_body_is_400(client: httpx.Client, path: str) -> None:
    r = client.post(path, content=b"", headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert_serving(client)


E, R, C, P = "/v1/embeddings", "/v1/rerank", "/v1/chat/completions", "/v1/completions"

# (path, body, the parameter the message must name)
BAD_VALUES = [
    # wrong types
    pytest.param(E, good(E, input=5), "input", id="input-int"),
    pytest.param(E, good(E, input=[1.5, 2]), "input", id="input-list-of-float"),
    pytest.param(E, good(E, input=[1, 2]), "input", id="input-ids-to-a-text-engine"),
    pytest.param(E, good(E, model=7), "model", id="model-int"),
    pytest.param(C, good(C, messages="hi"), "messages", id="messages-str"),
    pytest.param(C, good(C, messages=[{"role": "wizard", "content": "x"}]), "role",
                 id="messages-bad-role"),
    pytest.param(C, good(C, temperature="hot"), "temperature", id="temperature-str"),
    pytest.param(C, good(C, stream="yes please"), "stream", id="stream-str"),
    pytest.param(R, good(R, documents="a b c"), "documents", id="documents-str"),
    pytest.param(P, good(P, prompt=5), "prompt", id="prompt-int"),
    pytest.param(E, good(E, encoding_format="hex"), "encoding_format", id="encoding-hex"),
    # empty values
    pytest.param(E, good(E, input=""), "input", id="input-empty-str"),
    pytest.param(E, good(E, input=[]), "input", id="input-empty-list"),
    pytest.param(E, good(E, input=["ok", ""]), "input", id="input-empty-item"),
    pytest.param(E, good(E, model=""), "model", id="model-empty"),
    pytest.param(C, good(C, messages=[]), "messages", id="messages-empty"),
    pytest.param(R, good(R, query=""), "query", id="query-empty"),
    pytest.param(R, good(R, documents=[]), "documents", id="documents-empty"),
    pytest.param(P, good(P, prompt=[]), "prompt", id="prompt-empty-list"),
    # missing values
    pytest.param(E, {"model": EMBED}, "input", id="input-missing"),
    pytest.param(C, {"messages": GOOD[C]["messages"]}, "model", id="model-missing"),
    # absurd values
    pytest.param(C, good(C, max_tokens=-1), "max_tokens", id="max-tokens-negative"),
    pytest.param(C, good(C, max_tokens=0), "max_tokens", id="max-tokens-zero"),
    pytest.param(P, good(P, max_tokens=0), "max_tokens", id="completion-max-tokens-zero"),
    pytest.param(C, good(C, max_tokens=10**12), "max_tokens", id="max-tokens-huge"),
    pytest.param(C, good(C, max_completion_tokens=-5), "max_completion_tokens",
                 id="max-completion-tokens-negative"),
    pytest.param(C, good(C, n=5000), "n", id="n-5000"),
    pytest.param(P, good(P, n=2), "n", id="completion-n-2"),
    pytest.param(C, good(C, temperature=50), "temperature", id="temperature-50"),
    pytest.param(C, good(C, temperature=-1), "temperature", id="temperature-negative"),
    pytest.param(C, good(C, top_p=0), "top_p", id="top-p-zero"),
    pytest.param(R, good(R, top_n=0), "top_n", id="top-n-zero"),
    pytest.param(E, good(E, input=["x"] * 5000), "input", id="too-many-inputs"),
    # unknown parameters
    pytest.param(C, good(C, tools=[]), "tools", id="tools"),
    pytest.param(E, good(E, dimensions_please=3), "dimensions_please", id="embed-unknown"),
    pytest.param(R, good(R, rank_fields=["x"]), "rank_fields", id="rerank-unknown"),
    pytest.param(P, good(P, best_of=3), "best_of", id="completion-unknown"),
    # response formats
    pytest.param(C, good(C, response_format={"type": "json_schema"}), "response_format",
                 id="json-schema-missing"),
    pytest.param(C, good(C, response_format={"type": "yaml"}), "response_format",
                 id="response-format-yaml"),
]


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "wizard", "content": "x"}], "messages.0.role"),
    ([{"role": "user", "content": "x", "tool_call_id": "a"}], "messages.0.tool_call_id"),
    ([{"role": "tool", "content": "x"}], "messages.0.tool_call_id"),
    ([{"role": "tool", "content": "tool_call_id"}], "messages.0.tool_call_id"),
    ([{"role": "user", "content": "x"}, {"role": "assistant"}], "messages.1"),
    ([{"role": "assistant", "content": "x", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f"}}]}], "messages.0.tool_calls.0.function.arguments"),
])
def test_a_bad_message_is_named_by_the_path_the_client_wrote(
        client: httpx.Client, messages: list[dict[str, object]], param: str) -> None:
    # Each role is its own model: pydantic's path holds the role ("messages.0.user.content");
    # the error names the client's path.
    err = assert_error(client.post("/v1/chat/completions", json=good(C, messages=messages)),
                       400)
    assert err["param"] == param, err


@pytest.mark.parametrize(("path", "body", "param"), BAD_VALUES)
def test_bad_values_are_400_naming_the_parameter(
    client: httpx.Client, path: str, body: dict[str, object], param: str,
) -> None:
    err = assert_error(client.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"
    assert err["param"] is not None and param.split(".")[0] in err["param"], err
    assert_serving(client)


def test_invalid_json_schema_is_400(client: httpx.Client) -> None:
    body = good(C, response_format={"type": "json_schema", "json_schema": {
        "name": "thing", "schema": {"type": "no-such-type"}}})
    err = assert_error(client.post(C, json=body), 400, "schema", "no-such-type")
    assert err["param"] == "response_format"
    assert_serving(client)


def test_invalid_json_schema_is_400_when_streaming(client: httpx.Client) -> None:
    body = good(C, stream=True, response_format={"type": "json_schema", "json_schema": {
        "name": "thing", "schema": {"type": "no-such-type"}}})
    assert_error(client.post(C, json=body), 400, "schema")
    assert_serving(client)


@pytest.mark.parametrize("schema", [
    pytest.param({"$ref": "#/$defs/nope"}, id="dangling-local-ref"),
    # Port 1 on localhost: refused at once if the server wrongly tries to fetch it.
    pytest.param({"$ref": "http://127.0.0.1:1/schema.json"}, id="remote-ref"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_unresolvable_schema_ref_is_400(
    client: httpx.Client, schema: dict[str, object], stream: bool,
) -> None:
    # The echo model answers with valid JSON, so only the schema can be at fault.
    body = good(C, stream=stream, messages=[{"role": "user", "content": '{"a": 1}'}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "thing", "schema": schema}})
    err = assert_error(client.post(C, json=body), 400, "schema")
    assert err["param"] == "response_format"
    assert_serving(client)


LONE = "LONE-SURROGATE"  # replaced in the raw JSON by the escape \ud800


@pytest.mark.parametrize(("path", "body"), [
    pytest.param(C, good(C, messages=[{"role": "user", "content": f"a {LONE} b"}]),
                 id="chat-content"),
    pytest.param(C, good(C, messages=[{"role": "user", "content": [
        {"type": "text", "text": f"a {LONE} b"}]}]), id="chat-content-part"),
    pytest.param(P, good(P, prompt=f"a {LONE} b"), id="completion-prompt"),
    pytest.param(R, good(R, documents=[f"a {LONE} b"], return_documents=True),
                 id="rerank-document"),
    pytest.param(E, good(E, input=[f"a {LONE} b"]), id="embed-input"),
])
def test_lone_surrogate_is_400(client: httpx.Client, path: str, body: dict[str, object]) -> None:
    # A lone surrogate escape is valid JSON syntax but not a Unicode string: it can be neither
    # tokenized nor written back as UTF-8, so it must be refused as bad input.
    raw = json.dumps(body).replace(LONE, "\\ud800").encode()
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert_serving(client)


def test_streaming_several_prompts_is_400(client: httpx.Client) -> None:
    err = assert_error(client.post(P, json=good(P, prompt=["a", "b"], stream=True)), 400,
                       "one prompt")
    assert err["param"] == "prompt"
    assert_serving(client)


def test_streaming_unknown_model_is_404_before_the_stream(client: httpx.Client) -> None:
    r = client.post(C, json=good(C, model="no-such-model", stream=True))
    assert assert_error(r, 404)["code"] == "model_not_found"
    assert_serving(client)


# ---------------------------------------------------------------- body size


def oversized_body() -> bytes:
    body = json.dumps(good(E, input=["x" * (LIMIT + 1)])).encode()
    assert len(body) > LIMIT
    return body


@pytest.mark.parametrize("path", [E, C])
def test_body_over_limit_with_content_length_is_413(client: httpx.Client, path: str) -> None:
    body = oversized_body()
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.request.headers["content-length"] == str(len(body))
    assert_error(r, 413, "max_request_bytes")
    assert_serving(client)


@pytest.mark.parametrize("path", [E, C])
def test_body_over_limit_streamed_chunked_is_413(client: httpx.Client, path: str) -> None:
    body = oversized_body()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(body), 64 * 1024):
            yield body[i:i + 64 * 1024]

    r = client.post(path, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert r.request.headers["transfer-encoding"] == "chunked"
    assert_error(r, 413, "max_request_bytes")
    assert_serving(client)


def test_body_over_limit_has_one_error_code_either_way(client: httpx.Client) -> None:
    body = oversized_body()
    declared = client.post(E, content=body, headers={"content-type": "application/json"})
    chunked = client.post(E, content=iter([body]), headers={"content-type": "application/json"})
    assert declared.status_code == chunked.status_code == 413
    assert declared.json()["error"]["code"] == "request_too_large"
    assert chunked.json()["error"]["code"] == declared.json()["error"]["code"]
    assert_serving(client)


def test_body_just_under_limit_is_not_refused_for_size(client: httpx.Client) -> None:
    text = "word " * ((LIMIT - 200) // 5)
    r = client.post(E, json=good(E, input=[text]))
    assert r.status_code == 200, r.text[:500]


# ---------------------------------------------------------------- routes and methods


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/nope"), ("POST", "/v1/nope"), ("GET", "/nope"), ("POST", "/v1/embedding"),
])
def test_unknown_route_is_404(client: httpx.Client, method: str, path: str) -> None:
    assert_error(client.request(method, path), 404)
    assert_serving(client)


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/embeddings"), ("GET", "/v1/chat/completions"), ("PUT", "/v1/rerank"),
    ("DELETE", "/v1/completions"), ("POST", "/healthz"), ("GET", f"/v1/residency/{ADMIN}/load"),
])
def test_wrong_method_is_405(client: httpx.Client, method: str, path: str) -> None:
    assert_error(client.request(method, path), 405)
    assert_serving(client)


# ---------------------------------------------------------------- rerank aliases, base64


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank"])
def test_rerank_aliases_answer_like_v1(client: httpx.Client, path: str) -> None:
    body = {"model": EMBED, "query": "red apple", "documents": ["green pear", "red apple pie",
                                                                "a red car"],
            "top_n": 2, "return_documents": True}
    want = client.post("/v1/rerank", json=body)
    got = client.post(path, json=body)
    assert want.status_code == got.status_code == 200, (want.text, got.text)
    assert got.json()["results"] == want.json()["results"]
    assert [r["index"] for r in got.json()["results"]] == [1, 2]
    assert got.json()["results"][0]["document"] == {"text": "red apple pie"}
    # and their errors too
    assert_error(client.post(path, json={**body, "query": ""}), 400, "query")
    assert_error(client.post(path, json={**body, "model": "nope"}), 404)


def test_embeddings_base64_matches_float(client: httpx.Client) -> None:
    texts = ["the cat", "sat on the mat"]
    as_float = client.post(E, json=good(E, input=texts, encoding_format="float"))
    as_b64 = client.post(E, json=good(E, input=texts, encoding_format="base64"))
    assert as_float.status_code == as_b64.status_code == 200
    for f, b in zip(as_float.json()["data"], as_b64.json()["data"], strict=True):
        assert isinstance(b["embedding"], str)
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype=np.float32)
        expected = np.asarray(f["embedding"], dtype=np.float32)
        assert decoded.shape == expected.shape and decoded.size > 0
        np.testing.assert_array_equal(decoded, expected)
    a, b = (np.asarray(d["embedding"]) for d in as_float.json()["data"])
    assert not np.array_equal(a, b)


# ---------------------------------------------------------------- the official client


def test_openai_client_embeddings(server: Running) -> None:
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        out = sdk.embeddings.create(model=EMBED, input=["the cat", "a dog"])
        plain = httpx.post(server.url + E, json=good(E, input=["the cat", "a dog"]))
        assert plain.status_code == 200
        assert len(out.data) == 2
        for got, want in zip(out.data, plain.json()["data"], strict=True):
            np.testing.assert_allclose(got.embedding, want["embedding"], rtol=0, atol=0)
        with pytest.raises(openai.NotFoundError) as info:
            sdk.embeddings.create(model="no-such-model", input=["x"])
        assert info.value.status_code == 404
        assert "no-such-model" in str(info.value)
        with pytest.raises(openai.BadRequestError):
            sdk.embeddings.create(model=CHAT, input=["x"])
        again = sdk.embeddings.create(model=EMBED, input="one more")
        assert len(again.data) == 1
    finally:
        sdk.close()


def test_openai_client_chat(server: Running) -> None:
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        out = sdk.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": "say three words"}])
        assert out.choices[0].message.content == "say three words"
        with pytest.raises(openai.BadRequestError):
            sdk.chat.completions.create(
                model=CHAT, messages=[{"role": "user", "content": "x"}], temperature=50)
    finally:
        sdk.close()


# ---------------------------------------------------------------- admin routes


def model_row(c: httpx.Client, name: str) -> dict[str, Any]:
    r = c.get("/v1/residency")
    assert r.status_code == 200, r.text
    rows: list[dict[str, Any]] = [m for m in r.json()["models"] if m["name"] == name]
    assert len(rows) == 1
    return rows[0]


def test_residency_shape(client: httpx.Client) -> None:
    r = client.get("/v1/residency")
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["name"] for d in body["devices"]] == ["cpu"]
    cpu = body["devices"][0]
    assert cpu["budget_bytes"] == 2 << 30
    assert isinstance(cpu["used_bytes"], int) and cpu["used_bytes"] >= 0
    assert {m["name"] for m in body["models"]} == {EMBED, CHAT, ADMIN}
    fields = {"name", "tasks", "state", "device", "pinned", "bytes_estimated", "bytes_measured",
              "in_flight", "queued", "last_used", "load_seconds", "error"}
    for m in body["models"]:
        assert fields <= set(m), m
        assert m["device"] == "cpu"
        assert m["state"] in {"cold", "admitting", "loading", "hot", "unloading", "warm",
                              "failed"}
        assert isinstance(m["pinned"], bool)
        assert isinstance(m["in_flight"], int) and isinstance(m["queued"], int)
    rows = {m["name"]: m for m in body["models"]}
    assert rows[EMBED]["tasks"] == ["embed", "rerank"]
    assert rows[CHAT]["tasks"] == ["chat", "complete"]
    assert rows[EMBED]["bytes_estimated"] == 64 << 20
    assert rows[CHAT]["bytes_estimated"] == 48 << 20


def test_admin_load_unload_pin_unpin(client: httpx.Client) -> None:
    try:
        r = client.post(f"/v1/residency/{ADMIN}/load")
        assert r.status_code == 200, r.text
        assert r.json() == {"model": ADMIN, "state": "hot", "pinned": False}
        row = model_row(client, ADMIN)
        assert row["state"] == "hot"
        assert row["bytes_measured"] == 32 << 20
        assert row["load_seconds"] is not None and row["error"] is None

        r = client.post(f"/v1/residency/{ADMIN}/unload")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "cold"
        assert model_row(client, ADMIN)["state"] == "cold"

        r = client.post(f"/v1/residency/{ADMIN}/pin")
        assert r.status_code == 200, r.text
        assert r.json() == {"model": ADMIN, "state": "hot", "pinned": True}

        err = assert_error(client.post(f"/v1/residency/{ADMIN}/unload"), 409, "pinned")
        assert err["type"] == "conflict_error"
        assert model_row(client, ADMIN)["state"] == "hot"
        assert client.get("/readyz").status_code == 200  # pinned and hot: ready

        r = client.post(f"/v1/residency/{ADMIN}/unpin")
        assert r.status_code == 200, r.text
        assert r.json()["pinned"] is False

        r = client.post(f"/v1/residency/{ADMIN}/unload")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "cold"
    finally:
        client.post(f"/v1/residency/{ADMIN}/unpin")
    assert_serving(client)


def test_plan(client: httpx.Client) -> None:
    # Cold, with room to spare (2 GiB budget): it fits, evicting nothing.
    assert client.post(f"/v1/residency/{ADMIN}/unload").status_code == 200
    r = client.get("/v1/residency/plan", params={"model": ADMIN})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == ADMIN
    assert body["verdict"] == "fits" and body["victims"] == []
    assert isinstance(body["reason"], str) and body["reason"]
    # Hot: nothing to do.
    assert client.post(f"/v1/residency/{ADMIN}/load").status_code == 200
    again = client.get("/v1/residency/plan", params={"model": ADMIN}).json()
    assert again["verdict"] == "already_loaded" and again["victims"] == []


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/residency/no-such-model/load"),
    ("POST", "/v1/residency/no-such-model/unload"),
    ("POST", "/v1/residency/no-such-model/pin"),
    ("POST", "/v1/residency/no-such-model/unpin"),
    ("GET", "/v1/residency/plan?model=no-such-model"),
])
def test_admin_unknown_model_is_404(client: httpx.Client, method: str, path: str) -> None:
    err = assert_error(client.request(method, path), 404, "no-such-model")
    assert err["code"] == "model_not_found"
    assert_serving(client)


def test_plan_without_model_is_400(client: httpx.Client) -> None:
    assert_error(client.get("/v1/residency/plan"), 400, "model")
    assert_serving(client)


# ---------------------------------------------------------------- health


@pytest.mark.parametrize("path", ["/healthz", "/health"])
def test_healthz(client: httpx.Client, path: str) -> None:
    r = client.get(path)
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


# ---------------------------------------------------------------- fields an engine does not honour


@pytest.mark.parametrize("field,value", [
    ("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2), ("presence_penalty", 0.5),
    ("frequency_penalty", -0.5), ("logit_bias", {"12": 5}), ("ignore_eos", True),
    ("min_tokens", 2)])
def test_an_extension_the_engine_does_not_honour_is_refused_by_name(
        client: httpx.Client, field: str, value: object) -> None:
    """The fake engine declares none: each is a 400 naming it and the engine, before a load."""
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"prompt": "x"})):
        err = assert_error(client.post(path, json={"model": CHAT, field: value, **body}), 400,
                           field, "'fake'")
        assert err["param"] == field
    assert_serving(client)


def test_extensions_at_their_defaults_are_accepted_anywhere(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={
        "model": CHAT, "messages": [{"role": "user", "content": "x"}], "presence_penalty": 0,
        "frequency_penalty": 0.0, "ignore_eos": False, "min_tokens": 0, "stop": None,
        "stream_options": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,param", [
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, None), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stream_options": {"continuous_usage_stats": 1}}, "stream_options")])
def test_extensions_out_of_range_are_400(client: httpx.Client, body: dict[str, Any],
                                         param: str | None) -> None:
    r = client.post("/v1/chat/completions", json={
        "model": CHAT, "messages": [{"role": "user", "content": "x"}], **body})
    err = assert_error(r, 400)
    if param is not None:
        assert param in (err["param"] or "") + err["message"], err


def test_token_ids_are_refused_by_an_engine_that_takes_text(client: httpx.Client) -> None:
    assert_error(client.post("/v1/embeddings", json={"model": EMBED, "input": [1, 2, 3]}),
                 400, "token ids")
    assert_error(client.post("/v1/completions", json={"model": CHAT, "prompt": [[1, 2]]}),
                 400, "token ids")
    assert_error(client.post("/v1/embeddings", json={"model": EMBED, "input": [[]]}), 400)
    assert_error(client.post("/v1/embeddings", json={"model": EMBED, "input": [-1]}), 400)
    assert_serving(client)


def test_readyz_without_pins(client: httpx.Client) -> None:
    r = client.get("/readyz")
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ready"}


PINNED_TOML = """
[server]
failure_cooldown_s = 3600

[devices.cpu]
memory_budget = "1GiB"

[[models]]
name = "doomed"
tasks = ["embed"]
backend = "fake"
source = "fake:64MiB"
device = "cpu"
pin = true

[[models]]
name = "fine"
tasks = ["embed"]
backend = "fake"
source = "fake:32MiB"
device = "cpu"
"""


def test_readyz_503_names_a_pinned_model_that_failed(tmp_path: Path) -> None:
    control = FakeControl()
    doomed = FakeControl(fail_next=1_000_000)  # every load of the pinned model fails, also
    # the scheduler's retries of it in the background

    def factory(spec: LoadSpec) -> Backend:
        backend = FakeBackend(spec)
        backend.control = doomed if spec.path.name == "fake:64MiB" else control
        return backend

    with serve(config_from(tmp_path, PINNED_TOML), factory=factory) as running, \
            running.client(timeout=60) as c:
        r = c.get("/readyz")
        assert r.status_code == 503, r.text
        body = r.json()
        assert (body["status"], body["pinned_not_loaded"]) == ("not_ready", ["doomed"])
        (pin,) = body["pins"]  # why, and when the scheduler tries again
        assert pin["model"] == "doomed" and pin["state"] == "failed"
        assert "fake out of memory" in pin["error"] and pin["next_retry_s"] >= 0
        assert c.get("/healthz").status_code == 200
        row = model_row(c, "doomed")
        assert row["state"] == "failed" and row["pinned"] is True
        assert "fake out of memory" in row["error"]
        err = assert_error(c.post(E, json={"model": "doomed", "input": ["x"]}), 503)
        assert err["code"] == "model_unavailable"
        r = c.post(E, json={"model": "fine", "input": ["x"]})
        assert r.status_code == 200, r.text
