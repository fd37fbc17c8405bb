"""Byte sizes: one parser for configs, one formatter for messages and tables."""

from __future__ import annotations

import pytest

from packserve.units import GB, GIB, MIB, format_bytes


@pytest.mark.parametrize(("n", "kwargs", "text"), [
    (400 * MIB, {}, "400.0 MiB"),
    (GIB, {}, "1.00 GiB"),
    (1536 * MIB, {}, "1.50 GiB"),
    (-3 * GIB // 2, {}, "-1.50 GiB"),  # an over-budget figure may be negative
    (87 * MIB + MIB // 3, {"compact": True}, "87 MiB"),
    (17823 * MIB, {"compact": True}, "17.4 GiB"),
    (24 * GB, {"decimal": True}, "24.0 GB"),
    (512 * MIB, {"decimal": True, "compact": True}, "512 MiB"),
    (GB - 1, {"decimal": True}, "953.7 MiB"),  # under 1 GB stays in MiB
])
def test_format_bytes(n: int, kwargs: dict[str, bool], text: str) -> None:
    assert format_bytes(n, **kwargs) == text
