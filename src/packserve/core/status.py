"""What the scheduler tells the rest of packserve about residency: the rows that `api/` (the
residency view, /readyz) and `metrics/` read. Plain frozen data; the scheduler builds them."""

from __future__ import annotations

from dataclasses import dataclass

from packserve.types import State, Task


@dataclass(frozen=True)
class Download:
    """Weights being fetched for a model (packserve.core.fetch): its source, bytes done of all."""

    source: str
    done_bytes: int
    total_bytes: int  # 0 until the source has been listed
    idle_s: float = 0.0  # seconds since its last byte (since it started, before the first)


@dataclass(frozen=True)
class LastCrash:
    """The last death of a model's engine process, and what it meant."""

    at: float  # wall-clock seconds since the epoch
    cause: str  # "SIGKILL", "SIGKILL (OOM kill)", "exit status 1", "hung"
    pid: int
    verdict: str  # core.crashes' words: loaded again, after a back-off, or quarantined
    log: str  # where its log is kept
    log_tail: str


@dataclass(frozen=True)
class ModelStatus:
    """One row of the residency view."""

    name: str
    tasks: tuple[Task, ...]
    state: State
    device: str
    pinned: bool
    bytes_estimated: int
    bytes_measured: int | None
    in_flight: int
    queued: int
    last_used: float | None  # wall-clock seconds since the epoch
    load_seconds: float | None
    error: str | None
    shares_weights_with: tuple[str, ...]
    bytes_warm: int | None = None  # what it holds while warm (engine objects, no weights)
    restore_seconds: float | None = None  # the last restore from warm
    download: Download | None = None  # its weights are being fetched (state: admitting)
    last_crash: LastCrash | None = None
    # a back-off after a crash, or a quarantine that ends: it may load again after this
    restart_in_s: float | None = None
    log: str | None = None  # its engine process's log, where it has one


@dataclass(frozen=True)
class DeviceStatus:
    """A device's budget and what its residents hold now."""

    name: str
    budget_bytes: int
    headroom_bytes: int
    used_bytes: int
    # how the device's bytes are counted: "rss" (CPU), "per_process" (NVML's figure for the
    # process holding them) or "device_total" (the device's used memory: the fallback)
    accounting: str = "rss"
    # what its models may hold now: the budget after headroom, less what other processes leave
    # and (on `cpu`) warm copies of GPU models; None where no scheduler says
    capacity_bytes: int | None = None
    # On a CUDA device: this process's base there (its CUDA context, counted once, in no
    # model's bytes), and what other processes hold (NVML; None where it cannot say)
    base_bytes: int | None = None
    others_bytes: int | None = None
    # On `cpu`: host RAM that warm copies of GPU models hold, counted in its budget
    warm_host_bytes: int | None = None


@dataclass(frozen=True)
class PinStatus:
    """A pinned model that is not hot, as /readyz reports it."""

    model: str
    state: State
    error: str | None  # why its last load failed; None while it loads for the first time
    next_retry_s: float | None  # seconds until the scheduler tries again; None: no retry planned
    download: Download | None = None  # its weights are being fetched


@dataclass(frozen=True)
class Readiness:
    """Ready when every pinned model is hot; `pins` are the pinned models that are not."""

    ready: bool
    pins: tuple[PinStatus, ...]

    @property
    def not_loaded(self) -> list[str]:
        return [p.model for p in self.pins]


@dataclass(frozen=True)
class Stuck:
    """Something the deep probe found running or waiting for `seconds`: a device lock held (by
    `who`), a load in its engine (`model`), or a model's queue that has not moved."""

    kind: str  # "lock", "load", "queue" or "download"
    device: str
    model: str  # a load's or a queue's catalog name(s), "+"-joined for shared weights
    seconds: float
    detail: str  # for a lock, what holds it ("model NAME" for a load); for a queue, how many
    # wait; for a download, its source (its `seconds`: since its last byte)


@dataclass(frozen=True)
class Liveness:
    """The deep probe's answer. `stuck`: whatever has run or waited past `load_timeout_s`;
    `wedged`: the models whose load did, charged when the worker is restarted for it. A lock or a
    load past it means the scheduler is wedged on that device (`restart`); a queue that has not
    moved is reported (`ok` false) but may be a long generation holding every slot."""

    load_timeout_s: float
    locks: tuple[Stuck, ...]  # every lock held now, however briefly
    loads: tuple[Stuck, ...]  # every load in its engine now
    stuck: tuple[Stuck, ...]
    wedged: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.stuck

    @property
    def restart(self) -> bool:
        return any(s.kind in ("lock", "load") for s in self.stuck)
