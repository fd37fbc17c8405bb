"""A generation request as data: what a chat or a completion asks, built once by its route from
the validated body (api.request) and read by everything after it: the lease (`inputs`, held to
the model's limits), the engine (`Runner.generate`, `Runner.wire`) and the check of the output
(api.request.finished, chosen by `output`).

It is plain data, frozen: strings, numbers, tuples, JSON schemas and the engine contract's own
dataclasses (core.backend). `to_json` writes it and `from_json` reads it back equal, so that it
can be logged, table-tested, and sent to another process. Here, in the core, because the
engines read it and the core imports nothing of the web layer.
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from packserve.core.backend import GenerationParams, Message, Tool
from packserve.errors import InvalidRequest
from packserve.types import Task


@dataclass(frozen=True)
class Inputs:
    """A request's texts, for the model's per-request limits: `texts` count toward max_inputs
    (embedding inputs, documents, messages, prompts) and, with `also` (a rerank query), toward
    max_input_tokens. `param` is the request field an error names."""

    texts: Sequence[str]
    param: str = "input"
    also: Sequence[str] = ()
    # Token-id inputs: their lengths, which count toward max_input_tokens as they are (their
    # `texts` are placeholders, counted toward max_inputs only).
    token_counts: Sequence[int] = ()


@dataclass(frozen=True)
class Named:
    """`tool_choice` naming one function (which may itself be called "none" or "auto")."""

    name: str


Choice = Literal["none", "auto", "required"] | Named


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asks of tools, checked: the tools, which of them may be called, and
    the envelope schema the output is held to (None with `tool_choice: "none"`; api.tools)."""

    tools: tuple[Tool, ...]
    choice: Choice
    envelope: dict[str, object] | None

    @property
    def callable(self) -> tuple[Tool, ...]:
        if isinstance(self.choice, Named):
            return tuple(t for t in self.tools if t.name == self.choice.name)
        return () if self.choice == "none" else self.tools


# What the output is taken as once generated: text as it is, JSON checked against the schema
# it was held to, or the tool envelope read as a call or a reply (api.request.finished).
Output = Literal["text", "json", "tool_call"]


@dataclass(frozen=True)
class GenerationRequest:
    """One chat (`messages`) or completion (`prompts`, a choice each) of `model`."""

    task: Task  # Task.CHAT or Task.COMPLETE
    model: str  # the catalog name
    # Sampling, max_tokens within the model's max_output_tokens, logprobs, and the
    # grammar the output is held to (a response format's schema, or the tool envelope).
    params: GenerationParams
    messages: tuple[Message, ...] = ()  # a chat, as the model's own chat template shows it
    prompts: tuple[str | tuple[int, ...], ...] = ()  # a completion's prompts: text or token ids
    tools: ToolUse | None = None  # a chat with tools that may be called, or tool turns
    # The same conversation through packserve's generic tool prompt (api.tools), for an engine
    # whose chat template does not show tools; None where the model's entry does not enable it.
    tool_prompt: tuple[Message, ...] | None = None
    inputs: Inputs = Inputs(())  # its texts, for the model's max_inputs and max_input_tokens
    stream: bool = False
    include_usage: bool = False  # a stream ends with a usage chunk
    usage_per_chunk: bool = False  # every streamed chunk carries the usage so far
    keep_alive: float | None = None  # Ollama's: the model's idle seconds after it (None: config)

    @property
    def output(self) -> Output:
        if self.tools is not None and self.tools.envelope is not None:
            return "tool_call"
        if self.params.json_schema is not None or self.params.json_object:
            return "json"
        return "text"

    @property
    def choices(self) -> int:
        """How many generations answer it: one per prompt, one for a chat."""
        return len(self.prompts) if self.task is Task.COMPLETE else 1

    @property
    def plain(self) -> bool:
        """Whether the engine's own answer in OpenAI's shape answers it (`Runner.wire`): one
        choice, no tools, no structured output, no logprobs."""
        return (self.choices == 1 and self.tools is None and self.output == "text"
                and self.params.logprobs is None)

    def conversation(self, renders_tools: bool) -> tuple[tuple[Message, ...], GenerationParams]:
        """The messages and parameters a chat engine gets. With tools: through the engine's own
        chat template where it `renders_tools`, else through the generic tool prompt; where
        neither may show them, InvalidRequest."""
        if self.tools is None:
            return self.messages, self.params
        if renders_tools:
            return self.messages, dataclasses.replace(self.params, tools=self.tools.callable)
        if self.tool_prompt is None:
            raise InvalidRequest(
                f"model {self.model!r}'s chat template has no tool support; set tool_prompt = "
                f"true in its [[models]] entry to use packserve's generic tool prompt",
                param="tools" if self.tools.tools else "messages")
        return self.tool_prompt, self.params

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> GenerationRequest:
        request: GenerationRequest = _decoded(cls, json.loads(text))
        return request


def _decoded(hint: Any, value: Any) -> Any:
    """`value`, as `json.loads` gives it, made the type `hint` names: dataclasses from objects,
    tuples from arrays, enums from their values; a union takes its first member that the value's
    JSON kind fits."""
    origin, args = get_origin(hint), get_args(hint)
    if value is None:
        return None
    if origin in (Union, types.UnionType):
        return _decoded(next(a for a in args if _fits(a, value)), value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = get_type_hints(hint)
        return hint(**{f.name: _decoded(hints[f.name], value[f.name])
                       for f in dataclasses.fields(hint) if f.init})
    if origin is Sequence or (origin is tuple and args[-1] is Ellipsis):
        return tuple(_decoded(args[0], item) for item in value)
    if origin is tuple:
        return tuple(_decoded(a, item) for a, item in zip(args, value, strict=True))
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint(value)
    return value  # str, int, float, bool, a Literal, a JSON schema


def _fits(hint: Any, value: Any) -> bool:
    origin = get_origin(hint)
    if dataclasses.is_dataclass(hint) or dict in (hint, origin):
        return isinstance(value, dict)
    if origin in (tuple, Sequence):
        return isinstance(value, list)
    if origin is Literal:
        return value in get_args(hint)
    if hint is float:
        return isinstance(value, int | float)
    return isinstance(hint, type) and isinstance(value, hint)
