"""The HTTP app: its lifespan, middleware, error mapping (api.errors) and routers (api.routes).

Routes validate, ask the scheduler for a lease, and run the model off the loop (api.calls);
they reach the scheduler, telemetry and batchers through `Services` on `app.state`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from packserve.api.access import Authenticate, OperatorViews
from packserve.api.asgi import BodyLimit, CancelOnDisconnect, RequestId
from packserve.api.batching import Batchers
from packserve.api.errors import add_error_handlers
from packserve.api.openapi import install as install_openapi
from packserve.api.routes import ROUTERS
from packserve.api.services import Services
from packserve.auth import KeyRing
from packserve.config import SloConfig
from packserve.core.compute import Gates
from packserve.core.events import CLIENT_CLOSED
from packserve.core.scheduler import Scheduler
from packserve.metrics.telemetry import Telemetry


def create_app(scheduler: Scheduler, telemetry: Telemetry, *, max_request_bytes: int = 4 << 20,
               start_scheduler: bool = True, background_start: bool = False,
               sample_interval_s: float = 1.0, keys: KeyRing | None = None,
               operator_views: OperatorViews = "admin", compute_priority: bool = False,
               slo: SloConfig | None = None) -> FastAPI:
    """The ASGI app around `scheduler`. Its lifespan loads the pins (before serving, or while
    serving with `background_start`), samples headroom every `sample_interval_s`, and unloads
    the models at shutdown. With `keys`, every request is checked (api.access). Engine calls
    compete for compute by deadline (`core.compute`) unless `compute_priority` is off; `slo`
    gives each model type's latency target."""

    async def sample_forever() -> None:
        while True:
            telemetry.sample()
            await asyncio.sleep(sample_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        sampler = asyncio.create_task(sample_forever())
        starting: asyncio.Task[None] | None = None
        if start_scheduler and background_start:
            starting = asyncio.create_task(scheduler.start())
        elif start_scheduler:
            await scheduler.start()
        try:
            yield
        finally:
            sampler.cancel()
            if starting is not None:
                starting.cancel()
                with contextlib.suppress(BaseException):
                    await starting
            await scheduler.close()

    app = FastAPI(title="packserve", version="0.1.0", lifespan=lifespan)
    app.state.services = Services(scheduler, telemetry, gates=Gates(enabled=compute_priority),
                                  slo=slo or SloConfig(),
                                  batchers=Batchers(on_pass=telemetry.count_embedding_pass))
    # Outermost last: ids first, then the caller's key, counting, the body limit, and
    # cancellation on disconnect.
    app.add_middleware(CancelOnDisconnect)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(CountResponses, telemetry=telemetry)
    app.add_middleware(Authenticate, keys=keys, views=operator_views)
    app.add_middleware(RequestId)
    add_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    install_openapi(app, lambda: [(m.name, m.tasks) for m in scheduler.models()],
                    keys=keys is not None, views=operator_views)
    return app


class CountResponses:
    """Count every HTTP response by route template and status code."""

    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app = app
        self.telemetry = telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = False

        async def sending(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = int(message["status"]), True
            await send(message)

        try:
            await self.app(scope, receive, sending)
            if not started:  # CancelOnDisconnect stopped it: the client had gone
                status = CLIENT_CLOSED
        except asyncio.CancelledError:
            if not started:
                status = CLIENT_CLOSED
            raise
        finally:
            route = scope.get("route")
            self.telemetry.count_response(getattr(route, "path", "unmatched"), status)
