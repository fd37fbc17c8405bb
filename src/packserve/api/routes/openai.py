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
from packserve.api.services import Inputs, ServicesDep
from packserve.api.structured import check_json, response_format
from packserve.api.tools import chat_with_tools, tool_use
from packserve.core.backend import Generated, GenerationParams, OnText, Runner, Wire
from packserve.core.backend import Message as ChatTurn
from packserve.core.scheduler import ModelStatus
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
    async with s.lease(body.model, Task.EMBED, Inputs(body.texts)) as call:
        out = await call.embed(body.texts)
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
    params = GenerationParams(
        max_tokens=s.max_tokens(body.model, asked, param),
        temperature=body.temperature, top_p=body.top_p, stop=body.stops, seed=body.seed,
        json_schema=schema, json_object=json_mode,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    use = tool_use(body)
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
        return runner.wire(Task.CHAT, turns, params, stream=stream)

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
    params = GenerationParams(max_tokens=s.max_tokens(body.model, asked,
                                                      default=body.max_tokens),
                              temperature=body.temperature,
                              top_p=body.top_p, stop=body.stops, seed=body.seed,
                              logprobs=body.logprobs, echo=body.echo)
    if body.stream and len(body.prompts) != 1:
        raise InvalidRequest("streaming takes one prompt", param="prompt")
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequest("max_tokens 0 generates nothing; it is only accepted with echo "
                             "(to score the prompt)", param="max_tokens")
    if body.stream and body.echo:
        raise InvalidRequest("echo is not supported with stream; ask without stream to score "
                             "a prompt", param="echo")
    jobs = [_complete(prompt, params) for prompt in body.prompts]
    reply = TextCompletion(body.model, body.prompts, logprobs=body.logprobs is not None,
                           echo=body.echo)
    prompt = body.prompts[0]

    def plain(runner: Runner, stream: bool) -> Wire | None:
        return runner.wire(Task.COMPLETE, prompt, params, stream=stream)

    return await answer(s, reply, Task.COMPLETE, jobs,
                        inputs=Inputs(body.prompts, "prompt"), stream=body.stream,
                        include_usage=body.include_usage,
                        plain=plain if len(body.prompts) == 1 and not body.echo
                        and body.logprobs is None else None)


def _complete(prompt: str, params: GenerationParams) -> Generate:
    def run(runner: Runner, on_text: OnText) -> Generated:
        return runner.complete(prompt, params, on_text)
    return run
