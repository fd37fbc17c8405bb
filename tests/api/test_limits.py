"""Each model's per-request limits (max_inputs, max_input_tokens, max_output_tokens) through
the real HTTP app: over a limit is a 400 naming it; a request without max_tokens gets the
ceiling. Fake engines first, then the real tokenizers of MiniLM and SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.factories import (
    Running,
    config_from,
    cpu_device,
    default_config,
    fake_model,
    serve,
)


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    text = (cpu_device()
            + fake_model("emb", "max_inputs = 3", "max_input_tokens = 6",
                         tasks='["embed", "rerank"]')
            + fake_model("gen", "max_output_tokens = 4", "max_inputs = 2",
                         tasks='["chat", "complete"]'))
    with serve(config_from(tmp_path_factory.mktemp("limits"), text)) as running:
        yield running


def refused(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    for word in words:
        assert word in err["message"], err["message"]


def test_max_inputs_counts_texts(limited: Running) -> None:
    with limited.client() as c:
        refused(c.post("/v1/embeddings", json={"model": "emb", "input": ["a", "b", "c", "d"]}),
                "input", "max_inputs", "at most 3", "has 4")
        refused(c.post("/v1/rerank", json={"model": "emb", "query": "q",
                                           "documents": ["a", "b", "c", "d"]}),
                "documents", "max_inputs")
        refused(c.post("/v1/completions", json={"model": "gen", "prompt": ["a", "b", "c"]}),
                "prompt", "max_inputs")
        assert c.post("/v1/embeddings", json={"model": "emb", "input": ["a", "b", "c"]}
                      ).status_code == 200


def test_max_input_tokens_counts_every_text_of_the_request(limited: Running) -> None:
    with limited.client() as c:
        refused(c.post("/v1/embeddings", json={"model": "emb", "input": ["one two three",
                                                                         "four five six seven"]}),
                "input", "7 tokens", "max_input_tokens", "at most 6")
        # the rerank query counts too: 3 + 2 + 2 = 7
        refused(c.post("/v1/rerank", json={"model": "emb", "query": "a b c",
                                           "documents": ["d e", "f g"]}),
                "documents", "max_input_tokens")
        assert c.post("/v1/embeddings", json={"model": "emb", "input": ["one two", "three"]}
                      ).status_code == 200


def test_max_output_tokens_is_a_ceiling_and_the_default(limited: Running) -> None:
    with limited.client() as c:
        refused(c.post("/v1/chat/completions", json={
            "model": "gen", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
            "max_tokens", "max_output_tokens", "at most 4")
        refused(c.post("/v1/chat/completions", json={
            "model": "gen", "max_completion_tokens": 9,
            "messages": [{"role": "user", "content": "x"}]}), "max_completion_tokens")
        # without max_tokens, the ceiling applies (the fake engine echoes up to max_tokens words)
        r = c.post("/v1/chat/completions", json={
            "model": "gen", "messages": [{"role": "user", "content": "1 2 3 4 5 6 7"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "1 2 3 4"


@pytest.mark.real
def test_real_tokenizers_count_input_tokens(models_dir: Path) -> None:
    config = default_config(models_dir)
    models = [m.model_copy(update={"max_input_tokens": 8}) if m.name in (
        "all-minilm-l6-v2", "smollm2-135m-instruct") else m for m in config.models]
    long = "the quick brown fox jumps over the lazy dog again"  # 10 words, over 8 tokens
    with serve(config.model_copy(update={"models": models})) as running, \
            running.client() as c:
        refused(c.post("/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": long}),
                "input", "max_input_tokens", "at most 8")
        assert c.post("/v1/embeddings", json={"model": "all-minilm-l6-v2",
                                              "input": "a short one"}).status_code == 200
        refused(c.post("/v1/chat/completions", json={
            "model": "smollm2-135m-instruct", "max_tokens": 2,
            "messages": [{"role": "user", "content": long}]}), "messages", "max_input_tokens")
        r = c.post("/v1/chat/completions", json={
            "model": "smollm2-135m-instruct", "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
