"""The front process: owns the port, supervises the worker that holds the models."""

import sys

# The front uses httpx as a client only. Unless this import fails, `import httpx` also imports
# its command-line tool, httpx._main, with rich and pygments (~3 MiB of the front, measured);
# httpx catches the ImportError and defines a stub `httpx.main`. No effect once httpx is loaded.
# (None in sys.modules is the import system's "not importable"; typeshed types only modules.)
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
