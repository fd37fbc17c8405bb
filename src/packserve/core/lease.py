"""What a request holds while it uses a model: the boundary between the scheduler and the
handlers that run requests (`api/`); and the request's passage through the scheduler, which
its RequestEvent reports."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from packserve.core.backend import Runner
from packserve.core.events import CLIENT_CLOSED, RequestEvent
from packserve.errors import PackserveError
from packserve.types import Task


@dataclass
class Lease:
    """What a request holds while it uses a model. `runner` is valid until the lease ends.

    The handler records the tokens it reports to the client with `count_tokens`; they travel
    in the request's RequestEvent.
    """

    model: str
    task: Task
    runner: Runner
    prompt_tokens: int = 0
    completion_tokens: int = 0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    first_token_at: float | None = None  # a stream's first text went out (its clock's time)

    def count_tokens(self, prompt: int, completion: int = 0) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion

    def first_token(self) -> None:
        """A stream sent its first text now (time to first token, in the RequestEvent)."""
        if self.first_token_at is None:
            self.first_token_at = self.clock()


@dataclass
class Visit:
    """One request's passage through the scheduler (scheduler clock): it `entered`, took its
    quota `slot`, found its model hot (`ready`) and was lent `lease`; `event` reports it."""

    model: str
    task: Task
    device: str
    request_id: str
    key: str
    entered: float
    slot: float | None = None  # None: refused (its quota's queue was full, or it was cancelled)
    ready: float | None = None
    lease: Lease | None = None

    def event(self, now: float, exc: BaseException | None, slo_s: float) -> RequestEvent:
        """The RequestEvent of the visit ending `now`, by `exc` (None: it was served). A
        refused one is counted with zero load and inference seconds and no SLO."""
        status, outcome = (200, "ok") if exc is None else outcome_of(exc)
        refused = RequestEvent(
            model=self.model, task=self.task.value, device=self.device,
            queue_seconds=now - self.entered, load_seconds=0.0, inference_seconds=0.0,
            status=status, outcome=outcome, request_id=self.request_id, key=self.key)
        if self.slot is None:
            return refused
        ready = self.ready if self.ready is not None else self.slot
        lease = self.lease
        return dataclasses.replace(
            refused, queue_seconds=self.slot - self.entered, load_seconds=ready - self.slot,
            inference_seconds=now - ready,
            prompt_tokens=lease.prompt_tokens if lease else 0,
            completion_tokens=lease.completion_tokens if lease else 0,
            started=lease is not None, slo_s=slo_s,
            first_token_seconds=None if lease is None or lease.first_token_at is None
            else lease.first_token_at - self.entered)


def outcome_of(exc: BaseException) -> tuple[int, str]:
    """The status and outcome a request that ended with `exc` is counted with."""
    if isinstance(exc, asyncio.CancelledError):
        return CLIENT_CLOSED, "client_closed"
    if isinstance(exc, PackserveError):
        return exc.status, type(exc).__name__
    return 500, type(exc).__name__
