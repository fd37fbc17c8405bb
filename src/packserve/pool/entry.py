"""The pool's entry point: one OpenAI-compatible door for every replica.

The same routes, errors and clients as one packserve server. API keys, their model scopes and
their limits are enforced here, once for the whole pool (replicas' nodes listen on loopback
without keys). Each model request goes to its group's deployment handle, whose router
(packserve.pool.router) picks the replica. Embeddings and rerank lost with a dead replica are
sent again (`pool.retries`); a generation is not (it may not repeat): it gets a 503 that says
so, or, once its stream has started, an error event and `[DONE]`.

Views (`/v1/pool`, `/metrics`, `/`) show every replica; admin routes take `?replica=ID` to act
on one replica, and otherwise load where the router would send a request and unload, pin or
unpin on every replica of the model's group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from importlib import resources
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from packserve.api.access import CALLER, Authenticate, check_keep_alive, may_call
from packserve.api.asgi import REQUEST_ID, BodyLimit, CancelOnDisconnect, RequestId, error_body
from packserve.api.edge import (
    KeyHold,
    error_of,
    error_response,
    http_error,
    relayed_headers,
    sniff,
    unexpected,
)
from packserve.api.stream_end import StreamEnd
from packserve.auth import KeyLimits, KeyRing
from packserve.config import Config
from packserve.errors import Forbidden, RateLimited
from packserve.pool.app import SHARED, groups
from packserve.pool.node import Relay, ReplicaReply
from packserve.pool.router import ROUTERS
from packserve.pool.routing import idle_copies

log = logging.getLogger("packserve.pool")
_event_log = logging.getLogger("packserve.events")

# A request addressed to one replica (views, admin) waits this long for it to answer.
ADDRESSED_S = 60.0
_RETRY_SAFE = frozenset({"/v1/embeddings", "/v1/rerank"})
_MODEL_ROUTES = ("/v1/embeddings", "/v1/rerank", "/v1/chat/completions", "/v1/completions",
                 "/v1/responses")
_LOST = (RayActorError, ActorUnavailableError)
_STATE_RANK = {"hot": 0, "loading": 1, "admitting": 2, "warm": 3, "unloading": 3, "failed": 5}
_STATUS_PAGE = (resources.files("packserve.pool") / "status.html").read_text("utf-8")


class EntryMetrics:
    """The entry point's own counters; /metrics adds every replica's, labelled by replica."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("packserve_pool_requests", "Model requests through the entry "
                                "point, by model, replica and status", ["model", "replica",
                                                                       "status"],
                                registry=self.registry)
        self.lost = Counter("packserve_pool_replica_lost", "Requests whose replica died under "
                            "them, by model and what happened: retried elsewhere or failed",
                            ["model", "outcome"], registry=self.registry)
        self.copies_dropped = Counter("packserve_pool_copies_dropped", "Extra copies of a "
                                      "model unloaded after copy_idle_s without requests",
                                      ["model", "replica"], registry=self.registry)


class Pool:
    """What the entry point's routes share: the config, each group's handle, the keys."""

    def __init__(self, config: Config, handles: Mapping[str, DeploymentHandle[Any]],
                 keys: KeyRing | None = None) -> None:
        self.config = config
        self.handles = dict(handles)
        self.keys = keys
        self.limits = KeyLimits()
        self.metrics = EntryMetrics()
        self.groups = groups(config)
        self.group_of = {m: g.name for g in self.groups for m in g.models}
        self.default_group = SHARED if SHARED in self.handles else self.groups[0].name

    def handle_for(self, model: str) -> DeploymentHandle[Any]:
        return self.handles[self.group_of.get(model, self.default_group)]

    def replicas(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(group, replica, last report) for every replica the routers know."""
        out = []
        for g in self.groups:
            router = ROUTERS.get(g.name)
            for replica, stats in (router.stats() if router else {}).items():
                out.append((g.name, replica, stats))
        return out

    async def send(self, relay: Relay, group: str | None = None) -> ReplicaReply:
        """One unary relay through the router (or to `relay.replica`)."""
        handle = self.handles[group] if group else self.handle_for(relay.model)
        if relay.model:
            handle = handle.options(multiplexed_model_id=relay.model)
        if relay.replica:  # Ray Serve waits for an addressed replica that is gone: bound it
            reply: ReplicaReply = await asyncio.wait_for(handle.relay.remote(relay), ADDRESSED_S)
        else:
            reply = await handle.relay.remote(relay)
        return reply

    async def start(self) -> None:
        """Make each handle build its router (Ray Serve does it on first use): a /healthz
        through every group, so the views know the replicas before the first request."""
        for name in self.handles:
            await self.send(Relay("GET", "/healthz", ()), name)

    async def placement(self) -> None:
        """Every stats period: unload extra copies idle for copy_idle_s (the last stays)."""
        pool = self.config.pool
        while True:
            await asyncio.sleep(pool.stats_period_s)
            for g in self.groups:
                router = ROUTERS.get(g.name)
                if router is None:
                    continue
                for replica, model in idle_copies(router.views(), time.time(),
                                                  pool.copy_idle_s):
                    relay = Relay("POST", f"/v1/residency/{model}/unload", (), b"",
                                  replica=replica)
                    try:
                        reply = await self.send(relay, g.name)
                    except Exception as exc:
                        log.warning("dropping the idle copy of %s on %s failed: %s", model,
                                    replica, exc)
                        continue
                    if reply.status == 200:
                        self.metrics.copies_dropped.labels(model=model, replica=replica).inc()
                        _event_log.info(json.dumps({
                            "ts": round(time.time(), 3), "kind": "pool_copy_dropped",
                            "model": model, "replica": replica,
                            "idle_s": pool.copy_idle_s}, sort_keys=True))


def create_entry_app(pool: Pool) -> ASGIApp:
    """The entry point's ASGI app."""

    async def model_request(request: Request) -> Response:
        body = await request.body()
        sniffed = sniff(body)
        model, stream = sniffed.model, sniffed.stream
        relay = _relay(request, body, model or "")
        if model is None:  # not a JSON object naming a model: the node's own 400 says why
            return _response(await pool.send(replace(relay, model=""), pool.default_group))
        if not may_call(model) or (pool.keys is not None and model not in pool.group_of):
            caller = CALLER.get()
            visible = [m for m in pool.group_of if may_call(m)]
            return error_response(404, f"model {model!r} does not exist or you have no access "
                                  f"to it; key {caller.name if caller else ''!r} may call: "
                                  f"{', '.join(visible) or 'no model'}", "invalid_request_error",
                                  "model_not_found", param="model")
        try:
            if sniffed.keep_alive:  # the nodes run without keys: their check never sees it
                check_keep_alive(model)
            hold = KeyHold.admit(pool.limits, CALLER.get())
        except (Forbidden, RateLimited) as exc:
            return error_of(exc)
        try:
            if stream:  # the stream releases it when it ends
                return await _stream(pool, relay, request.url.path, hold)
            reply = await _unary(pool, relay, request.url.path)
            if isinstance(reply, ReplicaReply):
                hold.count(reply.body)
            return _response(reply) if isinstance(reply, ReplicaReply) else reply
        finally:
            if not stream:
                hold.release()

    def model_rows() -> list[dict[str, Any]]:
        """Every model the caller may call, in its best state on any replica."""
        best: dict[str, str] = {}
        for _g, _r, stats in pool.replicas():
            for name, m in stats.get("models", {}).items():
                if _STATE_RANK.get(m["state"], 4) < _STATE_RANK.get(best.get(name, "cold"), 4):
                    best[name] = m["state"]
        return [{"id": m.name, "object": "model", "created": 0, "owned_by": "packserve",
                 "tasks": [t.value for t in m.tasks], "state": best.get(m.name, "cold")}
                for m in pool.config.models if may_call(m.name)]

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": model_rows()})

    async def one_model(request: Request) -> JSONResponse:
        """The openai SDK's models.retrieve; unknown and out of scope look the same."""
        name = request.path_params["model"]
        for row in model_rows():
            if row["id"] == name:
                return JSONResponse(row)
        return error_response(404, f"model {name!r} does not exist or you have no access to it",
                              "invalid_request_error", "model_not_found", param="model")

    async def view(_: Request) -> JSONResponse:
        return JSONResponse(pool_view(pool))

    async def residency(request: Request) -> Response:
        replica = request.query_params.get("replica")
        if replica:
            return await addressed(request, replica)
        if request.url.path == "/v1/residency":
            return JSONResponse(pool_view(pool))
        # the dry-run plan: every replica of the model's group
        model = request.query_params.get("model", "")
        group = pool.group_of.get(model, pool.default_group)
        return JSONResponse({"model": model,
                             "replicas": await each_replica(request, group)})

    async def admin(request: Request) -> Response:
        replica = request.query_params.get("replica")
        if replica:
            return await addressed(request, replica)
        name = request.path_params["name"]
        verb = request.url.path.rsplit("/", 1)[1]
        if name not in pool.group_of:
            return error_response(404, f"model {name!r} is not in the pool's config",
                                  "invalid_request_error", "model_not_found")
        group = pool.group_of[name]
        if verb == "load":  # where a request would go
            reply = await pool.send(replace(_relay(request, b"", ""), model=name), group)
            return _response(reply)
        return JSONResponse({"model": name, "replicas": await each_replica(request, group)})

    async def each_replica(request: Request, group: str) -> dict[str, Any]:
        """`request` sent to every replica of `group`: each one's answer, or its error."""
        answers: dict[str, Any] = {}
        for g, r, _stats in pool.replicas():
            if g != group:
                continue
            try:
                reply = await pool.send(_relay(request, b"", "", replica=r), g)
                answers[r] = json.loads(reply.body)
            except (*_LOST, RayServeException, TimeoutError) as exc:
                answers[r] = error_body(f"replica {r!r} did not answer: "
                                        f"{type(exc).__name__}", "server_error",
                                        code="replica_unavailable")
        return answers

    async def addressed(request: Request, replica: str) -> Response:
        group = next((g for g, r, _ in pool.replicas() if r == replica), None)
        if group is None:
            return error_response(404, f"no replica {replica!r} in the pool (GET /v1/pool "
                                  f"lists them)", "invalid_request_error", "replica_not_found")
        body = await request.body()
        try:
            return _response(await pool.send(_relay(request, body, "", replica=replica), group))
        except TimeoutError:
            return error_response(504, f"replica {replica!r} did not answer within "
                                  f"{ADDRESSED_S:.0f}s", "server_error", "replica_timeout")
        except (*_LOST, RayServeException) as exc:
            return error_response(503, f"replica {replica!r} is gone ({type(exc).__name__})",
                                  "model_unavailable", "replica_lost", retry_after=1)

    async def metrics(_: Request) -> Response:
        texts = {}
        for g, r, _stats in pool.replicas():
            with contextlib.suppress(*_LOST, RayServeException, TimeoutError):
                reply = await pool.send(Relay("GET", "/metrics", (), replica=r), g)
                if reply.status == 200:  # a node that is down answers 503 in JSON
                    texts[r] = reply.body.decode("utf-8")
        registry = CollectorRegistry()
        registry.register(_Relabelled(texts))
        return Response(generate_latest(registry) + generate_latest(pool.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    async def summary(_: Request) -> JSONResponse:
        out = {}
        for g, r, _stats in pool.replicas():
            with contextlib.suppress(*_LOST, RayServeException, TimeoutError):
                reply = await pool.send(Relay("GET", "/v1/metrics/summary", (), replica=r), g)
                if reply.status == 200:
                    out[r] = json.loads(reply.body)
        return JSONResponse({"replicas": out})

    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "replicas": len(pool.replicas())})

    async def readyz(_: Request) -> JSONResponse:
        replicas = pool.replicas()
        reported = {g for g, _r, stats in replicas if stats.get("models") is not None}
        missing = [g.name for g in pool.groups if g.name not in reported]
        silent = [r for _g, r, stats in replicas if stats.get("models") is None]
        if missing or silent:  # routing ranks an unreported replica last: wait for all
            return JSONResponse({"status": "not_ready", "groups_without_replicas": missing,
                                 "replicas_not_reported": silent}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def status_page(_: Request) -> HTMLResponse:
        return HTMLResponse(_STATUS_PAGE)

    async def not_found(request: Request) -> Response:
        return error_response(404, f"no route {request.method} {request.url.path} on the "
                              f"pool's entry point", "invalid_request_error", "not_found")

    routes = [Route(p, model_request, methods=["POST"]) for p in _MODEL_ROUTES]
    routes += [
        Route("/", status_page, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/health", healthz, methods=["GET"]),  # vLLM's, TGI's and SGLang's name
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/metrics/summary", summary, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", one_model, methods=["GET"]),
        Route("/v1/pool", view, methods=["GET"]),
        Route("/v1/residency", residency, methods=["GET"]),
        Route("/v1/residency/plan", residency, methods=["GET"]),
        *(Route(f"/v1/residency/{{name:path}}/{verb}", admin, methods=["POST"])
          for verb in ("load", "unload", "offload", "pin", "unpin")),
        Route("/{path:path}", not_found, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(Authenticate, keys=pool.keys, views=pool.config.server.operator_views),
            Middleware(BodyLimit, max_bytes=pool.config.server.max_request_bytes),
            Middleware(CancelOnDisconnect),
        ],
        exception_handlers={StarletteHTTPException: http_error,
                            Exception: unexpected(log, "entry point")},
    )
    return RequestId(app)


def pool_view(pool: Pool) -> dict[str, Any]:
    """Every replica: its group, Ray node, devices and models, as last reported."""
    return {"replicas": [
        {"group": g, "replica": r, "node": stats.get("node", ""), "gpus": stats.get("gpus", []),
         "reported_at": stats.get("at"), "devices": stats.get("devices", []),
         "models": [{"name": name, **m} for name, m in stats.get("models", {}).items()]}
        for g, r, stats in pool.replicas()]}


async def _unary(pool: Pool, relay: Relay, path: str) -> ReplicaReply | Response:
    retries = pool.config.pool.retries if path in _RETRY_SAFE else 0
    for attempt in range(retries + 1):
        try:
            reply = await pool.send(relay)
        except RayServeException as exc:  # no replica to route to (all gone, or none yet)
            pool.metrics.lost.labels(model=relay.model, outcome="failed").inc()
            return error_response(503, f"the pool has no replica that can take model "
                                  f"{relay.model!r} now ({type(exc).__name__}: {exc})",
                                  "model_unavailable", "pool_unavailable", retry_after=5)
        except _LOST as exc:
            if attempt < retries:
                pool.metrics.lost.labels(model=relay.model, outcome="retried").inc()
                log.info("request %s (%s): its replica died (%s); sent again", REQUEST_ID.get(),
                         relay.model, type(exc).__name__)
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            pool.metrics.lost.labels(model=relay.model, outcome="failed").inc()
            return _lost(relay.model, path, exc, attempt)
        if reply.node_down and attempt < retries:
            relay = replace(relay, avoid=(*relay.avoid, reply.replica))
            pool.metrics.lost.labels(model=relay.model, outcome="retried").inc()
            log.info("request %s (%s): the node of replica %s is down; sent again",
                     REQUEST_ID.get(), relay.model, reply.replica)
            await asyncio.sleep(0.2 * (attempt + 1))
            continue
        pool.metrics.requests.labels(model=relay.model, replica=reply.replica,
                                     status=str(reply.status)).inc()
        return reply
    raise AssertionError("unreachable")


def _lost(model: str, path: str, exc: BaseException, attempt: int) -> Response:
    if path in _RETRY_SAFE:
        why = f"it was sent {attempt + 1} times and each replica died"
    else:
        why = "a generation is not sent again because it may not repeat"
    return error_response(503, f"the pool replica serving model {model!r} died while running this "
                          f"request ({type(exc).__name__}); {why}. Its models come up on another "
                          f"replica at the next request", "model_unavailable", "replica_lost",
                          retry_after=1)


async def _stream(pool: Pool, relay: Relay, path: str, hold: KeyHold) -> Response:
    handle = pool.handle_for(relay.model).options(stream=True,
                                                  multiplexed_model_id=relay.model)
    gen = handle.relay_stream.remote(relay)
    assert isinstance(gen, DeploymentResponseGenerator)
    try:
        head = await gen.__anext__()
    except _LOST as exc:
        pool.metrics.lost.labels(model=relay.model, outcome="failed").inc()
        hold.release()
        return _lost(relay.model, path, exc, 0)
    except BaseException:
        hold.release()
        raise
    assert isinstance(head, ReplicaReply)
    pool.metrics.requests.labels(model=relay.model, replica=head.replica,
                                 status=str(head.status)).inc()
    if head.node_down:  # a generation is not sent again: its 503 says why
        hold.release()
        return _response(head)

    async def body() -> AsyncIterator[bytes]:
        end = StreamEnd(path)
        try:
            async for chunk in gen:
                assert isinstance(chunk, bytes)
                end.seen(chunk)
                hold.count(chunk)
                yield chunk
        except _LOST as exc:
            pool.metrics.lost.labels(model=relay.model, outcome="failed").inc()
            message = (f"the pool replica serving model {relay.model!r} died mid-stream "
                       f"({type(exc).__name__}); a generation is not sent again")
            yield end.ending(message, "replica_lost")
        finally:
            hold.release()

    response = StreamingResponse(body(), status_code=head.status)
    response.raw_headers = [*head.headers, (b"x-packserve-replica", head.replica.encode())]
    return response


def _relay(request: Request, body: bytes, model: str, replica: str = "") -> Relay:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    if replica:  # the node must not see the pool's own parameter
        query = "&".join(f"{k}={v}" for k, v in request.query_params.multi_items()
                         if k != "replica")
        target = request.url.path + (f"?{query}" if query else "")
    headers = tuple(relayed_headers(request.headers.raw, REQUEST_ID.get(),
                                    drop=frozenset({b"authorization"})))
    return Relay(request.method, target, headers, body, model, replica)


def _response(reply: ReplicaReply) -> Response:
    response = Response(reply.body, status_code=reply.status)
    response.raw_headers = [*reply.headers, (b"content-length", str(len(reply.body)).encode()),
                            (b"x-packserve-replica", reply.replica.encode())]
    return response


class _Relabelled(Collector):
    """Every replica's metrics, merged family by family, each sample labelled by replica."""

    def __init__(self, texts: Mapping[str, str]) -> None:
        self.texts = texts

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in self.texts.items():
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type,
                                        family.unit))
                for s in family.samples:
                    merged.add_sample(s.name, {"replica": replica, **s.labels}, s.value,
                                      s.timestamp, s.exemplar)
        return list(families.values())
