"""Shared fixtures: the default catalog served for real (CPU unless PACKSERVE_TEST_DEVICE)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.factories import Running, default_config, serve


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data dir per test session, so the Gemma GGUF is assembled from its chunks once."""
    return tmp_path_factory.mktemp("packserve-data")


@pytest.fixture(scope="module")
def default_server(models_dir: Path) -> Iterator[Running]:
    with serve(default_config(models_dir)) as running:
        yield running
