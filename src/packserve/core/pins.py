"""Pinned models that did not load: retried in the background with backoff until they are hot,
unpinned or removed, and reported by /readyz meanwhile (`Scheduler.ready`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass

from packserve import backoff
from packserve.core.queue import Model
from packserve.core.resident import Resident
from packserve.errors import PackserveError

log = logging.getLogger("packserve.scheduler")


@dataclass(eq=False)
class PinRetry:
    """The retries of one pinned model's load: its last error and when it is tried next."""

    model: Model
    error: str
    delay_s: float
    next_at: float  # scheduler clock
    failures: int = 1


class PinKeeper:
    """Loads pins and keeps retrying those that fail. The scheduler lends it `ensure_hot`
    (ignoring a failure's cooldown), `spawn` (its background tasks, cancelled at close) and
    `listed` (the catalog's model by that name now, or None)."""

    def __init__(self, ensure_hot: Callable[[Resident], Awaitable[None]],
                 spawn: Callable[[Coroutine[object, object, None], str], None],
                 listed: Callable[[str], Model | None], *, clock: Callable[[], float],
                 sleep: Callable[[float], Awaitable[None]],
                 retry_s: tuple[float, float]) -> None:
        self._ensure_hot = ensure_hot
        self._spawn = spawn
        self._listed = listed
        self._clock = clock
        self._sleep = sleep  # the backoff timer
        self._first_s, self._max_s = retry_s
        self._retries: dict[str, PinRetry] = {}

    def get(self, name: str) -> PinRetry | None:
        """The retries of pinned model `name`, while any are planned."""
        return self._retries.get(name)

    async def load(self, models: Sequence[Model]) -> None:
        """Load pinned `models` now; a failure is retried in the background with backoff."""
        failed: dict[str, str] = {}  # resident key -> error: shared weights are tried once
        for model in models:
            res = model.resident
            if res.key not in failed:
                try:
                    await self._ensure_hot(res)
                    continue
                except PackserveError as exc:
                    failed[res.key] = exc.message
            log.error("pinned model %s did not load: %s; retrying in %gs", model.spec.name,
                      failed[res.key], self._first_s)
            self._retry(model, failed[res.key])

    def _retry(self, model: Model, error: str) -> None:
        name = model.spec.name
        retry = self._retries.get(name)
        if retry is not None and retry.model is model:
            retry.error = error
            return
        retry = PinRetry(model=model, error=error, delay_s=self._first_s,
                         next_at=self._clock() + self._first_s)
        self._retries[name] = retry
        self._spawn(self._keep(retry), f"packserve pin retry {name}")

    async def _keep(self, retry: PinRetry) -> None:
        """Retry a pinned model's load, the delay doubling up to the maximum, until it is
        hot, unpinned or removed."""
        model = retry.model
        name = model.spec.name
        try:
            while True:
                retry.next_at = self._clock() + retry.delay_s
                await self._sleep(retry.delay_s)
                if self._listed(name) is not model or not model.pinned:
                    return
                try:
                    await self._ensure_hot(model.resident)
                    log.info("pinned model %s loaded on retry", name)
                    return
                except PackserveError as exc:
                    retry.error = exc.message
                    retry.failures += 1
                    retry.delay_s = backoff.doubling(self._first_s, self._max_s, retry.failures)
                    log.warning("pinned model %s still did not load: %s; retrying in %gs",
                                name, exc.message, retry.delay_s)
        finally:
            if self._retries.get(name) is retry:
                del self._retries[name]
