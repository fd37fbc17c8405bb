"""The resident record and its table of state transitions (packserve.core.resident)."""

from __future__ import annotations

from pathlib import Path

import pytest

from packserve.core.backend import LoadSpec
from packserve.core.resident import TRANSITIONS, IllegalTransition, Resident, check_move
from packserve.types import State


def make() -> Resident:
    return Resident(load=LoadSpec(backend="fake", path=Path("m"), device="cpu",
                                          context_length=0), models=["m"],
                    estimated=100)


def test_a_resident_starts_cold() -> None:
    assert make().state is State.COLD


def test_assigning_state_directly_raises() -> None:
    res = make()
    with pytest.raises(AttributeError):
        res.state = State.HOT  # type: ignore[misc]
    assert res.state is State.COLD


def test_an_illegal_move_raises_and_changes_nothing() -> None:
    res = make()
    with pytest.raises(IllegalTransition, match="cold to hot"):
        res.move(State.HOT)
    assert res.state is State.COLD


def test_a_load_and_an_eviction_to_warm_and_back_follow_the_table() -> None:
    res = make()
    for to in (State.ADMITTING, State.LOADING, State.HOT, State.UNLOADING, State.WARM,
               State.ADMITTING, State.LOADING, State.HOT):
        res.move(to)
    assert res.state is State.HOT


def test_every_state_has_a_row_and_can_be_reached() -> None:
    assert set(TRANSITIONS) == set(State)
    assert set().union(*TRANSITIONS.values()) == set(State)


@pytest.mark.parametrize(("src", "dst"), [
    (State.HOT, State.WARM),  # a warm copy is made only through UNLOADING
    (State.HOT, State.ADMITTING),
    (State.COLD, State.HOT),  # every load is admitted first
    (State.WARM, State.HOT),
    (State.UNLOADING, State.HOT),
    (State.FAILED, State.FAILED),
])
def test_the_table_refuses(src: State, dst: State) -> None:
    with pytest.raises(IllegalTransition):
        check_move(src, dst)


def test_docs_draw_the_same_table() -> None:
    text = (Path(__file__).parents[2] / "docs" / "scheduling.md").read_text("utf-8")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] in {s.value for s in State}:
            rows[State(cells[0])] = {State(t.split(" ")[0]) for t in cells[1].split(", ")}
    table = {src: set(dst) for src, dst in TRANSITIONS.items()}
    assert rows == table
    drawn: dict[State, set[State]] = {}  # the mermaid diagram's arrows: the same moves
    for line in text.split("```mermaid", 1)[1].split("```", 1)[0].splitlines():
        if "-->" in line:
            src, dst = (part.split(":")[0].strip() for part in line.split("-->"))
            drawn.setdefault(State(src), set()).add(State(dst))
    assert drawn == table
