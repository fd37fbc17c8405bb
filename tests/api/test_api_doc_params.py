"""docs/api.md's table of request parameters names exactly the fields each route's body takes."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from packserve.api.schemas import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ResponsesRequest,
)

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
BODIES: dict[str, type[BaseModel]] = {
    "POST /v1/embeddings": EmbeddingRequest, "POST /v1/rerank": RerankRequest,
    "POST /v1/chat/completions": ChatRequest, "POST /v1/completions": CompletionRequest,
    "POST /v1/responses": ResponsesRequest,
}


def table() -> dict[str, set[str]]:
    """Each route of the table (its first name) -> every parameter its row names."""
    text = API_DOC.read_text("utf-8")
    start = text.index("| route | parameters |")
    rows: dict[str, set[str]] = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        route, *cells = line.strip("|").split("|")
        names = {n for cell in cells for n in re.findall(r"`([^`]+)`", cell)}
        rows[re.findall(r"`([^`]+)`", route)[0]] = names
    return rows


def test_the_api_doc_lists_every_parameter_of_every_route() -> None:
    rows = table()
    for route, body in BODIES.items():
        fields = {f.alias or name for name, f in body.model_fields.items()}
        assert rows[route] == fields, route
