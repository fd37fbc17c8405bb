"""core.request: a generation request is plain data (it goes to JSON and back equal), and what
it says of itself (its output, its choices, whether it is plain, its conversation) is a
function of its fields."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from packserve.core.backend import GenerationParams, Message, Tool, ToolCall
from packserve.core.request import GenerationRequest, Inputs, Named, Output, ToolUse
from packserve.errors import InvalidRequest
from packserve.types import Task

SCHEMA: dict[str, object] = {"type": "object", "properties": {"x": {"type": "integer"}},
                             "required": ["x"]}
TOOL = Tool("look", "finds things", SCHEMA)
TURNS = (Message("system", "Be brief."), Message("user", "go"),
         Message("assistant", "", (ToolCall("c1", "look", '{"x": 1}'),)),
         Message("tool", "found", tool_call_id="c1"))
GENERIC = (Message("system", "Be brief.\n\nYou have these tools"), Message("user", "go"))


DEFAULTS = GenerationParams()


def _chat(params: GenerationParams = DEFAULTS, **fields: Any) -> GenerationRequest:
    return dataclasses.replace(GenerationRequest(Task.CHAT, "m", params, messages=TURNS),
                               **fields)


def _completion(*prompts: str | tuple[int, ...],
                logprobs: int | None = None) -> GenerationRequest:
    return GenerationRequest(Task.COMPLETE, "m", GenerationParams(logprobs=logprobs),
                             prompts=prompts)


ROUND_TRIPS = [
    pytest.param(_chat(), id="plain-chat"),
    pytest.param(_chat(GenerationParams(max_tokens=7, temperature=0.0, top_p=1, stop=("\n",),
                                        seed=3, json_schema=SCHEMA, logprobs=2, top_k=0,
                                        min_p=0.1, logit_bias=((5, -100.0), (9, 1)),
                                        min_tokens=2, tools=(TOOL,))),
                 id="every-parameter"),
    pytest.param(_chat(tools=ToolUse((TOOL, Tool("other")), Named("look"), SCHEMA),
                       tool_prompt=GENERIC,
                       inputs=Inputs(("Be brief.", "go"), "messages", also=("look {}",)),
                       stream=True, include_usage=True), id="tools-named"),
    pytest.param(_chat(tools=ToolUse((TOOL,), "auto", None)), id="tool-turns-auto"),
    pytest.param(_completion("Once", "Twice", logprobs=1), id="two-prompts"),
    pytest.param(dataclasses.replace(
        _completion((1, 2, 3)), inputs=Inputs(("",), "prompt", token_counts=(3,)),
        usage_per_chunk=True), id="token-ids"),
]


@pytest.mark.parametrize("request_", ROUND_TRIPS)
def test_a_request_goes_to_json_and_back_equal(request_: GenerationRequest) -> None:
    text = request_.to_json()
    assert GenerationRequest.from_json(text) == request_
    assert json.loads(text)["task"] == request_.task.value  # readable as it is logged


OUTPUTS = [
    pytest.param(_chat(), "text", True, id="plain-chat"),
    pytest.param(_chat(GenerationParams(json_object=True)), "json", False, id="json-object"),
    pytest.param(_chat(GenerationParams(json_schema=SCHEMA)), "json", False, id="json-schema"),
    pytest.param(_chat(GenerationParams(logprobs=0)), "text", False, id="logprobs"),
    pytest.param(_chat(tools=ToolUse((TOOL,), "auto", SCHEMA)), "tool_call", False,
                 id="envelope"),
    pytest.param(_chat(GenerationParams(json_object=True), tools=ToolUse((TOOL,), "none", None)),
                 "json", False, id="tool-turns-with-a-response-format"),
    pytest.param(_completion("a"), "text", True, id="one-prompt"),
    pytest.param(_completion("a", "b"), "text", False, id="two-prompts"),
    pytest.param(_completion("a", logprobs=1), "text", False, id="completion-logprobs"),
]


@pytest.mark.parametrize(("request_", "output", "plain"), OUTPUTS)
def test_what_the_output_is_and_whether_the_engine_may_answer_it_itself(
        request_: GenerationRequest, output: Output, plain: bool) -> None:
    assert request_.output == output
    assert request_.plain is plain


def test_a_completion_has_a_choice_per_prompt_and_a_chat_one() -> None:
    assert _completion("a", "b", "c").choices == 3
    assert _chat().choices == 1


def test_tools_go_through_the_template_that_shows_them_else_the_generic_prompt() -> None:
    use = ToolUse((TOOL, Tool("other")), Named("look"), SCHEMA)
    request = _chat(tools=use, tool_prompt=GENERIC)
    messages, params = request.conversation(renders_tools=True)
    assert messages == TURNS and params.tools == (TOOL,)  # only what may be called
    assert request.conversation(renders_tools=False) == (GENERIC, request.params)
    assert _chat().conversation(renders_tools=True) == (TURNS, DEFAULTS)


@pytest.mark.parametrize(("tools", "param"), [((TOOL,), "tools"), ((), "messages")])
def test_without_a_template_or_the_generic_prompt_tools_are_refused(
        tools: tuple[Tool, ...], param: str) -> None:
    request = _chat(tools=ToolUse(tools, "none", None))
    with pytest.raises(InvalidRequest, match="tool_prompt = true") as caught:
        request.conversation(renders_tools=False)
    assert caught.value.param == param
