"""packserve's request router for Ray Serve, and round robin (a baseline for bench pool).

Ray Serve builds a router inside every deployment handle, so these run in the entry point's
process. `choose_replicas` is called for each request with the replicas Ray Serve knows; their
`routing_stats` are the last reports of `Node.record_routing_stats`, pushed by Ray Serve's
controller every `stats_period_s`. Between two reports the router counts, per replica and
model, the requests it sent and has not seen finish, so a burst does not pile onto the one
replica whose last report showed a free slot.

Ray Serve constructs the router, so the entry point cannot hand it anything: each router
registers itself in `ROUTERS` under its deployment's name, where the entry point finds it for
the pool view and for placement (dropping idle extra copies).
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from packserve.pool.routing import ReplicaView, is_deep, pending_bytes, route

# Deployment name -> its router in this process (see the module docstring).
ROUTERS: dict[str, Registered] = {}


def _addressed(pending: PendingRequest | None) -> str:
    """The replica a request is addressed to ("" if the router chooses)."""
    if pending is None or not pending.args:
        return ""
    return str(getattr(pending.args[0], "replica", "") or "")


def _model(pending: PendingRequest | None) -> str:
    return pending.metadata.multiplexed_model_id if pending is not None else ""


class Registered(RequestRouter):
    """What every pool router offers the entry point: the replicas' last reports, and
    requests addressed to one replica (`Relay.replica`) sent there and nowhere else."""

    def register(self) -> None:
        # Ray Serve may rebuild this class from a pickle, with its own copy of the module's
        # globals: the registry is looked up in the module the entry point imported.
        import importlib

        importlib.import_module(__name__).ROUTERS[self._deployment_id.name] = self

    def views(self) -> list[ReplicaView]:
        """Every replica as its last report had it."""
        return [ReplicaView.from_stats(r.replica_id.unique_id, r.routing_stats)
                for r in self.curr_replicas.values()]

    def stats(self) -> dict[str, dict[str, Any]]:
        """Every replica's last report, raw (the pool view shows its devices)."""
        return {r.replica_id.unique_id: dict(r.routing_stats)
                for r in self.curr_replicas.values()}

    @staticmethod
    def addressed(candidates: list[RunningReplica], pending: PendingRequest | None
                  ) -> list[list[RunningReplica]] | None:
        """The rank for a request addressed to one replica; None if it is not addressed."""
        target = _addressed(pending)
        if not target:
            return None
        return [[r for r in candidates if r.replica_id.unique_id == target]]


class PackserveRouter(Registered):
    """Hot with a free slot, then hot and busy if the wait beats a load, then fits without
    evicting, then cheapest eviction (packserve.pool.routing.route)."""

    def initialize_state(self, copy_queue_depth: int = 4, copy_after_s: float = 5.0,
                         **_: Any) -> None:
        self.copy_queue_depth = copy_queue_depth
        self.copy_after_s = copy_after_s
        # (replica, model) -> requests sent and not finished; request id -> (replica, model)
        self.outstanding: defaultdict[tuple[str, str], int] = defaultdict(int)
        self._sent: dict[str, tuple[str, str]] = {}
        self._deep_since: dict[str, float] = {}
        self.register()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        addressed = self.addressed(candidate_replicas, pending_request)
        if addressed is not None:
            return addressed
        avoid = set(getattr(pending_request.args[0], "avoid", ())) if pending_request and \
            pending_request.args else set()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas
                 if r.replica_id.unique_id not in avoid} or \
            {r.replica_id.unique_id: r for r in candidate_replicas}
        model = _model(pending_request)
        if not model:
            return [candidate_replicas]
        views = [ReplicaView.from_stats(i, r.routing_stats) for i, r in by_id.items()]
        sent = {i: self.outstanding[(i, model)] for i in by_id}
        now = time.monotonic()
        if is_deep(model, views, sent, self.copy_queue_depth):
            self._deep_since.setdefault(model, now)
        else:
            self._deep_since.pop(model, None)
        spill = now - self._deep_since.get(model, now) >= self.copy_after_s > 0 or (
            self.copy_after_s == 0 and model in self._deep_since)
        ranks = route(model, views, sent, spill=spill,
                      pending=pending_bytes(views, self.outstanding))
        if not ranks:  # nowhere it fits: let a node say so, with its numbers
            return [list(by_id.values())]
        return [[by_id[i] for i in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        model = _model(pending_request)
        if model:
            key = (replica_id.unique_id, model)
            self.outstanding[key] += 1
            self._sent[pending_request.metadata.internal_request_id] = key

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        key = self._sent.pop(internal_request_id, None)
        if key is not None:
            self.outstanding[key] = max(0, self.outstanding[key] - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        gone = replica_id.unique_id
        for key in [k for k in self.outstanding if k[0] == gone]:
            del self.outstanding[key]


class RoundRobinRouter(Registered):
    """Each request to the next replica, whatever it holds: the floor bench pool compares with."""

    def initialize_state(self, **_: Any) -> None:
        self._turn = itertools.count()
        self.register()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        addressed = self.addressed(candidate_replicas, pending_request)
        if addressed is not None:
            return addressed
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        return [[ordered[next(self._turn) % len(ordered)]]]


class RayRouter(PowerOfTwoChoicesRequestRouter, Registered):
    """Ray Serve's own routing (power of two choices, preferring replicas whose multiplexed
    models include the request's), plus addressed requests: the baseline of bench pool."""

    def initialize_state(self, **_: Any) -> None:
        self.register()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        addressed = self.addressed(candidate_replicas, pending_request)
        if addressed is not None:
            return addressed
        return await super().choose_replicas(candidate_replicas, pending_request)
