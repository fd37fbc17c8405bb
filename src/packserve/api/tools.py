"""Function calling for chat: OpenAI's `tools` and `tool_choice`, and tool turns in `messages`.

The model's output is held to an *envelope*, a JSON schema that the engine turns into a grammar
(as `response_format` is): `{"tool_call": {"name": N, "arguments": A}}`, where each allowed
name N comes with its own tool's parameters schema for A; with `tool_choice: "auto"` the
envelope may instead be `{"response": TEXT}`, a plain answer (llama.cpp's server does the same
for its generic tool format). The output is checked against the envelope, then turned into
`message.tool_calls` (finish_reason "tool_calls") or `message.content`.

How tools reach the model: the request (core.request) carries the conversation as the model's
own chat template shows tools and tool turns, and, if the operator enabled it for the model
(`tool_prompt = true`), through packserve's generic tool prompt: a system message listing the
tools, earlier calls as the assistant's JSON, results as user turns. The engine takes the first
where its template shows tools (`Backend.renders_tools`), else the second; else the request is
refused (400; `GenerationRequest.conversation`).

While tools may be called the answer is generated whole, then sent, streamed or not: a stream
carries the call in OpenAI's delta shape once it is complete (api.generation).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import uuid
from collections.abc import Sequence

from packserve.api.schemas import ChatMessage, ChatRequest
from packserve.api.structured import check_json, checked_schema
from packserve.core.backend import Generated, Message, Tool, ToolCall
from packserve.core.request import Choice, Named, ToolUse
from packserve.errors import InvalidRequest

NO_ARGUMENTS: dict[str, object] = {"type": "object", "properties": {},
                                   "additionalProperties": False}


def tool_use(body: ChatRequest) -> ToolUse | None:
    """The request's tool use, or None for a plain chat (no tools that may be called, no tool
    turns in `messages`). Raises InvalidRequest naming the parameter at fault."""
    turns = any(m.role == "tool" or m.calls for m in body.messages)
    if body.tools is None:
        if body.tool_choice is not None:
            raise InvalidRequest("tool_choice is given but tools is not; send the tools the "
                                 "model may call", param="tool_choice")
        return ToolUse((), "none", None) if turns else None
    tools, seen = [], set()
    for i, t in enumerate(body.tools):
        f = t.function
        if f.name in seen:
            raise InvalidRequest(f"two tools are named {f.name!r}; names must be unique",
                                 param="tools")
        seen.add(f.name)
        parameters = NO_ARGUMENTS if f.parameters is None else checked_schema(
            f.parameters, "tools", f"tools[{i}].function.parameters")
        if parameters.get("type", "object") != "object":  # a valid schema, of something else
            raise InvalidRequest(f"tools[{i}].function.parameters must be an object schema "
                                 f"(arguments are a JSON object), got type "
                                 f"{parameters.get('type')!r}", param="tools")
        tools.append(Tool(f.name, f.description or "", parameters))
    choice: Choice = ("auto" if body.tool_choice is None
                      else body.tool_choice if isinstance(body.tool_choice, str)
                      else Named(body.tool_choice.function.name))
    if isinstance(choice, Named) and choice.name not in seen:
        raise InvalidRequest(f"tool_choice names function {choice.name!r}, which is not in tools "
                             f"(they are: {', '.join(sorted(seen))})", param="tool_choice")
    use = ToolUse(tuple(tools), choice, None)
    if not use.callable:
        return use if turns else None
    if body.response_format is not None and body.response_format.type != "text":
        raise InvalidRequest("response_format cannot be combined with tools that may be called "
                             "(the output is then a tool call or a reply); send one or the "
                             "other, or tool_choice \"none\"", param="response_format")
    return dataclasses.replace(use, envelope=envelope(use.callable, choice == "auto"))


def envelope(tools: Sequence[Tool], may_reply: bool) -> dict[str, object]:
    """The JSON schema of an answer that calls one of `tools` (or, with `may_reply`, replies
    in text). Each tool's parameters move under `$defs`, its local references rewritten to
    point there, each target under a name of its own (llama.cpp's converter names a grammar
    rule after the last part of a reference, so two tools' `#/$defs/Item` would clash)."""
    defs: dict[str, object] = {}
    calls = []
    for i, tool in enumerate(tools):
        root = _hoisted(tool.parameters, f"tool{i}", defs)
        calls.append({"type": "object", "properties": {
            "name": {"const": tool.name}, "arguments": {"$ref": f"#/$defs/{root}"}},
            "required": ["name", "arguments"], "additionalProperties": False})
    call: dict[str, object] = {
        "type": "object", "properties": {"tool_call": calls[0] if len(calls) == 1
                                         else {"anyOf": calls}},
        "required": ["tool_call"], "additionalProperties": False}
    if not may_reply:
        return {**call, "$defs": defs}
    reply = {"type": "object", "properties": {"response": {"type": "string"}},
             "required": ["response"], "additionalProperties": False}
    return {"anyOf": [call, reply], "$defs": defs}


def _hoisted(schema: dict[str, object], prefix: str, defs: dict[str, object]) -> str:
    """Put a copy of `schema` (already checked: its references local and resolvable) in
    `defs` with every subschema a reference points to, each `$ref` rewritten to its target's
    key there; returns the key of the schema itself."""
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    doc = {k: v for k, v in copy.deepcopy(schema).items() if k not in ("$id", "$schema")}
    resolver = Registry().with_resource(
        "urn:packserve:tool", Resource.from_contents(doc, DRAFT202012)
    ).resolver("urn:packserve:tool")
    keys = {id(doc): prefix}
    defs[prefix] = doc
    rewrites: list[tuple[dict[str, object], object]] = []
    stack: list[object] = [doc]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        stack.extend(DRAFT202012.subresources_of(node))
        if isinstance(node.get("$ref"), str):
            rewrites.append((node, resolver.lookup(str(node["$ref"])).contents))
    for node, target in rewrites:  # after every lookup: they read the original pointers
        key = keys.setdefault(id(target), f"{prefix}-ref{len(keys)}")
        defs[key] = target
        node["$ref"] = f"#/$defs/{key}"
    return prefix


def resolved(out: Generated, use: ToolUse, model: str) -> Generated:
    """The answer the envelope in `out.text` holds: a call (finish_reason "tool_calls") or
    the reply's text. Raises ModelOutputInvalid for output that does not match the envelope.
    Output cut short (finish_reason "length") is never passed off as a call: it becomes the
    reply's text so far, if it was a reply, else empty content."""
    assert use.envelope is not None
    if out.finish_reason == "length":
        return dataclasses.replace(out, text=_reply_so_far(out.text))
    check_json(out.text, None, model)  # an object
    value = json.loads(out.text)
    call = value.get("tool_call")
    tool = next((t for t in use.callable if isinstance(call, dict) and call.get("name") == t.name),
                None)
    if tool is not None:  # first against its own schema, for an error that says what is wrong
        check_json(json.dumps(call.get("arguments")), tool.parameters, model)
    check_json(out.text, use.envelope, model)
    if "response" in value:
        return dataclasses.replace(out, text=value["response"])
    return dataclasses.replace(out, text="", finish_reason="tool_calls", tool_calls=(ToolCall(
        f"call_{uuid.uuid4().hex[:24]}", call["name"],
        json.dumps(call["arguments"], ensure_ascii=False)),))


def _reply_so_far(text: str) -> str:
    """The text of a `{"response": "...` envelope cut off mid-string; "" for anything else."""
    head, quote, rest = text.partition('"response"')
    if not quote or head.strip() != "{" or not rest.lstrip().startswith(":"):
        return ""
    rest = rest.lstrip()[1:].lstrip()
    if not rest.startswith('"'):
        return ""
    body = rest[1:]
    for cut in range(len(body), max(-1, len(body) - 7), -1):  # an escape is at most 6 chars
        try:
            value = json.loads(f'"{body[:cut]}"')
        except ValueError:
            continue
        return str(value)
    return ""


# ------------------------------------------------------------------------------ prompts

def turns(messages: Sequence[ChatMessage], use: ToolUse | None = None, native: bool = True
          ) -> tuple[Message, ...]:
    """The conversation as the engine gets it. `native`: the model's template shows the tools
    and tool turns itself, and only learns the envelope here; else the generic tool prompt."""
    out: list[Message] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments)
                      for c in m.calls)
        if native:
            out.append(Message(role, m.text, calls, m.answers))
        elif role == "tool":
            result = _result(m, messages)
            if out and out[-1].role == "user" and out[-1].content.startswith(_RESULT):
                out[-1] = Message("user", f"{out[-1].content}\n{result}")  # one turn of results
            else:
                out.append(Message("user", result))
        elif calls:
            shown = [json.dumps({"tool_call": {"name": c.name, "arguments": _object(c.arguments)}},
                                ensure_ascii=False) for c in calls]
            out.append(Message("assistant", "\n".join([m.text, *shown] if m.text else shown)))
        else:
            out.append(Message(role, m.text))
    system = "" if use is None else instructions(use, listed=not native)
    if not system:
        return tuple(out)
    if out and out[0].role == "system":
        return (Message("system", f"{out[0].content}\n\n{system}"), *out[1:])
    return (Message("system", system), *out)


_RESULT = "Result of tool"


def _result(m: ChatMessage, messages: Sequence[ChatMessage]) -> str:
    name = next((c.function.name for earlier in messages for c in earlier.calls
                 if c.id == m.answers), "?")
    return f"{_RESULT} {name} (call {m.answers}): {m.text}"


def _object(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def instructions(use: ToolUse, *, listed: bool) -> str:
    """What a system message tells the model about tools: with `listed`, the tools and their
    parameters; then how to answer (the envelope). "" when no tool may be called."""
    tools = use.callable
    if not tools:
        return ""
    lines = []
    if listed:
        lines.append("You have these tools (the JSON schema of each one's arguments):")
        lines += [json.dumps({"name": t.name, "description": t.description,
                              "parameters": t.parameters}, ensure_ascii=False) for t in tools]
    call = '{"tool_call": {"name": "<tool name>", "arguments": {<its arguments>}}}'
    if use.choice == "auto":
        lines.append(f"To call a tool, answer with only this JSON: {call}. To answer without "
                     f'a tool, answer with only this JSON: {{"response": "<your answer>"}}.')
    elif use.choice == "required":
        lines.append(f"Answer by calling one of the tools, with only this JSON: {call}.")
    else:
        assert isinstance(use.choice, Named)
        lines.append(f'Answer by calling the tool "{use.choice.name}", with only this JSON: '
                     f'{call.replace("<tool name>", use.choice.name)}.')
    return "\n".join(lines)


def tool_texts(body: ChatRequest, use: ToolUse) -> tuple[str, ...]:
    """What a request adds to the model's prompt beyond message contents (tool definitions,
    earlier calls), for the model's max_input_tokens."""
    defs = [json.dumps({"name": t.name, "description": t.description,
                        "parameters": t.parameters}) for t in use.tools]
    calls = [f"{c.function.name} {c.function.arguments}"
             for m in body.messages for c in m.calls]
    return (*defs, *calls)
