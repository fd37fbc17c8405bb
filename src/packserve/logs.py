"""Logging set-up shared by every packserve process (the front, its worker, a pool's child).

Its own module so that the worker, which only needs this, does not import the CLI's libraries.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path


def configure_logging(level: str) -> None:
    """Log lines on stderr; residency events as one JSON object per line, nothing around them.
    The front and the worker share stderr, so both call this."""
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    events = logging.getLogger("packserve.events")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    events.addHandler(handler)
    events.propagate = False
    # httpx logs every request at INFO: the front's to its worker, a pool replica's to its node.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def tail(path: Path, lines: int) -> list[str]:
    """The last `lines` non-empty lines of the text file at `path` (reading at most its last
    256 KiB); [] if it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - (256 << 10)))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]
