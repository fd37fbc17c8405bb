"""Generation requests from validated bodies, and their answers checked.

Each generation route builds its `GenerationRequest` (core.request) here, once: what the body
asks, checked against the model's catalog entry and its engine (the engine's extensions, the
model's max_output_tokens, whether it may use the generic tool prompt), with the response
format or the tool envelope already the grammar the output is held to. Everything after reads
that one object. `finished` is what becomes of the output, chosen by the request's `output`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Protocol

from packserve.api.schemas import ChatRequest, CompletionRequest, ResponsesRequest
from packserve.api.services import check_engine
from packserve.api.structured import check_json, response_format, text_format
from packserve.api.tools import resolved, tool_texts, tool_use, turns
from packserve.config import ModelSpec
from packserve.core.backend import Generated, GenerationParams, Message
from packserve.core.request import GenerationRequest, Inputs
from packserve.errors import InvalidRequest
from packserve.types import Task


class Models(Protocol):
    """What building a request asks of the catalog (`Services` answers it): the entry of a model
    the request being served may call, else ModelNotFound."""

    def spec_of(self, model: str) -> ModelSpec: ...


def chat_request(body: ChatRequest, models: Models) -> GenerationRequest:
    """/v1/chat/completions. Raises InvalidRequest naming the field at fault, ModelNotFound."""
    schema, json_mode = response_format(body)
    asked, param = ((body.max_completion_tokens, "max_completion_tokens")
                    if body.max_completion_tokens else (body.max_tokens, "max_tokens"))
    use = tool_use(body)
    spec = models.spec_of(body.model)
    json_answer = schema is not None or json_mode or use is not None
    continuous = _checked(body, spec, shaped_here=json_answer or body.logprobs,
                          json_answer=json_answer)
    params = GenerationParams(
        max_tokens=_max_tokens(spec, asked, param),
        temperature=body.temperature, top_p=body.top_p, stop=body.stops, seed=body.seed,
        json_schema=schema, json_object=json_mode,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None, **_extensions(body))
    if use is not None and use.envelope is not None:  # no stop strings inside the envelope
        params = dataclasses.replace(params, stop=(), logprobs=None, json_schema=use.envelope,
                                     json_object=False)
    return GenerationRequest(
        Task.CHAT, body.model, params, messages=turns(body.messages, use),
        tools=use,
        tool_prompt=(turns(body.messages, use, native=False)
                     if use is not None and spec.tool_prompt else None),
        inputs=Inputs(tuple(m.text for m in body.messages), "messages",
                      also=() if use is None else tool_texts(body, use)),
        stream=body.stream, include_usage=body.include_usage, usage_per_chunk=continuous,
        keep_alive=body.keep_alive)


# llama.cpp's server, like Ollama's and llama.cpp's router, generates without scoring the
# prompt: echo would need logits for every prompt position (n_vocab x tokens x 4 bytes: 512 MiB
# for Gemma 3 at 512 tokens). docs/api.md says where to score prompts instead.
ECHO_REFUSED = ("echo (the prompt's tokens returned, scored with logprobs) is not supported: "
                "packserve's llama.cpp engine generates without scoring the prompt, as "
                "llama.cpp's server and Ollama do; send echo false, or score prompts with a "
                "server that does (vLLM, prompt_logprobs)")


def completion_request(body: CompletionRequest, models: Models) -> GenerationRequest:
    """/v1/completions. Raises InvalidRequest naming the field at fault, ModelNotFound."""
    spec = models.spec_of(body.model)
    asked = body.max_tokens if "max_tokens" in body.model_fields_set else None
    if body.echo:
        raise InvalidRequest(ECHO_REFUSED, param="echo")
    if body.max_tokens == 0:
        raise InvalidRequest("max_tokens 0 generates nothing: ask for at least 1",
                             param="max_tokens")
    ids = body.token_ids
    if ids is not None:
        check_engine(spec, token_ids="prompt")
    continuous = _checked(body, spec, shaped_here=body.logprobs is not None)
    params = GenerationParams(max_tokens=_max_tokens(spec, asked, default=body.max_tokens),
                              temperature=body.temperature,
                              top_p=body.top_p, stop=body.stops, seed=body.seed,
                              logprobs=body.logprobs, **_extensions(body))
    if body.stream and len(body.prompts) != 1:
        raise InvalidRequest("streaming takes one prompt", param="prompt")
    return GenerationRequest(
        Task.COMPLETE, body.model, params,
        prompts=tuple(body.prompts) if ids is None else tuple(tuple(row) for row in ids),
        inputs=Inputs(tuple(body.prompts), "prompt",
                      token_counts=tuple(len(row) for row in ids or ())),
        stream=body.stream, include_usage=body.include_usage, usage_per_chunk=continuous,
        keep_alive=body.keep_alive)


def responses_request(body: ResponsesRequest, models: Models) -> GenerationRequest:
    """/v1/responses: a chat. Raises InvalidRequest naming the field at fault, ModelNotFound."""
    if body.previous_response_id is not None:
        raise InvalidRequest("previous_response_id is not supported: packserve keeps no "
                             "responses (it stores nothing, whatever `store` says), so send "
                             "the whole conversation in `input`",
                             param="previous_response_id")
    if body.tools:
        raise InvalidRequest("tools are not supported on /v1/responses", param="tools")
    schema, json_mode = text_format(body)
    spec = models.spec_of(body.model)
    params = GenerationParams(
        max_tokens=_max_tokens(spec, body.max_output_tokens, "max_output_tokens"),
        temperature=body.temperature, top_p=body.top_p, json_schema=schema,
        json_object=json_mode)
    messages = tuple(Message("system" if role == "developer" else role, text)
                     for role, text in body.messages)
    return GenerationRequest(Task.CHAT, body.model, params, messages=messages,
                             inputs=Inputs(tuple(m.content for m in messages), "input"),
                             stream=body.stream, keep_alive=body.keep_alive)


def finished(request: GenerationRequest, out: Generated) -> Generated:
    """`out` as the answer to `request`: the tool envelope read as a call or a reply
    (api.tools.resolved); JSON that stopped on its own checked against the schema it was held
    to; text as it is. Raises ModelOutputInvalid for output that must not be passed off as an
    answer."""
    if request.output == "tool_call":
        assert request.tools is not None
        return resolved(out, request.tools, request.model)
    if request.output == "json" and out.finish_reason == "stop":
        check_json(out.text, request.params.json_schema, request.model)
    return out


async def finish(request: GenerationRequest, out: Generated) -> Generated:
    """`finished`, off the event loop where there is anything to check: a schema's `pattern`
    can backtrack for seconds on hostile output."""
    if request.output == "text":
        return out
    return await asyncio.to_thread(finished, request, out)


def _checked(body: ChatRequest | CompletionRequest, spec: ModelSpec, *, shaped_here: bool,
             json_answer: bool = False) -> bool:
    """Refuse the extensions that the model's engine, or this request's other fields, do not
    allow (`shaped_here`: packserve shapes the stream; `json_answer`: a JSON answer or a tool
    call); whether each streamed chunk carries the usage so far (continuous_usage_stats)."""
    continuous = body.stream and body.continuous_usage
    check_engine(spec, [*body.extensions,
                        *(["stream_options.continuous_usage_stats"] if continuous else [])])
    if continuous and shaped_here:
        raise InvalidRequest("stream_options.continuous_usage_stats is served on plain "
                             "generations; this one (logprobs, structured output or "
                             "tools) is shaped by packserve, which reports usage at its end",
                             param="stream_options")
    forced = "min_tokens" if body.min_tokens else "ignore_eos" if body.ignore_eos else None
    if forced is not None and json_answer:
        raise InvalidRequest(f"{forced} makes the model go on past its end, and a JSON answer "
                             f"or a tool call ends where its JSON does: ask for one or the "
                             f"other", param=forced)
    return continuous


def _extensions(body: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """The request's fields beyond OpenAI's, as GenerationParams takes them."""
    return {"top_k": None if body.top_k is None else max(body.top_k, 0),
            "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "logit_bias": tuple((int(k), v) for k, v in (body.logit_bias or {}).items()),
            "ignore_eos": body.ignore_eos, "min_tokens": body.min_tokens}


def _max_tokens(spec: ModelSpec, requested: int | None, param: str = "max_tokens",
                default: int | None = None) -> int | None:
    """The max_tokens a generation runs with: what the request asked (None: it did not say, and
    `default` applies), within the model's max_output_tokens."""
    ceiling = spec.max_output_tokens
    if requested is None:
        if ceiling is None or default is None:
            return default if ceiling is None else ceiling
        return min(default, ceiling)
    if ceiling is None:
        return requested
    if requested > ceiling:
        raise InvalidRequest(f"{param} is {requested} but model {spec.name!r} generates at "
                             f"most {ceiling} tokens per request (its max_output_tokens)",
                             param=param)
    return requested
