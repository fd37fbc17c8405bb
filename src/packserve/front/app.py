"""The front process: it owns the listening socket and hands every request to the worker.

Why a front at all: the worker holds every engine, and engines are native code that can die
(SIGSEGV, SIGILL, an OOM kill). The front imports no engine (no torch, no llama.cpp), so it
survives; while a new worker starts it keeps the port answering, fails only the requests that
were running a generation in a charged engine (503, or an error event in a started stream),
and sends everything else again once (docs/reliability.md has the scenarios and figures).

It also owns what must outlive a worker: draining on SIGTERM, config reload on SIGHUP and
`POST /v1/admin/reload`, the crash history, quarantines and their counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from packserve import uvicorn_server
from packserve.api.access import Authenticate
from packserve.api.asgi import (
    REQUEST_ID,
    BodyLimit,
    CancelOnDisconnect,
    RequestId,
    error_body,
)
from packserve.api.edge import (
    HOP_RESPONSE,
    error_response,
    http_error,
    relayed_headers,
    sniff,
    unexpected,
)
from packserve.api.stream_end import StreamEnd
from packserve.auth import KeyRing
from packserve.config import Config
from packserve.errors import ConfigError
from packserve.front.supervisor import DEEP_PROBE_S, Crash, Supervisor, Worker, WorkerAlive
from packserve.front.upstream import Upstream, UpstreamError
from packserve.front.upstream import request as upstream_request

log = logging.getLogger("packserve.front")
_event_log = logging.getLogger("packserve.events")

# An operator's load names its model in the path, not in a body (for crash labels only: what
# a load clears, the worker reports; packserve.front.supervisor).
_LOAD_PREFIX, _LOAD_SUFFIX = "/v1/residency/", "/load"
# Keys read once when the worker or the front starts; a reload that changes them is refused.
RESTART_KEYS = ("host", "port", "data_dir")


class FrontMetrics:
    """The front's own counters; /metrics appends them to the worker's."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.crashes = Counter(
            "packserve_engine_crashes", "Engine process deaths: the worker's, charged to each "
            "model whose engine was running (model=\"\" when none was), and each runner "
            "process's, charged to its models", ["model", "signal"], registry=self.registry)
        self.worker_starts = Counter("packserve_worker_starts",
                                     "Worker processes started, the first one included",
                                     registry=self.registry)
        self.after_crash = Counter(
            "packserve_crash_requests", "Requests in flight when a worker died, by what "
            "happened to them: retried once, or failed (a generation in a charged engine)",
            ["model", "outcome"], registry=self.registry)

    def on_crash(self, crash: Crash) -> None:
        for model in crash.charged or ("",):
            self.crashes.labels(model=model, signal=crash.cause).inc()

    def on_runner_crash(self, model: str, cause: str) -> None:
        self.crashes.labels(model=model, signal=cause).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Front:
    """What the front's routes share: the supervisor, draining and the requests in flight."""

    def __init__(self, config: Config, supervisor: Supervisor, metrics: FrontMetrics,
                 reload: Callable[[], Config] | None = None, keys: KeyRing | None = None
                 ) -> None:
        self.config = config
        self.keys = keys
        self.supervisor = supervisor
        self.metrics = metrics
        self._reload = reload
        self.draining = False
        self.in_flight = 0
        self._ids: set[str] = set()  # the ids the worker sees, of the requests in flight
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def wait_s(self) -> float:
        """How long a request waits for a worker to answer (a restart, a slow first start)."""
        return self.config.server.load_wait_s

    @contextlib.contextmanager
    def tracked(self) -> Iterator[None]:
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    @contextlib.contextmanager
    def unique_id(self, rid: str) -> Iterator[str]:
        """The id the worker sees: `rid`, or `rid.N` while another request in flight has the
        same one (clients choose X-Request-ID; crashes are charged by the id)."""
        wid, n = rid, 0
        while wid in self._ids:
            n += 1
            wid = f"{rid[:120]}.{n}"
        self._ids.add(wid)
        try:
            yield wid
        finally:
            self._ids.discard(wid)

    async def wait_idle(self, within_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), within_s)
            return True
        except TimeoutError:
            return False

    async def reload(self) -> dict[str, Any]:
        """Re-read the config; refuse it (ConfigError) if invalid or if it changes keys that
        need a restart; else hand it to the worker, which adds, removes and requotes models
        without dropping a request."""
        if self._reload is None:
            raise ConfigError("this server was not started from a config it can re-read")
        new = await asyncio.to_thread(self._reload)
        old = self.config
        changed = [f"server.{k}" for k in RESTART_KEYS
                   if getattr(old.server, k) != getattr(new.server, k)]
        changed += [f"server.{k}" for k in type(old.server).model_fields
                    if k not in RESTART_KEYS and getattr(old.server, k) != getattr(new.server, k)]
        if old.devices != new.devices:
            changed.append("devices")
        if changed:
            raise ConfigError(f"not reloaded: {', '.join(changed)} changed, which needs a "
                              f"restart; the running config keeps serving")
        worker = await self.supervisor.wait_up(self.wait_s)
        if worker is None:
            raise ConfigError("not reloaded: no worker is answering")
        try:
            async with asyncio.timeout(self.wait_s + 30):
                status, answer = await worker.call("POST", "/internal/reconfigure",
                                                   new.model_dump_json().encode())
            body = json.loads(answer)
            if status != 200:
                raise ConfigError(f"not reloaded: {body['error']['message']}")
        except (UpstreamError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"not reloaded: the worker did not answer the reload "
                              f"({type(exc).__name__}: {exc}); the running config keeps "
                              f"serving") from exc
        self.config = new
        self.supervisor.config = new
        # Deaths of weights that are gone are no charge against those that replace them.
        self.supervisor.forget([*body.get("removed", ()), *body.get("new_weights", ())],
                               "a reload")
        _event_log.info(json.dumps({"ts": round(time.time(), 3), "kind": "reload", **body},
                                   sort_keys=True))
        return {"status": "reloaded", **body}


def create_front_app(front: Front) -> ASGIApp:
    supervisor = front.supervisor

    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "worker": supervisor.view()})

    async def healthz_deep(_: Request) -> JSONResponse:
        """The deep probe (what alerts watch): the worker's scheduler read within a bound, and
        the front's view of the worker. 503 when the worker does not answer or is stuck."""
        view = supervisor.view()
        worker = await supervisor.wait_up(0)
        if worker is None:
            return JSONResponse({"status": f"worker {supervisor.state.value}", "worker": view},
                                status_code=503)
        try:
            async with asyncio.timeout(DEEP_PROBE_S):
                status, text = await worker.call("GET", "/internal/liveness")
            body = json.loads(text)
        except (UpstreamError, TimeoutError, ValueError):
            return JSONResponse({"status": "worker not answering", "bound_s": DEEP_PROBE_S,
                                 "worker": view}, status_code=503)
        return JSONResponse({**body, "worker": view}, status_code=status)

    async def readyz(request: Request) -> Response:
        if front.draining:
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"Retry-After": "5"})
        worker = supervisor.current
        if worker is None or not worker.up.is_set() or worker.dead.done():
            body = {"status": "not_ready", "worker": supervisor.state.value}
            if worker is not None and worker.pending and not worker.dead.done():
                body["pending"] = worker.pending  # e.g. assembling a model on a first start
            return JSONResponse(body, status_code=503)
        return await proxy(request)

    async def metrics(_: Request) -> Response:
        text = b""
        worker = await supervisor.wait_up(0)
        if worker is not None:
            with contextlib.suppress(UpstreamError, TimeoutError):
                async with asyncio.timeout(10):
                    _status, text = await worker.call("GET", "/metrics")
        return Response(text + front.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def summary(request: Request) -> Response:
        if await supervisor.wait_up(2.0) is None:
            return JSONResponse(error_body(
                f"the worker is {supervisor.state.value}; the crash history is in "
                f"/healthz and in the event log", "model_unavailable",
                code="worker_unavailable"), status_code=503, headers={"Retry-After": "1"})
        response = await proxy(request)
        if response.status_code != 200 or not isinstance(response.body, bytes):
            return response
        data = json.loads(response.body)
        data["worker"] = supervisor.view()
        data["crashes"] = [c.as_dict() for c in reversed(supervisor.crashes)]
        return JSONResponse(data, headers={"x-request-id": REQUEST_ID.get()})

    async def reload(_: Request) -> JSONResponse:
        try:
            return JSONResponse(await front.reload())
        except ConfigError as exc:
            return JSONResponse(error_body(exc.message, "invalid_request_error",
                                           code="config_not_reloaded"), status_code=400)

    async def proxy(request: Request) -> Response:
        if request.url.path.startswith("/internal/"):
            return error_response(404, f"no route {request.url.path}", "not_found_error",
                                  "not_found")
        if front.draining:
            return error_response(503, "packserve is shutting down; retry on another replica "
                                  "or in a few seconds", "server_draining", "draining",
                                  retry_after=5)
        body = await request.body()
        stack = contextlib.ExitStack()
        stack.enter_context(front.tracked())
        call = _Call(request, body, stack.enter_context(front.unique_id(REQUEST_ID.get())))
        try:
            response = await _forward(front, call)
        except BaseException:
            stack.close()
            raise
        if isinstance(response, StreamingResponse):
            # Ends when the stream does, however it ends (the relay's finally, or after it).
            response.background = BackgroundTask(stack.close)
            call.on_stream_end = stack.close
        else:
            stack.close()
        return response

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    app = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/health", healthz, methods=["GET"]),  # vLLM's, TGI's and SGLang's name
            Route("/healthz/deep", healthz_deep, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/metrics/summary", summary, methods=["GET"]),
            Route("/v1/admin/reload", reload, methods=["POST"]),
            Route("/{path:path}", proxy, methods=methods),
        ],
        middleware=[
            # A request its key may not make is refused before its body is read or relayed;
            # the worker checks again (and checks each model against the key's scope).
            Middleware(Authenticate, keys=front.keys, views=front.config.server.operator_views),
            Middleware(BodyLimit, max_bytes=front.config.server.max_request_bytes),
            Middleware(CancelOnDisconnect),
        ],
        exception_handlers={StarletteHTTPException: http_error,
                            Exception: unexpected(log, "front")},
    )
    # Outside Starlette's error middleware, so that its 500s carry the request id too.
    return RequestId(app)


class _Call:
    """One client request, as it will be sent (and maybe sent again) to a worker."""

    def __init__(self, request: Request, body: bytes, rid: str) -> None:
        self.method = request.method
        # As the client sent it (percent-encoded): the decoded path may hold spaces.
        query: bytes = request.scope.get("query_string", b"")
        self.target = (request.scope.get("raw_path") or request.url.path.encode("utf-8")) + (
            b"?" + query if query else b"")
        self.body = body
        self.rid = rid
        self.headers = relayed_headers(request.headers.raw, rid)
        self.path = request.url.path
        self.on_stream_end: Callable[[], None] | None = None

    @functools.cached_property
    def model(self) -> str:
        """The model it asks for, for crash metrics and messages: parsed only after a crash,
        never on the way in (a body may be megabytes of JSON)."""
        return _model_of(self.path, self.body)


def _model_of(path: str, body: bytes) -> str:
    if path.startswith(_LOAD_PREFIX) and path.endswith(_LOAD_SUFFIX):
        return path[len(_LOAD_PREFIX):-len(_LOAD_SUFFIX)]
    return (sniff(body).model or "")[:128]


async def _forward(front: Front, call: _Call) -> Response:
    """Send `call` to the worker; after a crash, fail it or send it once more (Crash.fails)."""
    supervisor = front.supervisor
    attempt = 0
    while True:
        worker = await supervisor.wait_up(front.wait_s)
        if worker is None and supervisor.stopping and supervisor.config_error is None:
            return error_response(503, "packserve is shutting down", "server_draining", "draining",
                                  retry_after=5)
        if worker is None:
            why = supervisor.config_error or f"no worker answered within {front.wait_s:.0f}s"
            return error_response(503, f"packserve cannot serve this now: {why}",
                                  "model_unavailable", "worker_unavailable", retry_after=5)
        try:
            return await _send(front, worker, call)
        except UpstreamError:
            verdict = await _after_failure(front, worker, call, attempt)
            if verdict is not None:
                return verdict
            attempt += 1


async def _send(front: Front, worker: Worker, call: _Call) -> Response:
    """One try. A stream's response starts as soon as the worker's does (its lease is taken);
    anything else is read whole first, so a crash before the end can still be answered."""
    upstream = await upstream_request(worker.pool, call.method, call.target,
                                      call.headers, call.body)
    headers = [(k, v) for k, v in upstream.headers if k.lower() not in HOP_RESPONSE]
    if upstream.header(b"content-type").startswith(b"text/event-stream"):
        stream = StreamingResponse(_relay(front, worker, call, upstream),
                                   status_code=upstream.status)
        stream.raw_headers = headers
        return stream
    try:
        content = await upstream.read()
    finally:
        upstream.close()
    response = Response(content, status_code=upstream.status)
    response.raw_headers = [*headers, (b"content-length", str(len(content)).encode())]
    return response


async def _after_failure(front: Front, worker: Worker, call: _Call,
                         attempt: int) -> Response | None:
    """The connection to `worker` broke: a 503 for this request, or None to send it again."""
    try:
        crash = await front.supervisor.death_of(worker)
    except WorkerAlive:
        return error_response(502, "the connection to packserve's worker failed while it stayed up",
                              "server_error", "worker_connection_failed")
    if crash is None:  # stopping
        return error_response(503, "packserve is shutting down", "server_draining", "draining",
                              retry_after=5)
    model = call.model or "(none)"
    run = crash.fails(call.rid)
    if run is not None:
        front.metrics.after_crash.labels(model=model, outcome="failed").inc()
        return error_response(503, _crash_message(crash, run.model, run.task), "model_unavailable",
                              "engine_crashed", retry_after=1)
    if attempt >= 1:
        front.metrics.after_crash.labels(model=model, outcome="failed").inc()
        doing = "ran" if call.rid in crash.running else "waited"
        return error_response(503, f"packserve's worker died ({crash.cause}) again while this "
                              f"request {doing}; it had already been sent again once after an "
                              f"earlier crash", "model_unavailable", "engine_crashed",
                              retry_after=1)
    front.metrics.after_crash.labels(model=model, outcome="retried").inc()
    log.info("request %s (%s) sent again after the worker died (%s)", call.rid, model,
             crash.cause)
    return None


def _crash_message(crash: Crash, model: str, task: str) -> str:
    if model not in crash.charged:  # the worker was restarted for another model's hung load
        return (f"the worker serving model {model!r} was restarted while running this {task} "
                f"request, because the load of {', '.join(crash.charged) or 'a model'} hung "
                f"past load_timeout_s; a {task} is not sent again because it may not repeat; a "
                f"new worker serves the next requests")
    tail = (f"; {model} is now quarantined until crash_window_s has passed or an operator "
            f"loads it (third crash within crash_window_s)" if model in crash.quarantined else
            "; a new worker serves the next requests (pinned models load at once, the others "
            "on first use)")
    return (f"the engine of model {model!r} crashed ({crash.cause}) while running this {task} "
            f"request; a {task} is not sent again because it may not repeat{tail}")


async def _relay(front: Front, worker: Worker, call: _Call,
                 upstream: Upstream) -> AsyncIterator[bytes]:
    """Relay a worker's event stream. If the worker dies mid-stream: an error in the route's
    own shape, then the end (`api.stream_end`)."""
    end = StreamEnd(call.path)
    try:
        async for chunk in upstream.chunks():
            if chunk:
                end.seen(chunk)
                yield chunk
    except UpstreamError:
        try:
            crash = await front.supervisor.death_of(worker)
        except WorkerAlive:
            crash = None
        if crash is not None:
            run = crash.fails(call.rid)
            front.metrics.after_crash.labels(model=call.model or "(none)",
                                             outcome="failed").inc()
            message = _crash_message(crash, run.model if run else call.model,
                                     run.task if run else "streamed")
            code = "engine_crashed"
        else:
            message, code = "the connection to packserve's worker broke mid-stream", \
                "worker_connection_failed"
        yield end.ending(message, code)
    finally:
        if call.on_stream_end is not None:
            call.on_stream_end()
        upstream.close()


class _FrontServer(uvicorn_server.Server):
    """uvicorn, minus its own signal handling: the front drains on SIGTERM/SIGINT instead of
    closing the socket at once."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run_front(config: Config, reload: Callable[[], Config] | None = None,
                    keys: KeyRing | None = None) -> int:
    """Serve `config`: start the worker, open the port at once, drain on SIGTERM or SIGINT,
    reload the config and the keys on SIGHUP. Returns the exit status."""
    metrics = FrontMetrics()
    supervisor = Supervisor(config, on_crash=metrics.on_crash,
                            on_runner_crash=metrics.on_runner_crash,
                            on_start=metrics.worker_starts.inc)
    front = Front(config, supervisor, metrics, reload, keys)
    app = create_front_app(front)
    server = _FrontServer(uvicorn_server.Config(
        app, host=config.server.host, port=config.server.port, log_level=config.server.log_level,
        access_log=config.server.access_log,
        ws="none",  # no websocket routes; "auto" imports the websockets library (~1 MiB)
        lifespan="off", timeout_graceful_shutdown=2))
    loop = asyncio.get_running_loop()
    status = 0
    draining: asyncio.Task[None] | None = None

    async def drain(signame: str) -> None:
        front.draining = True
        drain_s = front.config.server.drain_s
        log.info("%s: draining; %d requests in flight get up to %.0fs", signame,
                 front.in_flight, drain_s)
        t0 = time.monotonic()
        idle = await front.wait_idle(drain_s)
        log.info("drained in %.2fs%s", time.monotonic() - t0,
                 "" if idle else f"; {front.in_flight} requests were still running")
        await supervisor.stop(grace_s=max(5.0, drain_s - (time.monotonic() - t0)))
        server.should_exit = True

    def on_stop(signame: str) -> None:
        nonlocal draining
        if draining is None:
            draining = asyncio.create_task(drain(signame))
        else:  # a second signal: stop waiting
            log.warning("%s again: stopping now", signame)
            background.add(asyncio.create_task(supervisor.stop(grace_s=0)))
            server.force_exit = server.should_exit = True

    background: set[asyncio.Task[None]] = set()

    def on_hup() -> None:
        if keys is not None and keys.reload():  # the worker sees the file change on its own
            log.info("SIGHUP: keys reloaded from %s (%d keys)", keys.path, len(keys.keys))

        async def run() -> None:
            try:
                result = await front.reload()
                log.info("SIGHUP: config reloaded: %s", result)
            except ConfigError as exc:
                log.error("SIGHUP: %s", exc.message)
            except Exception:
                log.exception("SIGHUP: the reload failed")
        task = asyncio.create_task(run())
        background.add(task)
        task.add_done_callback(background.discard)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop, sig.name)
    loop.add_signal_handler(signal.SIGHUP, on_hup)

    async def watch_config_error() -> None:
        nonlocal status
        await supervisor.refused.wait()
        status = 2
        server.should_exit = True

    await supervisor.start()
    watcher = asyncio.create_task(watch_config_error())
    try:
        await server.serve()
    finally:
        watcher.cancel()
        if draining is None or not draining.done():
            await supervisor.stop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
    return status
