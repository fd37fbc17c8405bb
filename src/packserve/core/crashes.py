"""What a crash costs its model: one rule for every engine process, the worker's and each
runner's.

An engine process can die on its own (SIGSEGV, SIGILL, the OOM killer, an abort). The first
death of a model in a while costs only the requests it was running: the model is loaded again
by its next request. A death within `crash_window_s` of the one before is loaded again after a
back-off, so that a model that dies at once on every load does not keep a core and the device
lock busy; the third within the window quarantines it: requests get 503 with the reason and a
`Retry-After` until the window has passed since that death, or until an operator loads it.
(`failure_cooldown_s` is the other rule: for a load that fails, not a process that dies.)

`judge` is pure: the scheduler applies it to its runners' deaths, the front's supervisor to
its worker's, each on its own history. The front keeps both (the worker reports each runner's
death and its verdict) and hands the runners' deaths, and the verdicts in force, to each new
worker: a worker's restart gives no model a clean slate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from packserve import backoff

# The second death in the window waits this long before the model may load again, doubling with
# each further one up to the ceiling (the third quarantines unless the rule is changed).
BACKOFF_S = (2.0, 30.0)
QUARANTINE_AFTER = 3  # deaths within the window


class Action(StrEnum):
    RELOAD = "reload"  # its next request loads it again, at once
    BACKOFF = "backoff"  # loaded again once `delay_s` has passed
    QUARANTINE = "quarantine"  # 503 until `delay_s` has passed or an operator loads it


@dataclass(frozen=True)
class Verdict:
    """What a model's latest death means for it."""

    action: Action
    delay_s: float  # until it may load again (0 for a reload)
    deaths: int  # within the window, the latest included

    def describe(self, window_s: float) -> str:
        if self.action is Action.RELOAD:
            return "loaded again by its next request"
        if self.action is Action.BACKOFF:
            return (f"death {self.deaths} within crash_window_s ({window_s:g} s): loaded again "
                    f"after a {self.delay_s:g} s back-off")
        return (f"death {self.deaths} within crash_window_s ({window_s:g} s): quarantined for "
                f"{self.delay_s:g} s, or until an operator loads it")


def quarantine_reason(deaths: int, cause: str, doing: str) -> str:
    """Why a runner's model is quarantined: what its 503 and the status page say."""
    return (f"its engine process died {deaths} times within crash_window_s, last {cause} "
            f"while {doing}")


def judge(deaths: Sequence[float], window_s: float) -> Verdict:
    """The verdict on the latest of `deaths` (times in seconds, oldest first, the latest last):
    how many of them fall within `window_s` of it decides."""
    assert deaths, "judge needs the death it is asked about"
    latest = deaths[-1]
    within = sum(1 for t in deaths if latest - t <= window_s)
    if within >= QUARANTINE_AFTER:
        return Verdict(Action.QUARANTINE, window_s, within)
    if within >= 2:
        return Verdict(Action.BACKOFF, backoff.doubling(*BACKOFF_S, within - 1), within)
    return Verdict(Action.RELOAD, 0.0, within)
