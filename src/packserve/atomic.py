"""Files replaced whole: a reader sees the old file or the new one, never part of either."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: Path, *, mode: int = 0o644, suffix: str = ".tmp") -> Iterator[Path]:
    """A new file beside `path` (its own name: other processes may be writing too) for the
    block to write; renamed over `path` when the block ends, removed if it raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.fchmod(fd, mode)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str, *, mode: int = 0o644) -> None:
    """Replace `path` with `text` (UTF-8) in one step."""
    with replacing(path, mode=mode) as tmp:
        tmp.write_text(text, "utf-8")
