"""The Responses API's envelope and stream (/v1/responses, api.routes.responses): a `response`
object whose output is one assistant message with one `output_text` part, answered whole or as
server-sent events of typed, numbered events, as OpenAI streams them.

A response is `completed`, or `incomplete` when generation stopped at its token limit; a stream
that fails after it started ends with an `error` event and `response.failed`. The lease is held
exactly as chat holds it (`Services.call` with Task.CHAT), so quotas, metrics and errors are
chat's.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi.responses import StreamingResponse

from packserve.api.errors import described
from packserve.api.generation import event_stream
from packserve.api.request import finish
from packserve.api.schemas import ResponsesRequest
from packserve.api.services import Services
from packserve.api.sse import sse
from packserve.core.backend import Generated
from packserve.core.request import GenerationRequest
from packserve.errors import PackserveError

log = logging.getLogger("packserve.api")

Status = Literal["in_progress", "completed", "incomplete", "failed"]


class Reply:
    """One response: its ids and creation time are fixed when it is made, and it echoes the
    request's settings as OpenAI's response objects do. Its stream events are numbered in the
    order they are made (`sequence_number`)."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.model = body.model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self._sequence = 0
        text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {}
        self._settings: dict[str, Any] = {
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,  # OpenAI's default
            "previous_response_id": None, "service_tier": "default",
            "store": False,  # packserve keeps nothing, whatever `store` asked
            "temperature": body.temperature, "text": {"format": {"type": "text"}, **text},
            "tool_choice": "auto", "tools": [], "top_p": body.top_p, "truncation": "disabled",
            "user": body.user}

    def response(self, status: Status, out: Generated | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object: in progress (no output yet), finished with `out`, or failed."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": error,
            "incomplete_details": incomplete, "model": self.model,
            "output": [] if out is None else [self.message(out.text, status)],
            "usage": None if out is None else {
                "input_tokens": out.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": out.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": out.prompt_tokens + out.completion_tokens},
            **self._settings}

    def message(self, text: str | None, status: Status) -> dict[str, Any]:
        """The output message; without `text`, as it is announced (no content yet)."""
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": [] if text is None else [part(text)]}

    def event(self, type_: str, **fields: Any) -> str:
        """One server-sent event, named by its type as OpenAI names them."""
        payload = {"type": type_, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(payload, type_)

    def text_event(self, type_: str, **fields: Any) -> str:
        """An event about the one text part of the one output message."""
        return self.event(type_, item_id=self.message_id, output_index=0, content_index=0,
                          **fields)


def part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def status_of(out: Generated) -> Status:
    return "incomplete" if out.finish_reason == "length" else "completed"


async def answer(s: Services, reply: Reply, request: GenerationRequest) -> dict[str, Any]:
    """Run `request` (a chat) on a lease of its model and answer with the whole response."""
    async with s.call(request.model, request.task, request.inputs, request.keep_alive) as call:
        out = await call.generate(request)
    out = await finish(request, out)
    return reply.response(status_of(out), out)


async def stream(s: Services, reply: Reply, request: GenerationRequest) -> StreamingResponse:
    """`request` as server-sent events. As chat's streams: the lease is taken before the
    response starts (its errors keep their status code) and released when the stream ends."""
    return await event_stream(_events(s, reply, request))


async def _events(s: Services, reply: Reply, request: GenerationRequest
                  ) -> AsyncIterator[str]:
    async with (s.call(request.model, request.task, request.inputs, request.keep_alive) as call,
                call.stream(request) as pieces):
        yield reply.event("response.created", response=reply.response("in_progress"))
        yield reply.event("response.in_progress", response=reply.response("in_progress"))
        yield reply.event("response.output_item.added", output_index=0,
                          item=reply.message(None, "in_progress"))
        yield reply.text_event("response.content_part.added", part=part(""))
        async for piece in pieces:
            yield reply.text_event("response.output_text.delta", delta=piece.text, logprobs=[])
        try:
            out = await finish(request, await pieces.result())
        except Exception as exc:  # the response has started: report in-band, keep serving
            if not isinstance(exc, PackserveError):
                log.exception("response stream for %s failed", reply.model)
            error = described(exc)[0]["error"]
            code = error["code"] or error["type"]
            yield reply.event("error", code=code, message=error["message"],
                              param=error["param"])
            yield reply.event("response.failed", response=reply.response(
                "failed", error={"code": code, "message": error["message"]}))
            return
        status = status_of(out)
        yield reply.text_event("response.output_text.done", text=out.text, logprobs=[])
        yield reply.text_event("response.content_part.done", part=part(out.text))
        yield reply.event("response.output_item.done", output_index=0,
                          item=reply.message(out.text, status))
        yield reply.event(f"response.{status}", response=reply.response(status, out))
