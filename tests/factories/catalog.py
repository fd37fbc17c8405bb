"""The default catalog on the test device (`PACKSERVE_TEST_DEVICE`, cpu by default)."""

from __future__ import annotations

import os
from pathlib import Path

from packserve import backends
from packserve.config import Config, load_config
from packserve.sources import resolve_source

TEST_DEVICE = os.environ.get("PACKSERVE_TEST_DEVICE", "cpu")


def default_config(data_dir: Path, **overrides: object) -> Config:
    """The built-in catalog with its data in `data_dir`, on the test device."""
    config = load_config(None, **overrides)  # type: ignore[arg-type]
    return config.model_copy(update={
        "server": config.server.model_copy(update={"data_dir": str(data_dir)}),
        "models": [m.model_copy(update={"device": TEST_DEVICE}) for m in config.models],
    })


def catalog_path(name: str, tmp: Path, *, converted: bool = False) -> Path:
    """The weights file of the default catalog's entry `name`, resolved as the server would
    (an assembled GGUF lands under `tmp`); with `converted`, what its engine serves from it
    (MiniLM's safetensors folder converted to the GGUF its runner reads)."""
    spec = next(m for m in load_config(None).models if m.name == name)
    path = resolve_source(spec.source, base_dir=tmp, models_dir=tmp / "models", roots=None)
    engine = backends.get(spec.backend)
    if converted and engine.convert is not None:  # MiniLM's folder -> the GGUF its runner reads
        path = engine.convert(path, tmp / "models", None)
    return path
