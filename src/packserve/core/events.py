"""Facts the scheduler emits, as plain frozen dataclasses. Exporters (logs, metrics) read them."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadEvent:
    model: str  # catalog names sharing the weights, joined by "+"
    device: str
    bytes_estimated: int
    bytes_measured: int
    seconds: float
    reason: str
    tier_from: str = "cold"  # "cold": a whole load; "warm": restored from the warm tier
    kind: str = "load"


@dataclass(frozen=True)
class EvictEvent:
    model: str
    device: str
    bytes: int
    seconds: float
    reason: str
    # make_room (another load needed the bytes), memory_retry (a load ran out of memory),
    # budget_shrank, overshoot (a load measured over its estimate and the device over its
    # budget), operator, retired (quarantined or removed from the catalog), idle (its
    # keep_alive ran out)
    cause: str = "make_room"
    policy: str = ""  # the device's victim policy, when it chose this victim
    why: str = ""  # the policy's words: "reload 0.4 s, next use expected in 90 s, ..."
    tier_to: str = "cold"  # "warm": its engine objects stay (`bytes` is what it gave back)
    kind: str = "evict"


@dataclass(frozen=True)
class LoadStartEvent:
    """The engine's `load()` of `model` is about to start in a worker thread.

    Emitted on the event loop just before the thread starts; the same load then ends with
    exactly one LoadEvent or LoadFailedEvent. A supervisor that sees the process die between
    the two knows the engine call was running.
    """

    model: str
    device: str
    kind: str = "load_start"


@dataclass(frozen=True)
class LoadFailedEvent:
    model: str
    device: str
    bytes: int  # what the load was admitted for
    seconds: float
    reason: str
    will_retry: bool
    kind: str = "failure"


@dataclass(frozen=True)
class RequestStartEvent:
    """A request got its lease: the model is hot and the request starts using the device."""

    model: str
    task: str
    device: str
    request_id: str = ""  # the caller's id (X-Request-ID), "" when it gave none
    key: str = ""  # the name of the caller's API key, "" without keys
    kind: str = "request_start"


@dataclass(frozen=True)
class RequestEvent:
    """A request ended (or was refused by its quota, with zero durations)."""

    model: str
    task: str
    device: str
    queue_seconds: float
    load_seconds: float
    inference_seconds: float
    status: int  # the HTTP status it maps to: 200, 499 if the caller went away, or the error's
    outcome: str  # "ok", "client_closed" (cancelled while waiting or holding), or the error class
    prompt_tokens: int = 0  # input tokens for embed and rerank
    completion_tokens: int = 0
    started: bool = False  # a RequestStartEvent was emitted for it
    request_id: str = ""
    key: str = ""  # the name of the caller's API key (never the key), "" without keys
    # A stream's time to its first text, from its arrival at the scheduler (queue, load or
    # restore, and prompt); None for an answer sent whole.
    first_token_seconds: float | None = None
    slo_s: float = 0.0  # the request's SLO: its first token (a stream) or its answer, within
    kind: str = "request"


@dataclass(frozen=True)
class OperatorLoadEvent:
    """An operator's load of catalog model `model` (`Scheduler.load`, the admin route
    `POST /v1/residency/NAME/load`) succeeded: it is hot, and whatever failed state it had (a
    cooldown, a quarantine) is cleared.

    Emitted once, after the load, only when it succeeded: never for one that failed or whose
    caller was cancelled. A front supervising this process forgives the crash charges of every
    name of the load (`load`; packserve.front.supervisor), so the next worker does not
    quarantine it again.
    """

    model: str  # the catalog name the operator gave, not the weights' label
    device: str
    load: str = ""  # the weights' label: every name that shares the load, "a+b"
    kind: str = "operator_load"


@dataclass(frozen=True)
class CrashEvent:
    """The engine process of `model` died on its own (a runner's: its reaper saw it, or its
    start failed or hung past load_timeout_s), and what the crash rule made of it
    (core.crashes). A front supervising this process counts it in
    `packserve_engine_crashes{model,signal}`, beside its worker's own deaths."""

    model: str  # catalog names sharing the weights, joined by "+"
    device: str
    pid: int
    signal: str  # the cause: "SIGKILL", "SIGKILL (OOM kill)", "exit status 1", "hung"
    doing: str  # serving, idle (hot, no request), warm, loading, going warm, waking
    action: str  # reload, backoff, quarantine (core.crashes.Action)
    retry_in_s: float  # until it may load again
    deaths: int  # within crash_window_s, this one included
    log: str  # where its log is kept
    log_tail: str
    kind: str = "crash"


Event = (LoadEvent | LoadStartEvent | EvictEvent | LoadFailedEvent | RequestStartEvent
         | RequestEvent | OperatorLoadEvent | CrashEvent)
EventSink = Callable[[Event], None]

_event_log = logging.getLogger("packserve.events")

# What a request cut short by its own client is counted as (nginx's convention; no response is
# sent). Distinct from 500 so that dashboards do not page on impatient clients.
CLIENT_CLOSED = 499


def log_event(event: Event) -> None:
    """The default sink: one JSON line per residency event, load starts included.

    Requests are too many to log; only those that ended in a server-side failure or a client
    abort (status 499 and above) are, so their request id can be found.
    """
    if isinstance(event, RequestStartEvent):
        return
    if isinstance(event, RequestEvent) and event.status < CLIENT_CLOSED:
        return
    _event_log.info(json.dumps({"ts": round(time.time(), 3), **dataclasses.asdict(event)},
                               sort_keys=True))


def emit(sinks: Iterable[EventSink], event: Event) -> None:
    """Hand `event` to every sink. A sink that raises is logged and skipped: an exporter's bug
    must not break scheduling."""
    for sink in sinks:
        try:
            sink(event)
        except Exception:
            logging.getLogger("packserve.scheduler").exception("event sink failed on %s", event)
