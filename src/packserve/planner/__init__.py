"""Sizing before buying: memory per model and workload, GPU choice and count, cost.

Pure arithmetic over model shapes (read from the models' own headers, or from a catalog of
well-known families) and data files of GPUs and prices kept in `planner/data/`. The server's
admission estimate (`packserve.core.footprint`) calls the same functions.
"""
