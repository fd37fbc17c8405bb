"""From per-model breakdowns to a machine: GPU count per card type, NVLink, host RAM, CPU
cores, NVMe, and what it costs. Pure arithmetic.

Rules (reference: gpu-servers-phases.md): host RAM at least twice the total GPU memory; at
least 4 CPU cores per GPU; local NVMe with several GB/s of reads for weights and checkpoints.
Two or more GPUs working on one model (tensor parallel, or any training) want NVLink.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from packserve.config import AUTO_BUDGET_FRACTION, DeviceConfig
from packserve.planner.catalog import Gpu, Price
from packserve.planner.sizing import GPU_RUNTIME_BYTES, Breakdown
from packserve.units import format_bytes

HOURS_PER_MONTH = 730.0  # 365 x 24 / 12
DAYS_PER_MONTH = HOURS_PER_MONTH / 24
HOST_RAM_PER_GPU_MEMORY = 2
CPU_CORES_PER_GPU = 4
TRAINING_FRACTION = 0.95  # of a card's memory, past what the driver and ECC keep


@dataclass(frozen=True)
class GpuFit:
    """How many of one card type hold the models, and what that machine looks like."""

    gpu: Gpu
    count: int
    split_models: tuple[str, ...]  # models spread over several cards (tensor parallel)
    nvlink_needed: bool
    host_ram_bytes: int
    cpu_cores: int


@dataclass(frozen=True)
class Cost:
    currency: str
    price_per_gpu_hour: float
    cost_per_hour: float
    cost_per_million_tokens: float | None
    break_even_months: float | None  # buying instead of renting around the clock
    flat_rate_hours_per_day: float | None  # past this daily use, flat monthly beats per-second


def fit_gpu(gpu: Gpu, models: Sequence[Breakdown], training: bool = False) -> GpuFit:
    """Place models on cards of one type: a model larger than one card (`usable_bytes`) is
    split over ceil(size / card) cards, the rest are packed first-fit by decreasing size."""
    usable = usable_bytes(gpu, training)
    free: list[int] = []
    split = []
    for m in sorted(models, key=lambda b: b.total, reverse=True):
        if m.total > usable:
            n = math.ceil(m.total / usable)
            free.extend([0] * (n - 1) + [n * usable - m.total])
            split.append(m.name)
            continue
        for i, room in enumerate(free):
            if room >= m.total:
                free[i] -= m.total
                break
        else:
            free.append(usable - m.total)
    count = max(1, len(free))
    return GpuFit(gpu=gpu, count=count, split_models=tuple(split),
                  nvlink_needed=count > 1 and (bool(split) or training),
                  host_ram_bytes=HOST_RAM_PER_GPU_MEMORY * count * gpu.memory_bytes,
                  cpu_cores=CPU_CORES_PER_GPU * count)


def nvme_bytes(models: Sequence[Breakdown], training: bool) -> int:
    """Local disk: the weights plus room for a second copy (an upgrade, a download); training
    also keeps two checkpoints of weights and optimizer state."""
    weights = sum(m.weights for m in models)
    if not training:
        return 2 * weights
    return weights + 2 * sum(m.weights + m.optimizer for m in models)


def usable_bytes(gpu: Gpu, training: bool = False) -> int:
    """What models may take of one card. Serving: what packserve's scheduler gives them there
    with `memory_budget = "auto"` and the default headroom (`Residency.capacity`): 90% of the
    card, and at most the card less this process's CUDA context, less the headroom. Training:
    95% of the card less the context."""
    memory = gpu.memory_bytes
    if training:
        return int(memory * TRAINING_FRACTION) - GPU_RUNTIME_BYTES
    headroom = int(DeviceConfig.model_fields["headroom"].default)
    return min(int(memory * AUTO_BUDGET_FRACTION["cuda"]), memory - GPU_RUNTIME_BYTES) - headroom


def usable_rule(training: bool) -> str:
    """`usable_bytes` in words, for the plan's notes."""
    if training:
        return f"a card offers {TRAINING_FRACTION:.0%} of its memory minus the CUDA context"
    headroom = format_bytes(int(DeviceConfig.model_fields["headroom"].default), compact=True)
    return (f"a card offers its models what packserve's auto budget gives them: "
            f"{AUTO_BUDGET_FRACTION['cuda']:.0%} of its memory (at most its memory minus the "
            f"CUDA context), minus the default headroom of {headroom}")


def cost_per_hour(count: int, price_per_gpu_hour: float) -> float:
    return count * price_per_gpu_hour


def cost_per_million_tokens(per_hour: float, tokens_per_second: float) -> float:
    return per_hour / (tokens_per_second * 3600) * 1e6


def break_even_months(purchase: float, rent_per_hour: float, hours_per_day: float = 24.0,
                      owning_per_hour: float = 0.0) -> float | None:
    """Months after which buying at `purchase` costs less than renting for `hours_per_day`.
    `owning_per_hour` (power, hosting) is paid only while running. None: renting never loses."""
    saved_per_month = (rent_per_hour - owning_per_hour) * hours_per_day * DAYS_PER_MONTH
    return purchase / saved_per_month if saved_per_month > 0 else None


def flat_rate_hours_per_day(flat_monthly: float, hourly: float) -> float:
    """Daily hours of use above which a flat monthly rate costs less than per-second billing."""
    return flat_monthly / (hourly * DAYS_PER_MONTH)


def price_fit(fit: GpuFit, price: Price | None, currency: str, *,
              tokens_per_second: float | None = None, purchase: float | None = None,
              hours_per_day: float = 24.0, kwh_price: float = 0.0) -> Cost | None:
    if price is None:
        return None
    per_hour = cost_per_hour(fit.count, price.hourly)
    power = fit.count * fit.gpu.power_w / 1000 * kwh_price
    return Cost(
        currency=currency, price_per_gpu_hour=price.hourly, cost_per_hour=per_hour,
        cost_per_million_tokens=(cost_per_million_tokens(per_hour, tokens_per_second)
                                 if tokens_per_second else None),
        break_even_months=(break_even_months(purchase, per_hour, hours_per_day, power)
                           if purchase else None),
        flat_rate_hours_per_day=(flat_rate_hours_per_day(price.flat_monthly, price.hourly)
                                 if price.flat_monthly else None))
