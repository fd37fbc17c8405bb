"""OpenAI-shaped routes: models, embeddings, chat and text completions."""

from __future__ import annotations

import base64
from typing import Any

import orjson
from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from packserve.api.access import may_call
from packserve.api.calls import Generate
from packserve.api.generation import ChatCompletion, TextCompletion, answer
from packserve.api.schemas import ChatRequest, CompletionRequest, EmbeddingRequest
from packserve.api.services import Services, ServicesDep
from packserve.api.structured import check_json, response_format
from packserve.api.tools import chat_with_tools, tool_use
from packserve.core.backend import Generated, GenerationParams, OnText, Runner, Wire
from packserve.core.backend import Message as ChatTurn
from packserve.core.request import Inputs
from packserve.core.status import ModelStatus
from packserve.errors import InvalidRequest, ModelNotFound
from packserve.types import Task

router = APIRouter()


@router.get("/v1/models")
async def models(s: ServicesDep) -> dict[str, Any]:
    return {"object": "list",
            "data": [_model_row(m) for m in s.scheduler.models() if may_call(m.name)]}


@router.get("/v1/models/{model:path}")
async def model(model: str, s: ServicesDep) -> dict[str, Any]:
    """One entry of /v1/models (the SDK's `models.retrieve`)."""
    for m in s.scheduler.models():
        if m.name == model and may_call(model):
            return _model_row(m)
    s.spec_of(model)  # raises the 404 of every model route: missing and out of scope alike
    raise ModelNotFound(f"model {model!r} does not exist", param="model")  # reloaded away


def _model_row(m: ModelStatus) -> dict[str, Any]:
    return {"id": m.name, "object": "model", "created": 0, "owned_by": "packserve",
            "tasks": [t.value for t in m.tasks], "state": m.state.value}


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, s: ServicesDep) -> Response:
    ids = body.token_ids
    if ids is not None:
        s.check_engine(body.model, token_ids="input")
    inputs = Inputs(body.texts, token_counts=[len(row) for row in ids or ()])
    async with s.call(body.model, Task.EMBED, inputs) as call:
        out = await (call.embed(body.texts) if ids is None else call.embed_ids(ids))
    vectors = out.vectors.astype("<f4", copy=False)
    # Floats are written as the doubles the float32 values are (what `tolist()` gave), so that
    # a client reading them gets exactly the numbers base64 carries. orjson writes them
    # straight from the array, where `tolist()` and the json module went float by float on the
    # worker's event loop.
    values: list[Any] = ([base64.b64encode(v.tobytes()).decode("ascii") for v in vectors]
                         if body.encoding_format == "base64" else list(vectors.astype("<f8")))
    tokens = sum(out.tokens)
    return Response(orjson.dumps(
        {"object": "list",
         "data": [{"object": "embedding", "index": i, "embedding": value}
                  for i, value in enumerate(values)],
         "model": body.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
        option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")


@router.post("/v1/chat/completions", response_model=None)
async def chat(body: ChatRequest, s: ServicesDep) -> dict[str, Any] | StreamingResponse:
    schema, json_mode = response_format(body)
    asked, param = ((body.max_completion_tokens, "max_completion_tokens")
                    if body.max_completion_tokens else (body.max_tokens, "max_tokens"))
    use = tool_use(body)
    json_answer = schema is not None or json_mode or use is not None
    continuous = _checked(body, s, shaped_here=json_answer or body.logprobs,
                          json_answer=json_answer)
    params = GenerationParams(
        max_tokens=s.max_tokens(body.model, asked, param),
        temperature=body.temperature, top_p=body.top_p, stop=body.stops, seed=body.seed,
        json_schema=schema, json_object=json_mode,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None, **_extensions(body))
    if use is not None:
        return await chat_with_tools(s, body, params, use)
    turns = [ChatTurn("system" if m.role == "developer" else m.role, m.text)
             for m in body.messages]

    def run(runner: Runner, on_text: OnText) -> Generated:
        return runner.chat(turns, params, on_text)

    def check(out: Generated) -> None:
        if (schema is not None or json_mode) and out.finish_reason == "stop":
            check_json(out.text, schema, body.model)

    def plain(runner: Runner, stream: bool) -> Wire | None:
        return runner.wire(Task.CHAT, turns, params, stream=stream, usage_per_chunk=continuous)

    inputs = Inputs([m.text for m in body.messages], "messages")
    return await answer(s, ChatCompletion(body.model, logprobs=body.logprobs), Task.CHAT, [run],
                        inputs=inputs,
                        check=check, stream=body.stream, include_usage=body.include_usage,
                        # structured output and logprobs are checked and shaped here
                        plain=None if schema is not None or json_mode or body.logprobs
                        else plain)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, s: ServicesDep
                      ) -> dict[str, Any] | StreamingResponse:
    asked = body.max_tokens if "max_tokens" in body.model_fields_set else None
    ids = body.token_ids
    if ids is not None:
        s.check_engine(body.model, token_ids="prompt")
        if body.echo:
            raise InvalidRequest("echo needs the prompt's text; this prompt is token ids",
                                 param="echo")
    continuous = _checked(body, s, shaped_here=body.echo or body.logprobs is not None)
    params = GenerationParams(max_tokens=s.max_tokens(body.model, asked,
                                                      default=body.max_tokens),
                              temperature=body.temperature,
                              top_p=body.top_p, stop=body.stops, seed=body.seed,
                              logprobs=body.logprobs, echo=body.echo, **_extensions(body))
    if body.stream and len(body.prompts) != 1:
        raise InvalidRequest("streaming takes one prompt", param="prompt")
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequest("max_tokens 0 generates nothing; it is only accepted with echo "
                             "(to score the prompt)", param="max_tokens")
    if body.stream and body.echo:
        raise InvalidRequest("echo is not supported with stream; ask without stream to score "
                             "a prompt", param="echo")
    prompts: list[str] | list[list[int]] = body.prompts if ids is None else ids
    jobs = [_complete(prompt, params) for prompt in prompts]
    reply = TextCompletion(body.model, body.prompts, logprobs=body.logprobs is not None,
                           echo=body.echo)
    prompt = prompts[0]

    def plain(runner: Runner, stream: bool) -> Wire | None:
        return runner.wire(Task.COMPLETE, prompt, params, stream=stream,
                           usage_per_chunk=continuous)

    inputs = Inputs(body.prompts, "prompt", token_counts=[len(row) for row in ids or ()])
    return await answer(s, reply, Task.COMPLETE, jobs, inputs=inputs, stream=body.stream,
                        include_usage=body.include_usage,
                        plain=plain if len(body.prompts) == 1 and not body.echo
                        and body.logprobs is None else None)


def _checked(body: ChatRequest | CompletionRequest, s: Services, *, shaped_here: bool,
             json_answer: bool = False) -> bool:
    """Refuse the extensions that the model's engine, or this request's other fields, do not
    allow (`shaped_here`: packserve shapes the stream; `json_answer`: a JSON answer or a tool
    call); whether each streamed chunk carries the usage so far (continuous_usage_stats)."""
    continuous = body.stream and body.continuous_usage
    s.check_engine(body.model, [*body.extensions,
                                *(["stream_options.continuous_usage_stats"] if continuous
                                  else [])])
    if continuous and shaped_here:
        raise InvalidRequest("stream_options.continuous_usage_stats is served on plain "
                             "generations; this one (logprobs, echo, structured output or "
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


def _complete(prompt: str | list[int], params: GenerationParams) -> Generate:
    def run(runner: Runner, on_text: OnText) -> Generated:
        return runner.complete(prompt, params, on_text)
    return run
