"""Fixtures of the metrics tests: a server of two fake models with a known price."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.factories import Running, config_from, serve

FAKE = """
[devices.cpu]
memory_budget = "150MiB"
headroom = 0
price_per_hour = 3.6

[[models]]
name = "emb"
tasks = ["embed", "rerank"]
backend = "fake"
source = "emb/fake:100MiB"
device = "cpu"

[[models]]
name = "gen"
tasks = ["chat", "complete"]
backend = "fake"
source = "gen/fake:100MiB"
device = "cpu"
"""


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with serve(config_from(tmp_path_factory.mktemp("fake"), FAKE)) as running:
        yield running
