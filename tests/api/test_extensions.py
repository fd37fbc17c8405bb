"""The fields beyond OpenAI's that benchmark tools and frameworks send (vLLM's and llama.cpp's
server's names), honoured by the default catalog's llama-server runners through the HTTP app and
the openai SDK: each is checked against the answer without it, so that a field ignored would
fail. Also token-id inputs and `/health`. (A field an engine does not honour is refused by name:
tests/api/test_bad_input.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from packserve import backends
from packserve.backends.llama_server import LlamaServerBackend
from packserve.config import load_config
from tests.factories import Running, catalog_path

pytestmark = pytest.mark.real

CHAT = "smollm2-135m-instruct"
COMPLETE = "gemma-3-270m"
EMBED = "all-minilm-l6-v2"
# SmolLM2 ends its answer to this well before 64 tokens
SHORT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say OK."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def sdk(default_server: Running) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused",
                       timeout=300) as client:
        yield client


class Tokenizer:
    """A model's own tokenizer: llama.cpp's, in a runner of the same GGUF file (/tokenize)."""

    def __init__(self, name: str, models_dir: Path) -> None:
        engine = backends.get(next(m for m in load_config(None).models if m.name == name).backend)
        runner = engine.build(engine.load_spec(catalog_path(name, models_dir), "cpu", 256, 64,
                                               {}, parallel=1))
        assert isinstance(runner, LlamaServerBackend)
        self.runner = runner

    def __call__(self, text: str, *, bos: bool = False, special: bool = False) -> list[int]:
        ids: list[int] = self.runner._post_json("/tokenize", {
            "content": text, "add_special": bos, "parse_special": special})["tokens"]
        return ids


def _loaded(name: str, models_dir: Path) -> Iterator[Tokenizer]:
    tokenizer = Tokenizer(name, models_dir)
    tokenizer.runner.load()
    yield tokenizer
    tokenizer.runner.unload()


@pytest.fixture(scope="module")
def gemma(models_dir: Path) -> Iterator[Tokenizer]:
    yield from _loaded(COMPLETE, models_dir)


@pytest.fixture(scope="module")
def smollm2(models_dir: Path) -> Iterator[Tokenizer]:
    yield from _loaded(CHAT, models_dir)


def _chat(sdk: openai.OpenAI, **extra: Any) -> Any:
    return sdk.chat.completions.create(model=CHAT, temperature=0, max_tokens=64,
                                       messages=SHORT, extra_body=extra or None)


def _complete(sdk: openai.OpenAI, prompt: Any = PROMPT, **kw: Any) -> str:
    extra = {k: kw.pop(k) for k in list(kw) if k not in ("temperature", "seed", "max_tokens")}
    kw = {"temperature": 0, "max_tokens": 12, **kw}
    out = sdk.completions.create(model=COMPLETE, prompt=prompt, extra_body=extra or None, **kw)
    return str(out.choices[0].text)


def test_ignore_eos_generates_to_max_tokens(sdk: openai.OpenAI, smollm2: Tokenizer) -> None:
    plain = _chat(sdk)
    assert plain.usage.completion_tokens < 64 and plain.choices[0].finish_reason == "stop"
    out = _chat(sdk, ignore_eos=True)
    assert out.usage.completion_tokens == 64 and out.choices[0].finish_reason == "length"
    text = out.choices[0].message.content
    assert text.startswith(plain.choices[0].message.content)
    # The model's own tokenizer on the text returned: the 64 tokens, read back.
    assert len(smollm2(text, special=True)) == 64


def test_min_tokens_holds_the_end_back_until_then(sdk: openai.OpenAI) -> None:
    plain = _chat(sdk)
    assert plain.usage.completion_tokens < 40
    out = _chat(sdk, min_tokens=40)
    assert 40 <= out.usage.completion_tokens <= 64
    assert out.choices[0].message.content.startswith(plain.choices[0].message.content)


def test_a_stop_string_still_ends_an_ignore_eos_answer(sdk: openai.OpenAI) -> None:
    plain = _chat(sdk, ignore_eos=True)
    word = plain.choices[0].message.content.split()[2]
    out = _chat(sdk, ignore_eos=True, stop=[word])
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens < 64
    assert word not in out.choices[0].message.content


def test_guidellms_stream_counts_usage_in_every_chunk(default_server: Running) -> None:
    """guidellm 0.8.1's request, field for field: usage in every chunk, past the model's end."""
    body = {"model": CHAT, "messages": SHORT, "max_tokens": 32, "stop": None, "ignore_eos": True,
            "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{default_server.url}/v1/chat/completions", json=body,
                      timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    content = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert content and all("usage" in e for e in content), events[:3]
    made = [e["usage"]["completion_tokens"] for e in content]
    assert made == sorted(made) and made[-1] <= 32
    prompts = {e["usage"]["prompt_tokens"] for e in content}
    final = events[-1]["usage"]
    assert final["completion_tokens"] == 32 and prompts == {final["prompt_tokens"]}
    assert all("timings" not in e for e in events)


def test_continuous_usage_on_a_completion_stream(sdk: openai.OpenAI) -> None:
    chunks = list(sdk.completions.create(
        model=COMPLETE, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"stream_options": {"include_usage": True,
                                       "continuous_usage_stats": True}}))
    with_text = [c for c in chunks if c.choices and c.choices[0].text]
    assert with_text and all(c.usage is not None for c in with_text)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_continuous_usage_where_packserve_shapes_the_stream_is_refused(
        sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="continuous_usage_stats"):
        sdk.chat.completions.create(
            model=CHAT, messages=SHORT, max_tokens=4, stream=True, logprobs=True,
            stream_options={"include_usage": True},
            extra_body={"stream_options": {"include_usage": True,
                                           "continuous_usage_stats": True}})


def test_ignore_eos_with_a_json_answer_is_refused(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="ignore_eos") as err:
        sdk.chat.completions.create(model=CHAT, messages=SHORT, max_tokens=8,
                                    response_format={"type": "json_object"},
                                    extra_body={"ignore_eos": True})
    assert err.value.body["param"] == "ignore_eos"  # type: ignore[index]


def test_top_k_and_min_p_narrow_sampling_to_the_greedy_token(sdk: openai.OpenAI) -> None:
    greedy = _complete(sdk)
    hot = [_complete(sdk, temperature=1.8, seed=seed) for seed in (1, 2, 3)]
    assert any(text != greedy for text in hot)  # without them, sampling wanders
    assert all(_complete(sdk, temperature=1.8, seed=seed, top_k=1) == greedy
               for seed in (1, 2, 3))
    assert all(_complete(sdk, temperature=1.8, seed=seed, min_p=1.0) == greedy
               for seed in (1, 2, 3))


def test_penalties_change_a_repetitive_answer(sdk: openai.OpenAI) -> None:
    prompt = "apple apple apple apple apple apple apple apple"
    plain = _complete(sdk, prompt, max_tokens=16)
    assert _complete(sdk, prompt, max_tokens=16, repetition_penalty=1.8) != plain
    assert _complete(sdk, prompt, max_tokens=16, presence_penalty=2.0) != plain
    assert _complete(sdk, prompt, max_tokens=16, frequency_penalty=2.0) != plain


def test_logit_bias_bans_and_forces_tokens(sdk: openai.OpenAI, gemma: Tokenizer) -> None:
    greedy = _complete(sdk, max_tokens=4)
    first = gemma(greedy)[0]
    banned = _complete(sdk, max_tokens=4, logit_bias={str(first): -100})
    assert gemma(banned)[0] != first
    (forced,) = gemma(" banana")
    assert _complete(sdk, max_tokens=3, logit_bias={str(forced): 100}) == " banana" * 3


def test_a_token_id_prompt_is_taken_as_it_is(sdk: openai.OpenAI, gemma: Tokenizer) -> None:
    ids = gemma(PROMPT, bos=True)  # as the text is read
    assert _complete(sdk, ids) == _complete(sdk)
    out = sdk.completions.create(model=COMPLETE, prompt=ids, max_tokens=2, temperature=0)
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    batch = sdk.completions.create(model=COMPLETE, prompt=[ids, ids[:3]], max_tokens=2,
                                   temperature=0)
    assert len(batch.choices) == 2


def test_token_ids_outside_the_vocabulary_are_400_naming_the_first(
        sdk: openai.OpenAI, default_server: Running) -> None:
    with pytest.raises(openai.BadRequestError, match="token id 999999") as err:
        sdk.completions.create(model=COMPLETE, prompt=[2, 999999, 1000000], max_tokens=2)
    assert err.value.body["param"] == "prompt"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="token id 30522"):
        sdk.embeddings.create(model=EMBED, input=[[101, 30522, 102]])
    with pytest.raises(openai.BadRequestError, match="token id 49152") as err:
        sdk.chat.completions.create(model=CHAT, messages=SHORT, max_tokens=2,
                                    logit_bias={"49152": 5})
    assert err.value.body["param"] == "logit_bias"  # type: ignore[index]
    assert httpx.get(f"{default_server.url}/health", timeout=10).status_code == 200


def test_token_id_embeddings_are_the_texts_vectors(sdk: openai.OpenAI) -> None:
    """MiniLM's ids for "hello world" ([CLS] hello world [SEP], BERT's uncased vocabulary)."""
    ids = [101, 7592, 2088, 102]
    by_text = sdk.embeddings.create(model=EMBED, input="hello world")
    by_ids = sdk.embeddings.create(model=EMBED, input=[ids, ids[1:3]])
    assert by_ids.usage.prompt_tokens == 6 and by_text.usage.prompt_tokens == 4
    a, b = np.array(by_text.data[0].embedding), np.array(by_ids.data[0].embedding)
    assert float(a @ b) > 0.9999
    bare = np.array(by_ids.data[1].embedding)  # no [CLS]/[SEP] added: another vector
    assert float(a @ bare) < 0.999
    single = sdk.embeddings.create(model=EMBED, input=ids)  # one input as list[int]
    assert len(single.data) == 1 and float(np.array(single.data[0].embedding) @ a) > 0.9999


def test_a_streams_first_token_and_inter_token_latency_are_in_the_summary(
        sdk: openai.OpenAI, default_server: Running) -> None:
    """The server's time to first token is within what the client waited for its first text."""
    def streams() -> int:
        with default_server.client() as c:
            rows = c.get("/v1/metrics/summary").json()["latency"]["by_model"]
        row = next((r for r in rows if r["model"] == CHAT), None)
        return 0 if row is None else row["time_to_first_token"]["count"]

    before = streams()
    chunks = sdk.chat.completions.create(model=CHAT, messages=SHORT, max_tokens=16,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streams() == before + 1
    with default_server.client() as c:
        summary = c.get("/v1/metrics/summary").json()
        metrics = c.get("/metrics").text
    row = next(r for r in summary["latency"]["by_model"] if r["model"] == CHAT)
    first = row["time_to_first_token"]
    # Each stream's first token comes before its end: the streams' median first token is within
    # the slowest answers of the model (not its median: most of its requests here are short
    # answers, and a stream that met a load waits longer for its first token than they take).
    assert 0 < first["p50_seconds"] <= row["p99_seconds"]
    assert set(first["split_p50_seconds"]) == {"queue", "load", "prompt"}
    assert row["inter_token"]["count"] >= 1 and row["inter_token"]["p50_seconds"] > 0
    assert 0 <= row["within_slo"] <= 1 and row["goodput_rps"] >= 0, (row, first)
    assert f'packserve_time_to_first_token_seconds_count{{model="{CHAT}",task="chat"}}' in metrics
