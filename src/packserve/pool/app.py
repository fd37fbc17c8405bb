"""Deploy a pool on Ray Serve: one application per group of replicas, each a `Node`.

A group is the shared replicas (every model not given dedicated replicas) or one
`[[pool.dedicated]]` entry (only its models). Each group's replicas run the same node config:
its models, the `[devices.*]` budgets, its pins (a pin is held by every replica of its group,
and a group with pins never scales below one replica, so no scale-in loses a pin's last copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from packserve.config import Config, PoolConfig
from packserve.pool.node import Node

SHARED = "packserve-shared"
_ROUTERS = {"packserve": "packserve.pool.router:PackserveRouter",
            "ray": "packserve.pool.router:RayRouter",
            "round_robin": "packserve.pool.router:RoundRobinRouter"}


@dataclass(frozen=True)
class Group:
    """Replicas that run one node config."""

    name: str  # the Ray Serve application and deployment name
    models: tuple[str, ...]
    min_replicas: int
    max_replicas: int
    config: Config  # the node config: these models only


def groups(config: Config) -> list[Group]:
    """The shared group (if any model is left for it) and one group per dedicated entry."""
    pool = config.pool
    dedicated = {name for g in pool.dedicated for name in g.models}
    out = []
    shared = tuple(m.name for m in config.models if m.name not in dedicated)
    if shared:
        out.append(Group(SHARED, shared, pool.min_replicas, pool.max_replicas,
                         _only(config, shared)))
    for i, g in enumerate(pool.dedicated):
        out.append(Group(f"packserve-dedicated-{i}", tuple(g.models), g.min_replicas,
                         g.max_replicas, _only(config, tuple(g.models))))
    return out


def _only(config: Config, names: tuple[str, ...]) -> Config:
    """The node config of a group: its models; the pool section is the entry point's."""
    return config.model_copy(update={"models": [m for m in config.models if m.name in names],
                                     "pool": PoolConfig()})


def deployment_options(config: Config, group: Group) -> dict[str, Any]:
    """What Ray Serve is told about a group's replicas."""
    pool = config.pool
    scaling: dict[str, Any] = {"num_replicas": group.min_replicas}
    if group.max_replicas > group.min_replicas:
        # Ray Serve counts a replica's requests in flight, which includes those queued inside
        # its node: the pool's total queue depth, per replica.
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=group.min_replicas, max_replicas=group.max_replicas,
            target_ongoing_requests=pool.target_queue, upscale_delay_s=pool.upscale_delay_s,
            downscale_delay_s=pool.downscale_delay_s)}
    return {
        "name": group.name,
        "ray_actor_options": {"num_cpus": pool.replica_cpus, "num_gpus": pool.replica_gpus,
                              "resources": dict(pool.replica_resources)},
        # The node queues and refuses (429) by its own quotas; Ray Serve must not refuse first.
        "max_ongoing_requests": 100_000,
        "health_check_period_s": 2.0, "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": config.server.drain_s + 10,
        "request_router_config": RequestRouterConfig.model_validate({
            "request_router_class": _ROUTERS[pool.router],
            "request_router_kwargs": {"copy_queue_depth": pool.copy_queue_depth,
                                      "copy_after_s": pool.copy_after_s},
            "request_routing_stats_period_s": pool.stats_period_s,
            "request_routing_stats_timeout_s": max(10.0, 4 * pool.stats_period_s)}),
        **scaling,
    }


def deploy(config: Config) -> dict[str, DeploymentHandle[Any]]:
    """Run every group on the Ray cluster this process is connected to; returns each group's
    handle once its replicas have started. Ray Serve's HTTP proxy is not used: the entry point
    (packserve.pool.entry) is the pool's only door."""
    serve.start(http_options={"location": "NoServer"})
    ray_models = config.pool.ray_models_per_replica if config.pool.router == "ray" else 0
    handles = {}
    for group in groups(config):
        app = serve.deployment(**deployment_options(config, group))(Node).bind(
            group.config.model_dump_json(), ray_models)
        handles[group.name] = serve.run(app, name=group.name, route_prefix=None)
    return handles


def undeploy(config: Config) -> None:
    for group in groups(config):
        serve.delete(group.name)
