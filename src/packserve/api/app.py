"""The HTTP app. Routes validate, ask the scheduler for a lease, and call the backend off the loop.

Every error leaves in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from importlib import resources
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from packserve.api.asgi import (
    CLIENT_CLOSED,
    REQUEST_ID,
    BodyLimit,
    CancelOnDisconnect,
    RequestId,
    error_body,
)
from packserve.api.batching import Batchers
from packserve.api.schemas import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
)
from packserve.core.backend import Backend, Generated, GenerationParams, OnText
from packserve.core.backend import Message as ChatTurn
from packserve.core.scheduler import Scheduler
from packserve.errors import InvalidRequest, ModelOutputInvalid, PackserveError
from packserve.metrics.telemetry import Telemetry
from packserve.types import Task

log = logging.getLogger("packserve.api")

_STATUS_PAGE = (resources.files("packserve.api") / "status.html").read_text("utf-8")

Run = Callable[[Backend, OnText | None], Generated]


def create_app(scheduler: Scheduler, telemetry: Telemetry, *, max_request_bytes: int = 4 << 20,
               start_scheduler: bool = True, background_start: bool = False,
               sample_interval_s: float = 1.0) -> FastAPI:
    """The ASGI app around `scheduler`. Its lifespan loads the pins (before serving, or while
    serving with `background_start`), samples headroom every `sample_interval_s`, and unloads
    the models at shutdown."""

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
    # Outermost last: ids first, then counting, the body limit, and cancellation on disconnect.
    app.add_middleware(CancelOnDisconnect)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(CountResponses, telemetry=telemetry)
    app.add_middleware(RequestId)
    batchers = Batchers()

    # ------------------------------------------------------------ operator figures

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def status_page() -> HTMLResponse:
        return HTMLResponse(_STATUS_PAGE)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(telemetry.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/metrics/summary")
    async def metrics_summary() -> dict[str, Any]:
        return telemetry.summary()

    # ------------------------------------------------------------ errors

    @app.exception_handler(PackserveError)
    async def _packserve_error(_: Request, exc: PackserveError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code),
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems, param = [], None
        for err in exc.errors():
            if err["type"] == "json_invalid":
                return JSONResponse(error_body(
                    f"request body is not valid JSON: {err.get('ctx', {}).get('error', '')}",
                    "invalid_request_error"), status_code=400)
            loc = [str(p) for p in err["loc"] if p != "body"]
            where = ".".join(loc) or "body"
            param = param or where
            problems.append(f"{where}: {err['msg']}")
        message = "invalid request: " + "; ".join(problems[:5])
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = _HTTP_CODES.get(exc.status_code, str(exc.status_code))
        return JSONResponse(error_body(str(exc.detail), type_, code=code),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}",
                                       "server_error"), status_code=500)

    # ------------------------------------------------------------ health

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        readiness = scheduler.ready()
        if readiness.ready:
            return JSONResponse({"status": "ready"})
        # Each pin not loaded: its state, why its last load failed, and when it is retried
        # (next_retry_s is null when no retry is planned, e.g. a first load still running).
        return JSONResponse({"status": "not_ready", "pinned_not_loaded": readiness.not_loaded,
                             "pins": [asdict(p) for p in readiness.pins]},
                            status_code=503)

    # ------------------------------------------------------------ OpenAI-shaped routes

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "packserve",
             "tasks": [t.value for t in m.tasks], "state": m.state.value}
            for m in scheduler.models()]}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> JSONResponse:
        texts = body.texts
        rid = REQUEST_ID.get()
        async with scheduler.acquire(body.model, Task.EMBED, request_id=rid) as lease:
            out = await batchers.for_backend(lease.backend).embed(lease.backend, texts)
            lease.count_tokens(sum(out.tokens))
        data = []
        for i, vec in enumerate(out.vectors):
            value: Any = (base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
                          if body.encoding_format == "base64" else vec.tolist())
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(out.tokens)
        # A JSONResponse skips FastAPI's jsonable_encoder, which walks every float: 9 ms of a
        # 32 x 384 batch on the build machine (bench overhead found it).
        return JSONResponse({"object": "list", "data": data, "model": body.model,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def rerank(body: RerankRequest) -> dict[str, Any]:
        docs = body.texts
        rid = REQUEST_ID.get()
        async with scheduler.acquire(body.model, Task.RERANK, request_id=rid) as lease:
            out = await off_loop(lease.backend.rerank, body.query, docs)
            lease.count_tokens(out.tokens)
        order = sorted(range(len(docs)), key=lambda i: out.scores[i], reverse=True)
        results = []
        for i in order[: body.top_n or len(docs)]:
            row: dict[str, Any] = {"index": i, "relevance_score": out.scores[i]}
            if body.return_documents:
                row["document"] = {"text": docs[i]}
            results.append(row)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model, "results": results,
                "usage": {"total_tokens": out.tokens},
                "meta": {"billed_units": {"search_units": 1}}}

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest) -> dict[str, Any] | StreamingResponse:
        schema, json_mode = _response_format(body)
        params = GenerationParams(
            max_tokens=body.max_completion_tokens or body.max_tokens,
            temperature=body.temperature, top_p=body.top_p, stop=body.stops, seed=body.seed,
            json_schema=schema, json_object=json_mode)
        turns = [ChatTurn("system" if m.role == "developer" else m.role, m.text)
                 for m in body.messages]

        def run(backend: Backend, on_text: OnText | None) -> Generated:
            return backend.chat(turns, params, on_text)

        def check(out: Generated) -> None:
            if (schema is not None or json_mode) and out.finish_reason == "stop":
                _check_json(out.text, schema, body.model)

        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
                delta: dict[str, Any] = {}
                if text is None and finish is None:
                    delta = {"role": "assistant", "content": ""}
                elif text is not None:
                    delta = {"content": text}
                return {"id": cid, "object": "chat.completion.chunk", "created": created,
                        "model": body.model, "choices": [
                            {"index": 0, "delta": delta, "finish_reason": finish}]}
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await _stream(scheduler, body.model, Task.CHAT, run, chunk, check,
                                 include_usage)
        rid = REQUEST_ID.get()
        async with scheduler.acquire(body.model, Task.CHAT, request_id=rid) as lease:
            stop = threading.Event()
            out = await off_loop(run, lease.backend, _until(stop), on_cancel=stop.set)
            lease.count_tokens(out.prompt_tokens, out.completion_tokens)
        check(out)
        return {"id": cid, "object": "chat.completion", "created": created, "model": body.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "finish_reason": out.finish_reason}],
                "usage": _usage(out.prompt_tokens, out.completion_tokens)}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> dict[str, Any] | StreamingResponse:
        params = GenerationParams(max_tokens=body.max_tokens, temperature=body.temperature,
                                  top_p=body.top_p, stop=body.stops, seed=body.seed)
        prompts = body.prompts
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            if len(prompts) != 1:
                raise InvalidRequest("streaming takes one prompt", param="prompt")

            def run(backend: Backend, on_text: OnText | None) -> Generated:
                return backend.complete(prompts[0], params, on_text)

            def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
                return {"id": cid, "object": "text_completion", "created": created,
                        "model": body.model, "choices": [
                            {"index": 0, "text": text or "", "finish_reason": finish,
                             "logprobs": None}]}
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await _stream(scheduler, body.model, Task.COMPLETE, run, chunk, None,
                                 include_usage, opening_chunk=False)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        async with scheduler.acquire(body.model, Task.COMPLETE,
                                     request_id=REQUEST_ID.get()) as lease:
            for i, prompt in enumerate(prompts):
                stop = threading.Event()
                out = await off_loop(lease.backend.complete, prompt, params, _until(stop),
                                     on_cancel=stop.set)
                lease.count_tokens(out.prompt_tokens, out.completion_tokens)
                choices.append({"index": i, "text": out.text, "finish_reason": out.finish_reason,
                                "logprobs": None})
                prompt_tokens += out.prompt_tokens
                completion_tokens += out.completion_tokens
        return {"id": cid, "object": "text_completion", "created": created, "model": body.model,
                "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

    # ------------------------------------------------------------ residency admin

    @app.get("/v1/residency")
    async def residency() -> dict[str, Any]:
        return {
            "devices": [asdict(d) for d in scheduler.devices()],
            "models": [{**asdict(m), "tasks": [t.value for t in m.tasks], "state": m.state.value,
                        "shares_weights_with": list(m.shares_weights_with)}
                       for m in scheduler.models()],
        }

    @app.get("/v1/residency/plan")
    async def plan(model: str) -> dict[str, Any]:
        answer = scheduler.plan(model)
        return {**asdict(answer), "model": model, "verdict": answer.verdict.value,
                "victims": list(answer.victims)}

    def admin(action: Callable[[str], Awaitable[None] | None]) -> Callable[[str], Any]:
        async def route(name: str) -> dict[str, Any]:
            result = action(name)
            if result is not None:
                await result
            row = next(m for m in scheduler.models() if m.name == name)
            return {"model": name, "state": row.state.value, "pinned": row.pinned}
        return route

    app.add_api_route("/v1/residency/{name:path}/load", admin(scheduler.load), methods=["POST"])
    app.add_api_route("/v1/residency/{name:path}/unload", admin(scheduler.unload),
                      methods=["POST"])
    app.add_api_route("/v1/residency/{name:path}/pin", admin(scheduler.pin), methods=["POST"])
    app.add_api_route("/v1/residency/{name:path}/unpin", admin(scheduler.unpin),
                      methods=["POST"])
    return app


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args: object,
                   on_cancel: Callable[[], None] | None = None) -> T:
    """`fn(*args)` in a worker thread. A thread cannot be interrupted: if the request is
    cancelled (its client left), `on_cancel` asks the engine to stop early, and this still
    waits for the thread before re-raising, because the request's lease (and so the model's
    residency and its engine-call bookkeeping) must outlive every engine call made under it."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    cancelled = False
    while True:
        try:
            await asyncio.wait({task})
            break
        except asyncio.CancelledError:
            if not cancelled and on_cancel is not None:
                on_cancel()
            cancelled = True
    if cancelled:
        if not task.cancelled():
            task.exception()  # retrieved: the client is gone, nobody else will read it
        raise asyncio.CancelledError
    return task.result()


def _until(stop: threading.Event) -> OnText:
    """An `on_text` that asks the engine to stop once `stop` is set."""
    return lambda _text: not stop.is_set()


def _response_format(body: ChatRequest) -> tuple[dict[str, object] | None, bool]:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None, False
    if fmt.type == "json_object":
        return None, True
    assert fmt.json_schema is not None
    schema = fmt.json_schema.schema_
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequest(f"response_format.json_schema.schema is not a valid JSON schema: "
                             f"{exc.message}", param="response_format") from exc
    _check_refs(schema)
    return schema, False


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def _check_refs(schema: dict[str, object]) -> None:
    """Only local `$ref`s, all resolvable: nothing is ever fetched on a client's behalf."""
    from referencing import Registry, Resource
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import DRAFT202012

    resolver = Registry().with_resource(
        "urn:packserve:request", Resource.from_contents(schema, DRAFT202012)
    ).resolver("urn:packserve:request")
    for ref in _refs(schema):
        if not ref.startswith("#"):
            raise InvalidRequest(f"schema $ref {ref!r} is not local; only '#/...' references "
                                 f"are allowed", param="response_format")
        try:
            resolver.lookup(ref)
        except Unresolvable as exc:
            raise InvalidRequest(f"schema $ref {ref!r} does not resolve", param="response_format"
                                 ) from exc


def _validator(schema: dict[str, object]) -> Any:
    from jsonschema import Draft202012Validator
    from referencing import Registry

    return Draft202012Validator(schema, registry=Registry())


def _check_json(text: str, schema: dict[str, object] | None, model: str) -> None:
    """Never pass broken JSON off as an answer: it must parse and match the schema."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ModelOutputInvalid(f"model {model!r} stopped with output that is not JSON: "
                                 f"{exc}") from exc
    if schema is not None:
        errors = sorted(_validator(schema).iter_errors(value), key=str)
        if errors:
            raise ModelOutputInvalid(f"model {model!r} produced JSON that does not match the "
                                     f"schema: {errors[0].message}")
    elif not isinstance(value, dict):
        raise ModelOutputInvalid(f"model {model!r} produced JSON that is not an object")


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _stream(
    scheduler: Scheduler, model: str, task: Task, run: Run,
    chunk: Callable[[str | None, str | None], dict[str, Any]],
    check: Callable[[Generated], None] | None, include_usage: bool, *,
    opening_chunk: bool = True,
) -> StreamingResponse:
    """Server-sent events. The lease is taken before the response starts, so quota, load and
    unknown-model errors still get their status code; it is released when the stream ends,
    after the generating thread has stopped."""
    events = _stream_events(scheduler, model, task, run, chunk, check, include_usage,
                            opening_chunk)
    first = await events.__anext__()  # acquires the lease, or raises a PackserveError

    async def body() -> AsyncIterator[str]:
        yield first
        async for event in events:
            yield event

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _stream_events(
    scheduler: Scheduler, model: str, task: Task, run: Run,
    chunk: Callable[[str | None, str | None], dict[str, Any]],
    check: Callable[[Generated], None] | None, include_usage: bool, opening_chunk: bool,
) -> AsyncIterator[str]:
    async with scheduler.acquire(model, task, request_id=REQUEST_ID.get()) as lease:
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        stop = threading.Event()

        def on_text(text: str) -> bool:
            if stop.is_set():
                return False
            loop.call_soon_threadsafe(pieces.put_nowait, text)
            return True

        async def work() -> Generated:
            try:
                return await asyncio.to_thread(run, lease.backend, on_text)
            finally:
                pieces.put_nowait(None)

        worker = asyncio.create_task(work())
        try:
            yield _sse(chunk(None, None)) if opening_chunk else ": stream open\n\n"
            while (piece := await pieces.get()) is not None:
                yield _sse(chunk(piece, None))
            try:
                out = await worker
                lease.count_tokens(out.prompt_tokens, out.completion_tokens)
                if check is not None:
                    check(out)
            except PackserveError as exc:
                yield _sse(error_body(exc.message, exc.type, exc.param, exc.code))
            except Exception as exc:  # the response has started: report in-band, keep serving
                log.exception("stream for %s failed", model)
                yield _sse(error_body(f"internal error: {type(exc).__name__}: {exc}",
                                      "server_error"))
            else:
                yield _sse(chunk(None, out.finish_reason))
                if include_usage:
                    final = chunk(None, None)
                    final["choices"] = []
                    final["usage"] = _usage(out.prompt_tokens, out.completion_tokens)
                    yield _sse(final)
            yield _sse("[DONE]")
        finally:
            stop.set()
            # The client may have gone: finish the thread before the lease lets the model go.
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await worker


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
