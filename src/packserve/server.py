"""Wiring: config -> resolved model files -> estimates -> a Scheduler. No policy lives here."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from packserve.config import AUTO_BUDGET_FRACTION, Config, DeviceConfig
from packserve.core.backend import BackendFactory, LoadSpec
from packserve.core.events import EventSink, log_event
from packserve.core.footprint import estimate
from packserve.core.memory import MemoryProbe, SystemProbe, cuda_available
from packserve.core.policy import VictimPolicy, lru_by_bytes
from packserve.core.scheduler import DeviceBudget, Entry, FootprintStore, Scheduler
from packserve.errors import ConfigError
from packserve.modelfiles import ModelFacts, read_facts_cached
from packserve.sources import resolve_source

if TYPE_CHECKING:
    from packserve.metrics.telemetry import Telemetry

log = logging.getLogger("packserve.server")

DEFAULT_LLAMA_CONTEXT = 2048


def resolve_device(requested: str) -> str:
    if requested != "auto":
        return requested
    return "cuda:0" if cuda_available() else "cpu"


def build_entries(config: Config) -> list[Entry]:
    """Resolve every model's source and estimate its footprint. Raises ConfigError."""
    entries = []
    base = Path(config.base_dir)
    models_dir = config.data_path / "models"
    facts_by_path: dict[Path, ModelFacts] = {}
    for i, spec in enumerate(config.models):
        where = f"models[{i}] ({spec.name})"
        device = resolve_device(spec.device)
        if spec.backend == "fake":
            from packserve.backends.fake import declared_bytes

            load = LoadSpec(backend="fake", path=Path(spec.source), device=device,
                            context_length=spec.context_length or 0, max_batch=spec.max_batch)
            entries.append(Entry(spec=spec, load=load, bytes_estimated=declared_bytes(load)))
            continue
        try:
            path = resolve_source(spec.source, base_dir=base, models_dir=models_dir)
            facts = facts_by_path.get(path) or read_facts_cached(
                path, config.data_path / "model_facts.json")
            facts_by_path[path] = facts
        except ConfigError as exc:
            raise ConfigError(f"{where}.source: {exc.message}") from exc
        if spec.backend == "llama-cpp":
            if path.suffix != ".gguf":
                raise ConfigError(f"{where}.source: llama-cpp needs a .gguf file, got {path}")
            context = spec.context_length or min(DEFAULT_LLAMA_CONTEXT,
                                                 facts.context_length or DEFAULT_LLAMA_CONTEXT)
        else:
            if not path.is_dir():
                raise ConfigError(f"{where}.source: {spec.backend} needs a model directory")
            context = spec.context_length or 0
        load = LoadSpec(backend=spec.backend, path=path, device=device, context_length=context,
                        max_batch=spec.max_batch, trust_remote_code=spec.trust_remote_code,
                        allow_pickle=spec.allow_pickle)
        entries.append(Entry(spec=spec, load=load,
                             bytes_estimated=estimate(spec.backend, facts, context).total))
    return entries


def device_budgets(config: Config, devices: set[str], probe: MemoryProbe) -> list[DeviceBudget]:
    budgets = []
    for name in sorted(devices | set(config.devices)):
        dev = config.device_config(name)
        if dev.memory_budget == "auto":
            kind = "cuda" if name.startswith("cuda") else "cpu"
            budget = int(probe.total_bytes(name) * AUTO_BUDGET_FRACTION[kind])
        else:
            budget = dev.memory_budget
        if dev.headroom >= budget:
            raise ConfigError(f"devices.{name}: headroom ({dev.headroom} bytes) must be smaller "
                              f"than memory_budget ({budget} bytes)")
        budgets.append(DeviceBudget(name=name, budget_bytes=budget, headroom_bytes=dev.headroom))
    return budgets


def build_telemetry(config: Config, scheduler: Scheduler) -> Telemetry:
    """Operator figures for `scheduler`, priced from the config; registers itself as a sink."""
    from packserve.metrics.telemetry import Telemetry

    prices = {d.name: config.device_config(d.name).price_per_hour for d in scheduler.devices()}
    telemetry = Telemetry(scheduler, prices=prices, default_price=DeviceConfig().price_per_hour,
                          currency=config.server.currency,
                          window_s=config.server.metrics_window_s)
    scheduler.add_sink(telemetry.on_event)
    return telemetry


def build_scheduler(
    config: Config,
    *,
    factory: BackendFactory | None = None,
    probe: MemoryProbe | None = None,
    sinks: Sequence[EventSink] = (log_event,),
    victim_policy: VictimPolicy | Mapping[str, VictimPolicy] = lru_by_bytes,
) -> Scheduler:
    """The scheduler for `config`, with packserve's victim policy unless given one (for every
    device, or by device name: the bench replays other engines' rules). Must be called from
    the thread that runs the event loop."""
    from packserve.backends import create_backend

    probe = probe or SystemProbe()
    entries = build_entries(config)  # engines are imported by their first load
    budgets = device_budgets(config, {e.load.device for e in entries}, probe)
    scheduler = Scheduler(
        entries, budgets, factory or create_backend, probe,
        FootprintStore(config.data_path / "footprints.json"),
        load_wait_s=config.server.load_wait_s,
        failure_cooldown_s=config.server.failure_cooldown_s,
        victim_policy=victim_policy,
        sinks=sinks,
    )
    scheduler.check_pins()
    return scheduler
