"""Function calling through the real HTTP app, the real SmolLM2 and the official openai SDK.

SmolLM2-135M may choose badly: these tests check the protocol (shapes, that a call's arguments
parse and match their tool's schema), not the model's judgement."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.factories import Running, default_config, serve

pytestmark = pytest.mark.real

CHAT = "smollm2-135m-instruct"
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME: dict[str, Any] = {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
    "required": ["timezone"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "The current weather in a city."}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                      "description": "The current time in a timezone."}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def sdk(default_server: Running) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused",
                       timeout=120, max_retries=0) as client:
        yield client


def _valid_call(call: Any, names: set[str]) -> dict[str, Any]:
    """The arguments of a call, once its shape and schema are checked."""
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    arguments: dict[str, Any] = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_a_named_tool_choice_forces_a_call_that_matches_its_schema(sdk: openai.OpenAI) -> None:
    out = sdk.chat.completions.create(
        model=CHAT, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    assert len(choice.message.tool_calls) == 1
    _valid_call(choice.message.tool_calls[0], {"get_weather"})
    assert out.usage is not None and out.usage.completion_tokens > 0


def test_required_calls_one_of_the_tools(sdk: openai.OpenAI) -> None:
    out = sdk.chat.completions.create(model=CHAT, messages=ASK, tools=TOOLS,
                                      tool_choice="required", max_tokens=60, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    _valid_call(choice.message.tool_calls[0], set(SCHEMAS))


def test_auto_answers_with_text_or_a_call(sdk: openai.OpenAI) -> None:
    out = sdk.chat.completions.create(model=CHAT, messages=ASK, tools=TOOLS, max_tokens=60,
                                      temperature=0)
    choice = out.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _valid_call(choice.message.tool_calls[0], set(SCHEMAS))
    else:
        assert isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")


def test_none_is_a_plain_chat(sdk: openai.OpenAI) -> None:
    out = sdk.chat.completions.create(model=CHAT, messages=ASK, tools=TOOLS, tool_choice="none",
                                      max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_a_streamed_call_is_reassembled_by_the_sdk(sdk: openai.OpenAI) -> None:
    with sdk.chat.completions.stream(
            model=CHAT, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream_options={"include_usage": True}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds
    assert "tool_calls.function.arguments.done" in kinds
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    _valid_call(choice.message.tool_calls[0], {"get_weather"})
    assert final.usage is not None and final.usage.prompt_tokens > 0


def test_a_tool_result_in_a_later_turn_gets_an_answer(sdk: openai.OpenAI) -> None:
    first = sdk.chat.completions.create(
        model=CHAT, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    asked = first.choices[0].message
    assert asked.tool_calls
    history: list[Any] = [*ASK, asked,  # the SDK's own message object, sent back as clients do
                          {"role": "tool", "tool_call_id": asked.tool_calls[0].id,
                           "content": "18 degrees celsius, light rain"}]
    second = sdk.chat.completions.create(model=CHAT, messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=24, temperature=0)
    assert second.choices[0].message.content
    # The result reached the model: a longer result makes a longer prompt, all else the same.
    # (Against the first turn's prompt it cannot be told: that one lists the tools, and how long
    # the call sent back is depends on the arguments the model chose.)
    longer = [*history[:-1], {**history[-1], "content": history[-1]["content"] + ", wind " * 8}]
    third = sdk.chat.completions.create(model=CHAT, messages=longer, tools=TOOLS,
                                        tool_choice="none", max_tokens=1, temperature=0)
    assert second.usage is not None and third.usage is not None
    assert third.usage.prompt_tokens >= second.usage.prompt_tokens + 8


def test_a_call_cut_short_by_max_tokens_is_not_a_call(sdk: openai.OpenAI) -> None:
    out = sdk.chat.completions.create(
        model=CHAT, messages=ASK, tools=TOOLS, max_tokens=4, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None and not choice.message.content


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "nope"}}}]},
     "tools", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "$ref": "https://example.com/s.json"}}}]}, "tools", "not local"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "auto"}, "tool_choice", "tools is not"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "unique"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "pattern"),
])
def test_bad_tool_requests_are_400s(sdk: openai.OpenAI, extra: dict[str, Any], param: str,
                                    words: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=CHAT, messages=ASK, max_tokens=8,
                                    extra_body=extra)
    error = caught.value.body
    assert isinstance(error, dict)
    assert str(error["param"]).startswith(param) and words in error["message"], error


def test_a_template_without_tools_and_no_tool_prompt_is_a_400(models_dir: Path) -> None:
    config = default_config(models_dir, only_models=[CHAT])
    config = config.model_copy(update={"models": [
        m.model_copy(update={"tool_prompt": False}) for m in config.models]})
    with serve(config) as running, openai.OpenAI(
            base_url=f"{running.url}/v1", api_key="unused", max_retries=0) as client:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model=CHAT, messages=ASK, tools=TOOLS,
                                               max_tokens=8, stream=stream)
            assert "has no tool support" in caught.value.message
            assert "tool_prompt = true" in caught.value.message
        # A plain chat on the same model is untouched.
        out = client.chat.completions.create(model=CHAT, messages=ASK, max_tokens=4)
        assert out.choices[0].message.content is not None
