"""`packserve pool`: deploy the replicas on Ray Serve and serve the entry point."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn

from packserve.auth import KeyRing
from packserve.config import Config

log = logging.getLogger("packserve.pool")


def run_pool(config: Config, keys: KeyRing | None) -> int:
    """Join (or start) the Ray cluster, deploy every group, serve the entry point until SIGTERM
    or SIGINT, then delete the replicas. Returns the exit status."""
    import ray
    from ray import serve

    from packserve.pool.app import deploy, groups, undeploy
    from packserve.pool.entry import Pool

    pool = config.pool
    if pool.address:
        ray.init(address=pool.address, logging_level=logging.WARNING)
    else:
        ray.init(include_dashboard=False, logging_level=logging.WARNING)
    try:
        log.info("packserve pool: deploying %d group(s) of replicas on the Ray cluster at %s",
                 len(groups(config)), ray.get_runtime_context().gcs_address)
        handles = deploy(config)
        entry = Pool(config, handles, keys)
        return asyncio.run(_serve(entry))
    finally:
        with contextlib.suppress(Exception):
            undeploy(config)
            serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (it would re-raise SIGTERM after serving, which
    ends the process before the replicas are deleted)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve(entry: object) -> int:
    from packserve.pool.entry import Pool, create_entry_app

    assert isinstance(entry, Pool)
    config = entry.config
    server = _Server(uvicorn.Config(
        create_entry_app(entry), host=config.server.host, port=config.server.port,
        log_level=config.server.log_level, access_log=config.server.access_log,
        ws="none",  # no websocket routes; "auto" imports the websockets library (~1 MiB)
        lifespan="off", timeout_graceful_shutdown=5))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    await entry.start()
    placement = asyncio.create_task(entry.placement())
    log.info("packserve pool: entry point on http://%s:%d", config.server.host,
             config.server.port)
    try:
        await server.serve()
    finally:
        placement.cancel()
    return 0
