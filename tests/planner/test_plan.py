"""GPU count and NVLink, the host rules, and the cost arithmetic, by hand-computed values."""

from __future__ import annotations

import pytest

from packserve.planner import catalog, plan
from packserve.planner.catalog import Gpu, Price
from packserve.planner.sizing import GPU_RUNTIME_BYTES, Breakdown

GB = 1_000_000_000
CARD = Gpu(name="X", memory_bytes=100 * GB, bandwidth_gbs=1000, power_w=500,
           interconnect="NVLink", nvlink=True, source="test")
# serving: min(90% of the card, the card less its context) less the default 256 MiB headroom
USABLE = 90 * GB - (256 << 20)  # ~89.73 GB per card


def model(name: str, gb: float) -> Breakdown:
    return Breakdown(name=name, weights=int(gb * GB))


def test_one_model_that_fits_takes_one_card_without_nvlink() -> None:
    fit = plan.fit_gpu(CARD, [model("a", 40)])
    assert (fit.count, fit.split_models, fit.nvlink_needed) == (1, (), False)


def test_a_model_larger_than_a_card_is_split_and_needs_nvlink() -> None:
    fit = plan.fit_gpu(CARD, [model("big", 150)])
    assert fit.count == 2 and fit.split_models == ("big",) and fit.nvlink_needed


def test_several_small_models_are_packed_first_fit_without_nvlink() -> None:
    # 60 + 25 share a card (85 <= 89.73); 50 + 35 share another: 2 cards, no split.
    fit = plan.fit_gpu(CARD, [model("a", 60), model("b", 50), model("c", 35), model("d", 25)])
    assert fit.count == 2 and not fit.split_models and not fit.nvlink_needed


def test_a_card_offers_models_what_the_servers_auto_budget_gives_them() -> None:
    assert plan.usable_bytes(CARD) == USABLE
    small = Gpu(name="S", memory_bytes=4 * GB, bandwidth_gbs=1, power_w=1, interconnect="",
                nvlink=False, source="test")  # 10% of it is less than the context
    assert plan.usable_bytes(small) == 4 * GB - GPU_RUNTIME_BYTES - (256 << 20)
    assert plan.usable_bytes(CARD, training=True) == 95 * GB - GPU_RUNTIME_BYTES


def test_training_on_two_cards_needs_nvlink() -> None:
    fit = plan.fit_gpu(CARD, [model("a", 60), model("b", 60)], training=True)
    assert fit.count == 2 and fit.nvlink_needed


def test_host_ram_is_twice_gpu_memory_and_four_cores_per_gpu() -> None:
    fit = plan.fit_gpu(CARD, [model("big", 250)])  # 3 cards
    assert fit.count == 3
    assert fit.host_ram_bytes == 2 * 3 * 100 * GB
    assert fit.cpu_cores == 12


def test_nvme_guidance() -> None:
    m = Breakdown(name="a", weights=10 * GB, optimizer=20 * GB)
    assert plan.nvme_bytes([m], training=False) == 20 * GB
    assert plan.nvme_bytes([m], training=True) == 10 * GB + 2 * 30 * GB


def test_cost_arithmetic_by_hand() -> None:
    assert plan.cost_per_hour(2, 1.5) == 3.0
    # 3.0 per hour at 1000 tokens/s: 3.6M tokens an hour -> 3.0 / 3.6 = 0.8333 per million
    assert plan.cost_per_million_tokens(3.0, 1000) == pytest.approx(0.8333, abs=1e-4)
    # 15000 to buy, renting 3.0/h around the clock: 3.0 x 24 x 30.4167 = 2190 a month
    assert plan.break_even_months(15000, 3.0) == pytest.approx(15000 / 2190, rel=1e-9)
    # at 12 h a day, and paying 0.5/h of power when owning: (2.5 x 12 x 30.4167) = 912.5
    assert plan.break_even_months(15000, 3.0, 12, 0.5) == pytest.approx(15000 / 912.5)
    assert plan.break_even_months(15000, 1.0, 24, 1.0) is None
    # flat 1065 a month vs 2.50 per hour: 1065 / (2.5 x 30.4167) = 14.0 hours a day
    assert plan.flat_rate_hours_per_day(1065, 2.5) == pytest.approx(14.0055, abs=1e-3)


def test_price_fit_puts_it_together() -> None:
    fit = plan.fit_gpu(CARD, [model("big", 150)])  # 2 cards
    cost = plan.price_fit(fit, Price(hourly=2.0, flat_monthly=900), "EUR",
                          tokens_per_second=2000, purchase=50000, kwh_price=0.25)
    assert cost is not None
    assert cost.cost_per_hour == 4.0
    assert cost.cost_per_million_tokens == pytest.approx(4.0 / 7.2)
    # owning: 2 x 500 W x 0.25/kWh = 0.25/h; saved (4.0 - 0.25) x 730 = 2737.5 a month
    assert cost.break_even_months == pytest.approx(50000 / 2737.5)
    assert cost.flat_rate_hours_per_day == pytest.approx(900 / (2.0 * 730 / 24))
    assert plan.price_fit(fit, None, "EUR") is None


def test_data_files_are_dated_sourced_and_complete() -> None:
    gpus = {g.name: g for g in catalog.load_gpus()}
    expected = {"L4": 24, "RTX 4090": 24, "L40S": 48, "RTX PRO 6000": 96, "A100 80GB": 80,
                "H100": 80, "H200": 141}
    assert {n: g.memory_bytes // GB for n, g in gpus.items()} == expected
    assert all(g.source and g.bandwidth_gbs > 0 and g.power_w > 0 for g in gpus.values())
    prices = catalog.load_prices()
    assert prices.as_of and prices.sources and set(prices.prices) == set(gpus)
    for p in prices.prices.values():
        assert p.flat_monthly is not None
        # the reference puts the flat-rate crossover at 12-16 hours a day
        assert 12 <= plan.flat_rate_hours_per_day(p.flat_monthly, p.hourly) <= 16
