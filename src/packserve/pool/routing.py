"""Pure routing policy for a pool: plain data in, plain data out. No Ray, no asyncio, no clock.

Each replica reports what it holds (`ReplicaView`, built from its routing stats); the router
asks `route` where a request for a model should go and `idle_copies` which extra copies to drop.
Tests call them with hand-written tables (tests/pool/test_routing.py).

The order of preference for a request (docs/pool.md):
1. a replica where the model is hot and has a free slot (the least occupied first);
2. one where it is hot (or loading) but busy, if the expected wait there beats a load elsewhere;
3. one where it fits without evicting anything (the most free bytes first);
4. the one whose eviction costs least: the reload seconds of the victims its own dry-run plan
   names (the node's policy chooses them, not the router);
5. one where it fits once busy models finish; a busy one whose wait was longer than a load;
   one where the model failed (in its cooldown or quarantined there).
A replica that does not serve the model, or where it can never fit, is not a candidate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from packserve.core.policy import Verdict
from packserve.types import State

# A model never loaded anywhere yet: what a load is taken to cost until one is measured.
DEFAULT_LOAD_S = 2.0
# A request whose model's service time is not measured yet: what it is taken to take.
DEFAULT_SERVICE_S = 0.2
_HOLDING = (State.HOT, State.LOADING, State.ADMITTING)
_WARM_FIRST = 1 << 62  # ranks a replica with a warm copy before any free bytes do


@dataclass(frozen=True)
class ModelAt:
    """One catalog model on one replica, as the replica's last report had it."""

    state: State
    concurrency: int
    in_flight: int = 0
    queued: int = 0
    bytes: int = 0
    pinned: bool = False
    load_s: float | None = None  # its last measured load there
    service_s: float | None = None  # mean seconds per request there, lately
    last_used: float | None = None  # wall clock
    verdict: Verdict = Verdict.FITS  # the replica's dry-run plan for loading it now
    evict_s: float = 0.0  # reload seconds of the victims that plan names
    evict_bytes: int = 0

    @property
    def holds(self) -> bool:
        return self.state in _HOLDING


@dataclass(frozen=True)
class ReplicaView:
    """One replica: its id, where it runs, and its models (those it serves)."""

    replica: str
    node: str = ""
    free_bytes: int = 0  # on the device its models use (the largest, with several)
    models: Mapping[str, ModelAt] = field(default_factory=dict)
    reported: bool = True  # False until its first report arrives

    @classmethod
    def from_stats(cls, replica: str, stats: Mapping[str, object]) -> ReplicaView:
        """The view of a replica's routing stats (pool.node.Node.record_routing_stats)."""
        if not stats or "models" not in stats:
            return cls(replica=replica, reported=False)
        rows = stats["models"]
        assert isinstance(rows, Mapping)
        models = {name: ModelAt(
            state=State(m["state"]), concurrency=int(m["concurrency"]),
            in_flight=int(m["in_flight"]), queued=int(m["queued"]), bytes=int(m["bytes"]),
            pinned=bool(m["pinned"]), load_s=m.get("load_s"), service_s=m.get("service_s"),
            last_used=m.get("last_used"), verdict=Verdict(m["verdict"]),
            evict_s=float(m.get("evict_s", 0.0)), evict_bytes=int(m.get("evict_bytes", 0)))
            for name, m in rows.items()}
        return cls(replica=replica, node=str(stats.get("node", "")),
                   free_bytes=int(str(stats.get("free_bytes", 0))), models=models)


def load_seconds(model: str, replicas: Sequence[ReplicaView]) -> float:
    """What loading `model` takes: its slowest measured load in the pool, else the default."""
    seen = [m.load_s for r in replicas if (m := r.models.get(model)) and m.load_s]
    return max(seen) if seen else DEFAULT_LOAD_S


def occupancy(m: ModelAt, outstanding: int) -> int:
    """Requests on the model there: the replica's count, or this router's own if higher (its
    report may predate requests just sent)."""
    return max(m.in_flight + m.queued, outstanding)


def expected_wait(m: ModelAt, busy: int, load_s: float) -> float:
    """Seconds a request sent now would wait there before it runs."""
    service = m.service_s or DEFAULT_SERVICE_S
    ahead = max(0, busy - m.concurrency + 1)
    wait = math.ceil(ahead / max(1, m.concurrency)) * service
    if m.state is not State.HOT:  # loading: about half a load is left, on average
        wait += load_s / 2
    return wait


def is_deep(model: str, replicas: Sequence[ReplicaView], outstanding: Mapping[str, int],
            depth: int) -> bool:
    """Whether every replica holding `model` has more than `depth` requests waiting for it
    (False when none holds it): the trigger for one more copy."""
    holders = [(r, m) for r in replicas if (m := r.models.get(model)) and m.holds]
    return bool(holders) and all(
        occupancy(m, outstanding.get(r.replica, 0)) - m.concurrency > depth for r, m in holders)


def pending_bytes(replicas: Sequence[ReplicaView],
                  outstanding: Mapping[tuple[str, str], int]) -> dict[str, int]:
    """Per replica, the bytes of models this router has sent requests for there that its last
    report did not show as held: loads on their way, which that report could not count."""
    views = {r.replica: r for r in replicas}
    out: dict[str, int] = {}
    for (replica, model), n in outstanding.items():
        m = views[replica].models.get(model) if replica in views else None
        if n > 0 and m is not None and not m.holds:
            out[replica] = out.get(replica, 0) + m.bytes
    return out


def route(model: str, replicas: Sequence[ReplicaView],
          outstanding: Mapping[str, int] | None = None, *, spill: bool = False,
          pending: Mapping[str, int] | None = None) -> list[list[str]]:
    """Replica ids for a request for `model`, in ranks, most preferred first (Ray Serve tries
    a rank's replicas before the next rank's). `outstanding`: requests for `model` this router
    has sent to each replica and not yet seen finish. `spill`: the model has been deep on every
    holder long enough to get one more copy, so a replica without it comes before a busy one.
    `pending`: bytes on their way to each replica (`pending_bytes`), taken off its free bytes,
    so that a burst of cold requests spreads instead of queueing loads on one replica."""
    outstanding = outstanding or {}
    pending = pending or {}
    load_s = load_seconds(model, replicas)
    free: list[tuple[float, str]] = []
    busy: list[tuple[float, str]] = []
    fits: list[tuple[float, str]] = []
    evicts: list[tuple[float, int, str]] = []
    later: list[tuple[float, str]] = []
    unknown: list[str] = []
    for r in replicas:
        if not r.reported:
            unknown.append(r.replica)
            continue
        m = r.models.get(model)
        if m is None or (not m.holds and m.verdict is Verdict.NEVER_FITS):
            continue
        if m.state is State.FAILED:  # cooling down or quarantined there: last resort
            later.append((1.0, r.replica))
            continue
        n = occupancy(m, outstanding.get(r.replica, 0))
        if m.state is State.HOT and n < m.concurrency:
            free.append((n / m.concurrency, r.replica))
        elif m.holds:
            busy.append((expected_wait(m, n, load_s), r.replica))
        elif m.verdict in (Verdict.FITS, Verdict.ALREADY_LOADED):
            # A warm copy there comes back by a restore, not a whole load: it goes first.
            room = r.free_bytes - pending.get(r.replica, 0)
            fits.append((-room - (_WARM_FIRST if m.state is State.WARM else 0), r.replica))
        elif m.verdict is Verdict.FITS_AFTER_EVICTION:
            evicts.append((m.evict_s, m.evict_bytes, r.replica))
        else:  # WAIT_FOR_BUSY
            later.append((0.0, r.replica))
    cheapest_load = load_s if fits else load_s + min(e[0] for e in evicts) if evicts \
        else math.inf
    soon = [b for b in busy if b[0] <= cheapest_load and not spill]
    slow = [b for b in busy if b not in soon]
    order = [*_ids(free), *_ids(soon), *_ids(fits), *[e[2] for e in sorted(evicts)],
             *_ids(slow), *_ids(later), *unknown]
    return [[replica] for replica in order]


def _ids(rows: list[tuple[float, str]]) -> list[str]:
    return [replica for _, replica in sorted(rows)]


def idle_copies(replicas: Sequence[ReplicaView], now: float, idle_s: float
                ) -> list[tuple[str, str]]:
    """(replica, model) pairs to unload: copies of a model hot on several replicas that have
    had nothing to do for `idle_s` and are not pinned. The most recently used copy of each
    model always stays, and so does any copy a request is using or waiting for."""
    drop: list[tuple[str, str]] = []
    names = {name for r in replicas for name in r.models}
    for name in sorted(names):
        copies = sorted(((m.last_used or 0.0, r.replica, m) for r in replicas
                         if (m := r.models.get(name)) and m.state is State.HOT),
                        key=lambda c: c[0], reverse=True)
        for last_used, replica, m in copies[1:]:
            if not m.pinned and m.in_flight + m.queued == 0 and now - last_used >= idle_s:
                drop.append((replica, name))
    return drop
