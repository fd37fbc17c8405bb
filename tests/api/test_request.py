"""api.request without a model: the generation request each body builds (a table of body ->
request fields), the refusals that building it makes, and what `finished` makes of an output."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from packserve.api.request import (
    chat_request,
    completion_request,
    finished,
    responses_request,
)
from packserve.api.schemas import ChatRequest, CompletionRequest, ResponsesRequest
from packserve.config import ModelSpec
from packserve.core.backend import Generated, Message
from packserve.core.request import GenerationRequest, Inputs, Named
from packserve.errors import InvalidRequest, ModelNotFound, ModelOutputInvalid
from packserve.types import Task

SCHEMA: dict[str, object] = {"type": "object", "properties": {"x": {"type": "integer"}},
                             "required": ["x"]}
TOOL = {"type": "function", "function": {"name": "look", "parameters": SCHEMA}}
HI = [{"role": "user", "content": "hi"}]


@dataclass
class Catalog:
    """The catalog as building a request asks it (`api.request.Models`): one model, "m"."""

    entry: dict[str, Any] = field(default_factory=dict)

    def spec_of(self, model: str) -> ModelSpec:
        if model != "m":
            raise ModelNotFound(f"model {model!r} does not exist", param="model")
        return ModelSpec.model_validate({"name": "m", "tasks": ["chat", "complete"],
                                         "backend": "llama-server", "source": "x",
                                         **self.entry})


def chat(body: dict[str, Any], entry: dict[str, Any]) -> GenerationRequest:
    return chat_request(ChatRequest.model_validate({"model": "m", "messages": HI, **body}),
                        Catalog(entry))


def completion(body: dict[str, Any], entry: dict[str, Any]) -> GenerationRequest:
    return completion_request(CompletionRequest.model_validate({"model": "m", **body}),
                              Catalog(entry))


def responses(body: dict[str, Any], entry: dict[str, Any]) -> GenerationRequest:
    return responses_request(ResponsesRequest.model_validate({"model": "m", **body}),
                             Catalog(entry))


Build = Callable[[dict[str, Any], dict[str, Any]], GenerationRequest]


def _field(request: GenerationRequest, path: str) -> object:
    """The value at `path`: attribute names and tuple indices, dotted."""
    value: Any = request
    for name in path.split("."):
        value = value[int(name)] if name.isdigit() else getattr(value, name)
    return value


BUILT = [
    pytest.param(chat, {"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 5, "max_tokens": 9, "stop": "\n", "seed": 4}, {},
        {"task": Task.CHAT, "messages": (Message("system", "Be brief."), Message("user", "ab")),
         "params.max_tokens": 5, "params.stop": ("\n",), "params.seed": 4, "output": "text",
         "plain": True, "tools": None, "inputs": Inputs(("Be brief.", "ab"), "messages")},
        id="chat-plain"),
    pytest.param(chat, {}, {"max_output_tokens": 10}, {"params.max_tokens": 10},
                 id="chat-max-tokens-is-the-ceiling-when-unasked"),
    pytest.param(chat, {"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": SCHEMA}}},
                 {}, {"params.json_schema": SCHEMA, "output": "json", "plain": False},
                 id="chat-json-schema"),
    pytest.param(chat, {"response_format": {"type": "json_object"}}, {},
                 {"params.json_object": True, "params.json_schema": None, "output": "json"},
                 id="chat-json-object"),
    pytest.param(chat, {"logprobs": True}, {}, {"params.logprobs": 0, "plain": False},
                 id="chat-logprobs"),
    pytest.param(chat, {"logprobs": True, "top_logprobs": 3}, {}, {"params.logprobs": 3},
                 id="chat-top-logprobs"),
    pytest.param(chat, {"top_k": -1, "logit_bias": {"5": -100, "7": 2.5}, "min_p": 0.1}, {},
                 {"params.top_k": 0, "params.logit_bias": ((5, -100), (7, 2.5)),
                  "params.min_p": 0.1}, id="chat-extensions"),
    pytest.param(chat, {"top_k": 3}, {}, {"params.top_k": 3},
                 id="chat-an-extension-the-engine-honours"),
    pytest.param(chat, {"stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}, {},
                 {"stream": True, "include_usage": True, "usage_per_chunk": True},
                 id="chat-stream-usage"),
    pytest.param(chat, {"stream_options": {"continuous_usage_stats": True}}, {},
                 {"stream": False, "usage_per_chunk": False}, id="chat-usage-only-streams"),
    pytest.param(chat, {"tools": [TOOL], "stop": "x", "logprobs": True}, {},
                 {"output": "tool_call", "tools.choice": "auto", "params.stop": (),
                  "params.logprobs": None, "params.json_object": False, "tool_prompt": None,
                  "plain": False, "inputs.also": (json.dumps({
                      "name": "look", "description": "", "parameters": SCHEMA}),)},
                 id="chat-tools-auto"),
    pytest.param(chat, {"tools": [TOOL], "tool_choice": {"type": "function",
                                                         "function": {"name": "look"}}},
                 {"tool_prompt": True},
                 {"tools.choice": Named("look"), "messages.0.role": "system",
                  "messages.1": Message("user", "hi"), "tool_prompt.0.role": "system",
                  "tool_prompt.1": Message("user", "hi")},
                 id="chat-tools-named-with-the-generic-prompt"),
    pytest.param(chat, {"tools": [TOOL], "tool_choice": "none",
                        "response_format": {"type": "json_object"}, "messages": [
                            *HI, {"role": "assistant", "tool_calls": [{
                                "id": "c1", "type": "function",
                                "function": {"name": "look", "arguments": "{}"}}]},
                            {"role": "tool", "tool_call_id": "c1", "content": "found"}]}, {},
                 {"output": "json", "tools.envelope": None, "params.json_object": True,
                  "messages.2.tool_call_id": "c1", "inputs.also.1": "look {}"},
                 id="chat-tool-turns-with-no-tool-to-call"),
    pytest.param(completion, {"prompt": "Once"}, {},
                 {"task": Task.COMPLETE, "prompts": ("Once",), "params.max_tokens": 16,
                  "choices": 1, "plain": True, "inputs": Inputs(("Once",), "prompt")},
                 id="completion-default-max-tokens"),
    pytest.param(completion, {"prompt": "Once"}, {"max_output_tokens": 8},
                 {"params.max_tokens": 8}, id="completion-default-within-the-ceiling"),
    pytest.param(completion, {"prompt": ["a", "b"], "logprobs": 2}, {},
                 {"choices": 2, "params.logprobs": 2, "plain": False},
                 id="completion-logprobs-two-prompts"),
    pytest.param(completion, {"prompt": [[1, 2], [3]]}, {},
                 {"prompts": ((1, 2), (3,)),
                  "inputs": Inputs(("", ""), "prompt", token_counts=(2, 1))},
                 id="completion-token-ids"),
    pytest.param(responses, {"input": "hi", "instructions": "Be brief.",
                             "max_output_tokens": 6, "text": {"format": {
                                 "type": "json_schema", "name": "x", "schema": SCHEMA}}}, {},
                 {"task": Task.CHAT,
                  "messages": (Message("system", "Be brief."), Message("user", "hi")),
                  "params.max_tokens": 6, "params.json_schema": SCHEMA, "output": "json",
                  "inputs": Inputs(("Be brief.", "hi"), "input")}, id="responses-json"),
    pytest.param(responses, {"input": [{"role": "developer", "content": "x"}],
                             "stream": True}, {},
                 {"messages": (Message("system", "x"),), "stream": True,
                  "include_usage": False}, id="responses-stream"),
]


@pytest.mark.parametrize(("build", "body", "entry", "fields"), BUILT)
def test_a_body_builds_its_request(build: Build, body: dict[str, Any], entry: dict[str, Any],
                                   fields: dict[str, object]) -> None:
    request = build(body, entry)
    for path, value in fields.items():
        assert _field(request, path) == value, path
    assert GenerationRequest.from_json(request.to_json()) == request


REFUSED = [
    pytest.param(chat, {"max_tokens": 11}, {"max_output_tokens": 10}, "max_tokens",
                 id="chat-over-the-ceiling"),
    pytest.param(chat, {"max_completion_tokens": 11}, {"max_output_tokens": 10},
                 "max_completion_tokens", id="chat-over-the-ceiling-by-its-other-name"),
    pytest.param(chat, {"min_tokens": 2, "response_format": {"type": "json_object"}}, {},
                 "min_tokens", id="chat-min-tokens-with-json"),
    pytest.param(chat, {"ignore_eos": True, "tools": [TOOL]}, {}, "ignore_eos",
                 id="chat-ignore-eos-with-tools"),
    pytest.param(chat, {"stream": True, "logprobs": True,
                        "stream_options": {"continuous_usage_stats": True}}, {},
                 "stream_options", id="chat-continuous-usage-on-a-shaped-stream"),
    pytest.param(chat, {"ignore_eos": True}, {"backend": "fake"}, "ignore_eos",
                 id="chat-an-extension-the-engine-does-not-honour"),
    pytest.param(completion, {"prompt": ["a", "b"], "stream": True}, {}, "prompt",
                 id="completion-stream-of-two-prompts"),
    pytest.param(completion, {"prompt": "a", "max_tokens": 0}, {}, "max_tokens",
                 id="completion-nothing-to-generate"),
    pytest.param(completion, {"prompt": "a", "stream": True, "echo": True}, {}, "echo",
                 id="completion-stream-echo"),
    pytest.param(completion, {"prompt": [1, 2], "echo": True}, {}, "echo",
                 id="completion-echo-of-token-ids"),
    pytest.param(completion, {"prompt": "a", "echo": True, "max_tokens": 0, "logprobs": 0}, {},
                 "echo", id="completion-echo-to-score-a-prompt"),
    pytest.param(completion, {"prompt": [1, 2]}, {"backend": "fake"}, "prompt",
                 id="completion-token-ids-the-engine-does-not-take"),
    pytest.param(responses, {"input": "hi", "previous_response_id": "r"}, {},
                 "previous_response_id", id="responses-previous-response"),
    pytest.param(responses, {"input": "hi", "tools": [{}]}, {}, "tools", id="responses-tools"),
    pytest.param(responses, {"input": "hi", "max_output_tokens": 9}, {"max_output_tokens": 8},
                 "max_output_tokens", id="responses-over-the-ceiling"),
    pytest.param(responses, {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": 3}}}}, {}, "text.format",
                 id="responses-bad-schema"),
]


@pytest.mark.parametrize(("build", "body", "entry", "param"), REFUSED)
def test_building_refuses_naming_the_field(build: Build, body: dict[str, Any],
                                           entry: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        build(body, entry)
    assert caught.value.param == param


def test_the_body_is_checked_before_the_model_is_looked_up() -> None:
    bad = {"response_format": {"type": "json_schema",
                               "json_schema": {"name": "x", "schema": {"type": 3}}}}
    with pytest.raises(InvalidRequest):
        chat_request(ChatRequest.model_validate({"model": "gone", "messages": HI, **bad}),
                     Catalog())
    with pytest.raises(ModelNotFound):
        chat_request(ChatRequest.model_validate({"model": "gone", "messages": HI}), Catalog())


def _out(text: str, finish: Any = "stop") -> Generated:
    return Generated(text=text, finish_reason=finish, prompt_tokens=1, completion_tokens=2)


def test_finished_reads_a_tool_call_checks_json_and_passes_text() -> None:
    tools = chat({"tools": [TOOL], "tool_choice": "required"}, {})
    (call,) = finished(tools, _out('{"tool_call": {"name": "look", "arguments": {"x": 1}}}')
                       ).tool_calls
    assert call.name == "look" and json.loads(call.arguments) == {"x": 1}
    structured = chat({"response_format": {"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": SCHEMA}}}, {})
    with pytest.raises(ModelOutputInvalid):
        finished(structured, _out('{"x": "one"}'))
    cut = _out('{"x": ', "length")
    assert finished(structured, cut) is cut  # cut short: passed on as it is, never checked
    plain = chat({}, {})
    assert finished(plain, _out("not json")) == _out("not json")
