"""OpenAI-shaped routes: models, embeddings, chat and text completions."""

from __future__ import annotations

import base64
from typing import Any

import orjson
from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from packserve.api.access import may_call
from packserve.api.generation import ChatCompletion, TextCompletion, answer
from packserve.api.request import chat_request, completion_request
from packserve.api.schemas import ChatRequest, CompletionRequest, EmbeddingRequest
from packserve.api.services import ServicesDep, check_engine
from packserve.core.request import Inputs
from packserve.core.status import ModelStatus
from packserve.errors import ModelNotFound
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
        check_engine(s.spec_of(body.model), token_ids="input")
    inputs = Inputs(body.texts, token_counts=[len(row) for row in ids or ()])
    async with s.call(body.model, Task.EMBED, inputs, body.keep_alive) as call:
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
    request = chat_request(body, s)
    return await answer(s, request, ChatCompletion(body.model,
                                                   logprobs=request.params.logprobs is not None))


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, s: ServicesDep
                      ) -> dict[str, Any] | StreamingResponse:
    request = completion_request(body, s)
    return await answer(s, request, TextCompletion(body.model, body.prompts,
                                                   logprobs=body.logprobs is not None))
