"""Runners take turns on the CPU: while several are busy, the one serving the earliest deadline
runs and the others are stopped; an idle, forgotten or lone runner is never held, and one whose
process is not started yet holds nobody until it is. Checked on real processes (`sleep`), whose
state the kernel reports."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator

import pytest

from packserve.backends.runner import Competitor, Turns, _urgency


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _until(pid: int, stopped: bool, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while (_state(pid) == "T") != stopped:
        assert time.monotonic() < deadline, f"{pid} is {_state(pid)}"
        time.sleep(0.005)


@pytest.fixture
def procs() -> Iterator[list[int]]:
    ps = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    yield [p.pid for p in ps]
    for p in ps:
        p.kill()
        p.wait()


def test_the_earliest_deadline_runs_and_the_others_wait(procs: list[int]) -> None:
    a, b, c = procs
    turns = Turns()
    ra, rb, rc = Competitor(a), Competitor(b), Competitor(c)
    now = time.monotonic()
    with turns.working(ra, now + 4.0, 4.0):
        time.sleep(0.05)
        assert turns.stopped() == frozenset()  # alone: never held
        with turns.working(rb, now + 0.5, 0.5):  # an embedding comes: it runs, a waits
            _until(a, stopped=True)
            assert _state(b) != "T" and turns.stopped() == {a}
            with turns.working(rc, now + 9.0, 4.0):
                _until(c, stopped=True)
        _until(a, stopped=False)  # b is done: a runs again
        assert turns.stopped() == frozenset()
    assert _state(c) != "T"


@contextlib.contextmanager
def _held(turns: Turns, a: int, held: Competitor) -> Iterator[None]:
    """An embedding's request on `a` holds a generation's on `held` until the block ends."""
    now = time.monotonic()
    with turns.working(Competitor(a), now + 0.5, 0.5), turns.working(held, now + 4.0, 4.0):
        assert held.pid is not None
        _until(held.pid, stopped=True)
        yield


def test_a_forgotten_runner_is_let_go_at_once(procs: list[int]) -> None:
    a, b, _ = procs
    turns = Turns()
    rb = Competitor(b)
    with _held(turns, a, rb):
        turns.forget(rb)  # being unloaded: SIGTERM must reach it
        assert _state(b) != "T" and b not in turns.stopped()
        time.sleep(0.1)
        assert _state(b) != "T"  # and it is not held again


def test_a_late_request_competes_as_if_it_came_again() -> None:
    now = time.monotonic()
    assert _urgency([(now + 1.0, 4.0)]) == pytest.approx(now + 1.0)
    # 5 s late with a 4 s SLO: due again 3 s from now, after a fresh 0.5 s request
    assert _urgency([(now - 5.0, 4.0)]) == pytest.approx(now + 3.0, abs=0.01)
    assert _urgency([(now - 5.0, 4.0), (now + 2.0, 4.0)]) == pytest.approx(now + 2.0)


def test_a_start_competes_once_its_process_exists(procs: list[int]) -> None:
    """A runner's start is under its turn from before its process is spawned (the scheduler
    holds `working` around the load): with no process it holds nobody; once it has one, it
    waits while a runner due earlier computes, and the earlier one waits while it is due
    first."""
    a, b, _ = procs
    turns = Turns()
    starting = Competitor()
    now = time.monotonic()
    with turns.working(Competitor(a), now + 0.5, 0.5), turns.working(starting, now + 4.0, 4.0):
        time.sleep(0.05)
        assert turns.stopped() == frozenset()  # nothing to stop yet, and nobody waits for it
        turns.spawned(starting, b)
        _until(b, stopped=True)
        assert _state(a) != "T"
    _until(b, stopped=False)
    with turns.working(starting, now + 0.5, 0.5), turns.working(Competitor(a), now + 4.0, 4.0):
        _until(a, stopped=True)
        assert _state(b) != "T"
    _until(a, stopped=False)


def test_the_time_a_runner_is_held_is_counted(procs: list[int]) -> None:
    """A start's timeout leaves out the time its turn held it (`Competitor.held`)."""
    a, b, _ = procs
    turns = Turns()
    rb = Competitor(b)
    with _held(turns, a, rb):
        time.sleep(0.2)
        assert rb.held() >= 0.2  # counted while still held
    _until(b, stopped=False)
    assert rb.held_s >= 0.2 and rb.held() == rb.held_s


def test_a_runner_restarted_in_place_keeps_its_turns(procs: list[int]) -> None:
    """The requests of a runner that died go on competing with its new process: a request
    due later than another runner's holds the new process, not the dead pid."""
    a, b, c = procs
    turns = Turns()
    runner = Competitor(b)
    with _held(turns, a, runner):
        turns.spawned(runner, None)  # it died (or is killed): let go, never held again
        _until(b, stopped=False)
        turns.spawned(runner, c)  # restarted in place
        _until(c, stopped=True)
        assert _state(b) != "T" and turns.stopped() == {c}
    _until(c, stopped=False)
