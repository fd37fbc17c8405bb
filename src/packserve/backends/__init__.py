"""The registry of engines: the one list of what `backend = NAME` may name.

Each engine's module declares `ENGINES`, a tuple of `packserve.core.engine.Engine`; adding an
engine is one new module here plus one line in `_BUILT_IN`. Everything else (config checks,
the server's wiring, footprints, the planner, the audit, the benches) asks this module.
Importing it imports no engine library: each backend imports its own in `prepare()`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from packserve.backends.runner import RunnerHost
from packserve.core.backend import Backend, BackendFactory, LoadSpec
from packserve.core.engine import Engine

_BUILT_IN = (
    "packserve.backends.sentence_tf",
    "packserve.backends.llama_server",
    "packserve.backends.fake",
)

_ENGINES: dict[str, Engine] = {}

# Names an entry may still give for an engine folded into another (the config reads them as the
# engine they name, saying so once): `llama-cpp` was the in-process llama.cpp engine
# (llama-cpp-python), removed for the runner that serves the same GGUF files through the same
# API (docs/engines.md).
ALIASES = {"llama-cpp": "llama-server"}


def register(engine: Engine) -> Engine:
    """Add `engine` to the registry; a name can be registered once."""
    if engine.name in _ENGINES and _ENGINES[engine.name] is not engine:
        raise ValueError(f"an engine named {engine.name!r} is already registered")
    _ENGINES[engine.name] = engine
    return engine


def unregister(name: str) -> None:
    """Remove an engine registered at run time (tests do; built-in engines stay)."""
    _ENGINES.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_ENGINES)


def get(name: str) -> Engine:
    """The engine called `name`. Raises ValueError naming the engines there are."""
    engine = _ENGINES.get(name)
    if engine is None:
        raise ValueError(f"unknown backend {name!r} (packserve has: {', '.join(_ENGINES)})")
    return engine


def factory(host: RunnerHost) -> BackendFactory:
    """The server's backend factory: the engine named by a spec builds its backend, and an
    engine in a process of its own runs it on `host` (the worker's spawner, turns and logs)."""
    from packserve.backends.llama_server import RunnerBackend

    def create(spec: LoadSpec) -> Backend:
        backend = get(spec.backend).build(spec)
        if isinstance(backend, RunnerBackend):
            backend.host = host
        return backend

    return create


def check_weights(spec: LoadSpec) -> None:
    """The server's check before every load: the weight files' headers, where there are files."""
    get(spec.backend).check_weights(spec)


def prepare(backends: Iterable[str]) -> None:
    """Import engine libraries now, so that no load pays for it in its measured footprint."""
    for name in sorted(set(backends)):
        get(name).prepare()


for _module in _BUILT_IN:
    for _engine in importlib.import_module(_module).ENGINES:
        register(_engine)
