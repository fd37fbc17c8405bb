"""Relaying a generation that its engine answers in OpenAI's shape itself (a `Wire`: a
llama-server runner). The request goes to the engine's unix socket and the answer's bytes go
back to the client with the catalog's model name in them. Per event of a stream the worker
renames the model (one `bytes.replace`) and writes once; it decodes only the last event, whose
usage is counted on the lease, and drops it unless the client asked for it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, Callable
from typing import Any

import httptools
import orjson

from packserve.api.errors import described
from packserve.api.sse import sse
from packserve.core.backend import Wire
from packserve.errors import (
    EngineCrashed,
    InputTooLong,
    InvalidRequest,
    ModelUnavailable,
    PackserveError,
)

READ = 65536
_TEXT = re.compile(rb'"(?:content|text)":"[^"]')  # an event with text in it


class Unreachable(EngineCrashed):
    """The engine did not take the request (its socket refused or closed before an answer
    began): nothing ran, so it may be sent again once the model is loaded anew
    (`api.calls.Call.relay`)."""
Count = Callable[[int, int], None]  # prompt tokens, completion tokens


class _Answer:
    """httptools' callbacks: the status once the headers are in, the body as it comes."""

    def __init__(self) -> None:
        self.headers_done = False
        self.done = False
        self.body = bytearray()

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = True


class _Exchange:
    """One request to the engine on its own connection (closed when the answer ends, or when
    the client leaves: the engine then stops the generation)."""

    def __init__(self, wire: Wire, model: str) -> None:
        self.wire = wire
        self.model = model
        self.answer = _Answer()
        self.parser = httptools.HttpResponseParser(self.answer)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> int:
        """Send the request and read up to the end of the answer's headers: its status."""
        head = (f"POST {self.wire.path} HTTP/1.1\r\nHost: runner\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(self.wire.body)}\r\n"
                f"Connection: close\r\n\r\n").encode()
        try:
            self.reader, self.writer = await asyncio.open_unix_connection(self.wire.socket)
            self.writer.write(head + self.wire.body)
            while not self.answer.headers_done:
                if not await self.read():
                    raise ConnectionError("closed before its answer")
        except (OSError, httptools.HttpParserError) as exc:
            raise Unreachable(f"the engine of {self.model} went away: {exc}",
                              retry_after_s=1) from exc
        return int(self.parser.get_status_code())

    async def read(self) -> bool:
        """Feed what the engine sent next to the parser; False at the end of the answer."""
        assert self.reader is not None
        if self.answer.done:
            return False
        data = await self.reader.read(READ)
        if not data:
            return False
        self.parser.feed_data(data)
        return True

    async def whole(self) -> bytes:
        while await self.read():
            pass
        return bytes(self.answer.body)

    def take(self) -> bytes:
        data = bytes(self.answer.body)
        self.answer.body.clear()
        return data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    async def refusal(self, status: int) -> PackserveError:
        """The engine's error answer, as packserve's error for the same reason."""
        body = await self.whole()
        try:
            info = orjson.loads(body).get("error", {})
        except (orjson.JSONDecodeError, AttributeError):
            info = {"message": body.decode("utf-8", "replace")}
        return refused(status, info if isinstance(info, dict) else {}, self.model)


def refused(status: int, info: dict[str, Any], model: str) -> PackserveError:
    message = f"{model}: {info.get('message') or 'the engine refused the request'}"
    if info.get("type") == "exceed_context_size_error":
        return InputTooLong(message, param="messages")
    if 400 <= status < 500:
        return InvalidRequest(message)
    return ModelUnavailable(message, retry_after_s=1)


async def whole(wire: Wire, model: str, count: Count) -> dict[str, Any]:
    """A generation that is not streamed: the engine's answer, named for `model`."""
    exchange = _Exchange(wire, model)
    try:
        status = await exchange.open()
        if status != 200:
            raise await exchange.refusal(status)
        body = await exchange.whole()
    finally:
        exchange.close()
    if not exchange.answer.done:
        raise EngineCrashed(f"the engine of {model} went away mid-answer", retry_after_s=1)
    out: dict[str, Any] = orjson.loads(body)
    out["model"] = model
    if wire.id_prefix is not None and isinstance(out.get("id"), str):
        theirs, ours = wire.id_prefix
        out["id"] = ours + out["id"].removeprefix(theirs)
    out.pop("timings", None)
    usage = out.get("usage") or {}
    count(int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))
    return out


async def stream(wire: Wire, model: str, count: Count, *, include_usage: bool,
                 first_text: Callable[[], None] = lambda: None) -> AsyncGenerator[bytes]:
    """A streamed generation's events as the engine writes them, named for `model`. The first
    `__anext__` opens the exchange, so that a refusal raises before the response starts.
    With the wire's `usage_per_chunk`, each event that carries the runner's timings is decoded
    and carries the usage so far instead (vLLM's `continuous_usage_stats`)."""
    exchange = _Exchange(wire, model)
    try:
        status = await exchange.open()
        if status != 200:
            raise await exchange.refusal(status)
        yield b""  # open: the response may start
        renames = [(b'"model":' + json.dumps(wire.served_as).encode(),
                    b'"model":' + json.dumps(model).encode())]
        if wire.id_prefix is not None:
            renames.append((b'"id":"' + wire.id_prefix[0].encode(),
                            b'"id":"' + wire.id_prefix[1].encode()))
        pending = b""
        texted = False
        while True:
            pending += exchange.take()
            *events, pending = pending.split(b"\n\n")
            out: list[bytes] = []
            for event in events:
                if event.startswith(b"data: [DONE]"):
                    yield b"".join(out) + b"data: [DONE]\n\n"
                    return
                if b'"usage":{' in event:  # the last: its own event (chat), or the finish's
                    usage = orjson.loads(event[6:]).get("usage") or {}
                    count(int(usage.get("prompt_tokens", 0)),
                          int(usage.get("completion_tokens", 0)))
                    if not include_usage and b'"choices":[]' in event:
                        continue
                elif event.startswith(b"error") or event.startswith(b'data: {"error"'):
                    info = orjson.loads(event.partition(b" ")[2]).get("error", {})
                    error = refused(int(info.get("code", 500) or 500), info, model)
                    out.append(_event(described(error)[0]))
                    continue
                if event:
                    if wire.usage_per_chunk and b'"timings":{' in event:
                        event = _with_usage(event)
                    for theirs, ours in renames:
                        event = event.replace(theirs, ours)
                    out.append(event + b"\n\n")
            if out:
                chunk = b"".join(out)
                if not texted and _TEXT.search(chunk):
                    texted = True
                    first_text()
                yield chunk
            if not await exchange.read():
                break
        # The answer ended without its [DONE]: the engine died mid-stream.
        gone = EngineCrashed(f"the engine of {model} went away mid-stream", retry_after_s=1)
        yield _event(described(gone)[0]) + b"data: [DONE]\n\n"
    except OSError as exc:
        gone = EngineCrashed(f"the engine of {model} went away mid-stream: {exc}",
                             retry_after_s=1)
        yield _event(described(gone)[0]) + b"data: [DONE]\n\n"
    finally:
        exchange.close()


def _with_usage(event: bytes) -> bytes:
    """A runner's event with its `timings` turned into the usage so far (the prompt: its
    tokens read from the cache plus those it read now)."""
    payload = orjson.loads(event[6:])
    timings = payload.pop("timings", None) or {}
    prompt = int(timings.get("cache_n", 0)) + int(timings.get("prompt_n", 0))
    made = int(timings.get("predicted_n", 0))
    payload.setdefault("usage", {"prompt_tokens": prompt, "completion_tokens": made,
                                 "total_tokens": prompt + made})
    return b"data: " + orjson.dumps(payload)


def _event(payload: dict[str, Any]) -> bytes:
    return sse(payload).encode()
