"""The one reader of the config file, the built-in default catalog and the CLI overrides.

A config is a TOML file with three parts: `[server]`, `[devices.NAME]` and `[[models]]`, and a
fourth that only `packserve pool` reads: `[pool]`.
Every key has a default (README.md lists them). A bad config is refused at start with the
key, the line where it is, and the reason.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import math
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)

from packserve.errors import ConfigError
from packserve.types import Task
from packserve.units import parse_bytes, parse_duration


def _parse_budget(value: object) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    return parse_bytes(value)


Bytes = Annotated[int, BeforeValidator(parse_bytes)]
# 5m, 90s, 300, never (inf; written back as "never": JSON has no infinity)
Duration = Annotated[float, BeforeValidator(parse_duration),
                     PlainSerializer(lambda s: "never" if math.isinf(s) else s)]
Budget = Annotated[int | Literal["auto"], BeforeValidator(_parse_budget)]

_DEVICE_RE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")
log = logging.getLogger(__name__)


@functools.cache
def _say_alias(name: str, engine: str) -> None:
    """Once per process: an entry named an engine by an old name."""
    log.warning("backend = %r is read as %r: packserve's in-process llama.cpp engine was "
                "removed, and its runner serves the same GGUF files through the same API "
                "(docs/engines.md)", name, engine)


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")

# `memory_budget = "auto"` takes this fraction of what the device has (documented in README).
AUTO_BUDGET_FRACTION: Mapping[str, float] = {"cpu": 0.75, "cuda": 0.90}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SloConfig(_Strict):
    """`[server.slo]`: seconds per model type, first token for a stream."""

    embed: float = Field(default=0.5, gt=0)
    rerank: float = Field(default=0.5, gt=0)
    chat: float = Field(default=4.0, gt=0)
    complete: float = Field(default=4.0, gt=0)

    def of(self, task: Task) -> float:
        return float(getattr(self, task.value))


class ServerConfig(_Strict):
    """`[server]`: where to listen and how long to wait."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    data_dir: str = "~/.cache/packserve"
    # Directories model sources must stay under (real paths: `..` and symlinks leading out are
    # refused at start); relative ones from this file's folder. None (unset): this file's
    # folder, data_dir/models and the folders of the packages that `package:` sources name.
    model_roots: list[str] | None = Field(default=None, min_length=1)
    load_wait_s: float = Field(default=120.0, gt=0, allow_inf_nan=False)
    # A load (or a device lock) running longer is wedged: the deep probe says so and the front
    # restarts the worker, charging the model whose load hung.
    load_timeout_s: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    # Disk for models downloaded from the Hub (`hf:` sources, in data_dir/models/hf): past it,
    # the least recently used downloads of models no longer in the config are deleted. None:
    # no limit.
    hf_cache_budget: Bytes | None = None
    failure_cooldown_s: float = Field(default=30.0, ge=0)
    max_request_bytes: Bytes = 4 * 1024 * 1024
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: bool = True  # one line per HTTP request (a pool's replicas turn it off)
    currency: str = Field(default="EUR", min_length=1, max_length=8)
    metrics_window_s: float = Field(default=300.0, gt=0)
    # SIGTERM: requests in flight get this long to finish (under Kubernetes' 30 s grace period).
    drain_s: float = Field(default=25.0, ge=0, le=3600)
    # The crash rule of every engine process (the worker's, each runner's; core.crashes): a
    # death within this long of the one before is loaded again after a back-off, the third
    # quarantines the model (503) until this long has passed or an operator loads it.
    # failure_cooldown_s is for loads that fail, this for processes that die.
    crash_window_s: float = Field(default=300.0, ge=0, allow_inf_nan=False)
    # API keys (packserve.auth): a TOML file of key digests, relative to this file. "": no keys,
    # every route open, and the server refuses any address but localhost unless open_to_anyone.
    keys_file: str = ""
    # The read-only operator views (status page, /metrics, summary, residency, plan, OpenAPI):
    # "admin" keys only, or "open" to anyone who reaches the port. Only with keys_file.
    operator_views: Literal["open", "admin"] = "admin"
    # Listen on a non-local address without keys: anyone who reaches the port can call every
    # model and every admin route. Off unless the operator says so.
    open_to_anyone: bool = False
    # Latency targets per model type; with `compute_priority`, the requests to engines that run
    # in the worker (the torch engines) compete for its cores by deadline (arrival + SLO). Off
    # by default: on 2 cores the OS's sharing did as well (docs/scheduling.md). The llama.cpp
    # runners take turns by the same deadlines under `runner_turns`.
    slo: SloConfig = SloConfig()
    compute_priority: bool = False
    # llama-server runners on the CPU compute one at a time when several are busy, the
    # earliest deadline first (the others are paused): llama.cpp's threads spin at barriers,
    # and two busy runners on the same cores slowed each other ~4x (docs/engines.md).
    runner_turns: bool = True
    # Loads run at this nice value (0-19; 0: as inference), so resident models keep serving
    # while weights are read.
    load_nice: int = Field(default=10, ge=0, le=19)
    # A load that waits for busy models to finish (to evict them) takes its turn once one of its
    # requests has waited this fraction of its SLO: requests for those models that arrive then,
    # due no sooner, wait behind it, each for at most this fraction of its own SLO, so a steady
    # stream to one model cannot starve another's load (docs/scheduling.md). 0: they go ahead.
    load_turn: float = Field(default=0.5, ge=0, le=1)

    @model_validator(mode="after")
    def _keys_or_localhost(self) -> ServerConfig:
        if not self.keys_file and not self.open_to_anyone and not _is_loopback(self.host):
            raise ValueError(
                f"host {self.host!r} is reachable from other machines but no keys_file is set: "
                f"anyone who reaches the port could call every model and load, unload, pin and "
                f"reload. Set keys_file (packserve keys create NAME), or accept the risk with "
                f"open_to_anyone = true (--open-to-anyone)")
        return self


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


class DeviceConfig(_Strict):
    """`[devices.NAME]`: the memory the scheduler may fill on one device."""

    memory_budget: Budget = "auto"
    headroom: Bytes = 256 * 1024 * 1024
    # A placeholder so cost figures are not zero out of the box: set your device's real price.
    price_per_hour: float = Field(default=1.0, ge=0)
    # Whom to evict when a load needs room: "cost" weighs each idle model's reload seconds by
    # the chance it is needed within `eviction_horizon_s`, per byte; "lru" is least recently
    # used first (packserve's rule before 0.12).
    eviction: Literal["cost", "lru"] = "cost"
    eviction_horizon_s: float = Field(default=60.0, gt=0, le=86_400)
    # An evicted model keeps its engine objects (tokenizer, vocabulary, module graph) and gives
    # back its weights, so coming back costs a read of the weights instead of a whole load
    # (sentence-transformers with safetensors weights; llama.cpp on CPU). false: evictions unload.
    warm_tier: bool = True
    # Idle models let go: a model with no request for `keep_alive` goes to the warm tier (cold
    # where it has none), and a warm copy with none for `keep_alive` + `cold_after` goes cold.
    # Pins stay. "never" by default: packserve keeps models ready; set it on a shared card.
    keep_alive: Duration = math.inf
    cold_after: Duration = math.inf


class ModelSpec(_Strict):
    """One `[[models]]` entry: a name clients send as `model`, and how to serve it."""

    name: str
    tasks: list[Task] = Field(min_length=1)
    backend: str  # an engine in packserve.backends' registry
    source: str
    device: str = "auto"
    pin: bool = False
    max_concurrency: int | None = Field(default=None, ge=1, le=4096)
    max_queue: int = Field(default=64, ge=0, le=100_000)
    max_memory: Bytes | None = None
    context_length: int | None = Field(default=None, ge=16, le=1_048_576)
    max_batch: int = Field(default=64, ge=1, le=4096)
    # Per-request limits; a request over one gets a 400 naming it.
    max_inputs: int = Field(default=2048, ge=1, le=100_000)  # texts: inputs, documents, prompts
    max_input_tokens: int | None = Field(default=None, ge=1)  # all of one request's inputs
    max_output_tokens: int | None = Field(default=None, ge=1)  # ceiling on max_tokens
    # Latency target in seconds (first token of a stream, else the whole answer): the compute
    # scheduler's deadline. Default: `[server.slo]` for the model's first task.
    slo_s: float | None = Field(default=None, gt=0, le=86_400)
    threads: int | None = Field(default=None, ge=1, le=1024)  # llama.cpp; default: half the cores
    # llama.cpp: sequences decoded together in one batch (parallel slots). Default: the
    # engine's. "shared": the slots share one KV cache of context_length tokens (no memory
    # over one sequence; greedy answers may differ slightly with their neighbours);
    # "per_slot": each slot has its own, counted in the footprint (answers as if alone).
    parallel: int | None = Field(default=None, ge=1, le=64)
    parallel_cache: Literal["shared", "per_slot"] = "shared"
    # Chat with tools on a model whose chat template cannot show them: packserve's generic tool
    # prompt (the tools listed in a system message, calls and results as plain turns). Off: 400.
    tool_prompt: bool = False
    # This model's idle time before it lets go (see `[devices.NAME] keep_alive`); default: its
    # device's.
    keep_alive: Duration | None = None
    trust_remote_code: bool = False
    allow_pickle: bool = False

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError("use letters, digits and . _ : / - (at most 128 characters)")
        return v

    @field_validator("source")
    @classmethod
    def _hub_grammar(cls, v: str) -> str:
        from packserve import hub

        try:
            hub.parse(v)
        except ConfigError as exc:
            raise ValueError(exc.message) from exc
        return v

    @field_validator("backend")
    @classmethod
    def _backend_known(cls, v: str) -> str:
        from packserve import backends

        if v in backends.ALIASES:
            _say_alias(v, backends.ALIASES[v])
            v = backends.ALIASES[v]
        backends.get(v)  # raises ValueError naming the engines there are
        return v

    @field_validator("device")
    @classmethod
    def _device_ok(cls, v: str) -> str:
        if not _DEVICE_RE.match(v):
            raise ValueError("must be cpu, cuda, cuda:N or auto")
        return "cuda:0" if v == "cuda" else v

    @field_validator("tasks")
    @classmethod
    def _tasks_unique(cls, v: list[Task]) -> list[Task]:
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _tasks_match_backend(self) -> ModelSpec:
        from packserve import backends

        allowed = backends.get(self.backend).tasks
        bad = [t.value for t in self.tasks if t not in allowed]
        if bad:
            raise ValueError(
                f"backend {self.backend!r} cannot do {', '.join(bad)} "
                f"(it does {', '.join(sorted(t.value for t in allowed))})"
            )
        if (self.parallel is not None or self.parallel_cache != "shared") \
                and not backends.get(self.backend).default_parallel:
            raise ValueError(f"parallel: backend {self.backend!r} decodes no sequences in "
                             f"parallel")
        return self

    @property
    def concurrency(self) -> int:
        from packserve import backends

        engine = backends.get(self.backend)
        return self.max_concurrency or max(engine.default_concurrency,
                                           self.parallel or engine.default_parallel)


class PoolGroup(_Strict):
    """`[[pool.dedicated]]`: replicas that serve only these models and nothing else."""

    models: list[str] = Field(min_length=1)
    min_replicas: int = Field(default=1, ge=1, le=1024)
    max_replicas: int = Field(default=1, ge=1, le=1024)


class PoolConfig(_Strict):
    """`[pool]`: read by `packserve pool` only (packserve.pool); `packserve serve` ignores it.

    Every replica is a whole packserve node serving `[[models]]` (less the dedicated ones) on
    the budgets of `[devices.*]`; the entry point listens on `server.host`/`server.port` and
    holds the keys of `server.keys_file`.
    """

    # Ray cluster: "" starts one on this machine, "auto" joins the one this machine is in,
    # or "ray://HOST:10001" / "HOST:6379".
    address: str = ""
    min_replicas: int = Field(default=2, ge=1, le=1024)
    max_replicas: int = Field(default=2, ge=1, le=1024)
    # Scale out when the pool's requests in flight and queued exceed this per replica, after
    # upscale_delay_s above it; scale in after downscale_delay_s below it.
    target_queue: float = Field(default=8.0, gt=0)
    upscale_delay_s: float = Field(default=5.0, ge=0)
    downscale_delay_s: float = Field(default=60.0, ge=0)
    # What each replica asks Ray for: CPUs, GPUs and custom resources (one GPU: one node).
    replica_cpus: float = Field(default=1.0, ge=0)
    replica_gpus: float = Field(default=0.0, ge=0)
    replica_resources: dict[str, float] = Field(default_factory=dict)
    # How often each replica reports what it holds to the router.
    stats_period_s: float = Field(default=0.5, gt=0, le=60)
    # One more copy: a model whose queue stays above copy_queue_depth on every replica that
    # holds it, for copy_after_s, is sent to one more replica. An extra copy idle for
    # copy_idle_s is unloaded (the last copy stays).
    copy_queue_depth: int = Field(default=4, ge=1)
    copy_after_s: float = Field(default=5.0, ge=0)
    copy_idle_s: float = Field(default=120.0, gt=0)
    # How the entry point picks a replica: packserve's residency-aware router, Ray Serve's own
    # multiplexed routing ("ray"), or round robin (the last two are baselines for bench pool).
    router: Literal["packserve", "ray", "round_robin"] = "packserve"
    # With router = "ray": the models Ray Serve's multiplexing keeps per replica (it counts
    # models, not bytes; packserve's scheduler still holds each node to its budget).
    ray_models_per_replica: int = Field(default=3, ge=1, le=1024)
    # Embeddings and rerank lost with a dead replica are sent again this many times.
    retries: int = Field(default=2, ge=0, le=10)
    dedicated: list[PoolGroup] = Field(default_factory=list)

    @model_validator(mode="after")
    def _bounds(self) -> PoolConfig:
        bounds = [("pool", self.min_replicas, self.max_replicas)]
        bounds += [(f"pool.dedicated[{i}]", g.min_replicas, g.max_replicas)
                   for i, g in enumerate(self.dedicated)]
        for where, low, high in bounds:
            if high < low:
                raise ValueError(f"{where}: max_replicas ({high}) is below min_replicas "
                                 f"({low})")
        seen: set[str] = set()
        for g in self.dedicated:
            for name in g.models:
                if name in seen:
                    raise ValueError(f"model {name!r} is in two [[pool.dedicated]] groups")
                seen.add(name)
        return self


class Config(_Strict):
    """The whole config. Build it with `load_config`."""

    server: ServerConfig = ServerConfig()
    devices: dict[str, DeviceConfig] = Field(default_factory=dict)
    models: list[ModelSpec] = Field(default_factory=list)
    pool: PoolConfig = PoolConfig()  # `packserve pool` only
    base_dir: str = "."  # where relative `source` paths start; set by load_config

    @field_validator("devices")
    @classmethod
    def _device_names(cls, v: dict[str, DeviceConfig]) -> dict[str, DeviceConfig]:
        for name in v:
            if not _DEVICE_RE.match(name) or name == "auto":
                raise ValueError(f"device name {name!r} must be cpu, cuda or cuda:N")
        return {("cuda:0" if k == "cuda" else k): d for k, d in v.items()}

    @model_validator(mode="after")
    def _unique_names(self) -> Config:
        seen: set[str] = set()
        for m in self.models:
            if m.name in seen:
                raise ValueError(f"two models are named {m.name!r}; names must be unique")
            seen.add(m.name)
        unknown = [n for g in self.pool.dedicated for n in g.models if n not in seen]
        if unknown:
            raise ValueError(f"[[pool.dedicated]] names {', '.join(unknown)}, not in "
                             f"[[models]]")
        return self

    def device_config(self, device: str) -> DeviceConfig:
        return self.devices.get(device, DeviceConfig())

    @property
    def data_path(self) -> Path:
        return Path(os.path.expanduser(self.server.data_dir))

    @property
    def keys_path(self) -> Path | None:
        """The keys file, relative paths from the config file's folder; None without keys."""
        if not self.server.keys_file:
            return None
        return Path(self.base_dir) / os.path.expanduser(self.server.keys_file)


def default_catalog_text() -> str:
    return resources.files("packserve").joinpath("default_catalog.toml").read_text("utf-8")


def load_config(
    path: str | Path | None = None,
    *,
    host: str | None = None,
    port: int | None = None,
    memory_budget: str | None = None,
    open_to_anyone: bool = False,
    only_models: Sequence[str] | None = None,
) -> Config:
    """Read the config file (or the built-in catalog), apply CLI overrides, validate.

    Raises ConfigError naming the key, its line and the reason.
    """
    if path is None:
        text, origin, base = default_catalog_text(), "<built-in default catalog>", Path.cwd()
    else:
        p = Path(path)
        try:
            text = p.read_text("utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config {p}: {exc.strerror}") from exc
        origin, base = str(p), p.resolve().parent
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{origin}: not valid TOML: {exc}") from exc

    server = dict(raw.get("server", {}))
    if host is not None:
        server["host"] = host
    if port is not None:
        server["port"] = port
    if open_to_anyone:
        server["open_to_anyone"] = True
    raw["server"] = server
    if memory_budget is not None:
        devices = {k: dict(v) for k, v in raw.get("devices", {}).items()}
        for name in {"cpu", *devices}:
            devices.setdefault(name, {})["memory_budget"] = memory_budget
        raw["devices"] = devices
    if only_models:
        known = [m.get("name") for m in raw.get("models", [])]
        missing = [n for n in only_models if n not in known]
        if missing:
            raise ConfigError(
                f"--models names {', '.join(missing)}, not in {origin} "
                f"(it has: {', '.join(str(k) for k in known)})"
            )
        raw["models"] = [m for m in raw.get("models", []) if m.get("name") in only_models]
    raw["base_dir"] = str(base)
    _check_unique_names(raw, text, origin)
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, text, origin)) from exc


def _check_unique_names(raw: dict[str, object], text: str, origin: str) -> None:
    models = raw.get("models")
    seen: set[object] = set()
    for i, m in enumerate(models if isinstance(models, list) else []):
        name = m.get("name") if isinstance(m, dict) else None
        if name is not None and name in seen:
            line = _find_line(text, ("models", i, "name"))
            raise ConfigError(f"invalid config:\n  {origin}:{line}: models[{i}].name: two "
                              f"models are named {name!r}; names must be unique")
        seen.add(name)


def _explain(exc: ValidationError, text: str, origin: str) -> str:
    lines = []
    for err in exc.errors():
        loc = err["loc"]
        key = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[")
        line = _find_line(text, loc)
        where = f"{origin}:{line}" if line else origin
        msg = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{where}: {key or '(top level)'}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _find_line(text: str, loc: tuple[int | str, ...]) -> int | None:
    """Best-effort line number of a key given pydantic's location tuple."""
    if not loc:
        return None
    rows = text.splitlines()
    head = str(loc[0])
    start = 0
    if head == "models" and len(loc) >= 2 and isinstance(loc[1], int):
        seen = -1
        for i, row in enumerate(rows):
            if row.strip() == "[[models]]":
                seen += 1
                if seen == loc[1]:
                    start = i
                    break
        else:
            return None
        keys = loc[2:]
    elif head in ("server", "devices", "pool"):
        target = f"[devices.{loc[1]}]" if head == "devices" and len(loc) > 1 else f"[{head}]"
        start = next((i for i, r in enumerate(rows) if r.strip() == target), 0)
        keys = loc[2:] if head == "devices" else loc[1:]
    else:
        keys = loc
    key = next((str(k) for k in keys if isinstance(k, str)), None)
    if key is None:
        return start + 1
    for i in range(start, len(rows)):
        if i > start and rows[i].lstrip().startswith("["):
            break
        if re.match(rf"^\s*{re.escape(key)}\s*=", rows[i]):
            return i + 1
    return start + 1
