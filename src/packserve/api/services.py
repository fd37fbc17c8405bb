"""What routes reach: one app's scheduler, telemetry and embedding batchers, through a FastAPI
dependency (`ServicesDep`). `create_app` makes them once and stores them on `app.state`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from packserve.api.access import CALLER, may_call
from packserve.api.asgi import REQUEST_ID
from packserve.api.batching import Batchers
from packserve.api.calls import Call
from packserve.auth import KeyLimits
from packserve.core.scheduler import Scheduler
from packserve.errors import ModelNotFound
from packserve.metrics.telemetry import Telemetry
from packserve.types import Task


@dataclass(frozen=True)
class Services:
    """The objects one app's routes share; made once by `create_app`."""

    scheduler: Scheduler
    telemetry: Telemetry
    batchers: Batchers = field(default_factory=Batchers)
    limits: KeyLimits = field(default_factory=KeyLimits)  # each API key's own limits

    @contextlib.asynccontextmanager
    async def lease(self, model: str, task: Task) -> AsyncIterator[Call]:
        """Lease `model` for `task` on behalf of the request being served, and use it through
        the `Call` this yields. Raises the scheduler's PackserveErrors (see `api.errors`)."""
        caller = CALLER.get()
        if caller is not None and (not caller.may_call(model)
                                   or model not in self.scheduler.model_names()):
            # The same answer whether the model is missing or out of scope: a key learns
            # nothing about models it may not call.
            raise ModelNotFound(
                f"model {model!r} does not exist or you have no access to it; key "
                f"{caller.name!r} may call: {', '.join(self.visible_models()) or 'no model'}",
                param="model")
        if caller is None:
            async with self.scheduler.acquire(model, task, request_id=REQUEST_ID.get()) as lease:
                yield Call(lease, self.batchers)
            return
        self.limits.admit(caller)  # RateLimited (429) before the request takes a model slot
        used = 0
        try:
            async with self.scheduler.acquire(model, task, request_id=REQUEST_ID.get(),
                                              key=caller.name, weight=caller.weight) as lease:
                try:
                    yield Call(lease, self.batchers)
                finally:
                    used = lease.prompt_tokens + lease.completion_tokens
        finally:
            self.limits.release(caller, used)

    def visible_models(self) -> list[str]:
        """The catalog names the request being served may call (all of them without keys)."""
        return [name for name in self.scheduler.model_names() if may_call(name)]


async def services(request: Request) -> Services:
    """The app's Services. Async, so that FastAPI runs it on the loop, not in a thread."""
    found: Services = request.app.state.services
    return found


ServicesDep = Annotated[Services, Depends(services)]
