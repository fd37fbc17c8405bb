"""Shared fixtures: the default catalog served for real (CPU unless PACKSERVE_TEST_DEVICE); and
the tiers `scripts/test.sh --fast` selects by: a test that asks for real models (`models_dir`,
`default_server`) is marked `real`, one that starts packserve or Ray processes (tests/front,
tests/pool, tests/bench and the modules that use `serve_process`) `process`. A test marked `gpu`
is skipped where no NVIDIA driver answers (NVML lists no GPU): the prepared GPU check
(scripts/gpu-check.sh) runs them on a card."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.factories import Running, default_config, serve

_PROCESS_DIRS = frozenset({"front", "pool", "bench"})
_REAL_FIXTURES = frozenset({"models_dir", "default_server"})


@functools.cache
def no_nvidia_driver() -> str | None:
    """Why there is no card to run `gpu` tests on, or None when NVML lists a GPU. Asked once,
    and only when a `gpu` test was collected."""
    try:
        nv = importlib.import_module("pynvml")  # untyped: read through its module
        nv.nvmlInit()
        try:
            count = int(nv.nvmlDeviceGetCount())
        finally:
            nv.nvmlShutdown()
    except Exception as exc:  # no package, no driver library, a driver that does not answer
        return f"no NVIDIA driver answers (NVML: {type(exc).__name__}: {exc})"
    return None if count else "the NVIDIA driver lists no GPU"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    sources: dict[str, bool] = {}
    for item in items:
        if item.get_closest_marker("gpu") is not None and (why := no_nvidia_driver()):
            item.add_marker(pytest.mark.skip(reason=f"gpu: {why}"))
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
