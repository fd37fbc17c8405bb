"""What generation routes share: the OpenAI envelope (id, created, choices, usage, stream chunks)
and the way a response is produced, whole or as server-sent events.

A route builds its `GenerationRequest` (api.request) and a `Completion`, and returns
`answer(...)`. Chat and text completions differ only in their names and in the shape of a
choice; a new generation route is one more `Completion` subclass.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from typing import Any, ClassVar

from fastapi.responses import StreamingResponse

from packserve.api.calls import Call
from packserve.api.errors import described
from packserve.api.request import finish
from packserve.api.services import Services
from packserve.api.sse import sse
from packserve.core.backend import FinishReason, Generated, TokenLogprob
from packserve.core.request import GenerationRequest
from packserve.errors import PackserveError

log = logging.getLogger("packserve.api")

ARGUMENT_PIECE = 32  # characters of a tool call's arguments per replayed chunk after its first


class Completion(ABC):
    """One response's envelope; its id and creation time are fixed when it is made."""

    prefix: ClassVar[str]  # of the id
    object_type: ClassVar[str]  # the "object" of the whole response
    chunk_type: ClassVar[str]  # the "object" of each stream chunk

    def __init__(self, model: str, *, logprobs: bool = False) -> None:
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.logprobs = logprobs  # the request asked for them: every choice carries them

    @abstractmethod
    def choice(self, index: int, out: Generated) -> dict[str, Any]:
        """Choice `index` of a whole response."""

    @abstractmethod
    def delta(self, text: str | None, finish: FinishReason | None,
              logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        """The one choice of a stream chunk: a piece of text (and the logprobs of its tokens),
        or the finish."""

    def opening(self) -> str:
        """What a stream sends first, once the lease is held (before any text)."""
        return ": stream open\n\n"

    def response(self, outs: Sequence[Generated]) -> dict[str, Any]:
        return {**self._head(self.object_type),
                "choices": [self.choice(i, out) for i, out in enumerate(outs)],
                "usage": usage(sum(o.prompt_tokens for o in outs),
                               sum(o.completion_tokens for o in outs))}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self._head(self.chunk_type), "choices": choices}

    def usage_chunk(self, out: Generated) -> dict[str, Any]:
        """The last chunk when the client asked for `stream_options.include_usage`."""
        return {**self.chunk([]), "usage": usage(out.prompt_tokens, out.completion_tokens)}

    def replayed(self, out: Generated, include_usage: bool) -> Iterator[str]:
        """A whole answer as OpenAI streams one: the opening; the text, or each call's id and
        name and then its arguments in pieces (chat's delta shape: only chats make calls); the
        finish; the usage if asked; `[DONE]`."""
        yield self.opening()
        if out.text:
            yield sse(self.chunk([self.delta(out.text, None, out.logprobs or ())]))
        for index, c in enumerate(out.tool_calls):
            pieces = [c.arguments[i:i + ARGUMENT_PIECE]
                      for i in range(0, len(c.arguments), ARGUMENT_PIECE)]
            head = {"index": index, "id": c.id, "type": "function",
                    "function": {"name": c.name, "arguments": ""}}
            yield sse(self.chunk([{"index": 0, "delta": {"tool_calls": [head]},
                                   "logprobs": None, "finish_reason": None}]))
            for piece in pieces:
                yield sse(self.chunk([{"index": 0, "delta": {"tool_calls": [
                    {"index": index, "function": {"arguments": piece}}]},
                    "logprobs": None, "finish_reason": None}]))
        yield sse(self.chunk([self.delta(None, out.finish_reason)]))
        if include_usage:
            yield sse(self.usage_chunk(out))
        yield sse("[DONE]")

    def _head(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}


class ChatCompletion(Completion):
    """/v1/chat/completions: an assistant message per choice; streams open with its role."""

    prefix = "chatcmpl"
    object_type = "chat.completion"
    chunk_type = "chat.completion.chunk"

    def choice(self, index: int, out: Generated) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": out.text}
        if out.tool_calls:  # the answer is calls (api.tools), not text
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in out.tool_calls]}
        return {"index": index, "message": message,
                "logprobs": self._logprobs(out.logprobs or ()),
                "finish_reason": out.finish_reason}

    def delta(self, text: str | None, finish: FinishReason | None,
              logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if text is None and finish is None:
            delta = {"role": "assistant", "content": ""}
        elif text is not None:
            delta = {"content": text}
        return {"index": 0, "delta": delta,
                "logprobs": self._logprobs(logprobs) if text is not None else None,
                "finish_reason": finish}

    def _logprobs(self, tokens: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """OpenAI's chat shape: each token with its bytes and the most likely alternatives."""
        if not self.logprobs:
            return None
        return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
                             "top_logprobs": [{"token": a.token, "logprob": a.logprob,
                                               "bytes": list(a.bytes)} for a in t.top]}
                            for t in tokens],
                "refusal": None}

    def opening(self) -> str:
        """The assistant's role, as OpenAI's streams start."""
        return sse(self.chunk([self.delta(None, None)]))


class TextCompletion(Completion):
    """/v1/completions: text per choice; streams open with an SSE comment."""

    prefix = "cmpl"
    object_type = chunk_type = "text_completion"

    def __init__(self, model: str, prompts: Sequence[str], *, logprobs: bool = False) -> None:
        super().__init__(model, logprobs=logprobs)
        self.prompts = list(prompts)
        # Where the next streamed token starts in the text (OpenAI counts from the prompt's
        # start: a completion's first token sits at len(prompt)).
        self._offset = len(self.prompts[0]) if self.prompts else 0
        self._bytes = self._utf8()  # one decoder across a stream's chunks

    def choice(self, index: int, out: Generated) -> dict[str, Any]:
        return {"index": index, "text": out.text, "finish_reason": out.finish_reason,
                "logprobs": self._logprobs(out.logprobs or (), len(self.prompts[index]),
                                           self._utf8())[0]}

    def delta(self, text: str | None, finish: FinishReason | None,
              logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        shape = None
        if text is not None:
            shape, self._offset = self._logprobs(logprobs, self._offset, self._bytes)
        return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": shape}

    @staticmethod
    def _utf8() -> codecs.IncrementalDecoder:
        return codecs.getincrementaldecoder("utf-8")("ignore")

    def _logprobs(self, tokens: Sequence[TokenLogprob], start: int,
                  decoder: codecs.IncrementalDecoder) -> tuple[dict[str, Any] | None, int]:
        """OpenAI's legacy shape: parallel lists of tokens, their logprobs, the alternatives
        and where each token starts."""
        if not self.logprobs:
            return None, start
        offsets, at = [], start
        for t in tokens:
            offsets.append(at)
            # Offsets count characters of the text: a token holding part of a multi-byte
            # character adds nothing until the one that completes it.
            at += len(decoder.decode(t.bytes))
        return {"tokens": [t.token for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [None if t.logprob is None
                                 else {a.token: a.logprob for a in t.top} for t in tokens],
                "text_offset": offsets}, at


async def answer(s: Services, request: GenerationRequest, reply: Completion
                 ) -> dict[str, Any] | StreamingResponse:
    """Answer `request` on one lease of its model, with one choice per prompt (the engine's own
    answer, relayed, for a plain one: `Runner.wire`). A streaming request is answered with
    server-sent events as its text comes; one with tools, once its whole answer is read
    (api.tools). Each output is `finish`ed: after the lease is given back, unless streaming."""
    if request.stream and request.tools is None:
        return await _streamed(s, request, reply)
    async with s.call(request.model, request.task, request.inputs, request.keep_alive) as call:
        wire = call.wire(request)
        if wire is not None:
            return await call.relay_whole(request, wire)
        outs = [await call.generate(request, i) for i in range(request.choices)]
    outs = [await finish(request, out) for out in outs]
    if request.stream:
        return StreamingResponse(reply.replayed(outs[0], request.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return reply.response(outs)


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


async def _streamed(s: Services, request: GenerationRequest, reply: Completion
                    ) -> StreamingResponse:
    """The lease is taken before the response starts, so quota, load and unknown-model errors
    still get their status code; it is released when the stream ends, after the generating
    thread has stopped. Errors after the start are reported in-band, then `[DONE]`."""
    return await event_stream(_events(s, request, reply))


async def event_stream(events: AsyncIterator[str | bytes]) -> StreamingResponse:
    """`events` as a server-sent-event response, once its first event has come: a generator
    that takes its lease before its first `yield` raises its PackserveError here, before the
    response starts, so that the error keeps its status code."""
    first = await events.__anext__()

    async def body() -> AsyncIterator[str | bytes]:
        yield first
        async for event in events:
            yield event

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _events(s: Services, request: GenerationRequest, reply: Completion
                  ) -> AsyncIterator[str | bytes]:
    async with s.call(request.model, request.task, request.inputs, request.keep_alive) as call:
        wire = call.wire(request)
        # Each inner generator is closed here, inside the lease, however the stream ends.
        if wire is not None:
            async with contextlib.aclosing(call.relay(
                    request, wire, include_usage=request.include_usage)) as raw:
                async for chunk in raw:
                    yield chunk
            return
        async with contextlib.aclosing(_generated(reply, call, request)) as events:
            async for event in events:
                yield event


async def _generated(reply: Completion, call: Call, request: GenerationRequest
                     ) -> AsyncGenerator[str]:
    async with call.stream(request) as pieces:
        yield reply.opening()
        async for piece in pieces:
            yield sse(reply.chunk([reply.delta(piece.text, None, piece.logprobs)]))
        try:
            out = await finish(request, await pieces.result())
        except Exception as exc:  # the response has started: report in-band, keep serving
            if not isinstance(exc, PackserveError):
                log.exception("stream for %s failed", reply.model)
            yield sse(described(exc)[0])
        else:
            yield sse(reply.chunk([reply.delta(None, out.finish_reason)]))
            if request.include_usage:
                yield sse(reply.usage_chunk(out))
        yield sse("[DONE]")
