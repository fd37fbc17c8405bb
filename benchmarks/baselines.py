"""Other engines' eviction rules, as victim policies of packserve's own scheduler: the
baselines `python -m benchmarks trace` and `sim` replay a trace under (`policy_server`).

A server cannot be configured to use them (`packserve.core.policy.make_policy` knows `cost` and
`lru`), so they live here, beside the benchmarks. Each keeps the scheduler contract's two safety
rules (packserve.core.policy, "victim policies"): it never names a resident that is not
`evictable`, and never answers with victims that leave too few bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from packserve.core.policy import ResidentView, VictimPolicy, choose_victims, lru_order


def lru_by_count(max_models: int) -> VictimPolicy:
    """Ray Serve multiplexing's rule: at most `max_models` resident; evict LRU beyond that.

    Modelled as: the resident being loaded counts as one, so while `max_models` or more others
    hold memory, the least recently used idle ones leave until the count is `max_models - 1`,
    whether or not their bytes are needed. Ray would also unload a model with requests in
    flight; here busy and pinned models are never chosen (the scheduler contract), so the
    count may be exceeded while they are busy. The byte budget still applies: if the count
    rule frees too few bytes, further LRU victims are added as `lru_by_bytes` would.
    """
    if max_models < 1:
        raise ValueError("max_models must be at least 1")

    def policy(residents: Sequence[ResidentView], need_bytes: int,
               free_bytes: int) -> tuple[str, ...] | None:
        excess = sum(1 for r in residents if r.holds_memory) + 1 - max_models
        victims: list[str] = []
        freed = free_bytes
        for r in sorted((r for r in residents if r.evictable), key=lru_order):
            if len(victims) >= excess and freed >= need_bytes:
                break
            victims.append(r.key)
            freed += r.frees
        return tuple(victims) if freed >= need_bytes else None

    return policy


def shortest_keep_alive_first(
    keep_alive_s: Mapping[str, float], default_s: float = 300.0,
) -> VictimPolicy:
    """Ollama's rule: evict the model whose keep-alive expires soonest.

    Ollama gives every runner a keep-alive (default 5 minutes, settable per model and per
    request) and, when it needs room, unloads the idle runner whose expiry comes first. Modelled
    as: expiry = `last_used + keep_alive` with keep-alives looked up by resident key or by any
    of its catalog names (the longest wins for shared weights), `default_s` otherwise; victims
    in order of expiry until the bytes fit. With one keep-alive for all it is plain LRU.
    """

    def keep_alive(r: ResidentView) -> float:
        found = [keep_alive_s[n] for n in (r.key, *r.models) if n in keep_alive_s]
        return max(found) if found else default_s

    def by_expiry(r: ResidentView) -> tuple[float, ...]:
        return (r.last_used + keep_alive(r), -r.bytes)

    def policy(residents: Sequence[ResidentView], need_bytes: int,
               free_bytes: int) -> tuple[str, ...] | None:
        return choose_victims(residents, need_bytes, free_bytes, by_expiry)

    return policy
