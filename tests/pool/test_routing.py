"""The pool's routing policy, as tables (packserve.pool.routing): no Ray, no clock."""

from __future__ import annotations

from packserve.core.policy import Verdict
from packserve.pool.routing import (
    DEFAULT_LOAD_S,
    ModelAt,
    ReplicaView,
    idle_copies,
    is_deep,
    route,
)
from packserve.types import State

M = "embedder"


def at(state: State = State.COLD, **kw: object) -> ModelAt:
    return ModelAt(state=state, **{"concurrency": 2, **kw})  # type: ignore[arg-type]


def replica(name: str, m: ModelAt | None = None, free: int = 0, **others: ModelAt
            ) -> ReplicaView:
    models = {**({M: m} if m is not None else {}), **others}
    return ReplicaView(replica=name, free_bytes=free, models=models)


def flat(ranks: list[list[str]]) -> list[str]:
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0] for rank in ranks]


def test_hot_with_a_free_slot_comes_first_least_occupied_first() -> None:
    replicas = [replica("cold", at(verdict=Verdict.FITS), free=10**9),
                replica("busy", at(State.HOT, in_flight=1)),
                replica("idle", at(State.HOT))]
    assert flat(route(M, replicas)) == ["idle", "busy", "cold"]


def test_outstanding_requests_count_before_the_next_report() -> None:
    replicas = [replica("a", at(State.HOT)), replica("b", at(State.HOT))]
    assert flat(route(M, replicas, {"a": 1}))[0] == "b"
    # a is full by this router's own count: b's free slot wins even though a reported idle
    assert flat(route(M, replicas, {"a": 2, "b": 1})) == ["b", "a"]


def test_a_busy_hot_copy_wins_when_its_wait_beats_a_load() -> None:
    quick = at(State.HOT, in_flight=2, queued=1, service_s=0.05, load_s=3.0)
    replicas = [replica("busy", quick), replica("empty", at(verdict=Verdict.FITS), free=10**9)]
    assert flat(route(M, replicas)) == ["busy", "empty"]


def test_a_load_elsewhere_wins_when_the_wait_is_longer() -> None:
    slow = at(State.HOT, in_flight=2, queued=8, service_s=2.0, load_s=0.5)
    replicas = [replica("busy", slow), replica("empty", at(verdict=Verdict.FITS), free=10**9)]
    assert flat(route(M, replicas)) == ["empty", "busy"]


def test_spill_puts_a_replica_without_the_model_before_a_busy_one() -> None:
    quick = at(State.HOT, in_flight=2, queued=1, service_s=0.05, load_s=3.0)
    replicas = [replica("busy", quick), replica("empty", at(verdict=Verdict.FITS), free=10**9)]
    assert flat(route(M, replicas, spill=True)) == ["empty", "busy"]


def test_a_loading_copy_counts_as_half_a_load_of_wait() -> None:
    loading = at(State.LOADING, load_s=4.0)
    replicas = [replica("loading", loading), replica("empty", at(verdict=Verdict.FITS))]
    assert flat(route(M, replicas)) == ["loading", "empty"]  # 2 s left < a 4 s load


def test_fits_without_evicting_beats_eviction_most_free_first() -> None:
    replicas = [replica("evict", at(verdict=Verdict.FITS_AFTER_EVICTION, evict_s=0.1)),
                replica("small", at(verdict=Verdict.FITS), free=100),
                replica("large", at(verdict=Verdict.FITS), free=500)]
    assert flat(route(M, replicas)) == ["large", "small", "evict"]


def test_the_cheapest_eviction_by_reload_seconds_then_bytes() -> None:
    replicas = [replica("dear", at(verdict=Verdict.FITS_AFTER_EVICTION, evict_s=2.0)),
                replica("cheap", at(verdict=Verdict.FITS_AFTER_EVICTION, evict_s=0.3,
                                    evict_bytes=900)),
                replica("cheaper", at(verdict=Verdict.FITS_AFTER_EVICTION, evict_s=0.3,
                                      evict_bytes=100)),
                replica("later", at(verdict=Verdict.WAIT_FOR_BUSY))]
    assert flat(route(M, replicas)) == ["cheaper", "cheap", "dear", "later"]


def test_replicas_that_cannot_serve_the_model_are_no_candidates() -> None:
    replicas = [replica("never", at(verdict=Verdict.NEVER_FITS)),
                replica("other", None, other=at(State.HOT)),
                replica("ok", at(verdict=Verdict.FITS))]
    assert flat(route(M, replicas)) == ["ok"]
    assert route(M, replicas[:2]) == []


def test_a_replica_without_a_report_comes_last() -> None:
    replicas = [ReplicaView(replica="new", reported=False),
                replica("ok", at(verdict=Verdict.FITS_AFTER_EVICTION, evict_s=9.0))]
    assert flat(route(M, replicas)) == ["ok", "new"]


def test_stats_round_trip_through_a_report() -> None:
    stats = {"node": "n1", "free_bytes": 123, "models": {M: {
        "state": "hot", "concurrency": 4, "in_flight": 1, "queued": 0, "bytes": 5,
        "pinned": True, "load_s": 0.4, "service_s": 0.01, "last_used": 7.0,
        "verdict": "already_loaded", "evict_s": 0.0, "evict_bytes": 0}}}
    view = ReplicaView.from_stats("r1", stats)
    assert view.node == "n1" and view.free_bytes == 123
    assert view.models[M] == ModelAt(State.HOT, 4, 1, 0, 5, True, 0.4, 0.01, 7.0,
                                     Verdict.ALREADY_LOADED)
    assert not ReplicaView.from_stats("r2", {}).reported


def test_deep_only_when_every_holder_is_deep() -> None:
    deep = at(State.HOT, in_flight=2, queued=5)
    shallow = at(State.HOT, in_flight=2, queued=1)
    assert is_deep(M, [replica("a", deep), replica("b", deep)], {}, depth=4)
    assert not is_deep(M, [replica("a", deep), replica("b", shallow)], {}, depth=4)
    assert not is_deep(M, [replica("a", at())], {}, depth=4)  # nobody holds it


def test_idle_extra_copies_go_the_most_recent_stays() -> None:
    replicas = [replica("new", at(State.HOT, last_used=100.0)),
                replica("old", at(State.HOT, last_used=10.0)),
                replica("busy", at(State.HOT, last_used=5.0, in_flight=1)),
                replica("pinned", at(State.HOT, last_used=1.0, pinned=True))]
    assert idle_copies(replicas, now=200.0, idle_s=60.0) == [("old", M)]
    assert idle_copies(replicas, now=60.0, idle_s=60.0) == []  # old idle 50 s < 60 s
    assert idle_copies(replicas[:1], now=10**6, idle_s=1.0) == []  # the last copy stays


def test_an_unmeasured_model_costs_the_default_load() -> None:
    # busy wait 0.4 s < default load: the busy copy first
    busy = at(State.HOT, in_flight=2, queued=1, service_s=0.2)
    replicas = [replica("busy", busy), replica("empty", at(verdict=Verdict.FITS))]
    assert DEFAULT_LOAD_S > 0.4
    assert flat(route(M, replicas)) == ["busy", "empty"]


def test_a_replica_where_the_model_failed_is_the_last_resort() -> None:
    replicas = [replica("failed", at(State.FAILED)),
                replica("evict", at(verdict=Verdict.FITS_AFTER_EVICTION, evict_s=5.0))]
    assert flat(route(M, replicas)) == ["evict", "failed"]


def test_loads_on_their_way_count_against_a_replicas_free_bytes() -> None:
    from packserve.pool.routing import pending_bytes

    other = "other"
    replicas = [replica("a", at(verdict=Verdict.FITS), free=1000,
                        other=at(bytes=600, verdict=Verdict.FITS)),
                replica("b", at(verdict=Verdict.FITS), free=900)]
    assert flat(route(M, replicas)) == ["a", "b"]
    # A request for `other` just went to a, whose report does not show it loading yet.
    pending = pending_bytes(replicas, {("a", other): 1})
    assert pending == {"a": 600}
    assert flat(route(M, replicas, pending=pending)) == ["b", "a"]


def test_a_replica_with_a_warm_copy_comes_before_emptier_ones() -> None:
    replicas = [replica("roomy", at(verdict=Verdict.FITS), free=10**10),
                replica("warm", at(State.WARM, verdict=Verdict.FITS), free=10**8)]
    assert flat(route(M, replicas)) == ["warm", "roomy"]
