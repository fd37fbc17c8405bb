"""One backoff for every retry loop: a first wait, doubling with each failure, up to a ceiling."""

from __future__ import annotations


def doubling(first_s: float, ceiling_s: float, failures: int) -> float:
    """Seconds to wait after `failures` failures in a row (1: the first wait, `first_s`)."""
    return min(ceiling_s, first_s * 2.0 ** max(0, failures - 1))
