"""Every endpoint through the real HTTP app and the real default models (CPU)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from packserve.core.events import LoadEvent
from tests.factories import Running

pytestmark = pytest.mark.real

EMBEDDER, RERANKER = "all-minilm-l6-v2", "minilm-rerank"
CHAT, EXTRACT, COMPLETE = "smollm2-135m-instruct", "smollm2-extract", "gemma-3-270m"


@pytest.fixture(scope="module")
def sdk(default_server: Running) -> Iterator[openai.OpenAI]:
    """The official openai client, pointed at packserve; closed after the module."""
    with openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused",
                       timeout=120) as client:
        yield client


def test_models_lists_the_default_catalog(default_server: Running) -> None:
    with default_server.client() as c:
        data = c.get("/v1/models").json()
    assert data["object"] == "list"
    rows = {m["id"]: m for m in data["data"]}
    assert set(rows) == {EMBEDDER, RERANKER, CHAT, EXTRACT, COMPLETE}
    assert rows[EMBEDDER]["tasks"] == ["embed"] and rows[COMPLETE]["tasks"] == ["complete"]
    assert all(m["state"] in {"cold", "hot", "loading"} for m in data["data"])


def test_related_sentences_are_closer_than_unrelated(sdk: openai.OpenAI) -> None:
    # The openai SDK asks for base64 by default: this exercises that path.
    out = sdk.embeddings.create(model=EMBEDDER, input=[
        "The cat sits on the mat.", "A kitten is resting on a rug.",
        "Quarterly revenue grew by eight percent."])
    vecs = np.array([d.embedding for d in out.data])
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    assert vecs.shape == (3, 384)
    assert vecs[0] @ vecs[1] > vecs[0] @ vecs[2] + 0.2
    assert out.usage.prompt_tokens > 10


def test_float_and_base64_encodings_agree(default_server: Running) -> None:
    with default_server.client() as c:
        f = c.post("/v1/embeddings", json={"model": EMBEDDER, "input": "hello"}).json()
        b = c.post("/v1/embeddings", json={"model": EMBEDDER, "input": "hello",
                                           "encoding_format": "base64"}).json()
    import base64

    decoded = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, np.array(f["data"][0]["embedding"]), rtol=1e-6)


def test_concurrent_embeddings_share_passes_and_metrics_show_their_sizes(
        default_server: Running) -> None:
    def passes(c: httpx.Client) -> tuple[float, float]:
        text = c.get("/metrics").text
        count = re.search(rf'^packserve_embedding_batch_inputs_count{{model="{EMBEDDER}"}} (\S+)',
                          text, re.M)
        total = re.search(rf'^packserve_embedding_batch_inputs_sum{{model="{EMBEDDER}"}} (\S+)',
                          text, re.M)
        return (float(count[1]), float(total[1])) if count and total else (0.0, 0.0)

    with default_server.client() as c:
        c.post("/v1/embeddings", json={"model": EMBEDDER, "input": "warm"}).raise_for_status()
        n0, inputs0 = passes(c)

        def one(i: int) -> None:
            c.post("/v1/embeddings", json={"model": EMBEDDER, "input": [f"sentence {i}"] * 2}
                   ).raise_for_status()

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(48)))
        n1, inputs1 = passes(c)
    assert inputs1 - inputs0 == 96  # every input counted once
    assert 1 <= n1 - n0 < 48  # some requests shared a pass


def test_rerank_puts_the_relevant_document_first(default_server: Running) -> None:
    docs = [
        "Bananas are a good source of potassium.",
        "The Eiffel Tower is in Paris, the capital of France.",
        "Python is a popular programming language.",
        "Mount Everest is the highest mountain on Earth.",
    ]
    with default_server.client() as c:
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            r = c.post(path, json={"model": RERANKER, "query": "What is the capital of France?",
                                   "documents": docs, "top_n": 2, "return_documents": True})
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert results[0]["index"] == 1
            assert len(results) == 2
            assert results[0]["relevance_score"] >= results[1]["relevance_score"]
            assert results[0]["document"]["text"] == docs[1]


def test_embedder_and_reranker_share_one_load(default_server: Running) -> None:
    with default_server.client() as c:
        c.post("/v1/embeddings", json={"model": EMBEDDER, "input": "x"}).raise_for_status()
        c.post("/v1/rerank", json={"model": RERANKER, "query": "q", "documents": ["d"]}
               ).raise_for_status()
        residency = c.get("/v1/residency").json()
    loads = [e for e in default_server.events
             if isinstance(e, LoadEvent) and EMBEDDER in e.model]
    assert len(loads) == 1 and loads[0].model == f"{EMBEDDER}+{RERANKER}"
    rows = {m["name"]: m for m in residency["models"]}
    assert rows[EMBEDDER]["shares_weights_with"] == [RERANKER]
    hot = {m["bytes_measured"] for m in residency["models"]
           if m["state"] == "hot" and m["name"] in (EMBEDDER, RERANKER)}
    assert len(hot) == 1  # one figure, counted once in used_bytes below
    used = residency["devices"][0]["used_bytes"]
    distinct = {(tuple(sorted([m["name"], *m["shares_weights_with"]])), m["bytes_measured"])
                for m in residency["models"] if m["state"] == "hot"}
    assert used == sum(b for _, b in distinct)


def test_chat_answers(sdk: openai.OpenAI) -> None:
    out = sdk.chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert out.choices[0].message.content
    assert out.choices[0].finish_reason in {"stop", "length"}
    assert out.usage is not None and out.usage.prompt_tokens > 0
    assert 0 < out.usage.completion_tokens <= 24


def test_chat_streams_several_chunks(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "Write one sentence about the sea."}],
        max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert len(pieces) >= 3
    assert finish in {"stop", "length"}
    # The usage chunk counts what was generated: all 24 tokens when cut by max_tokens.
    # (Not compared with a non-streamed run: llama.cpp's greedy output can differ between two
    # calls, as the prompt's cached prefix changes how its logits are computed.)
    assert usage is not None and usage.prompt_tokens > 0
    assert 0 < usage.completion_tokens <= 24
    if finish == "length":
        assert usage.completion_tokens == 24


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_extraction_returns_json_matching_the_schema(default_server: Running,
                                                      stream: bool) -> None:
    body = {
        "model": EXTRACT, "temperature": 0, "max_tokens": 80, "stream": stream,
        "messages": [{"role": "user", "content":
                      "Extract the person as JSON: Alice is 31 years old and lives in Paris."}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "person", "schema": PERSON}},
    }
    with default_server.client() as c:
        if not stream:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text, finish = choice["message"]["content"], choice["finish_reason"]
        else:
            text, finish = "", None
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    delta = event["choices"][0]["delta"] if event["choices"] else {}
                    text += delta.get("content") or ""
                    finish = (event["choices"][0]["finish_reason"]
                              if event["choices"] else finish) or finish
    assert finish == "stop"
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    assert value["name"] == "Alice" and value["age"] == 31


def test_json_object_mode_returns_an_object(default_server: Running) -> None:
    with default_server.client() as c:
        r = c.post("/v1/chat/completions", json={
            "model": EXTRACT, "temperature": 0, "max_tokens": 100,
            "messages": [{"role": "user", "content":
                          'Answer with a JSON object with one key, "color": the color of '
                          'the sky.'}],
            "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_json_object_cut_short_is_length_not_an_answer(default_server: Running) -> None:
    with default_server.client() as c:
        r = c.post("/v1/chat/completions", json={
            "model": EXTRACT, "temperature": 0, "max_tokens": 3,
            "messages": [{"role": "user", "content": "Give the color of the sky as JSON."}],
            "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"  # never passed off as complete JSON


def test_completion_continues_the_prompt(sdk: openai.OpenAI) -> None:
    out = sdk.completions.create(
        model=COMPLETE, prompt="Monday, Tuesday, Wednesday,", max_tokens=6, temperature=0)
    assert "Thursday" in out.choices[0].text
    assert out.usage is not None and out.usage.completion_tokens <= 6


def test_completion_streams(sdk: openai.OpenAI) -> None:
    stream = sdk.completions.create(
        model=COMPLETE, prompt="1, 2, 3, 4, 5,", max_tokens=8, temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text.strip().startswith("6")


def test_context_overflow_is_a_400(default_server: Running) -> None:
    with default_server.client() as c:
        r = c.post("/v1/completions", json={"model": COMPLETE, "prompt": "word " * 3000,
                                             "max_tokens": 4})
        assert r.status_code == 400, r.text
        assert "context" in r.json()["error"]["message"]
        ok = c.post("/v1/completions", json={"model": COMPLETE, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_too_long_embedding_input_is_a_400(default_server: Running) -> None:
    with default_server.client() as c:
        r = c.post("/v1/embeddings", json={"model": EMBEDDER, "input": ["ok", "word " * 600]})
        assert r.status_code == 400
        assert "input[1]" in r.json()["error"]["message"]
        assert c.post("/v1/embeddings", json={"model": EMBEDDER, "input": "ok"}).status_code == 200


def test_concurrent_embeddings_are_batched_and_all_answered(default_server: Running) -> None:
    sentences = [f"sentence number {i}" for i in range(24)]

    def one(text: str) -> list[float]:
        with httpx.Client(base_url=default_server.url, timeout=120) as c:
            r = c.post("/v1/embeddings", json={"model": EMBEDDER, "input": text})
            r.raise_for_status()
            return list(r.json()["data"][0]["embedding"])

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(one, sentences))
    with default_server.client() as c:
        direct = c.post("/v1/embeddings", json={"model": EMBEDDER, "input": sentences}).json()
    for mine, ref in zip(got, direct["data"], strict=True):
        np.testing.assert_allclose(mine, ref["embedding"], atol=1e-4)


def test_residency_reports_measured_bytes_and_plan(default_server: Running) -> None:
    with default_server.client() as c:
        c.post("/v1/completions", json={"model": COMPLETE, "prompt": "Hi", "max_tokens": 1})
        rows = {m["name"]: m for m in c.get("/v1/residency").json()["models"]}
        plan = c.get("/v1/residency/plan", params={"model": COMPLETE}).json()
    gemma = rows[COMPLETE]
    assert gemma["state"] == "hot" and gemma["bytes_measured"] > 200 << 20
    assert gemma["load_seconds"] > 0 and gemma["last_used"] is not None
    # The header-based estimate is within 10% of what loading measured.
    gap = abs(gemma["bytes_estimated"] - gemma["bytes_measured"])
    assert gap <= 0.1 * gemma["bytes_measured"]
    assert plan["verdict"] == "already_loaded"


def test_ps_prints_the_residency_table(default_server: Running,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from packserve.cli import main

    assert main(["ps", "--url", default_server.url]) == 0
    out = capsys.readouterr().out
    for name in (EMBEDDER, CHAT, COMPLETE):
        assert name in out
    assert "budget" in out and "headroom" in out and "P95" in out
    assert " ms " in out  # a p95 figure for the models that served requests
