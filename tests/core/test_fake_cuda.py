"""The scheduler's GPU accounting against a fake CUDA machine (tests/factories/fake_cuda.py),
on every run, on the CPU (issue 31): NVML's per-process figures against another tenant that
allocates during a load, the fallback without them, the CUDA context counted once as the
process's base, torch's caching allocator emptied before a measurement, no load planned past
what other processes leave, the warm tier of GPU models in host RAM within the `cpu` budget,
and the planner's GPU rows against what the scheduler holds on a card of that size."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from packserve.config import Config, ModelSpec
from packserve.core.backend import Backend, LoadSpec
from packserve.core.catalog import DeviceBudget, Entry
from packserve.core.events import EvictEvent, LoadEvent
from packserve.core.scheduler import Scheduler
from packserve.errors import ModelUnavailable
from packserve.planner import plan
from packserve.planner.catalog import Gpu
from packserve.planner.sizing import GPU_RUNTIME_BYTES, Breakdown
from packserve.server import device_budgets
from packserve.types import State, Task
from tests.factories import use
from tests.factories.fake_cuda import GIB, MIB, CudaEngine, FakeCuda, Tenant
from tests.factories.scheduler import Recorder

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

PID, OTHER = 4242, 777  # this process, another tenant on the card


def model(name: str, mib: int, device: str = "cuda:0") -> Entry:
    source = f"fake:{mib}MiB"
    spec = ModelSpec(name=name, tasks=[Task.EMBED], backend="fake", source=source,
                     device=device)
    return Entry(spec=spec, load=LoadSpec(backend="fake", path=Path(name) / source,
                                          device=device, context_length=0),
                 bytes_estimated=mib * MIB)


def scheduler(cuda: FakeCuda, entries: list[Entry], budgets: dict[str, int], *,
              per_process: bool | None = True, load_wait_s: float = 5.0,
              during_load: dict[str, Tenant | None] | None = None,
              tenant_bytes: int = 0, headroom: int = 0, engine: type[CudaEngine] = CudaEngine,
              pid: int = PID) -> tuple[Scheduler, Recorder, list[Backend]]:
    """A scheduler over `entries` with the real probe over `cuda` (a cpu model gets the
    suite's plain fake engine, its bytes the floor of its measurement); `during_load[name]`
    allocates `tenant_bytes` halfway through that model's load."""
    events, built = Recorder(), list[Backend]()
    probe = cuda.probe(PID, per_process=per_process)

    def factory(spec: LoadSpec) -> Backend:
        if not spec.device.startswith("cuda"):
            from packserve.backends.fake import FakeBackend

            built.append(backend := FakeBackend(spec))
            return backend
        backend = engine(spec)
        backend.cuda, backend.pid = cuda, pid
        tenant = (during_load or {}).get(spec.path.parent.name)
        if tenant is not None:
            backend.during_load = lambda: tenant.allocate(tenant_bytes)
        built.append(backend)
        return backend

    s = Scheduler(entries, [DeviceBudget(d, budget_bytes=b, headroom_bytes=headroom)
                            for d, b in budgets.items()],
                  factory, probe, None, load_wait_s=load_wait_s, clock=time.monotonic,
                  sinks=(events,), warm_tier=budgets)
    return s, events, built


def row(s: Scheduler, device: str) -> dict[str, object]:
    return next(vars(d) for d in s.devices() if d.name == device)


async def test_a_load_is_charged_its_own_bytes_while_another_tenant_allocates() -> None:
    cuda = FakeCuda()
    tenant = Tenant(cuda, OTHER)
    s, _, _ = scheduler(cuda, [model("a", 1024)], {"cuda:0": 8 * GIB},
                        during_load={"a": tenant}, tenant_bytes=3 * GIB)
    await s.start()
    await use(s, "a")
    (status,) = s.models()
    assert status.bytes_measured == GIB  # not the tenant's 3 GiB, not the context
    dev = row(s, "cuda:0")
    assert dev["accounting"] == "per_process"
    assert dev["base_bytes"] == cuda.context_bytes  # the context: the process's, counted once
    assert dev["others_bytes"] == 3 * GIB + cuda.context_bytes  # the tenant's, context too
    await s.close()


async def test_a_runner_on_the_card_opens_no_context_in_the_worker() -> None:
    """A runner is a process of its own (here pid 9000) with its own context, in its model's
    bytes: the worker opens none for it, and the device has no base."""
    cuda = FakeCuda()

    class Runner(CudaEngine):
        out_of_process = True

    s, _, _ = scheduler(cuda, [model("r", 512)], {"cuda:0": 8 * GIB}, engine=Runner, pid=9000)
    await s.start()
    await use(s, "r")
    assert row(s, "cuda:0")["base_bytes"] is None
    assert cuda.held_by(PID, 0) == 0  # no context in the worker
    assert cuda.held_by(9000, 0) == cuda.context_bytes + 512 * MIB
    await s.close()


async def test_without_per_process_figures_the_fallback_charges_the_tenant_and_says_so() -> None:
    """NVML lists the process without its figure: the device's used memory is the fallback,
    and another tenant's allocation during the load lands on the model (the stated cost)."""
    cuda = FakeCuda()
    tenant = Tenant(cuda, OTHER)
    s, _, _ = scheduler(cuda, [model("a", 1024)], {"cuda:0": 8 * GIB}, per_process=False,
                        during_load={"a": tenant}, tenant_bytes=3 * GIB)
    await s.start()
    await use(s, "a")
    assert s.models()[0].bytes_measured == GIB + 3 * GIB + cuda.context_bytes
    dev = row(s, "cuda:0")
    assert (dev["accounting"], dev["others_bytes"]) == ("device_total", None)
    await s.close()


@pytest.mark.parametrize("per_process", [None, False])
async def test_mig_or_no_figures_is_the_fallback(per_process: bool | None) -> None:
    cuda = FakeCuda()
    s, _, _ = scheduler(cuda, [model("a", 512)], {"cuda:0": 8 * GIB}, per_process=per_process)
    await s.start()
    await use(s, "a")
    assert row(s, "cuda:0")["accounting"] == "device_total"
    await s.close()


async def test_blocks_kept_by_the_caching_allocator_go_back_before_the_next_measurement() -> None:
    """An unload frees its tensors, and torch's allocator keeps their blocks reserved (NVML
    still counts them) until the cache is emptied: without emptying, the next load would reuse
    them and measure near nothing."""
    cuda = FakeCuda()
    s, _, _ = scheduler(cuda, [model("a", 1024), model("b", 256)], {"cuda:0": 1100 * MIB})
    await s.start()
    await use(s, "a")
    await use(s, "b")  # evicts a (cold: no host RAM budget for a GPU model's warm copy)
    assert s.state_of("a") is State.COLD and cuda.copies == []
    assert cuda.held_by(PID, 0) == cuda.context_bytes + 256 * MIB  # a's blocks went back
    await s.close()
    assert cuda.held_by(PID, 0) == cuda.context_bytes  # all given back but the context


async def test_no_load_is_planned_past_what_other_processes_leave() -> None:
    """The budget says 12 GiB, another process holds 12 of the card's 16 (and its context): a
    4 GiB model waits (a 503 naming why), never a 507, and loads once the memory is free."""
    cuda = FakeCuda()
    tenant = Tenant(cuda, OTHER)
    tenant.allocate(12 * GIB)
    s, _, _ = scheduler(cuda, [model("big", 4096)], {"cuda:0": 12 * GIB}, load_wait_s=0.3)
    await s.start()
    with pytest.raises(ModelUnavailable, match="other processes hold the rest of the device"):
        await use(s, "big")
    tenant.free_all()
    await use(s, "big")
    assert s.state_of("big") is State.HOT
    await s.close()


async def test_a_gpu_models_warm_copy_parks_in_host_ram_within_the_cpu_budget() -> None:
    """Evicted from the card, a model parks its weights in host RAM (counted in `cpu`'s
    budget) and comes back by a copy; when the host has no room for another copy, that victim
    goes cold instead."""
    cuda = FakeCuda(copy_bytes_per_s=64 * GIB)
    s, events, _ = scheduler(cuda, [model("a", 1024), model("b", 1024)],
                             {"cuda:0": 1536 * MIB, "cpu": 1536 * MIB})
    await s.start()
    await use(s, "a")
    await use(s, "b")  # a goes warm: 1 GiB parked in host RAM
    assert s.state_of("a") is State.WARM
    assert cuda.host_bytes == GIB == row(s, "cpu")["warm_host_bytes"]
    await use(s, "a")  # back by a copy; b must leave, and the host has no room for it
    assert s.state_of("b") is State.COLD
    restore = [e for e in events.of(LoadEvent) if e.model == "a"][-1]
    assert restore.tier_from == "warm"
    b_out = [e for e in events.of(EvictEvent) if e.model == "b"][-1]
    assert b_out.tier_to == "cold"
    assert [d for d, _, _ in cuda.copies] == ["to_host", "to_device"]
    assert cuda.host_bytes == 0 == row(s, "cpu")["warm_host_bytes"]
    await s.close()


async def test_warm_copies_stay_when_letting_them_go_would_not_make_room() -> None:
    """A CPU load waiting for a busy CPU model: the GPU model's warm copy in host RAM could not
    make the room it needs, so it stays (the load waits, then a 503)."""
    cuda = FakeCuda()
    s, _, _ = scheduler(cuda, [model("a", 256), model("b", 256), model("c1", 1024, "cpu"),
                               model("c2", 1024, "cpu")],
                        {"cuda:0": 300 * MIB, "cpu": 1536 * MIB}, load_wait_s=0.3)
    await s.start()
    await use(s, "a")
    await use(s, "b")  # a parks 256 MiB in host RAM
    assert s.state_of("a") is State.WARM
    async with s.acquire("c1", Task.EMBED):  # c1 busy: c2 needs 1 GiB, the copy frees 256 MiB
        with pytest.raises(ModelUnavailable):
            await use(s, "c2")
    assert s.state_of("a") is State.WARM and cuda.host_bytes == 256 * MIB
    await s.close()


async def test_a_cpu_load_takes_back_the_host_ram_that_gpu_warm_copies_hold() -> None:
    cuda = FakeCuda()
    s, events, _ = scheduler(cuda, [model("a", 1024), model("b", 1024),
                                    model("c", 1024, device="cpu")],
                             {"cuda:0": 1536 * MIB, "cpu": 1536 * MIB})
    await s.start()
    await use(s, "a")
    await use(s, "b")  # a parks 1 GiB in host RAM
    assert s.state_of("a") is State.WARM
    await use(s, "c")  # needs that RAM: a's copy goes cold
    assert (s.state_of("a"), s.state_of("c")) == (State.COLD, State.HOT)
    assert cuda.host_bytes == 0
    assert [e.reason for e in events.of(EvictEvent) if e.model == "a"][-1] == "host RAM for c"
    await s.close()


@pytest.mark.parametrize(("sizes_mib", "cards"), [
    # A 16 GiB card offers its models 14,489.6 MiB (sizes are whole 2 MiB blocks, as the
    # caching allocator reserves them).
    ((5000, 5000, 4488), 1),
    ((5000, 5000, 4490), 2),
])
async def test_what_the_planner_packs_on_one_card_the_scheduler_holds_there_at_once(
        sizes_mib: tuple[int, ...], cards: int) -> None:
    """`packserve plan`'s GPU rows against the scheduler on a fake card of that size, its
    budget `auto` with the default headroom and its context the planner's: models the plan
    puts on one card are all hot there at once; when it says two, one is evicted."""
    card = Gpu(name="T", memory_bytes=16 * GIB, bandwidth_gbs=1.0, power_w=1, interconnect="",
               nvlink=False, source="test")
    names = [f"m{i}" for i in range(len(sizes_mib))]
    fit = plan.fit_gpu(card, [Breakdown(name=n, weights=mib * MIB)
                              for n, mib in zip(names, sizes_mib, strict=True)])
    assert fit.count == cards
    cuda = FakeCuda(totals={0: card.memory_bytes}, context_bytes=GPU_RUNTIME_BYTES)
    config = Config.model_validate({"devices": {"cuda:0": {"memory_budget": "auto"}}})
    budgets = {b.name: b for b in device_budgets(config, {"cuda:0"}, cuda.probe(PID))}
    assert set(budgets) == {"cuda:0", "cpu"}  # host RAM's budget, for warm copies: auto
    budget = budgets["cuda:0"]
    s, events, _ = scheduler(cuda, [model(n, mib) for n, mib in zip(names, sizes_mib,
                                                                     strict=True)],
                             {"cuda:0": budget.budget_bytes}, headroom=budget.headroom_bytes)
    await s.start()
    for n in names:
        await use(s, n)
    hot = [n for n in names if s.state_of(n) is State.HOT]
    assert (len(hot) == len(names)) is (cards == 1), (hot, events.of(EvictEvent))
    await s.close()
