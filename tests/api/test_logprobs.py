"""Logprobs through the real HTTP app, the real llama.cpp models and the openai SDK: chat's
`logprobs`/`top_logprobs` and completions' integer `logprobs`, whole and streamed; `echo`
refused."""

from __future__ import annotations

import math
from collections.abc import Iterator

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionTokenLogprob

from packserve.api.generation import TextCompletion
from packserve.core.backend import Generated, TokenLogprob
from tests.factories import Running

pytestmark = pytest.mark.real

CHAT, COMPLETE = "smollm2-135m-instruct", "gemma-3-270m"
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def sdk(default_server: Running) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused",
                       timeout=120) as client:
        yield client


def test_chat_logprobs_cover_every_token_and_the_greedy_choice_is_the_top_one(
        sdk: openai.OpenAI) -> None:
    out = sdk.chat.completions.create(model=CHAT, messages=ASK,
                                      max_tokens=8, temperature=0, logprobs=True,
                                      top_logprobs=3)
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    tokens = choice.logprobs.content
    assert out.usage is not None and len(tokens) == out.usage.completion_tokens
    assert "".join(t.token for t in tokens) == choice.message.content
    for t in tokens:
        assert t.logprob <= 0 and bytes(t.bytes or []).decode() == t.token
        assert len(t.top_logprobs) == 3
        tops = [a.logprob for a in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert sum(math.exp(lp) for lp in tops) <= 1 + 1e-6
        # temperature 0 takes the most likely token: the one reported first
        assert t.token == t.top_logprobs[0].token
        assert t.logprob == pytest.approx(tops[0])


def test_chat_without_logprobs_carries_none(sdk: openai.OpenAI) -> None:
    out = sdk.chat.completions.create(model=CHAT, messages=ASK,
                                      max_tokens=2)
    assert out.choices[0].logprobs is None


def test_streamed_chat_logprobs_add_up_to_the_text(sdk: openai.OpenAI) -> None:
    text, tokens = "", list[ChatCompletionTokenLogprob]()
    for chunk in sdk.chat.completions.create(
            model=CHAT, messages=ASK, max_tokens=8, temperature=0,
            logprobs=True, top_logprobs=1, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                tokens += choice.logprobs.content
    assert text and "".join(t.token for t in tokens) == text
    assert all(len(t.top_logprobs) == 1 and t.logprob <= 0 for t in tokens)


def test_completion_logprobs_in_the_legacy_shape(sdk: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    out = sdk.completions.create(model=COMPLETE, prompt=prompt, max_tokens=4, temperature=0,
                                 logprobs=2)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert out.usage is not None and len(lp.tokens) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset is not None and lp.text_offset[0] == len(prompt)
    assert lp.top_logprobs is not None
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top, key=top.__getitem__) == token
        assert logprob == pytest.approx(max(top.values()))


@pytest.mark.parametrize("extra", [{"max_tokens": 0, "logprobs": 0}, {"max_tokens": 3},
                                   {"logprobs": 1, "stream": True}])
def test_echo_is_refused_saying_why_and_where_to_score_prompts(
        sdk: openai.OpenAI, extra: dict[str, object]) -> None:
    with pytest.raises(openai.BadRequestError, match="echo") as caught:
        sdk.completions.create(model=COMPLETE, prompt="Hi", echo=True,  # type: ignore[call-overload]
                               **extra)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "echo"
    assert "without scoring the prompt" in body["message"] and "vLLM" in body["message"]
    # echo false is OpenAI's default, and taken
    out = sdk.completions.create(model=COMPLETE, prompt="Hi", echo=False, max_tokens=2)
    assert out.choices[0].text


@pytest.mark.parametrize(("route", "extra", "param"), [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
])
def test_bad_logprobs_requests_are_400s(default_server: Running, route: str,
                                        extra: dict[str, object], param: str | None) -> None:
    body: dict[str, object] = ({"model": CHAT, "messages": ASK} if "chat" in route
                               else {"model": COMPLETE, "prompt": "Hi"})
    with default_server.client() as c:
        r = c.post(route, json={**body, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_text_offsets_count_characters_when_a_token_splits_one() -> None:
    # "é" is two bytes; a byte-level tokenizer may give each its own token.
    tokens = (TokenLogprob("\ufffd", b"\xc3", -1.0), TokenLogprob("\ufffd", b"\xa9", -1.0),
              TokenLogprob(" b", b" b", -1.0))
    reply = TextCompletion("m", ["a"], logprobs=True)
    out = Generated(text="\u00e9 b", finish_reason="length", prompt_tokens=1,
                    completion_tokens=3, logprobs=tokens)
    choice = reply.choice(0, out)
    assert choice["text"] == "\u00e9 b"
    assert choice["logprobs"]["text_offset"] == [1, 1, 2]  # from the prompt's end
    # Streamed, the offsets go on from the prompt's end across chunks.
    stream = TextCompletion("m", ["x"], logprobs=True)
    first = stream.delta("\u00e9", None, tokens[:2])["logprobs"]["text_offset"]
    second = stream.delta(" b", None, tokens[2:])["logprobs"]["text_offset"]
    assert (first, second) == ([1, 1], [2])
