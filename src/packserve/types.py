"""Small shared vocabulary that crosses module boundaries."""

from __future__ import annotations

from enum import StrEnum


class Task(StrEnum):
    """What a client can ask a model to do. Structured extraction is `chat` with a JSON schema."""

    EMBED = "embed"
    RERANK = "rerank"
    CHAT = "chat"
    COMPLETE = "complete"


class State(StrEnum):
    """Where a model's weights are (DESIGN.md, scheduler contract)."""

    COLD = "cold"  # on disk
    LOADING = "loading"  # being read onto its device; its bytes are already reserved
    HOT = "hot"  # on its device, serving
    WARM = "warm"  # offloaded to host RAM (GPU tiers; not produced yet)
    FAILED = "failed"  # the last load failed; retried after a cooldown
