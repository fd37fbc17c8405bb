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

    COLD = "cold"  # on disk; holds nothing
    ADMITTING = "admitting"  # a load waits for its device's lock, for memory or for evictions;
    # holds nothing yet (but its warm copy, if it comes from warm)
    LOADING = "loading"  # being read onto its device; its bytes are already reserved
    HOT = "hot"  # on its device, serving
    UNLOADING = "unloading"  # leaving its device; holds its bytes until the engine lets go
    WARM = "warm"  # its engine objects stay, its weights were given back; a load restores it
    FAILED = "failed"  # the last load failed (retried after a cooldown), or it was quarantined
    # (until an operator loads it again)
