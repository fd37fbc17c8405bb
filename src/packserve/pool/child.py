"""`python -m packserve.pool.child CONFIG_JSON PARENT_PID`: one pool replica's packserve node.

The replica (packserve.pool.node) starts this process: a whole packserve node, front and worker,
as `packserve serve` runs it, on the config the replica wrote. It ends when the replica's
process does, however that ends (a Ray kill, a lost node): a replica that is gone must not
leave a node holding memory that its successor needs. It imports no Ray.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from packserve.config import Config

ORPHAN_CHECK_S = 0.5


async def _main(config: Config, parent: int) -> int:
    from packserve.front.app import run_front

    async def orphaned() -> None:
        while True:
            await asyncio.sleep(ORPHAN_CHECK_S)
            if os.getppid() != parent:
                os._exit(3)  # the worker has PR_SET_PDEATHSIG on us: it goes too

    watch = asyncio.create_task(orphaned())
    try:
        return await run_front(config)
    finally:
        watch.cancel()


def main(argv: list[str]) -> int:
    from packserve.logs import configure_logging

    path, parent = Path(argv[0]), int(argv[1])
    config = Config.model_validate_json(path.read_text("utf-8"))
    configure_logging(config.server.log_level)
    return asyncio.run(_main(config, parent))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
