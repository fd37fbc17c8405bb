"""Reranking, at the three paths that rerank clients call: /v1/rerank, /rerank and /v2/rerank."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter

from packserve.api.schemas import RerankRequest
from packserve.api.services import ServicesDep
from packserve.core.request import Inputs
from packserve.types import Task

router = APIRouter()


async def rerank(body: RerankRequest, s: ServicesDep) -> dict[str, Any]:
    docs = body.texts
    async with s.call(body.model, Task.RERANK, Inputs(docs, "documents", also=[body.query]),
                      body.keep_alive) as call:
        out = await call.rerank(body.query, docs)
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


for _path in ("/v1/rerank", "/rerank", "/v2/rerank"):
    router.add_api_route(_path, rerank, methods=["POST"])
