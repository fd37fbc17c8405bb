"""Facts the scheduler emits, as plain frozen dataclasses. Exporters (logs, metrics) read them."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadEvent:
    model: str  # catalog names sharing the weights, joined by "+"
    device: str
    bytes_estimated: int
    bytes_measured: int
    seconds: float
    reason: str
    kind: str = "load"


@dataclass(frozen=True)
class EvictEvent:
    model: str
    device: str
    bytes: int
    reason: str
    kind: str = "evict"


@dataclass(frozen=True)
class LoadFailedEvent:
    model: str
    device: str
    seconds: float
    reason: str
    will_retry: bool
    kind: str = "failure"


@dataclass(frozen=True)
class RequestEvent:
    model: str
    task: str
    queue_seconds: float
    load_seconds: float
    inference_seconds: float
    outcome: str  # "ok" or the error class name
    kind: str = "request"


Event = LoadEvent | EvictEvent | LoadFailedEvent | RequestEvent
EventSink = Callable[[Event], None]

_event_log = logging.getLogger("packserve.events")


def log_event(event: Event) -> None:
    """The default sink: one JSON line per residency event (requests are too many to log)."""
    if isinstance(event, RequestEvent):
        return
    _event_log.info(json.dumps(dataclasses.asdict(event), sort_keys=True))
