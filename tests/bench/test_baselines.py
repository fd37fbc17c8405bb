"""Table tests for the other engines' victim policies the trace benchmark compares against
(benchmarks/baselines.py); packserve's own rules are tested in tests/core/test_policy.py."""

from __future__ import annotations

import pytest

from benchmarks.baselines import lru_by_count, shortest_keep_alive_first
from packserve.core.policy import ResidentView, VictimPolicy, lru_by_bytes
from tests.factories import MIB, resident, victim_rows

A, B, C, BUSY, PINNED, LOADING = victim_rows()  # A least recently used, C most


@pytest.mark.parametrize(("max_models", "residents", "need", "free", "expected"), [
    (3, [A, B], 50, 1000, ()),  # 2 resident + 1 new = 3: under the count, bytes fit
    (2, [A, B], 50, 1000, ("a",)),  # over the count: LRU leaves although the bytes fit
    (1, [A, B, C], 50, 1000, ("a", "b", "c")),  # count 1: everything else leaves
    (2, [A, B, C], 50, 1000, ("a", "b")),
    (3, [A, B], 350, 100, ("a", "b")),  # count fine, bytes not: LRU until the bytes fit
    (1, [BUSY, A], 50, 1000, ("a",)),  # busy is never chosen: the count is exceeded
    (2, [BUSY, PINNED], 50, 1000, ()),  # nothing evictable, bytes fit: load over the count
    (2, [BUSY, A], 600, 100, None),  # bytes cannot fit without the busy one: wait
    (2, [LOADING, A], 50, 1000, ("a",)),  # a loading resident counts but is not evictable
])
def test_lru_by_count(max_models: int, residents: list[ResidentView], need: int, free: int,
                      expected: tuple[str, ...] | None) -> None:
    assert lru_by_count(max_models)(residents, need * MIB, free * MIB) == expected


def test_lru_by_count_refuses_a_zero_count() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        lru_by_count(0)


@pytest.mark.parametrize(("keep_alive", "residents", "need", "free", "expected"), [
    ({}, [A, B, C], 150, 100, ("a",)),  # one keep-alive for all: plain LRU
    ({"a": 600}, [A, B, C], 150, 100, ("b",)),  # a expires at 601, b at 302: b first
    ({"a": 600}, [A, B, C], 400, 100, ("b", "c")),  # 100 + 200 + 300 >= 400
    ({"a": 600, "b": 600}, [A, B, C], 150, 100, ("c",)),
    ({"x": 600}, [resident("w", 200, last_used=1, models=("x", "y")), B], 150, 100, ("b",)),
    ({}, [BUSY, PINNED], 150, 100, None),
])
def test_shortest_keep_alive_first(keep_alive: dict[str, float], residents: list[ResidentView],
                                   need: int, free: int,
                                   expected: tuple[str, ...] | None) -> None:
    policy = shortest_keep_alive_first(keep_alive, default_s=300)
    assert policy(residents, need * MIB, free * MIB) == expected


@pytest.mark.parametrize("policy", [lru_by_bytes, lru_by_count(1),
                                    shortest_keep_alive_first({"a": 1e9})])
def test_no_policy_overcommits_or_takes_busy_models(policy: VictimPolicy) -> None:
    """Whatever the rule, victims free enough bytes and are idle, unpinned and hot."""
    residents = [A, B, C, BUSY, PINNED, LOADING]
    by_key = {r.key: r for r in residents}
    for need in range(0, 900, 50):
        victims = policy(residents, need * MIB, 0)
        if victims is None:
            continue
        assert all(by_key[k].evictable for k in victims)
        assert sum(by_key[k].bytes for k in victims) >= need * MIB
