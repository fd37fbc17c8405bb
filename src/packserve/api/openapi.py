"""The OpenAPI document at `/openapi.json`, made to say what the server really takes and answers.

FastAPI's own document is close but wrong in three ways that matter to a client generator or a
fuzzer: a model route's `model` is any string (so every generated request is a 404), a bad
request is a 422 with FastAPI's own body (packserve answers 400 in OpenAI's error shape), and
integer bounds are rounded through floats (`seed` ≤ 2**63 - 1 comes out as ≤ 2**63). Here the
request bodies are pydantic's own validation schemas, `model` is an enum of the catalog names
that can do the route's task (and that the caller may call), and the error answers are listed
with their real status and shape. Nothing here changes how a request is handled.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from packserve.api.access import OperatorViews, access_of, may_call
from packserve.api.schemas import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ResponsesRequest,
)
from packserve.auth import Access
from packserve.types import Task

# Each request body, with the task its route asks of the model.
BODIES: dict[type[BaseModel], Task] = {
    EmbeddingRequest: Task.EMBED,
    RerankRequest: Task.RERANK,
    ChatRequest: Task.CHAT,
    CompletionRequest: Task.COMPLETE,
    ResponsesRequest: Task.CHAT,
}

# (catalog name, its tasks), in catalog order.
Catalog = Sequence[tuple[str, Sequence[Task]]]

_REF = "#/components/schemas/{model}"
_ERROR = "Error"

# What each error status means, per kind of route (see docs/api.md).
_MODEL_ERRORS = {
    "400": "malformed or out-of-range input, a value of the wrong JSON type, or a task the model "
           "lacks",
    "404": "no such model, or one the key may not call",
    "413": "the body is over `max_request_bytes`",
    "429": "the model's queue is full (with `Retry-After`)",
    "503": "the model failed to load or memory is busy (with `Retry-After`), its engine crashed, "
           "or the server is draining",
    "507": "the model can never fit in its device's budget",
}
_OUTPUT_INVALID = ("the model finished with output that does not satisfy the JSON "
                   "`response_format` (never passed off as an answer)")
_ADMIN_ERRORS = {
    "404": "no such model",
    "409": "the model's state forbids the action",
    "503": "the model failed to load, or the server is draining",
    "507": "the model can never fit in its device's budget",
}
_AUTH_ERRORS = {
    "401": "no API key, or one that is not valid",
    "403": "an admin route called with a plain key",
}


def error_schema() -> dict[str, Any]:
    """OpenAI's error shape, as `api.asgi.error_body` writes it."""
    nullable_string = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    return {
        "title": _ERROR, "type": "object", "required": ["error"],
        "additionalProperties": False,
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "additionalProperties": False,
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": nullable_string,
                "code": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
            },
        }},
    }


def describe(base: dict[str, Any], catalog: Catalog, *, keys: bool = False,
             views: OperatorViews = "admin") -> dict[str, Any]:
    """`base` (FastAPI's document, left untouched) made true for a server of `catalog`, with
    API keys required (`keys`) or not. A pure function of its arguments."""
    doc = copy.deepcopy(base)
    schemas: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas[_ERROR] = error_schema()

    # Request bodies: pydantic's validation schemas (exact integer bounds), with the models.
    refs, defs = models_json_schema([(m, "validation") for m in BODIES], ref_template=_REF)
    schemas.update(defs.get("$defs", {}))
    names = [name for name, _ in catalog]
    body_task: dict[str, Task] = {}
    for model, task in BODIES.items():
        component = schemas[model.__name__]
        assert refs[(model, "validation")]["$ref"] == _REF.format(model=model.__name__)
        able = [name for name, tasks in catalog if task in tasks]
        if able:  # an empty enum is no schema: with no model for the task, any name is a 404
            component["properties"]["model"] = {**component["properties"]["model"],
                                                "enum": able}
        body_task[_REF.format(model=model.__name__)] = task

    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            _describe_operation(path, method, op, body_task, names, keys, views)
    return doc


def _describe_operation(path: str, method: str, op: dict[str, Any], body_task: dict[str, Task],
                        names: list[str], keys: bool, views: OperatorViews) -> None:
    responses: dict[str, Any] = op.setdefault("responses", {})
    errors: dict[str, str] = {}
    if responses.pop("422", None) is not None:
        errors["400"] = "malformed or out-of-range input, or a value of the wrong JSON type"
    for param in op.get("parameters", []):
        # The admin routes' path and the dry-run plan's query name a catalog entry.
        if param.get("name") in ("name", "model") and names:
            param["schema"] = {**param.get("schema", {}), "enum": names}
    body_ref = (op.get("requestBody", {}).get("content", {}).get("application/json", {})
                .get("schema", {}).get("$ref"))
    if body_ref in body_task:
        errors.update(_MODEL_ERRORS)
        if body_task[body_ref] in (Task.CHAT, Task.COMPLETE):
            ok = responses.setdefault("200", {"description": "Successful Response"})
            ok.setdefault("content", {})["text/event-stream"] = {"schema": {
                "description": "with `\"stream\": true`: server-sent events, each a chunk "
                               "(or an error in OpenAI's shape), then `data: [DONE]`; on "
                               "/v1/responses, typed events (`response.created` ... "
                               "`response.completed`, or `error` and `response.failed`)",
                "anyOf": [{"type": "object"}, {"const": "[DONE]"}]}}
        if body_task[body_ref] is Task.CHAT:
            errors["502"] = _OUTPUT_INVALID
    elif method == "post" and "/v1/residency/" in path:
        errors.update(_ADMIN_ERRORS)
    elif path in ("/v1/residency/plan", "/v1/residency/{name}/log"):
        errors["404"] = _ADMIN_ERRORS["404"]
    elif path == "/v1/models/{model}":
        errors["404"] = _MODEL_ERRORS["404"]
    elif path == "/readyz":
        responses["503"] = {"description": "a pinned model is not loaded: which, why, and when "
                            "it is retried", "content": {"application/json": {"schema": {
                                "type": "object", "required": ["status"]}}}}
    if keys:
        need = access_of(method.upper(), path, views)
        if need is not Access.OPEN:
            errors["401"] = _AUTH_ERRORS["401"]
        if need is Access.ADMIN:
            errors["403"] = _AUTH_ERRORS["403"]
    for status, why in sorted(errors.items()):
        responses[status] = {"description": why, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=_ERROR)}}}}


def install(app: FastAPI, catalog: Callable[[], Iterable[tuple[str, Sequence[Task]]]], *,
            keys: bool = False, views: OperatorViews = "admin") -> None:
    """Serve `describe(...)` at `app.openapi()` (hence `/openapi.json` and `/docs`). `catalog`
    is read on each call, so a reloaded catalog is described at once; `model` enums list only
    the names the caller may call (`api.access.may_call`)."""
    base = app.openapi  # FastAPI's own, cached by FastAPI after its first call
    cache: dict[tuple[tuple[str, tuple[Task, ...]], ...], dict[str, Any]] = {}

    def openapi() -> dict[str, Any]:
        visible = tuple((name, tuple(tasks)) for name, tasks in catalog() if may_call(name))
        if visible not in cache:
            if len(cache) >= 16:  # key scopes (and reloads) each see their own catalog
                cache.clear()
            cache[visible] = describe(base(), visible, keys=keys, views=views)
        return cache[visible]

    app.openapi = openapi  # type: ignore[method-assign]
