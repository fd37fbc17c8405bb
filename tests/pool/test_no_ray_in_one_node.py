"""Ray is the pool extra's: a single-node server, and every module outside the pool's Ray
parts, imports without it."""

from __future__ import annotations

import subprocess
import sys

_CHECK = """
import pkgutil, importlib, sys
import packserve
ray_parts = {"packserve.pool.app", "packserve.pool.node", "packserve.pool.router",
             "packserve.pool.entry", "packserve.pool.run"}
for mod in pkgutil.walk_packages(packserve.__path__, "packserve."):
    if mod.name not in ray_parts:
        importlib.import_module(mod.name)
loaded = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
print(len(loaded), loaded[:5])
"""


def test_the_server_and_its_worker_import_no_ray() -> None:
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.startswith("0 "), out
