"""uvicorn's `Config` and `Server`, without uvicorn's command line.

`import uvicorn` runs uvicorn/__init__.py, which imports uvicorn.main for `uvicorn.run` and the
`uvicorn` command: click and the reloaders (watchfiles, multiprocessing), about 1.3 MiB of
every packserve process at rest (measured with tracemalloc and PSS) for code that a packserve
process never runs. Imported before uvicorn, this module puts a stand-in for uvicorn.main in
`sys.modules`: uvicorn/__init__.py takes `Server` from it (uvicorn.server's own class), and
`uvicorn.run` and `uvicorn.main` raise, for the life of the process. Where uvicorn was imported
already (a test process, Ray Serve), the real module stays and nothing changes.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any, NoReturn


def _stand_in() -> types.ModuleType:
    module = types.ModuleType("uvicorn.main", "packserve's stand-in: no uvicorn command line")
    module.__spec__ = importlib.machinery.ModuleSpec("uvicorn.main", None)

    def unavailable(*_: Any, **__: Any) -> NoReturn:
        raise RuntimeError("uvicorn's command line is not loaded in a packserve process; "
                           "use uvicorn.Server")

    def attribute(name: str) -> Any:
        if name == "Server":
            from uvicorn.server import Server

            return Server
        if name in ("main", "run"):
            return unavailable
        raise AttributeError(f"module 'uvicorn.main' (packserve's stand-in) has no {name!r}")

    module.__getattr__ = attribute  # type: ignore[method-assign]
    return module


if "uvicorn" not in sys.modules:
    sys.modules.setdefault("uvicorn.main", _stand_in())

from uvicorn.config import Config  # noqa: E402  (after the stand-in)
from uvicorn.server import Server  # noqa: E402

__all__ = ["Config", "Server"]
