"""`packserve serve` with another victim policy, for `python -m benchmarks trace` only.

Run as `python -m benchmarks.policy_server --config FILE --policy SPEC --port P`.
SPEC: `cost[:HORIZON_S]` (packserve's rule), `lru_by_bytes` (packserve 0.11's),
`lru_by_count:N` (Ray Serve multiplexing), `keep_alive:DEFAULT_S[,NAME=S...]` (Ollama's
shortest keep-alive first). Everything else is
what `packserve serve`'s worker builds (`server.build_scheduler`, the same app and telemetry),
in one process.
"""

from __future__ import annotations

import argparse
import asyncio

from benchmarks.baselines import lru_by_count, shortest_keep_alive_first
from packserve.core.policy import CostAware, VictimPolicy, lru_by_bytes


def parse_policy(spec: str) -> VictimPolicy:
    name, _, arg = spec.partition(":")
    if name == "lru_by_bytes":
        return lru_by_bytes
    if name == "cost":
        return CostAware(float(arg)) if arg else CostAware()
    if name == "lru_by_count":
        return lru_by_count(int(arg))
    if name == "keep_alive":
        default, *pairs = arg.split(",")
        keep = {k: float(v) for k, v in (p.split("=", 1) for p in pairs)}
        return shortest_keep_alive_first(keep, default_s=float(default))
    raise ValueError(f"unknown policy {spec!r}")


async def _serve(config_path: str, port: int, policy: VictimPolicy) -> None:
    import uvicorn

    from packserve.api.app import create_app
    from packserve.backends import prepare
    from packserve.config import load_config
    from packserve.server import build_scheduler, build_telemetry

    config = load_config(config_path, port=port)
    scheduler = build_scheduler(config, victim_policy=policy)
    # Engines imported before the trace, so that no policy pays an import in its first load.
    prepare({m.backend for m in config.models})
    app = create_app(scheduler, build_telemetry(config, scheduler),
                     max_request_bytes=config.server.max_request_bytes,
                     compute_priority=config.server.compute_priority, slo=config.server.slo)
    await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                        log_level="warning")).serve()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--policy", default="lru_by_bytes")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(_serve(args.config, args.port, parse_policy(args.policy)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
