"""api.tools without a model: request checks, the envelope and its grammar, reading the output,
the generic tool prompt, and the chat-template probe."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from packserve.api.schemas import ChatRequest
from packserve.api.tools import envelope, resolved, tool_use, turns
from packserve.core.backend import Generated, Tool
from packserve.core.request import Choice, Named, ToolUse
from packserve.errors import InvalidRequest, ModelOutputInvalid

ITEM: dict[str, object] = {
    "type": "object", "properties": {"x": {"$ref": "#/$defs/Item"},
                                     "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["x"], "$defs": {"Item": {"type": "integer"}}}
NAMED: dict[str, object] = {"type": "object", "properties": {"y": {"$ref": "#/$defs/Item"}},
                            "required": ["y"], "$defs": {"Item": {"type": "string"}}}


def _body(**extra: Any) -> ChatRequest:
    return ChatRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})


def _tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _use(choice: Choice = "auto") -> ToolUse:
    tools = (Tool("a", "", ITEM), Tool("b", "", NAMED))
    use = ToolUse(tools, choice, None)
    return ToolUse(tools, choice, envelope(use.callable, choice == "auto"))


def _out(text: str, finish: Any = "stop") -> Generated:
    return Generated(text=text, finish_reason=finish, prompt_tokens=3, completion_tokens=5)


def test_two_tools_with_the_same_def_names_keep_their_own_schemas() -> None:
    schema = _use().envelope
    assert schema is not None
    ok = {"tool_call": {"name": "b", "arguments": {"y": "text"}}}
    jsonschema.validate(ok, schema)
    jsonschema.validate({"tool_call": {"name": "a", "arguments": {"x": 1, "next": {"x": 2}}}},
                        schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_call": {"name": "b", "arguments": {"y": 3}}}, schema)


def test_a_call_becomes_tool_calls_and_its_arguments_are_checked() -> None:
    out = resolved(_out('{"tool_call": {"name": "b", "arguments": {"y": "hi"}}}'), _use(), "m")
    assert out.finish_reason == "tool_calls" and out.text == ""
    (call,) = out.tool_calls
    assert call.name == "b" and json.loads(call.arguments) == {"y": "hi"}
    assert call.id.startswith("call_")
    with pytest.raises(ModelOutputInvalid, match="not of type 'string'"):
        resolved(_out('{"tool_call": {"name": "b", "arguments": {"y": 3}}}'), _use(), "m")


def test_a_reply_is_content_and_a_cut_reply_keeps_its_text() -> None:
    assert resolved(_out('{"response": "hello\\nthere"}'), _use(), "m").text == "hello\nthere"
    cut = resolved(_out('{ "response" : "caf\\u00', "length"), _use(), "m")
    assert cut.text == "caf" and cut.finish_reason == "length" and not cut.tool_calls
    call = resolved(_out('{"tool_call": {"name": "b", "argu', "length"), _use(), "m")
    assert call.text == "" and not call.tool_calls


def test_a_forced_call_cannot_be_a_reply() -> None:
    with pytest.raises(ModelOutputInvalid):
        resolved(_out('{"response": "no"}'), _use(Named("b")), "m")


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [_tool("f"), _tool("f")]}, "tools"),
    ({"tools": [_tool("f", {"type": 3})]}, "tools"),
    ({"tools": [_tool("f", {"$ref": "#/nowhere"})]}, "tools"),
    ({"tools": [_tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": [_tool("f")], "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_name_their_parameter(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        tool_use(_body(**extra))
    assert caught.value.param == param


def test_plain_chats_and_none_without_tool_turns_are_not_tool_chats() -> None:
    assert tool_use(_body()) is None


@pytest.mark.parametrize("name", ["none", "auto", "required"])
def test_a_tool_may_be_named_like_a_mode_and_forcing_it_forces_it(name: str) -> None:
    use = tool_use(_body(tools=[_tool(name), _tool("other")],
                         tool_choice={"type": "function", "function": {"name": name}}))
    assert use is not None and use.choice == Named(name)
    assert [t.name for t in use.callable] == [name]
    assert tool_use(_body(tools=[_tool("f")], tool_choice="none")) is None
    # response_format is fine when no tool may be called
    assert tool_use(_body(tools=[_tool("f")], tool_choice="none",
                          response_format={"type": "json_object"})) is None
    use = tool_use(_body(tools=[_tool("f")]))
    assert use is not None and use.choice == "auto" and use.envelope is not None


def test_the_generic_prompt_lists_tools_and_renders_tool_turns() -> None:
    body = ChatRequest.model_validate({"model": "m", "tools": [_tool("f", NAMED)], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"y":"a"}'}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"y":"b"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]})
    use = tool_use(body)
    assert use is not None
    out = turns(body.messages, use, native=False)
    assert [m.role for m in out] == ["system", "user", "assistant", "user"]
    assert out[0].content.startswith("Be brief.") and '"name": "f"' in out[0].content
    assert '{"tool_call": {"name": "f", "arguments": {"y": "a"}}}' in out[2].content
    assert "f (call c1): one" in out[3].content and "f (call c2): two" in out[3].content
    native = turns(body.messages, use, native=True)
    assert [m.role for m in native] == ["system", "user", "assistant", "tool", "tool"]
    assert native[2].tool_calls[1].id == "c2" and native[4].tool_call_id == "c2"
    assert '"name": "f"' not in native[0].content  # the template lists the tools itself


def test_tool_messages_are_checked() -> None:
    for bad in ({"role": "tool", "content": "x"},
                {"role": "user", "content": "x", "tool_call_id": "c"},
                {"role": "assistant"},
                {"role": "user", "content": "x", "tool_calls": [{
                    "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}):
        with pytest.raises(ValueError):
            ChatRequest.model_validate({"model": "m", "messages": [bad]})


def test_an_answer_sent_back_whole_is_accepted() -> None:
    # What the openai SDK's `message.model_dump()` holds for packserve's own answers.
    sent_back = {"role": "assistant", "content": None, "refusal": None, "annotations": [],
                 "audio": None, "function_call": None, "tool_calls": [
                     {"id": "call_1", "type": "function",
                      "function": {"name": "a", "arguments": "{}"}}]}
    body = _body(messages=[{"role": "user", "content": "hi"}, sent_back,
                           {"role": "tool", "tool_call_id": "call_1", "content": "done"}])
    assert [m.role for m in body.messages] == ["user", "assistant", "tool"]


def test_parameters_that_are_not_an_object_schema_are_refused() -> None:
    with pytest.raises(InvalidRequest) as caught:
        tool_use(_body(tools=[_tool("a", {"type": "string"})]))
    assert caught.value.param == "tools" and "object schema" in caught.value.message
