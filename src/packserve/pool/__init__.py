"""A pool of packserve nodes on Ray Serve (`packserve pool`, docs/pool.md).

Only `routing` (pure policy) and `child` (the node process) import without Ray; the rest needs
the `pool` extra. Nothing outside this package imports it, so a single-node server never
loads Ray.
"""
