"""/v1/responses: OpenAI's Responses API, the text subset, served by the chat models with chat's
lease, quotas, metrics and errors (the envelope and the stream: api.responses).

Refused by name: `previous_response_id` (packserve keeps no responses, so there is nothing to
continue from; the client sends the conversation in `input`) and `tools`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from packserve.api import responses
from packserve.api.request import responses_request
from packserve.api.schemas import ResponsesRequest
from packserve.api.services import ServicesDep

router = APIRouter()


@router.post("/v1/responses", response_model=None)
async def create(body: ResponsesRequest, s: ServicesDep) -> dict[str, Any] | StreamingResponse:
    request = responses_request(body, s)
    reply = responses.Reply(body)
    if request.stream:
        return await responses.stream(s, reply, request)
    return await responses.answer(s, reply, request)
