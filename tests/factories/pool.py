"""Pools: a local Ray cluster in this process, and `packserve pool` as a process."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.factories.scheduler import MIB
from tests.factories.servers import Served, cli_process


@dataclass
class RayCluster:
    """A local Ray cluster of CPU nodes, each with one `packserve_node` resource (so each holds
    one pool replica), started in this process by `ray.cluster_utils.Cluster`."""

    address: str
    nodes: list[Any]
    cluster: Any


@contextlib.contextmanager
def ray_cluster(nodes: int = 2, cpus: int = 2, gpus: int = 0) -> Iterator[RayCluster]:
    """Start the cluster and connect this process to it (to kill replicas); shut all down on
    exit. Imports Ray here only: a test that never asks for a pool never loads it. `gpus`:
    cards each node declares to Ray (none is there: Ray hands their ids out all the same)."""
    import ray
    from ray.cluster_utils import Cluster

    store = 80 * MIB
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": cpus, "num_gpus": gpus, "resources": {"packserve_node": 1},
        "object_store_memory": store,
        "include_dashboard": False})
    added = [cluster.head_node]
    for _ in range(nodes - 1):
        added.append(cluster.add_node(num_cpus=cpus, num_gpus=gpus,
                                      resources={"packserve_node": 1},
                                      object_store_memory=store))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        yield RayCluster(cluster.address, added, cluster)
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]


def pool_section(address: str, replicas: int, **extra: object) -> str:
    """A `[pool]` table: `replicas` replicas, one per cluster node, quick stats."""
    settings: dict[str, object] = {
        "address": address, "min_replicas": replicas, "max_replicas": replicas,
        "replica_cpus": 0, "stats_period_s": 0.2, **extra}
    lines = [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    return "[pool]\n" + "\n".join(lines) + "\nreplica_resources = { packserve_node = 1 }\n"


@contextlib.contextmanager
def pool_process(config: Path, tmp: Path, timeout: float = 240.0) -> Iterator[Served]:
    """Run `packserve pool --config CONFIG` on a free port until its entry point is ready;
    SIGTERM it on exit (it deletes its replicas)."""
    with cli_process("pool", ["--config", str(config)], tmp, ready_s=timeout,
                     stop_s=90) as served:
        yield served
