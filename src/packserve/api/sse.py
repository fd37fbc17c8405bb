"""The one writer of server-sent events: every stream packserve writes or ends (chat and
completion chunks, `/v1/responses`' typed events, a relay's error tail) goes through `sse`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def sse(payload: Mapping[str, Any] | str, event: str | None = None) -> str:
    """One event: `data:` with `payload` (JSON, or a string as it is, such as `[DONE]`), after
    an `event:` line naming it when `event` is given (the Responses API's typed events)."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"
