"""The one backoff: a first wait, doubling with each failure, up to a ceiling."""

from __future__ import annotations

import pytest

from packserve.backoff import doubling


@pytest.mark.parametrize(("failures", "wait"), [(0, 0.5), (1, 0.5), (2, 1.0), (3, 2.0),
                                                (7, 30.0), (50, 30.0)])
def test_the_wait_doubles_up_to_its_ceiling(failures: int, wait: float) -> None:
    assert doubling(0.5, 30.0, failures) == wait
