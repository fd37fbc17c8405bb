"""Shared fixtures: the default catalog served for real (CPU unless PACKSERVE_TEST_DEVICE); and
the tiers `scripts/test.sh --fast` selects by: a test that asks for real models (`models_dir`,
`default_server`) is marked `real`, one that starts packserve or Ray processes (tests/front,
tests/pool, tests/bench and the modules that use `serve_process`) `process`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.factories import Running, default_config, serve

_PROCESS_DIRS = frozenset({"front", "pool", "bench"})
_REAL_FIXTURES = frozenset({"models_dir", "default_server"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    sources: dict[str, bool] = {}
    for item in items:
        path = Path(str(item.path))
        if _REAL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real)
        if path.parent.name in _PROCESS_DIRS:
            item.add_marker(pytest.mark.process)
            continue
        if str(path) not in sources:
            sources[str(path)] = "serve_process(" in path.read_text("utf-8")
        if sources[str(path)]:
            item.add_marker(pytest.mark.process)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data dir per test session, so the Gemma GGUF is assembled from its chunks once."""
    return tmp_path_factory.mktemp("packserve-data")


@pytest.fixture(scope="module")
def default_server(models_dir: Path) -> Iterator[Running]:
    with serve(default_config(models_dir)) as running:
        yield running
