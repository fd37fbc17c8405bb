"""The crash rule every engine process follows (core.crashes): the first death in a while is
loaded again at once, the next within the window after a back-off that doubles, the third
within the window quarantines for the window."""

from __future__ import annotations

import pytest

from packserve.core.crashes import BACKOFF_S, Action, Verdict, judge

WINDOW = 300.0


@pytest.mark.parametrize(("deaths", "verdict"), [
    ([10.0], Verdict(Action.RELOAD, 0.0, 1)),
    ([10.0, 400.0], Verdict(Action.RELOAD, 0.0, 1)),  # the one before is out of the window
    ([10.0, 12.0], Verdict(Action.BACKOFF, BACKOFF_S[0], 2)),
    ([10.0, 310.0], Verdict(Action.BACKOFF, BACKOFF_S[0], 2)),  # exactly the window apart
    ([10.0, 12.0, 14.0], Verdict(Action.QUARANTINE, WINDOW, 3)),
    ([0.0, 200.0, 400.0], Verdict(Action.BACKOFF, BACKOFF_S[0], 2)),  # 0.0 fell out
    ([0.0, 1.0, 2.0, 3.0], Verdict(Action.QUARANTINE, WINDOW, 4)),
])
def test_the_verdict_counts_the_deaths_within_the_window(deaths: list[float],
                                                         verdict: Verdict) -> None:
    assert judge(deaths, WINDOW) == verdict


def test_without_a_window_each_death_is_a_first() -> None:
    assert judge([1.0, 1.0], 0.0).action is Action.BACKOFF  # the same instant is within 0 s
    assert judge([1.0, 2.0], 0.0).action is Action.RELOAD


def test_each_verdict_says_what_it_means() -> None:
    assert judge([1.0], WINDOW).describe(WINDOW) == "loaded again by its next request"
    assert "2 s back-off" in judge([1.0, 2.0], WINDOW).describe(WINDOW)
    assert "quarantined for 300 s" in judge([1.0, 2.0, 3.0], WINDOW).describe(WINDOW)
