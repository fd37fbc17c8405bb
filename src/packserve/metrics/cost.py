"""Cost per million tokens, by attributing device time to the models that use it.

The rule (docs/operations.md, "Cost per million tokens"): while n requests are in flight on a
device, each holds 1/n of it, so over an interval dt a model with k of those requests is
charged k/n x dt device-seconds. Time with nothing in flight is idle; it is charged to the mix
as a whole.

  model cost  = price_per_hour / 3600 x device_seconds(model)
  model figure = model cost / tokens(model) x 1e6
  mix figure   = sum over devices of price_per_hour / 3600 x elapsed seconds / all tokens x 1e6

Pure bookkeeping over an injected clock; the Telemetry feeds it request start and end events.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelCost:
    model: str
    device: str
    device_seconds: float
    tokens: int
    cost: float
    cost_per_million_tokens: float | None  # None until the model has produced tokens


@dataclass(frozen=True)
class MixCost:
    elapsed_seconds: float  # summed over devices
    idle_seconds: float
    tokens: int
    cost: float
    cost_per_million_tokens: float | None


class CostMeter:
    """Integrates in-flight shares per device. Call `start` and `end` in event order."""

    def __init__(self, prices: Mapping[str, float], clock: Callable[[], float],
                 default_price: float = 0.0) -> None:
        self._prices = dict(prices)
        self._default = default_price
        self._clock = clock
        self._t0 = clock()
        self._last: dict[str, float] = {}
        self._inflight: dict[str, Counter[str]] = defaultdict(Counter)
        self._busy: defaultdict[str, float] = defaultdict(float)  # model -> device-seconds
        self._idle: defaultdict[str, float] = defaultdict(float)  # device -> seconds
        self._tokens: Counter[str] = Counter()
        self._device_of: dict[str, str] = {}
        for device in self._prices:
            self._last[device] = self._t0

    def price(self, device: str) -> float:
        return self._prices.get(device, self._default)

    def _advance(self, device: str) -> None:
        now = self._clock()
        dt = now - self._last.setdefault(device, self._t0)
        self._last[device] = now
        running = self._inflight[device]
        n = sum(running.values())
        if n == 0:
            self._idle[device] += dt
            return
        for model, k in running.items():
            if k:
                self._busy[model] += dt * k / n

    def start(self, model: str, device: str) -> None:
        self._advance(device)
        self._inflight[device][model] += 1
        self._device_of[model] = device

    def end(self, model: str, device: str, tokens: int) -> None:
        self._advance(device)
        if self._inflight[device][model] > 0:
            self._inflight[device][model] -= 1
        self._tokens[model] += tokens
        self._device_of[model] = device

    def report(self) -> tuple[list[ModelCost], MixCost]:
        for device in list(self._last):
            self._advance(device)
        models = []
        for model, device in sorted(self._device_of.items()):
            seconds = self._busy[model]
            tokens = self._tokens[model]
            cost = self.price(device) / 3600 * seconds
            models.append(ModelCost(model, device, seconds, tokens, cost,
                                    cost / tokens * 1e6 if tokens else None))
        elapsed = {d: self._clock() - self._t0 for d in self._last}
        cost = sum(self.price(d) / 3600 * s for d, s in elapsed.items())
        tokens = sum(self._tokens.values())
        mix = MixCost(elapsed_seconds=sum(elapsed.values()),
                      idle_seconds=sum(self._idle.values()), tokens=tokens, cost=cost,
                      cost_per_million_tokens=cost / tokens * 1e6 if tokens else None)
        return models, mix
