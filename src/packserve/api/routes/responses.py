"""/v1/responses: OpenAI's Responses API, the text subset, served by the chat models with chat's
lease, quotas, metrics and errors (the envelope and the stream: api.responses).

Refused by name: `previous_response_id` (packserve keeps no responses, so there is nothing to
continue from; the client sends the conversation in `input`) and `tools`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from packserve.api import responses
from packserve.api.schemas import ResponsesRequest
from packserve.api.services import ServicesDep
from packserve.api.structured import check_json, checked_schema
from packserve.core.backend import Generated, GenerationParams, OnText, Runner
from packserve.core.backend import Message as ChatTurn
from packserve.core.request import Inputs
from packserve.errors import InvalidRequest

router = APIRouter()


@router.post("/v1/responses", response_model=None)
async def create(body: ResponsesRequest, s: ServicesDep) -> dict[str, Any] | StreamingResponse:
    if body.previous_response_id is not None:
        raise InvalidRequest("previous_response_id is not supported: packserve keeps no "
                             "responses (it stores nothing, whatever `store` says), so send "
                             "the whole conversation in `input`",
                             param="previous_response_id")
    if body.tools:
        raise InvalidRequest("tools are not supported on /v1/responses", param="tools")
    schema, json_mode = _text_format(body)
    params = GenerationParams(
        max_tokens=s.max_tokens(body.model, body.max_output_tokens, "max_output_tokens"),
        temperature=body.temperature, top_p=body.top_p, json_schema=schema,
        json_object=json_mode)
    turns = [ChatTurn("system" if role == "developer" else role, text)
             for role, text in body.messages]

    def run(runner: Runner, on_text: OnText) -> Generated:
        return runner.chat(turns, params, on_text)

    def check(out: Generated) -> None:
        if (schema is not None or json_mode) and out.finish_reason == "stop":
            check_json(out.text, schema, body.model)

    reply = responses.Reply(body)
    inputs = Inputs([turn.content for turn in turns], "input")
    if body.stream:
        return await responses.stream(s, reply, run, inputs, check)
    return await responses.answer(s, reply, run, inputs, check)


def _text_format(body: ResponsesRequest) -> tuple[dict[str, object] | None, bool]:
    """(the JSON schema to constrain the output to, or None; whether any JSON object will do),
    as chat's `response_format` (api.structured)."""
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None, False
    if fmt.type == "json_object":
        return None, True
    assert fmt.schema_ is not None  # the schema's own validator requires it
    return checked_schema(fmt.schema_, "text.format", "text.format.schema"), False
