"""Error mapping: every error leaves in OpenAI's shape, {"error": {"message", "type", "param",
"code"}}, with the status its class declares (packserve.errors) or 400, 404, 413 or 500.

Before a response starts the exception handlers send it; after (a stream), the stream reports
`described(exc)` in-band.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from packserve.api.asgi import error_body
from packserve.errors import PackserveError

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def described(exc: Exception) -> tuple[dict[str, Any], int]:
    """The error body and status for `exc`: its own for a PackserveError, else a 500."""
    if isinstance(exc, PackserveError):
        return error_body(exc.message, exc.type, exc.param, exc.code), exc.status
    return error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500


def add_error_handlers(app: FastAPI) -> None:
    """Map what routes and the framework raise to OpenAI-shaped responses."""
    app.exception_handler(PackserveError)(_packserve_error)
    app.exception_handler(RequestValidationError)(_invalid)
    app.exception_handler(StarletteHTTPException)(_http)
    app.exception_handler(Exception)(_unexpected)


async def _packserve_error(_: Request, exc: PackserveError) -> JSONResponse:
    body, status = described(exc)
    return JSONResponse(body, status_code=status, headers=exc.headers)


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems, param = [], None
    for err in exc.errors():
        if err["type"] == "json_invalid":
            return JSONResponse(error_body(
                f"request body is not valid JSON: {err.get('ctx', {}).get('error', '')}",
                "invalid_request_error"), status_code=400)
        where = _where(err["loc"], exc.body)
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):  # the tag itself
            where += "." + str(err.get("ctx", {}).get("discriminator", "")).strip("'")
        param = param or where
        problems.append(f"{where}: {err['msg']}")
    message = "invalid request: " + "; ".join(problems[:5])
    return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)


def _where(loc: Sequence[int | str], body: object) -> str:
    """The path a client wrote, e.g. `messages.0.content`: without pydantic's names for union
    members ("function-after[...]" and the like, with addresses in them) and without the tag of
    a member picked by a field's value (`messages.0.user.content` names the role, not a key)."""
    parts, node = [], body
    for p in loc:
        if p == "body" or "[" in str(p):
            continue
        if isinstance(node, dict) and p not in node and p in (node.get("role"), node.get("type")):
            continue  # the tag of the member that `role` (or `type`) picked
        parts.append(str(p))
        if isinstance(node, dict):
            node = node.get(p)
        elif isinstance(node, list) and isinstance(p, int) and 0 <= p < len(node):
            node = node[p]
        else:
            node = None
    return ".".join(parts) or "body"


async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    code = _HTTP_CODES.get(exc.status_code, str(exc.status_code))
    return JSONResponse(error_body(str(exc.detail), type_, code=code),
                        status_code=exc.status_code, headers=exc.headers)  # 405: Allow


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    body, status = described(exc)
    return JSONResponse(body, status_code=status)
