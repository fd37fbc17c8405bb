"""The cost formula against hand-computed values, on a scripted sequence with a fake clock."""

from __future__ import annotations

import pytest

from packserve.metrics.cost import CostMeter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_worked_example_of_the_docs() -> None:
    # docs/operations.md "Cost per million tokens": 3.60 EUR/h is 0.001 EUR per device-second.
    # t=0-4 s: one request of A; t=2-6 s: one request of B; t=6-10 s: idle.
    clock = Clock()
    meter = CostMeter({"cuda:0": 3.60}, clock)
    meter.start("A", "cuda:0")
    clock.now = 2
    meter.start("B", "cuda:0")
    clock.now = 4
    meter.end("A", "cuda:0", tokens=1000)
    clock.now = 6
    meter.end("B", "cuda:0", tokens=500)
    clock.now = 10
    models, mix = meter.report()
    a, b = models
    assert (a.model, a.tokens, b.model, b.tokens) == ("A", 1000, "B", 500)
    assert a.device_seconds == pytest.approx(3.0) and b.device_seconds == pytest.approx(3.0)
    assert a.cost == pytest.approx(0.003) and a.cost_per_million_tokens == pytest.approx(3.0)
    assert b.cost_per_million_tokens == pytest.approx(6.0)
    assert mix.idle_seconds == pytest.approx(4.0)
    assert mix.elapsed_seconds == pytest.approx(10.0)
    assert mix.cost == pytest.approx(0.01)
    assert mix.cost_per_million_tokens == pytest.approx(0.01 / 1500 * 1e6)  # 6.67


def test_two_requests_of_one_model_take_the_whole_share() -> None:
    clock = Clock()
    meter = CostMeter({"cpu": 7.2}, clock)
    meter.start("A", "cpu")
    meter.start("A", "cpu")
    meter.start("B", "cpu")
    clock.now = 3  # A holds 2/3, B 1/3 of 3 s
    meter.end("A", "cpu", 10)
    meter.end("A", "cpu", 10)
    meter.end("B", "cpu", 10)
    models, mix = meter.report()
    assert [m.device_seconds for m in models] == [pytest.approx(2.0), pytest.approx(1.0)]
    assert mix.idle_seconds == 0.0


def test_devices_are_priced_and_shared_separately() -> None:
    clock = Clock()
    meter = CostMeter({"cpu": 0.36, "cuda:0": 3.6}, clock)
    meter.start("embed", "cpu")
    meter.start("chat", "cuda:0")
    clock.now = 5
    meter.end("embed", "cpu", 100)
    meter.end("chat", "cuda:0", 100)
    models, mix = meter.report()
    by = {m.model: m for m in models}
    assert by["embed"].device_seconds == by["chat"].device_seconds == pytest.approx(5.0)
    assert by["embed"].cost == pytest.approx(0.0005) and by["chat"].cost == pytest.approx(0.005)
    assert mix.cost == pytest.approx(0.0055) and mix.elapsed_seconds == pytest.approx(10.0)


def test_no_tokens_no_figure() -> None:
    clock = Clock()
    meter = CostMeter({}, clock, default_price=1.0)
    clock.now = 60
    models, mix = meter.report()
    assert models == [] and mix.cost_per_million_tokens is None and mix.tokens == 0
