"""The openai SDK as the suite's client: one pointed at a served process, and what a stream cut
by its source's death must look like through it."""

from __future__ import annotations

from collections.abc import Sequence

import openai
from openai.types.responses import ResponseErrorEvent, ResponseStreamEvent


def openai_client(url: str, key: str = "unused", timeout: float = 60.0) -> openai.OpenAI:
    """The SDK pointed at `url` (a front or a pool's entry point), without its own retries."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=timeout)


def assert_response_failed(events: Sequence[ResponseStreamEvent],
                           code: str) -> ResponseErrorEvent:
    """`events`, a whole /v1/responses stream as the SDK yielded it, was cut by its source's
    death: it ends in-band, with a typed `error` event of `code` and `response.failed` for the
    response it created, numbered on from the last event relayed. Returns the error event."""
    created, error, failed = events[0], events[-2], events[-1]
    assert created.type == "response.created", events[:1]
    assert error.type == "error" and failed.type == "response.failed", events[-3:]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert error.code == code, error
    assert failed.response.id == created.response.id and failed.response.status == "failed"
    assert failed.response.error is not None and failed.response.error.code == code
    return error
