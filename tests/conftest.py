"""Shared fixtures: the default catalog served for real (CPU unless PACKSERVE_TEST_DEVICE)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from packserve.config import Config, load_config
from tests.helpers import Running, serve

TEST_DEVICE = os.environ.get("PACKSERVE_TEST_DEVICE", "cpu")


def default_config(data_dir: Path, **overrides: object) -> Config:
    """The built-in catalog with its data in `data_dir`, on the test device."""
    config = load_config(None, **overrides)  # type: ignore[arg-type]
    return config.model_copy(update={
        "server": config.server.model_copy(update={"data_dir": str(data_dir)}),
        "models": [m.model_copy(update={"device": TEST_DEVICE}) for m in config.models],
    })


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data dir per test session, so the Gemma GGUF is assembled from its chunks once."""
    return tmp_path_factory.mktemp("packserve-data")


@pytest.fixture(scope="module")
def default_server(models_dir: Path) -> Iterator[Running]:
    with serve(default_config(models_dir)) as running:
        yield running
