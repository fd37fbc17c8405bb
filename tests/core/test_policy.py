"""Table tests for the pure scheduling policy (packserve.core.policy): plain data in and out."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from packserve.core.policy import (
    MIN_RATE_SPAN_S,
    CostAware,
    QuotaDecision,
    ResidentView,
    Verdict,
    admit_request,
    arrival_rate,
    choose_victims,
    lru_by_bytes,
    make_policy,
    pins_fit,
    plan_admission,
    policy_name,
)
from packserve.types import State
from tests.factories import cold, resident, victim_rows

MIB = 1 << 20
GIB = 1 << 30




# ------------------------------------------------------------------------- choose_victims

VICTIM_CASES = [
    pytest.param(
        [resident("a", 100, last_used=1)], 50, 60, (),
        id="fits-in-free-memory-evicts-nothing"),
    pytest.param(
        [resident("a", 100, last_used=3), resident("b", 100, last_used=1),
         resident("c", 100, last_used=2)], 150, 60, ("b",),
        id="least-recently-used-leaves-first"),
    pytest.param(
        [resident("a", 100, last_used=3), resident("b", 100, last_used=1),
         resident("c", 100, last_used=2)], 250, 60, ("b", "c"),
        id="lru-order-and-only-enough-victims"),
    pytest.param(
        [resident("a", 100, last_used=1), resident("b", 100, last_used=2)], 200, 100, ("a",),
        id="stops-when-freed-equals-need"),
    pytest.param(
        [resident("a", 100, last_used=5), resident("small", 50, last_used=5),
         resident("big", 200, last_used=5)], 200, 0, ("big",),
        id="tie-on-last-used-larger-first"),
    pytest.param(
        [resident("p", 500, last_used=0, pinned=True), resident("b", 100, last_used=9)],
        100, 0, ("b",),
        id="pinned-never-chosen-even-if-oldest"),
    pytest.param(
        [resident("busy", 500, last_used=0, in_flight=1), resident("b", 100, last_used=9)],
        100, 0, ("b",),
        id="in-flight-never-chosen-even-if-oldest"),
    pytest.param(
        [resident("l", 500, state=State.LOADING), resident("c", 500, state=State.COLD),
         resident("f", 500, state=State.FAILED), resident("b", 100, last_used=9)],
        100, 0, ("b",),
        id="loading-cold-failed-not-chosen"),
    pytest.param(
        [resident("a", 500, state=State.ADMITTING, last_used=0),
         resident("u", 500, state=State.UNLOADING, last_used=0), resident("b", 100, last_used=9)],
        100, 0, ("b",),
        id="admitting-and-unloading-not-chosen"),
    pytest.param(
        [resident("p", 500, pinned=True), resident("busy", 500, in_flight=2),
         resident("l", 500, state=State.LOADING), resident("b", 100)],
        300, 50, None,
        id="not-enough-evictable-returns-none"),
    pytest.param([], 10, 0, None, id="nothing-resident-returns-none"),
    pytest.param(
        [resident("w", 100, state=State.WARM, warm_mib=0, last_used=0),
         resident("b", 100, last_used=9)],
        100, 0, ("b",),
        id="a-warm-copy-that-frees-nothing-is-never-chosen"),
    pytest.param(
        [resident("h", 100, warm_mib=100, last_used=0), resident("b", 100, last_used=9)],
        100, 0, ("h", "b"),
        id="a-hot-one-whose-warm-copy-would-keep-it-all-is-still-named"),
]


@pytest.mark.parametrize(("residents", "need_mib", "free_mib", "expected"), VICTIM_CASES)
def test_choose_victims(
    residents: list[ResidentView], need_mib: int, free_mib: int,
    expected: tuple[str, ...] | None,
) -> None:
    assert choose_victims(residents, need_mib * MIB, free_mib * MIB) == expected


def test_choose_victims_honours_a_custom_order() -> None:
    residents = [resident("old", 100, last_used=1), resident("new", 100, last_used=9)]
    newest_first = choose_victims(residents, 100 * MIB, 0, order=lambda r: (-r.last_used,))
    assert newest_first == ("new",)


A, B, C, BUSY, PINNED, LOADING = victim_rows()  # A least recently used, C most


@pytest.mark.parametrize(("residents", "need", "free", "expected"), [
    ([A, B, C], 50, 100, ()),  # fits: nobody leaves
    ([A, B, C], 150, 100, ("a",)),  # LRU first, only as many bytes as needed
    ([C, B, A], 350, 100, ("a", "b")),  # input order does not matter
    ([BUSY, PINNED, A], 300, 100, None),  # busy and pinned never chosen: wait
    ([LOADING, A], 150, 100, ("a",)),  # a loading resident is not evictable
])
def test_lru_by_bytes(residents: list[ResidentView], need: int, free: int,
                      expected: tuple[str, ...] | None) -> None:
    assert lru_by_bytes(residents, need * MIB, free * MIB) == expected


# ------------------------------------------------------------------------- plan_admission

ADMISSION_CASES = [
    pytest.param(
        resident("t", 100), [resident("a", 900)], 1000,
        Verdict.ALREADY_LOADED, (),
        id="already-loaded"),
    pytest.param(
        cold("t", 100), [], 1000,
        Verdict.FITS, (),
        id="fits-on-empty-device"),
    pytest.param(
        cold("t", 100), [resident("a", 400, last_used=1), resident("b", 400, last_used=2)], 1000,
        Verdict.FITS, (),
        id="fits-in-free-memory-without-eviction"),
    pytest.param(
        cold("t", 300), [resident("a", 400, last_used=2), resident("b", 400, last_used=1)], 1000,
        Verdict.FITS_AFTER_EVICTION, ("b",),
        id="evicts-least-recently-used"),
    pytest.param(
        cold("t", 700), [resident("a", 400, last_used=2), resident("b", 400, last_used=1),
                         resident("c", 100, last_used=3)], 1000,
        Verdict.FITS_AFTER_EVICTION, ("b", "a"),
        id="evicts-only-enough"),
    pytest.param(
        cold("t", 300), [resident("a", 400, in_flight=1), resident("b", 400, in_flight=3)], 1000,
        Verdict.WAIT_FOR_BUSY, (),
        id="busy-models-hold-the-memory"),
    pytest.param(
        cold("t", 300), [resident("a", 400, state=State.LOADING), resident("b", 400)], 1000,
        Verdict.FITS_AFTER_EVICTION, ("b",),
        id="loading-resident-holds-memory-but-is-not-a-victim"),
    pytest.param(
        cold("t", 300), [resident("a", 800, state=State.LOADING)], 1000,
        Verdict.WAIT_FOR_BUSY, (),
        id="loading-resident-makes-it-wait"),
    pytest.param(
        cold("t", 300), [resident("p", 500, pinned=True), resident("b", 400)], 1000,
        Verdict.FITS_AFTER_EVICTION, ("b",),
        id="pinned-stays-unpinned-leaves"),
    pytest.param(
        cold("t", 600), [resident("p", 500, pinned=True)], 1000,
        Verdict.NEVER_FITS, (),
        id="never-fits-beside-pins"),
    pytest.param(
        cold("t", 1001), [], 1000,
        Verdict.NEVER_FITS, (),
        id="never-fits-empty-device"),
    pytest.param(
        cold("t", 500), [resident("p", 500, pinned=True), resident("b", 400)], 1000,
        Verdict.FITS_AFTER_EVICTION, ("b",),
        id="exactly-capacity-minus-pins-fits"),
    pytest.param(
        cold("t", 600), [resident("p", 500, pinned=True, state=State.COLD)], 1000,
        Verdict.FITS, (),
        id="pinned-but-not-loaded-holds-nothing"),
    pytest.param(
        cold("t", 600), [resident("x", 900, device="cuda:0"),
                         resident("p", 900, pinned=True, device="cuda:0")], 1000,
        Verdict.FITS, (),
        id="other-devices-ignored"),
    pytest.param(
        cold("t", 600), [resident("c", 900, state=State.COLD),
                         resident("f", 900, state=State.FAILED)], 1000,
        Verdict.FITS, (),
        id="cold-and-failed-hold-nothing"),
    pytest.param(
        cold("t", 600), [resident("a", 900, state=State.ADMITTING)], 1000,
        Verdict.FITS, (),
        id="admitting-holds-nothing-yet"),
    pytest.param(
        cold("t", 300), [resident("u", 800, state=State.UNLOADING)], 1000,
        Verdict.WAIT_FOR_BUSY, (),
        id="unloading-holds-its-bytes-until-done"),
    pytest.param(
        cold("t", 600), [resident("t", 900, in_flight=1)], 1000,
        Verdict.FITS, (),
        id="target-own-row-ignored"),
]


@pytest.mark.parametrize(
    ("target", "residents", "capacity_mib", "verdict", "victims"), ADMISSION_CASES)
def test_plan_admission_verdicts(
    target: ResidentView, residents: list[ResidentView], capacity_mib: int,
    verdict: Verdict, victims: tuple[str, ...],
) -> None:
    answer = plan_admission(target, residents, capacity_mib * MIB)
    assert (answer.verdict, answer.victims) == (verdict, victims)
    assert answer.target == target.key
    assert answer.device == target.device
    assert answer.need_bytes == target.bytes
    assert answer.capacity_bytes == capacity_mib * MIB


def test_plan_admission_uses_the_policy() -> None:
    def newest_first(residents: Sequence[ResidentView], need_bytes: int,
                     free_bytes: int) -> tuple[str, ...] | None:
        return choose_victims(residents, need_bytes, free_bytes, order=lambda r: (-r.last_used,))

    answer = plan_admission(cold("t", 50), [A, B], 250 * MIB, policy=newest_first)
    assert answer.verdict is Verdict.FITS_AFTER_EVICTION
    assert answer.victims == ("b",)  # least recently used first would name "a"
    assert "victim policy" in answer.reason
    assert plan_admission(cold("t", 50), [A, B], 250 * MIB).victims == ("a",)


@pytest.mark.parametrize(
    ("residents", "used", "pinned", "busy"),
    [
        pytest.param([], 0, 0, 0, id="empty"),
        pytest.param(
            [resident("p", 100, pinned=True), resident("b", 200, in_flight=1),
             resident("i", 300), resident("l", 50, state=State.LOADING),
             resident("c", 999, state=State.COLD), resident("g", 999, device="cuda:0")],
            650, 100, 250, id="mixed"),
        pytest.param(
            [resident("p", 100, pinned=True, in_flight=2)], 100, 100, 0,
            id="busy-pinned-counts-as-pinned-only"),
    ],
)
def test_plan_admission_accounting(
    residents: list[ResidentView], used: int, pinned: int, busy: int,
) -> None:
    answer = plan_admission(cold("t", 10), residents, 10 * GIB)
    assert (answer.used_bytes, answer.pinned_bytes, answer.busy_bytes) == (
        used * MIB, pinned * MIB, busy * MIB)


@pytest.mark.parametrize(
    ("need_mib", "residents", "draining"),
    [
        pytest.param(400, [resident("b", 800, in_flight=1)], ("b",), id="the-busy-one"),
        pytest.param(500, [resident("old", 300, in_flight=1, last_used=1),
                           resident("new", 300, in_flight=2, last_used=2),
                           resident("idle", 200, last_used=3)], ("old",),
                     id="only-those-the-policy-would-evict"),
        pytest.param(400, [resident("p", 300, pinned=True, in_flight=1),
                           resident("b", 400, in_flight=1)], ("b",), id="pinned-never"),
        pytest.param(400, [resident("u", 800, state=State.UNLOADING)], (),
                     id="unloading-not-busy"),
        pytest.param(400, [resident("l", 800, state=State.LOADING, in_flight=3)], (),
                     id="loading-not-drained"),
    ],
)
def test_a_load_waiting_for_busy_models_names_those_it_drains(
    need_mib: int, residents: list[ResidentView], draining: tuple[str, ...],
) -> None:
    answer = plan_admission(cold("t", need_mib), residents, 1000 * MIB)
    assert (answer.verdict, answer.draining) == (Verdict.WAIT_FOR_BUSY, draining)
    assert ("wait behind it" in answer.reason) == bool(draining)


def test_only_a_waiting_load_drains() -> None:
    busy = [resident("b", 500, in_flight=1)]
    assert plan_admission(cold("t", 400), busy, 1000 * MIB).draining == ()  # it fits


def test_never_fits_reason_names_model_footprint_budget_and_pins() -> None:
    target = cold("k-chat", 300, models=("chat-small", "complete-small"))
    residents = [
        resident("k-emb", 800, pinned=True, models=("embedder",)),
        resident("k-idle", 100),
    ]
    answer = plan_admission(target, residents, GIB)
    assert answer.verdict is Verdict.NEVER_FITS
    assert answer.pinned_bytes == 800 * MIB
    reason = answer.reason
    assert "chat-small+complete-small needs 300.0 MiB" in reason
    assert "cpu has a budget of 1.00 GiB" in reason
    assert "pinned models hold 800.0 MiB" in reason
    assert "embedder (800.0 MiB)" in reason
    assert "k-idle" not in reason


def test_never_fits_reason_without_pins_says_none() -> None:
    answer = plan_admission(cold("big", 2048), [], GIB)
    assert answer.verdict is Verdict.NEVER_FITS
    assert "big needs 2.00 GiB" in answer.reason
    assert "(pinned: none)" in answer.reason


def test_eviction_reason_names_victims() -> None:
    answer = plan_admission(cold("t", 300), [resident("old", 400, last_used=1),
                                             resident("new", 400, last_used=2)], 1000 * MIB)
    assert answer.victims == ("old",)
    assert "evicting old (400.0 MiB to cold, idle, least recently used)" in answer.reason
    assert "new" not in answer.reason


# ------------------------------------------------------------------------- pins_fit

@pytest.mark.parametrize(
    ("pinned", "capacity_mib", "fits"),
    [
        pytest.param([], 0, True, id="no-pins"),
        pytest.param([resident("a", 400), resident("b", 600)], 1000, True, id="exactly-fits"),
        pytest.param([resident("a", 400), resident("b", 601)], 1000, False, id="one-mib-over"),
        pytest.param([resident("a", 2000)], 1000, False, id="single-pin-too-big"),
    ],
)
def test_pins_fit(pinned: list[ResidentView], capacity_mib: int, fits: bool) -> None:
    reason = pins_fit(pinned, capacity_mib * MIB)
    assert (reason is None) == fits


def test_pins_fit_reason_names_models_and_numbers() -> None:
    pinned = [resident("ka", 600, models=("embedder",), device="cuda:0"),
              resident("kb", 600, models=("chat", "complete"), device="cuda:0")]
    reason = pins_fit(pinned, GIB)
    assert reason is not None
    assert "pinned models on cuda:0 need 1.17 GiB together" in reason
    assert "budget after headroom is 1.00 GiB" in reason
    assert "embedder 600.0 MiB" in reason
    assert "chat+complete 600.0 MiB" in reason


# ------------------------------------------------------------------------- admit_request

QUOTA_CASES = [
    pytest.param(0, 0, 1, 1, 1.0, QuotaDecision(run=True, queue=False), id="idle-runs"),
    pytest.param(3, 0, 4, 0, 1.0, QuotaDecision(run=True, queue=False), id="last-slot-runs"),
    pytest.param(1, 0, 1, 1, 1.0, QuotaDecision(run=False, queue=True), id="full-queues"),
    pytest.param(0, 1, 2, 4, 1.0, QuotaDecision(run=False, queue=True),
                 id="free-slot-but-queue-waiting-queues"),
    pytest.param(1, 1, 1, 1, 1.0, QuotaDecision(run=False, queue=False, retry_after_s=2),
                 id="queue-full-refuses"),
    pytest.param(4, 8, 4, 8, 2.5, QuotaDecision(run=False, queue=False, retry_after_s=6),
                 id="retry-after-ceil-waves-times-service"),
    pytest.param(2, 0, 2, 0, 3.0, QuotaDecision(run=False, queue=False, retry_after_s=2),
                 id="no-queue-refuses"),
    pytest.param(1, 1, 1, 1, 0.0, QuotaDecision(run=False, queue=False, retry_after_s=1),
                 id="zero-service-time-at-least-one"),
    pytest.param(8, 2, 8, 2, 0.01, QuotaDecision(run=False, queue=False, retry_after_s=1),
                 id="tiny-service-time-at-least-one"),
    pytest.param(1, 1, 1, 1, -5.0, QuotaDecision(run=False, queue=False, retry_after_s=1),
                 id="negative-service-time-at-least-one"),
]


@pytest.mark.parametrize(
    ("in_flight", "queued", "max_concurrency", "max_queue", "mean_service_s", "expected"),
    QUOTA_CASES,
)
def test_admit_request(
    in_flight: int, queued: int, max_concurrency: int, max_queue: int, mean_service_s: float,
    expected: QuotaDecision,
) -> None:
    assert admit_request(in_flight, queued, max_concurrency, max_queue,
                         mean_service_s) == expected


# ------------------------------------------------------------------------- cost-aware eviction

def _cost(*rows: ResidentView, need: int, free: int = 0,
          horizon_s: float = 60.0) -> tuple[str, ...] | None:
    return CostAware(horizon_s)(list(rows), need * MIB, free * MIB)


COST_CASES = [
    pytest.param(
        [resident("cheap", 100, last_used=9, reload_s=0.2, rate_per_s=0.5),
         resident("dear", 100, last_used=1, reload_s=8.0, rate_per_s=0.5)], 100, ("cheap",),
        id="keeps-the-model-that-costs-more-to-reload-though-lru-would-evict-it"),
    pytest.param(
        [resident("often", 100, last_used=1, reload_s=2.0, rate_per_s=1.0),
         resident("rare", 100, last_used=9, reload_s=2.0, rate_per_s=0.001)], 100, ("rare",),
        id="same-reload-the-one-unlikely-to-return-goes"),
    pytest.param(
        [resident("small", 100, reload_s=1.0, rate_per_s=0.05),
         resident("big", 1000, reload_s=4.0, rate_per_s=0.05)], 100, ("big",),
        id="per-byte-a-big-model-frees-more-for-its-cost"),
    pytest.param(
        [resident("a", 100, last_used=2), resident("b", 100, last_used=1)], 100, ("b",),
        id="nothing-measured-falls-back-to-lru"),
    pytest.param(
        [resident("tiny", 50, reload_s=0.0, rate_per_s=0.0),
         resident("big", 400, reload_s=1.0, rate_per_s=0.01)], 300, ("big",),
        id="a-victim-not-needed-once-a-larger-one-is-chosen-stays"),
    pytest.param(
        [resident("p", 500, pinned=True), resident("busy", 500, in_flight=1),
         resident("ok", 100, reload_s=50.0, rate_per_s=5.0)], 100, ("ok",),
        id="never-pinned-or-busy-however-costly-the-rest"),
    pytest.param(
        [resident("busy", 500, in_flight=1), resident("ok", 100)], 300, None,
        id="cannot-fit-until-busy-models-finish"),
]


@pytest.mark.parametrize(("rows", "need", "expected"), COST_CASES)
def test_cost_aware_victims(rows: list[ResidentView], need: int,
                            expected: tuple[str, ...] | None) -> None:
    assert _cost(*rows, need=need) == expected


def test_cost_aware_never_frees_too_little() -> None:
    rows = [resident(f"m{i}", 10 * (i + 1), reload_s=i % 3, rate_per_s=0.1 * (i % 4))
            for i in range(8)]
    for need in range(0, 400, 7):
        victims = _cost(*rows, need=need, free=5)
        if need > 5 + 360:  # more than every idle model and the free bytes together
            assert victims is None
            continue
        assert victims is not None
        freed = 5 + sum(r.bytes for r in rows if r.key in victims) // MIB
        assert freed >= need, (need, victims)


def test_reuse_chance_grows_with_rate_and_horizon() -> None:
    r = resident("m", 100, reload_s=2.0, rate_per_s=1 / 60)
    assert CostAware(60).reuse_chance(r) == pytest.approx(1 - math.exp(-1))
    assert CostAware(600).reuse_chance(r) > CostAware(60).reuse_chance(r)
    assert CostAware(60).expected_cost_s(r) == pytest.approx(2.0 * (1 - math.exp(-1)))


def test_arrival_rate_falls_while_idle() -> None:
    arrivals = [10.0, 12.0, 14.0, 16.0]
    assert arrival_rate([], 20.0) == 0.0
    assert arrival_rate(arrivals, 18.0) == pytest.approx(4 / 8)
    assert arrival_rate(arrivals, 410.0) == pytest.approx(4 / 400)
    assert arrival_rate([5.0, 5.0, 5.0], 5.0) == pytest.approx(3 / MIN_RATE_SPAN_S)


def test_plan_names_the_cost_policys_reasons() -> None:
    residents = [resident("embedder", 100, reload_s=0.4, rate_per_s=1 / 90),
                 resident("generator", 300, reload_s=6.0, rate_per_s=0.5)]
    answer = plan_admission(cold("new", 100), residents, 400 * MIB, CostAware())
    assert answer.victims == ("embedder",)
    assert ("embedder (100.0 MiB to cold, idle, reload 0.4 s, next use expected in 90 s"
            in answer.reason)


def test_make_policy_by_name() -> None:
    assert make_policy("lru") is lru_by_bytes
    assert isinstance(make_policy("cost", 30), CostAware)
    assert policy_name(make_policy("cost")) == "cost" and policy_name(lru_by_bytes) == "lru"
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo")
