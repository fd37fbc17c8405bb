"""Fixtures of the metrics tests: a server of two fake models with a known price."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.factories import Running, config_from, cpu_device, fake_model, serve

FAKE = (cpu_device("150MiB", "0", "price_per_hour = 3.6")
        + fake_model("emb", 'device = "cpu"', tasks='["embed", "rerank"]',
                     source="emb/fake:100MiB")
        + fake_model("gen", 'device = "cpu"', tasks='["chat", "complete"]',
                     source="gen/fake:100MiB"))

@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with serve(config_from(tmp_path_factory.mktemp("fake"), FAKE)) as running:
        yield running
