"""Admin routes: what is loaded where, what a load would evict, and
load/unload/offload/pin/unpin."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query

from packserve.api.services import Services, ServicesDep
from packserve.logs import tail

router = APIRouter()


@router.get("/v1/residency")
async def residency(s: ServicesDep) -> dict[str, Any]:
    return {
        "devices": [asdict(d) for d in s.scheduler.devices()],
        "models": [{**asdict(m), "tasks": [t.value for t in m.tasks], "state": m.state.value,
                    "shares_weights_with": list(m.shares_weights_with)}
                   for m in s.scheduler.models()],
    }


@router.get("/v1/residency/plan")
async def plan(model: str, s: ServicesDep) -> dict[str, Any]:
    return _plan(model, s)


@router.get("/v1/residency/plans")
async def plans(s: ServicesDep) -> dict[str, Any]:
    """The dry run for every model at once (a pool's router reads it every stats period)."""
    return {"plans": [_plan(name, s) for name in s.scheduler.model_names()]}


def _plan(model: str, s: Services) -> dict[str, Any]:
    answer = s.scheduler.plan(model)
    return {**asdict(answer), "model": model, "verdict": answer.verdict.value,
            "victims": list(answer.victims)}


def _admin(verb: str) -> Callable[[str, Services], Awaitable[dict[str, Any]]]:
    """A route that runs the scheduler's `verb` (load, unload, offload, pin, unpin) on the
    model, then answers with the model's state."""

    async def route(name: str, s: ServicesDep) -> dict[str, Any]:
        action: Callable[[str], Awaitable[None] | None] = getattr(s.scheduler, verb)
        done = action(name)
        if done is not None:
            await done
        row = next(m for m in s.scheduler.models() if m.name == name)
        return {"model": name, "state": row.state.value, "pinned": row.pinned}
    return route


@router.get("/v1/residency/{name:path}/log")
async def engine_log(name: str, s: ServicesDep, lines: int = Query(default=50, ge=1, le=5000)
                     ) -> dict[str, Any]:
    """The last `lines` lines of the log of `name`'s engine process (its runner's: kept under
    `data_dir/logs/runners` after it dies), with its last crash, if any."""
    s.scheduler.spec_of(name)  # 404 for an unknown model
    row = next(m for m in s.scheduler.models() if m.name == name)
    return {"model": name, "state": row.state.value, "log": row.log,
            "lines": tail(Path(row.log), lines) if row.log else [],
            "last_crash": asdict(row.last_crash) if row.last_crash else None}


for _verb in ("load", "unload", "offload", "pin", "unpin"):
    router.add_api_route(f"/v1/residency/{{name:path}}/{_verb}", _admin(_verb), methods=["POST"])
