"""What operators read: the status page, Prometheus metrics and their summary, health."""

from __future__ import annotations

from dataclasses import asdict
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from packserve.api.services import ServicesDep

router = APIRouter()

_STATUS_PAGE = (resources.files("packserve.api") / "status.html").read_text("utf-8")


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def status_page() -> HTMLResponse:
    return HTMLResponse(_STATUS_PAGE)


@router.get("/metrics", include_in_schema=False)
async def metrics(s: ServicesDep) -> Response:
    return Response(s.telemetry.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/metrics/summary")
async def metrics_summary(s: ServicesDep) -> dict[str, Any]:
    return s.telemetry.summary()


@router.get("/healthz")
@router.get("/health", include_in_schema=False)  # the name vLLM, TGI and SGLang serve
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/internal/liveness", include_in_schema=False)
async def liveness(s: ServicesDep) -> JSONResponse:
    """The deep probe's reading, for the front only (it serves it as `/healthz/deep` and its
    watchdog reads it): what the scheduler is doing, read without waiting for any lock. 503
    when a device lock, a load or a queue has been stuck past `load_timeout_s`."""
    live = s.scheduler.liveness()
    body = {"status": "ok" if live.ok else "stuck", "load_timeout_s": live.load_timeout_s,
            "restart": live.restart, "wedged": list(live.wedged),
            **{k: [asdict(x) for x in getattr(live, k)] for k in ("stuck", "locks", "loads")}}
    return JSONResponse(body, status_code=200 if live.ok else 503)


@router.get("/readyz")
async def readyz(s: ServicesDep) -> JSONResponse:
    readiness = s.scheduler.ready()
    if readiness.ready:
        return JSONResponse({"status": "ready"})
    # Each pin not loaded: its state, why its last load failed, and when it is retried
    # (next_retry_s is null when no retry is planned, e.g. a first load still running).
    return JSONResponse({"status": "not_ready", "pinned_not_loaded": readiness.not_loaded,
                         "pins": [asdict(p) for p in readiness.pins]},
                        status_code=503)
