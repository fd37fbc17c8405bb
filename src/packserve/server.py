"""Wiring: config -> resolved model files -> estimates -> a Scheduler. No policy lives here."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from packserve import backends
from packserve.auth import KeyRing
from packserve.backends.runner import RunnerHost
from packserve.config import AUTO_BUDGET_FRACTION, Config, DeviceConfig, ModelSpec
from packserve.core.backend import BackendFactory, LoadSpec
from packserve.core.catalog import DeviceBudget, Entry
from packserve.core.engine import Engine
from packserve.core.events import EventSink, log_event
from packserve.core.idle import IdleRule
from packserve.core.loader import FootprintStore
from packserve.core.memory import MemoryProbe, SystemProbe, nvidia_driver
from packserve.core.policy import VictimPolicy, make_policy
from packserve.core.scheduler import Scheduler
from packserve.errors import ConfigError
from packserve.hub import Hub, HubFetcher, HubSource
from packserve.hub import parse as parse_hub
from packserve.modelfiles import ModelFacts, read_facts_cached
from packserve.planner.sizing import GPU_RUNTIME_BYTES, Breakdown
from packserve.sources import Announce, confine, model_roots, resolve_source
from packserve.units import format_bytes

if TYPE_CHECKING:
    from packserve.metrics.telemetry import Telemetry

log = logging.getLogger("packserve.server")


def resolve_device(requested: str, engine: Engine,
                   driver: Callable[[], bool] = nvidia_driver) -> str:
    """The device of an entry asking for `requested`: as written, or for "auto" the first CUDA
    device where NVIDIA's `driver` is there and `engine`'s build can run there (`Engine.cuda`;
    a llama.cpp built without CUDA keeps its models on the CPU while torch's go to the card),
    else the CPU: never a device where the load must fail."""
    if requested != "auto":
        return requested
    if not driver():
        return "cpu"
    why = engine.cuda()
    if why is not None:
        log.info("device auto: %s models go to the CPU: %s", engine.name, why)
        return "cpu"
    return "cuda:0"


def as_written(requested: str, engine: Engine) -> str:
    """The device as the config writes it, "auto" included (the planner and tests: sizing
    must not depend on this host's GPU, nor import an engine to ask)."""
    return requested


@dataclass(frozen=True)
class Resolved:
    """One model entry made concrete: its engine, its load and what its files say."""

    spec: ModelSpec
    engine: Engine
    load: LoadSpec
    facts: ModelFacts | None  # None for an engine that reads no files

    def breakdown(self, context: int | None = None, sequences: int | None = None,
                  gpu: bool | None = None) -> Breakdown:
        """What this entry's load holds, by kind (at another `context` or number of concurrent
        sequences, for the planner; by default the load's own: its `parallel` slots). On a GPU
        (`gpu`; by default where its device is CUDA) a runner's own CUDA context too."""
        load = self.load if context is None else replace(self.load, context_length=context)
        size = self.engine.size(self.facts, load, self.spec.name,
                                self.load.parallel if sequences is None else sequences)
        if not self.engine.own_process or not (
                load.device.startswith("cuda") if gpu is None else gpu):
            return size
        return replace(size, overhead=size.overhead + GPU_RUNTIME_BYTES, assumptions=(
            *size.assumptions, f"{self.spec.name}: its runner process's own CUDA context on a "
            f"card, {format_bytes(GPU_RUNTIME_BYTES, compact=True)}"))


def resolve_models(config: Config, device: Callable[[str, Engine], str] = resolve_device,
                   announce: Announce = None) -> list[Resolved]:
    """Resolve every model's source through its engine, confined to the model roots (a source
    leading outside them is a ConfigError), and its device with `device` (the
    planner keeps "auto" as it is: `as_written`). Raises ConfigError."""
    out = []
    base = Path(config.base_dir)
    models_dir = config.data_path / "models"
    roots = model_roots(config.server.model_roots, base_dir=base, models_dir=models_dir,
                        sources=[s.source for s in config.models
                                 if backends.get(s.backend).reads_files])
    facts_by_path: dict[Path, ModelFacts] = {}
    hub = Hub(models_dir)
    for i, spec in enumerate(config.models):
        where = f"models[{i}] ({spec.name})"
        engine = backends.get(spec.backend)
        facts: ModelFacts | None = None
        if engine.reads_files:
            try:
                source = parse_hub(spec.source)
                if source is not None:  # sized from its headers until it is on disk
                    path, remote = _hub_source(hub, source, engine, roots, announce)
                else:
                    path = resolve_source(spec.source, base_dir=base, models_dir=models_dir,
                                          roots=roots, announce=announce)
                    remote = None
                if engine.convert is not None and remote is None:
                    path = engine.convert(path, models_dir, announce)
                facts = facts_by_path.get(path) or remote or read_facts_cached(
                    path, config.data_path / "model_facts.json")
                facts_by_path[path] = facts
            except ConfigError as exc:
                raise ConfigError(f"{where}.source: {exc.message}") from exc
            problem = engine.check_source(path) if path.exists() else None
            if problem is not None:
                raise ConfigError(f"{where}.source: {engine.name} needs {problem}")
        else:
            path = Path(spec.source)
        load = engine.load_spec(path, device(spec.device, engine),
                                engine.context(spec.context_length, facts), spec.max_batch,
                                {"trust_remote_code": spec.trust_remote_code,
                                 "allow_pickle": spec.allow_pickle}, spec.threads or 0,
                                spec.parallel or 0, spec.parallel_cache == "per_slot", facts)
        out.append(Resolved(spec=spec, engine=engine, load=load, facts=facts))
    return out


def _hub_source(hub: Hub, source: HubSource, engine: Engine, roots: Sequence[Path],
                announce: Announce) -> tuple[Path, ModelFacts | None]:
    """The model path of a Hub source and, while it is not on disk, its facts read from the
    Hub's headers (None once it is: the caller reads the files). An engine that converts what
    it loads (a safetensors folder into GGUF) needs the files now: they are fetched here."""
    source = hub.canonical(source)
    path = hub.model_path(source)
    confine(str(source), path.resolve(), roots)
    if hub.present(source) is not None:
        return path, None
    if engine.convert is None:
        return path, hub.remote_facts(source)
    if announce is not None:
        announce(f"downloading {source} into {hub.folder(source)} (engine {engine.name} "
                 f"converts it: first start only)")
    return hub.fetch(source), None


def hub_fetcher(config: Config) -> HubFetcher:
    """The scheduler's fetcher of Hub sources, pruning downloads to `hf_cache_budget` (keeping
    the config's own sources) after each."""
    hub = Hub(config.data_path / "models")
    budget = config.server.hf_cache_budget
    keep = [s for s in (parse_hub(m.source) for m in config.models) if s is not None]

    def prune() -> None:
        if budget is not None:
            hub.prune(budget, [hub.canonical(s) for s in keep])

    prune()
    return HubFetcher(hub, after=prune)


def build_entries(config: Config, announce: Announce = None) -> list[Entry]:
    """The scheduler's catalog: every model resolved and estimated; one-time work on the way
    is told to `announce`. Raises ConfigError."""
    return [Entry(spec=r.spec, load=r.load, bytes_estimated=r.breakdown().total)
            for r in resolve_models(config, announce=announce)]


def device_budgets(config: Config, devices: set[str], probe: MemoryProbe) -> list[DeviceBudget]:
    """Each device's budget; `cpu`'s too where a model is on a CUDA device, as warm copies of
    GPU models park in host RAM within it (`auto` where the config has no `[devices.cpu]`)."""
    budgets = []
    names = devices | set(config.devices)
    if any(n.startswith("cuda") for n in names):
        names.add("cpu")
    for name in sorted(names):
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
    victim_policy: VictimPolicy | Mapping[str, VictimPolicy] | None = None,
    announce: Announce = None,
) -> Scheduler:
    """The scheduler for `config`, with each device's victim policy from its `eviction` key
    unless given one (for every device, or by device name: the bench replays other engines'
    rules), and its engines' runner processes on a host of its own (`runner_host`). Must be
    called from the thread that runs the event loop (the runners inherit its priority)."""
    probe = probe or SystemProbe()
    if factory is None:
        host = runner_host(config)
        host.start()
        factory = backends.factory(host)
    entries = build_entries(config, announce)  # engines are imported by their first load
    budgets = device_budgets(config, {e.load.device for e in entries}, probe)
    if victim_policy is None:
        victim_policy = {b.name: make_policy(dev.eviction, dev.eviction_horizon_s)
                         for b in budgets for dev in [config.device_config(b.name)]}
    scheduler = Scheduler(
        entries, budgets, factory, probe,
        FootprintStore(config.data_path / "footprints.json"),
        load_wait_s=config.server.load_wait_s,
        load_timeout_s=config.server.load_timeout_s,
        failure_cooldown_s=config.server.failure_cooldown_s,
        crash_window_s=config.server.crash_window_s,
        victim_policy=victim_policy,
        load_nice=config.server.load_nice,
        load_turn=config.server.load_turn,
        warm_tier={b.name for b in budgets if config.device_config(b.name).warm_tier},
        idle={b.name: IdleRule(dev.keep_alive, dev.cold_after)
              for b in budgets for dev in [config.device_config(b.name)]},
        sinks=sinks,
        check_files=backends.check_weights,
        fetcher=hub_fetcher(config),
    )
    scheduler.check_pins()
    return scheduler


def runner_host(config: Config) -> RunnerHost:
    """What `config`'s runner processes share: their logs under `data_dir/logs/runners`, a
    start deadline of `load_timeout_s`, and the CPU turns (`runner_turns`)."""
    return RunnerHost(config.data_path / "logs" / "runners",
                      start_timeout_s=config.server.load_timeout_s,
                      turns=config.server.runner_turns)


def build_keyring(config: Config) -> KeyRing | None:
    """The API keys of `config`, or None when it names no keys file. Raises ConfigError."""
    path = config.keys_path
    return None if path is None else KeyRing(path)
