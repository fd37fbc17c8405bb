"""Table tests for the catalog diff of a reconfigure (packserve.core.catalog): plain data."""

from __future__ import annotations

from dataclasses import replace

import pytest

from packserve.core.catalog import (
    CatalogDiff,
    DeviceBudget,
    Entry,
    Listed,
    check_devices,
    check_pins,
    diff,
)
from packserve.errors import PinsDoNotFit
from tests.factories import MIB, entry


def listed(e: Entry, *, pinned: bool | None = None) -> Listed:
    return Listed(key=e.load.key, spec=e.spec, estimated=e.bytes_estimated,
                  pinned=e.spec.pin if pinned is None else pinned)


A, B = entry("a"), entry("b")

DIFF_CASES = [
    pytest.param({}, [A, B], ("a", "b"), (), (), set(),
                 id="a-first-catalog-adds-everything"),
    pytest.param({"a": listed(A)}, [A], (), (), (), {"a"}, id="same-entry-is-kept-unchanged"),
    pytest.param({"a": listed(A), "b": listed(B)}, [A], (), ("b",), (), {"a"},
                 id="a-missing-name-is-removed"),
    pytest.param({"a": listed(A)}, [entry("a", max_concurrency=2)], (), (), ("a",), {"a"},
                 id="new-quotas-change-and-keep-the-queue"),
    pytest.param({"a": listed(A)}, [replace(A, bytes_estimated=200 * MIB)], (), (), ("a",),
                 {"a"},
                 id="a-new-estimate-is-a-change"),
    pytest.param({"a": listed(A)}, [entry("a", weights="other")], (), (), ("a",), set(),
                 id="new-weights-are-a-remove-plus-add"),
]


@pytest.mark.parametrize(("old", "entries", "added", "removed", "changed", "kept"), DIFF_CASES)
def test_diff(old: dict[str, Listed], entries: list[Entry], added: tuple[str, ...],
              removed: tuple[str, ...], changed: tuple[str, ...], kept: set[str]) -> None:
    answer = diff(old, entries)
    assert (answer.report.added, answer.report.removed, answer.report.changed) == (
        added, removed, changed)
    assert answer.kept == kept
    assert answer.report.new_weights == tuple(n for n in changed if n not in kept)


PIN_CASES = [
    pytest.param(listed(A, pinned=True), entry("a"), True,
                 id="an-operators-pin-stays-when-the-file-keeps-its-pin"),
    pytest.param(listed(A, pinned=True), entry("a", pin=True), True,
                 id="the-file-pins-what-the-operator-pinned"),
    pytest.param(listed(entry("a", pin=True), pinned=False), entry("a", pin=True), False,
                 id="an-operators-unpin-stays"),
    pytest.param(listed(A), entry("a", pin=True), True, id="a-pin-set-in-the-file-applies"),
    pytest.param(listed(entry("a", pin=True)), entry("a"), False,
                 id="an-unpin-in-the-file-applies"),
    pytest.param(listed(A, pinned=True), entry("a", weights="other"), False,
                 id="new-weights-take-the-files-pin"),
]


@pytest.mark.parametrize(("before", "after", "pinned"), PIN_CASES)
def test_diff_pins(before: Listed, after: Entry, pinned: bool) -> None:
    answer: CatalogDiff = diff({"a": before}, [after])
    assert answer.pinned == {"a": pinned}


CPU = {"cpu": DeviceBudget(name="cpu", budget_bytes=300 * MIB, headroom_bytes=0)}


def test_an_entry_on_a_device_without_a_budget_is_refused() -> None:
    gpu = replace(A, load=replace(A.load, device="cuda:0"))
    with pytest.raises(PinsDoNotFit, match="cuda:0"):
        check_devices([gpu], CPU)
    check_devices([A], CPU)


FIT_CASES = [
    pytest.param([entry("a", 100), entry("b", 100)], {}, {}, True, id="two-pins-fit"),
    pytest.param([entry("a", 200), entry("b", 200)], {}, {}, False, id="two-pins-do-not-fit"),
    pytest.param([entry("a", 100), entry("b", 100)], {entry("a").load.key: 250 * MIB}, {},
                 False, id="a-measured-figure-counts-over-the-estimate"),
    pytest.param([entry("a", 100), entry("b", 100)], {}, {entry("a").load.key: 250 * MIB},
                 False, id="a-running-residents-larger-estimate-counts"),
    pytest.param([entry("a", 200, weights="w"), entry("b", 200, weights="w")], {}, {}, True,
                 id="shared-weights-count-once"),
]


@pytest.mark.parametrize(("entries", "measured", "floor", "fits"), FIT_CASES)
def test_check_pins(entries: list[Entry], measured: dict[str, int | None],
                    floor: dict[str, int], fits: bool) -> None:
    pinned = {e.spec.name: True for e in entries}
    if fits:
        check_pins(entries, pinned, measured, floor, CPU)
    else:
        with pytest.raises(PinsDoNotFit):
            check_pins(entries, pinned, measured, floor, CPU)


def test_unpinned_entries_do_not_count() -> None:
    entries = [entry("a", 200), entry("b", 200)]
    check_pins(entries, {"a": True, "b": False}, {}, {}, CPU)
