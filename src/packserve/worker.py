"""The worker process: it holds the scheduler and every engine, and serves the whole packserve
app on a Unix socket that only the front process talks to.

The front (packserve.front) starts it with `python -m packserve.worker` and these variables:

- `PACKSERVE_WORKER_CONFIG`: a file holding the validated config as JSON;
- `PACKSERVE_WORKER_SOCKET`: the Unix socket to serve on;
- `PACKSERVE_CONTROL_FD`: a pipe to the front. Before a model's engine is called (a request's
  lease starts, a load starts) and after, the worker writes one JSON line there, so that if the
  process dies the front knows which models' engines were running: those are charged with the
  crash; every other request is safe to send again. After an operator's load succeeds it writes
  one more (`operator_loaded`): the front then lifts that model's quarantine and forgets its
  charges; after a runner's death, one (`exit`) with the crash rule's verdict on it;
- `PACKSERVE_QUARANTINE`: JSON `{model: {"action": "backoff" | "quarantine", "for_s": s,
  "reason": text}}`, the models the crash rule (core.crashes) holds back, by the deaths of
  earlier workers or of runners, each for its seconds left;
- `PACKSERVE_DEATHS`: JSON `{model: [seconds ago, ...]}`, the deaths of each model's runners
  under earlier workers: the crash rule counts them with this worker's, so a restart does not
  give a model a clean slate.

Nothing else starts it. It dies with the front (PR_SET_PDEATHSIG), and writes Python's own
traceback of every thread to stderr if it crashes in native code (faulthandler).
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

# At module level: FastAPI resolves the route's annotations here. Starlette's Request, which is
# what fastapi.Request is: the front imports this module for its constants and never needs
# FastAPI (~10 MiB and 0.2 s of its start-up).
from starlette.requests import Request

from packserve.pdeath import die_with_parent

ENV_CONFIG = "PACKSERVE_WORKER_CONFIG"
ENV_SOCKET = "PACKSERVE_WORKER_SOCKET"
ENV_CONTROL_FD = "PACKSERVE_CONTROL_FD"
ENV_QUARANTINE = "PACKSERVE_QUARANTINE"
ENV_DEATHS = "PACKSERVE_DEATHS"
ENV_FRONT_PID = "PACKSERVE_FRONT_PID"

# How long the worker keeps an idle connection from the front open: far longer than the front
# keeps one for its next request (packserve.front.upstream.IDLE_S), so that the worker never
# closes a connection the front is about to use.
KEEP_ALIVE_S = 300

# The worker's exit status when its config cannot be served (a source missing, pins that do
# not fit): the front stops instead of restarting it.
EXIT_CONFIG = 2

log = logging.getLogger("packserve.worker")


class ControlChannel:
    """The worker's half of the pipe to the front, and its only writer: one JSON line (`k`
    says what) per engine call start and end, per operator load that succeeded, per runner's
    death (with the crash rule's verdict), and for the first-start work the worker is busy
    with.

    Lines are under PIPE_BUF (4 KiB) so each write is atomic; writes happen on the event loop
    thread, before the engine is called, so the front has the line if the engine then crashes.
    """

    def __init__(self, fd: int) -> None:
        # Here, once, not in on_event (called for every event): the front imports this
        # module for its constants and needs neither.
        import orjson

        from packserve.core import events

        self._fd = fd
        self._dumps = orjson.dumps  # twice per request: faster than the json module
        self._events = events

    def send(self, message: dict[str, object]) -> None:
        data = self._dumps(message) + b"\n"
        if len(data) > 4000:  # ids and names are at most 128 characters: never happens
            log.error("control line too long, not sent: %r", data[:200])
            return
        try:
            os.write(self._fd, data)
        except OSError as exc:  # the front is gone; PR_SET_PDEATHSIG will end us
            log.warning("control pipe write failed: %s", exc)

    def pending(self, what: str) -> None:
        """Say what the worker is busy with before it can serve (the front's /readyz shows it)."""
        self.send({"k": "pending", "what": what[:1000]})

    def on_event(self, event: object) -> None:
        events = self._events
        if isinstance(event, events.RequestStartEvent):
            self.send({"k": "start", "rid": event.request_id, "model": event.model,
                       "task": event.task})
        elif isinstance(event, events.RequestEvent) and event.started:
            self.send({"k": "end", "rid": event.request_id})
        elif isinstance(event, events.LoadStartEvent):
            self.send({"k": "load", "model": event.model})
        elif isinstance(event, events.LoadEvent | events.LoadFailedEvent):
            self.send({"k": "loaded", "model": event.model})
        elif isinstance(event, events.CrashEvent):
            # A runner's death: the front counts it beside its worker's own
            # (packserve_engine_crashes{model,signal}).
            self.send({"k": "exit", "model": event.model, "signal": event.signal,
                       "doing": event.doing, "action": event.action,
                       "for_s": event.retry_in_s, "deaths": event.deaths})
        elif isinstance(event, events.OperatorLoadEvent):
            # Written before the admin route answers 200, on a pipe the front's event loop
            # reads: the front has acted on it before it reads any request its client sends
            # after that answer.
            self.send({"k": "operator_loaded", "model": event.load or event.model})


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the front dies, however it dies: nobody can reach our
    socket then, and the device memory we hold is wanted by the next front's worker."""
    if not die_with_parent():  # not Linux: the front's stop() still ends us
        return
    # The front died before prctl took effect. (Compared with the front's pid, not with 1:
    # in a container the front may itself be pid 1.)
    front = os.environ.get(ENV_FRONT_PID)
    if front is not None and os.getppid() != int(front):
        sys.exit(0)


def main() -> int:
    _die_with_parent()
    faulthandler.enable()
    from packserve.config import Config
    from packserve.errors import ConfigError
    from packserve.logs import configure_logging

    config = Config.model_validate_json(Path(os.environ[ENV_CONFIG]).read_text("utf-8"))
    configure_logging(config.server.log_level)
    quarantine: dict[str, dict[str, Any]] = json.loads(os.environ.get(ENV_QUARANTINE) or "{}")
    deaths: dict[str, list[float]] = json.loads(os.environ.get(ENV_DEATHS) or "{}")
    control = ControlChannel(int(os.environ[ENV_CONTROL_FD]))
    try:
        return asyncio.run(_serve(config, os.environ[ENV_SOCKET], control, quarantine, deaths))
    except ConfigError as exc:
        print(f"packserve: {exc.message}", file=sys.stderr)
        return EXIT_CONFIG


async def _serve(config: Any, socket_path: str, control: ControlChannel,
                 quarantine: dict[str, dict[str, Any]], deaths: dict[str, list[float]]) -> int:
    from fastapi.responses import JSONResponse

    from packserve import uvicorn_server
    from packserve.api.app import create_app
    from packserve.api.asgi import error_body
    from packserve.config import Config
    from packserve.core.events import log_event
    from packserve.errors import ConfigError
    from packserve.server import (
        build_entries,
        build_keyring,
        build_scheduler,
        build_telemetry,
    )

    assert isinstance(config, Config)
    # One-time work of a first start (assembling a packaged model) shows in the front's /readyz.
    scheduler = build_scheduler(config, sinks=(log_event, control.on_event),
                                announce=control.pending)
    # The runner deaths the front has seen under earlier workers, and what the crash rule
    # (core.crashes) made of those and of the earlier workers' own deaths.
    scheduler.remember_deaths({name: [float(a) for a in ages] for name, ages in deaths.items()})
    for name, rule in quarantine.items():
        if name not in scheduler.model_names():
            continue
        if rule.get("action") == "backoff":
            scheduler.back_off(name, float(rule["for_s"]))
        else:
            scheduler.quarantine(name, str(rule["reason"]), rule.get("for_s"))
    telemetry = build_telemetry(config, scheduler)
    app = create_app(scheduler, telemetry, max_request_bytes=config.server.max_request_bytes,
                     background_start=True, keys=build_keyring(config),
                     operator_views=config.server.operator_views,
                     compute_priority=config.server.compute_priority, slo=config.server.slo)

    @app.post("/internal/reconfigure", include_in_schema=False)
    async def reconfigure(request: Request) -> JSONResponse:
        """Called by the front only (it never proxies /internal/) after it validated the file."""
        try:
            new = Config.model_validate_json(await request.body())
            entries = await asyncio.to_thread(build_entries, new)
            report = await scheduler.reconfigure(entries)
        except ConfigError as exc:
            return JSONResponse(error_body(exc.message, "invalid_request_error",
                                           code="invalid_config"), status_code=400)
        return JSONResponse({"added": list(report.added), "removed": list(report.removed),
                             "changed": list(report.changed),
                             "new_weights": list(report.new_weights)})

    server = uvicorn_server.Server(uvicorn_server.Config(
        app, uds=socket_path, log_level=config.server.log_level, lifespan="on",
        access_log=config.server.access_log, timeout_keep_alive=KEEP_ALIVE_S,
        ws="none",  # no websocket routes; "auto" imports the websockets library (~1 MiB)
        # The front sends SIGTERM only once it has drained its own requests: what is left is
        # gone (its client too), so the worker shuts down at once and unloads its models.
        timeout_graceful_shutdown=2))
    await server.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
