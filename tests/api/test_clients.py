"""The official clients against the real default models (CPU): the openai SDK's Responses API
(`responses.create`, its stream and `responses.stream`), `models.retrieve`, the fields it sends
that change nothing here, its `chat.completions.parse` helper; and the cohere SDK's rerank.

Token limits are small: these check the protocol (shapes, events, that constrained output parses
against its schema), not the small models' judgement."""

from __future__ import annotations

import json
from collections.abc import Iterator

import cohere
import jsonschema
import openai
import pydantic
import pytest

from tests.factories import Running

pytestmark = pytest.mark.real

RERANKER, CHAT, EXTRACT = "minilm-rerank", "smollm2-135m-instruct", "smollm2-extract"

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# A schema whose every output is short, so that generation ends (`completed`) within the limit.
VERDICT = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
# What a streamed response sends, in order, around its text deltas.
OPENING = ["response.created", "response.in_progress", "response.output_item.added",
           "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done",
           "response.output_item.done"]


@pytest.fixture(scope="module")
def sdk(default_server: Running) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", timeout=120,
                       max_retries=0) as client:
        yield client


# --------------------------------------------------------------------------------- /v1/responses

def test_a_string_input_is_answered(sdk: openai.OpenAI) -> None:
    out = sdk.responses.create(model=CHAT, input="What is the capital of France?",
                               max_output_tokens=8, temperature=0)
    assert out.object == "response" and out.model == CHAT and out.id.startswith("resp_")
    assert out.status in {"completed", "incomplete"}
    assert out.output_text and out.output[0].type == "message"
    assert out.usage is not None and out.usage.input_tokens > 0
    assert 0 < out.usage.output_tokens <= 8
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens


def test_messages_and_instructions_are_answered(sdk: openai.OpenAI) -> None:
    out = sdk.responses.create(
        model=CHAT, instructions="Answer in one short sentence.", max_output_tokens=8,
        temperature=0, input=[
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Blue."},
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Name another."}]}])
    assert out.output_text
    assert out.instructions == "Answer in one short sentence."
    assert out.usage is not None and out.usage.input_tokens > 15  # every message was read


def test_a_json_schema_format_gives_output_that_validates(sdk: openai.OpenAI) -> None:
    out = sdk.responses.create(
        model=EXTRACT, temperature=0, max_output_tokens=80,
        input="Extract the person as JSON: Alice is 31 years old.",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    assert out.status == "completed"
    value = json.loads(out.output_text)
    jsonschema.validate(value, PERSON)
    assert out.text is not None and out.text.format is not None
    assert out.text.format.type == "json_schema"


def test_max_output_tokens_cuts_the_response_short(sdk: openai.OpenAI) -> None:
    out = sdk.responses.create(model=CHAT, input="Write a long story about the sea.",
                               max_output_tokens=3, temperature=0)
    assert out.status == "incomplete"
    assert out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.usage is not None and out.usage.output_tokens == 3
    assert out.output[0].type == "message" and out.output[0].status == "incomplete"


def test_a_stream_sends_openais_events_in_order(sdk: openai.OpenAI) -> None:
    events = list(sdk.responses.create(model=CHAT, input="Write one sentence about the sea.",
                                       max_output_tokens=12, temperature=0, stream=True))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types[:4] == OPENING and len(deltas) >= 3
    assert types[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert types[4 + len(deltas):-1] == CLOSING
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    assert last.type in {"response.completed", "response.incomplete"}
    final = last.response
    assert last.type == f"response.{final.status}"
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == "".join(deltas) == final.output_text
    assert final.usage is not None and 0 < final.usage.output_tokens <= 12


def test_the_stream_helper_assembles_the_final_response(sdk: openai.OpenAI) -> None:
    with sdk.responses.stream(
            model=EXTRACT, temperature=0, max_output_tokens=40,
            input="Is Paris in France? Answer as JSON.",
            text={"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT}},
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()  # needs `response.completed`
    assert final.status == "completed"
    assert final.output_text == "".join(deltas)
    assert json.loads(final.output_text)["answer"] in {"yes", "no"}


@pytest.mark.parametrize(("param", "value"), [
    ("previous_response_id", "resp_123"),
    ("tools", [{"type": "function", "name": "f", "parameters": {"type": "object"}}]),
])
def test_what_is_not_served_is_refused_by_name(sdk: openai.OpenAI, param: str,
                                               value: object) -> None:
    with pytest.raises(openai.BadRequestError, match=param) as caught:
        sdk.responses.create(model=CHAT, input="hi", **{param: value})  # type: ignore[call-overload]
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param


# ------------------------------------------------------------------------- models, ignored fields

def test_models_retrieve_gives_the_entry_of_the_list(sdk: openai.OpenAI) -> None:
    listed = {m.id: m for m in sdk.models.list()}
    got = sdk.models.retrieve(CHAT)
    assert got.id == CHAT and got.object == "model" and got.owned_by == "packserve"
    assert got.model_dump() == listed[CHAT].model_dump()
    with pytest.raises(openai.NotFoundError, match="does not exist") as caught:
        sdk.models.retrieve("no-such-model")
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "model_not_found"


def test_fields_that_change_nothing_are_accepted(sdk: openai.OpenAI) -> None:
    chat = sdk.chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        store=True, metadata={"team": "search"}, service_tier="auto", parallel_tool_calls=False)
    assert chat.choices[0].message.content is not None
    out = sdk.responses.create(model=CHAT, input="Hi", max_output_tokens=2, store=True,
                               metadata={"team": "search"}, service_tier="auto",
                               parallel_tool_calls=False)
    assert out.metadata == {"team": "search"}
    assert out.model_dump().get("store") is False  # packserve keeps no responses


def test_an_unknown_field_is_still_a_400(sdk: openai.OpenAI) -> None:
    for create in (
            lambda: sdk.chat.completions.create(
                model=CHAT, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                extra_body={"frobnicate": True}),
            lambda: sdk.responses.create(model=CHAT, input="Hi", max_output_tokens=2,
                                         extra_body={"frobnicate": True})):
        with pytest.raises(openai.BadRequestError, match="frobnicate"):
            create()
    with pytest.raises(openai.BadRequestError, match="metadata"):
        sdk.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "Hi"}],
                                    max_tokens=2, metadata={"k": "v" * 513})


# ------------------------------------------------------------------- helpers and the cohere SDK

class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)  # a bound the grammar enforces: no runaway string
    age: int


def test_chat_completions_parse_gives_the_model_instance(sdk: openai.OpenAI) -> None:
    out = sdk.chat.completions.parse(
        model=EXTRACT, temperature=0, max_tokens=80, response_format=Person,
        messages=[{"role": "user", "content":
                   "Extract the person as JSON: Alice is 31 years old."}])
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Person)
    assert parsed.name and parsed.age >= 0


def test_cohere_rerank(default_server: Running) -> None:
    docs = ["Bananas are a good source of potassium.",
            "The Eiffel Tower is in Paris, the capital of France.",
            "Python is a popular programming language."]
    with cohere.ClientV2(base_url=default_server.url, api_key="unused") as client:
        out = client.rerank(model=RERANKER, query="What is the capital of France?",
                            documents=docs, top_n=2)
    assert len(out.results) == 2 and out.results[0].index == 1
    scores = [r.relevance_score for r in out.results]
    assert all(isinstance(s, float) for s in scores) and scores == sorted(scores, reverse=True)
