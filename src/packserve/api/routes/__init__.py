"""The HTTP routes, one router per concern; `create_app` includes `ROUTERS` in this order."""

from __future__ import annotations

from packserve.api.routes import openai, operations, rerank, residency, responses

ROUTERS = (operations.router, openai.router, responses.router, rerank.router,
           residency.router)
