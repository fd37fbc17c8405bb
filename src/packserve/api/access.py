"""Who may call what: every route is open, needs a key, or needs an admin key.

- open: `/healthz` (also as `/health`), `/readyz`.
- any key: the OpenAI and rerank routes, `/v1/models`; a model route also checks the key's
  scope (`Services.call`), and a model outside it is "does not exist or you have no access".
- admin key: load, unload, offload, pin, unpin, reload, and a model's engine log
  (`GET /v1/residency/NAME/log`).
- the read-only operator views (`/`, `/metrics`, `/v1/metrics/summary`, `/v1/residency`, the
  deep probe `/healthz/deep`, the dry-run plans, a pool's `/v1/pool`, `/docs`, `/openapi.json`)
  are open or admin by `server.operator_views`.

Without a keys file every route is open (and the server listens on localhost only, unless the
operator accepts the risk with `server.open_to_anyone`). Shared by the front and the worker: the
front answers its own routes and refuses a bad key before relaying; the worker checks again.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from typing import Literal

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from packserve.api.asgi import error_body
from packserve.auth import Access, Key, KeyRing
from packserve.errors import Forbidden

OperatorViews = Literal["open", "admin"]

# The key of the request being served (None: no keys are configured).
CALLER: ContextVar[Key | None] = ContextVar("packserve_caller", default=None)

_OPEN = frozenset({"/healthz", "/health", "/readyz"})  # /health: vLLM's and TGI's name
_VIEWS = frozenset({"/", "/metrics", "/v1/metrics/summary", "/v1/residency", "/healthz/deep",
                    "/v1/residency/plan", "/v1/residency/plans", "/v1/pool", "/docs",
                    "/docs/oauth2-redirect", "/openapi.json", "/redoc"})
_ADMIN = re.compile(r"^/v1/residency/.+/(load|unload|offload|pin|unpin)$|^/v1/admin/")
_ADMIN_READS = re.compile(r"^/v1/residency/.+/log$")


def access_of(method: str, path: str, views: OperatorViews) -> Access:
    """The class of a request to `path`."""
    if path in _OPEN or path.startswith("/internal/"):  # the front never relays /internal/
        return Access.OPEN
    if (method != "GET" and _ADMIN.match(path)) or _ADMIN_READS.match(path):
        return Access.ADMIN
    if path in _VIEWS and method in ("GET", "HEAD"):
        return Access.OPEN if views == "open" else Access.ADMIN
    return Access.KEY


def bearer(scope: Scope) -> str | None:
    """The key sent as `Authorization: Bearer KEY`, if any."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = bytes(value).decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class Authenticate:
    """Refuse a request its caller may not make (401, 403), before anything else reads it, and
    expose the caller's key to the code that serves it through `CALLER`."""

    def __init__(self, app: ASGIApp, keys: KeyRing | None, views: OperatorViews = "admin"
                 ) -> None:
        self.app = app
        self.keys = keys
        self.views = views

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.keys is None:
            await self.app(scope, receive, send)
            return
        need = access_of(scope["method"], scope["path"], self.views)
        presented = bearer(scope)
        key = self.keys.find(presented) if presented is not None else None
        if need is not Access.OPEN:
            refusal = _refusal(need, presented, key)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        token = CALLER.set(key)
        try:
            await self.app(scope, receive, send)
        finally:
            CALLER.reset(token)


def _refusal(need: Access, presented: str | None, key: Key | None) -> JSONResponse | None:
    if presented is None:
        return JSONResponse(error_body(
            "no API key: send it as 'Authorization: Bearer KEY' (the openai SDK's api_key)",
            "invalid_request_error", code="invalid_api_key"), status_code=401,
            headers={"WWW-Authenticate": "Bearer"})
    if key is None:
        return JSONResponse(error_body(
            "the API key is not valid (unknown, revoked or mistyped)",
            "invalid_request_error", code="invalid_api_key"), status_code=401,
            headers={"WWW-Authenticate": "Bearer"})
    if need is Access.ADMIN and not key.admin:
        return JSONResponse(error_body(
            f"key {key.name!r} is not an admin key; this route needs one",
            "permission_error", code="admin_key_required"), status_code=403)
    return None


def may_call(model: str) -> bool:
    """Whether the request being served may use `model` (always, without keys)."""
    key = CALLER.get()
    return key is None or key.may_call(model)


def check_keep_alive(model: str) -> None:
    """Raise Forbidden unless the caller may send Ollama's `keep_alive`: it changes how long
    `model` stays loaded for every client, so only an admin key may (anyone, without keys)."""
    caller = CALLER.get()
    if caller is not None and not caller.admin:
        raise Forbidden(f"keep_alive sets how long model {model!r} stays loaded for every "
                        f"client: an admin key may send it; key {caller.name!r} is not one",
                        param="keep_alive")
