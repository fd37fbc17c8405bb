"""Ending a relayed event stream whose source died after it started, in its route's own shape.

Both edges relay a worker's (or a pool replica's) server-sent events as bytes: the front
(`front.app`) and the pool's entry point (`pool.entry`). When the source dies mid-stream, the
client has had its 200 and part of the answer, so the error goes in-band, as the route itself
reports a failure after its start: chat and completions end with an `error` event in OpenAI's
error shape and `[DONE]`; `/v1/responses` with a typed `error` event and `response.failed`
(`api.responses`), carrying the response's id and the next sequence numbers. `StreamEnd` sees
each relayed chunk (for a responses stream it reads the first event's response object and the
last sequence number) and writes that ending.
"""

from __future__ import annotations

import json
import re
from typing import Any

from packserve.api.asgi import error_body
from packserve.api.sse import sse

_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')
_FIRST_EVENT_MAX = 1 << 20  # the response.created event is a few KiB; past this, stop looking


class StreamEnd:
    """What a relay has seen of one started stream to `path`."""

    def __init__(self, path: str) -> None:
        self.responses = path.rstrip("/").endswith("/responses")
        self._tail = b"\n\n"  # the last bytes relayed: an event ended there, or not
        self._sequence = -1
        self._head = b""  # a responses stream's bytes until its first whole event
        self._response: dict[str, Any] | None = None

    def seen(self, chunk: bytes) -> None:
        if not chunk:
            return
        self._tail = chunk[-2:]
        if not self.responses:
            return
        for match in _SEQUENCE.finditer(chunk):
            self._sequence = int(match.group(1))
        if self._response is None and len(self._head) < _FIRST_EVENT_MAX:
            self._head += chunk
            event, sep, _ = self._head.partition(b"\n\n")
            if sep:
                self._response = _response_of(event) or {}

    def ending(self, message: str, code: str) -> bytes:
        """The events that end the stream after `message` (an error of type
        model_unavailable with `code`), after whatever part of an event was relayed last."""
        prefix = b"" if self._tail == b"\n\n" else b"\n\n"
        if not self.responses:
            error = error_body(message, "model_unavailable", code=code)
            return prefix + (sse(error) + sse("[DONE]")).encode()
        response = {**(self._response or {}), "status": "failed",
                    "error": {"code": code, "message": message}}
        first = self._sequence + 1
        return prefix + _event("error", first, code=code, message=message, param=None) \
            + _event("response.failed", first + 1, response=response)


def _response_of(event: bytes) -> dict[str, Any] | None:
    """The response object of a stream's first event (`response.created`), if it is one."""
    data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    response = payload.get("response") if isinstance(payload, dict) else None
    return response if isinstance(response, dict) else None


def _event(type_: str, sequence: int, **fields: Any) -> bytes:
    return sse({"type": type_, "sequence_number": sequence, **fields}, type_).encode()
