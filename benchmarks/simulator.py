"""A discrete-event simulator of packserve's scheduler: the real victim policies, a simulated
clock, and the compute of one device shared between loads and requests.

Pure: no I/O, no asyncio, no wall clock. `simulate` replays a trace (`bench.trace.make_trace`'s
requests) on a `Box` (one device, its catalog and what each job costs there) and returns what
happened. What it mirrors of `core.scheduler` (`_admit_and_load`, `acquire`, `_evict_to`):

- A request for a model that is not hot starts a load of its weights. Loads take the device's
  lock one at a time, first come first served; the one holding it asks `plan_admission` with
  the residents as `ResidentView`s (`reload_s` = its last load's seconds here, `rate_per_s` =
  `arrival_rate` of its last `RATE_WINDOW` arrivals, `in_flight` = requests queued or running
  on it) and applies the verdict: FITS loads; FITS_AFTER_EVICTION unloads the first victim and
  plans again; WAIT_FOR_BUSY lets the lock go to the next load and queues for it again when
  memory may have changed (a request, a load or an unload ended; a hold below expired). A load
  or an unload holds its bytes while it runs.
- A request for a model that is loading or unloading waits; one that arrives while its weights
  unload loads them again afterwards, as the real scheduler does.
- Each set of weights serves `slots` requests at once (1: llama.cpp's one context; more: a
  continuously batched GPU engine, whose requests advance together at the weights' rate), in
  arrival order. Queued embeddings are merged into the next forward pass, as `api.batching`
  does: the pass takes its longest request's time plus `merge_marginal` of the others'.
- Compute is processor sharing: the device has `cores`; each running job (the requests on one
  set of weights, or a load) wants `threads[kind]`; when they want more than there is, each
  advances at `oversubscribed` x cores / wanted. With `priority`, generation makes no
  progress while embeddings or reranks run on the device (it yields between tokens), and loads
  get what serving leaves, at least `load_floor` of what they want.
- A load from disk first stalls the device for `stall_s` (nothing else advances), and the
  first request after it takes `warmup_s` more (both measured on the CPU box).
- With a warm tier, an evicted model's weights move to host RAM if they fit there (the warm
  copies kept longest ago leave for them) and come back at `restore_s` instead of `load_s`.
  Where a set of weights has `keeps_bytes` (the CPU box, as the server's warm tier works on a
  CPU) its warm copy stays on the device instead, holding those bytes inside the budget, and
  the policy sees it as the scheduler shows it (`goes_warm`, `keeps_bytes`, `restore_s`,
  `warm_bytes`, state WARM): it may evict a copy to cold, or evict victims straight to cold
  (`Admission.to_cold`).

Two holds that the real scheduler does not have, to try in the simulator only: a minimum
residency after a load, and a grace after a resident's last request (so that a burst for it is
served before a cold model takes its place). A held resident counts as busy for the policy.
And one it has (`load_turn`): while a load waits for busy models, the requests that arrive for
those the policy would evict were they idle (`Admission.draining`), due no earlier than the
load's earliest, wait behind it, each at most `load_turn` of its SLO.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from packserve.core.policy import (
    RATE_WINDOW,
    ResidentView,
    Verdict,
    VictimPolicy,
    arrival_rate,
    choose_victims,
    plan_admission,
)
from packserve.core.resident import Moves
from packserve.replay import TraceRequest
from packserve.types import State

TIGHT = frozenset({"embed", "rerank"})  # the tasks with the tight SLO; the rest generate
LOAD = "load"  # the key of a load's threads in `Box.threads`
STALL = "stall"  # the job of a load's stall (`Weights.stall_s`)
_EPS = 1e-9


@dataclass(frozen=True)
class ServiceModel:
    """Seconds one request takes alone on the device: linear in its prompt and output."""

    base_s: float
    per_word_s: float = 0.0
    per_token_s: float = 0.0

    def seconds(self, words: int, max_tokens: int) -> float:
        return max(0.0, self.base_s + self.per_word_s * words + self.per_token_s * max_tokens)


@dataclass(frozen=True)
class Weights:
    """One set of weights on the device: what it holds and what moving it costs, alone."""

    key: str
    bytes: int  # held on the device while loading, hot or unloading
    load_s: float  # from disk
    unload_s: float
    warmup_s: float = 0.0  # added to the first request after a load from disk (first pass
    # allocations, and what a request to a cold model pays beyond the load itself)
    stall_s: float = 0.0  # before a load from disk, nothing else on the device advances for
    # this long (the server checks the file's header in Python, holding the interpreter lock)
    restore_s: float | None = None  # from the host-RAM warm tier; None: never kept warm
    offload_s: float = 0.0  # device to host RAM, when evicted to the warm tier
    host_bytes: int = 0  # what its warm copy holds in host RAM
    keeps_bytes: int | None = None  # set: its warm copy stays on the device (its engine
    # objects, as on the CPU box), holding this much of the budget (0: nothing the scheduler
    # can measure), instead of moving to host RAM
    drop_s: float = 0.0  # a warm copy kept on the device, to cold
    slots: int = 1  # requests served at once
    max_batch: int = 1  # embeddings merged into one forward pass (1: none)


@dataclass(frozen=True)
class SimModel:
    """One catalog name: the task it serves on which weights, and how long a request takes."""

    name: str
    task: str  # embed, rerank, chat or complete
    weights: str  # a `Weights.key`
    service: ServiceModel


@dataclass(frozen=True)
class Box:
    """One device, its catalog, and the compute a job of each kind wants."""

    name: str
    capacity_bytes: int  # budget minus headroom
    cores: float
    threads: Mapping[str, float]  # per task and for LOAD (loads, restores, unloads)
    weights: tuple[Weights, ...]
    models: tuple[SimModel, ...]
    host_bytes: int = 0  # the warm tier's budget in host RAM
    merge_marginal: float = 0.3
    oversubscribed: float = 1.0  # share of the cores jobs get when they want more than there
    # is (below 1: threads that wait on each other lose time, as torch's do)

    def model(self, name: str) -> SimModel:
        return next(m for m in self.models if m.name == name)


@dataclass(frozen=True)
class SimOptions:
    priority: bool = False  # tight work first: generation pauses, loads get the leftovers
    warm_tier: bool = False
    min_residency_s: float = 0.0  # a load is not evicted for this long (0: off)
    grace_s: float = 0.0  # nor a resident within this long of its last request, while the
    # load that wants its room has waited less than this (0: off)
    load_floor: float = 0.25  # with priority: the least share of its threads a load gets
    rate_window: int = RATE_WINDOW  # arrivals each resident keeps for `arrival_rate`
    wait_holds_lock: bool = False  # as the scheduler did before commit 10c4f0f: a load that
    # waits for busy models keeps the device lock, and every later load waits behind it
    # A load waiting for busy models holds the requests that arrive for them afterwards, each
    # for at most this fraction of its task's SLO (the server's `load_turn`; 0: off).
    load_turn: float = 0.0
    slo_s: tuple[tuple[str, float], ...] = (("embed", 0.5), ("rerank", 0.5), ("chat", 4.0),
                                            ("complete", 4.0))


class SimClock:
    """The simulated clock, shared by the simulator and any policy that reads the time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Served:
    """One request's outcome."""

    at: float
    model: str
    task: str
    latency_s: float  # inf: never served (its model can never fit)


@dataclass(frozen=True)
class LoadRecord:
    at: float  # when the load started
    key: str
    seconds: float
    bytes: int
    warm: bool  # restored from the warm tier


@dataclass
class SimResult:
    served: list[Served] = field(default_factory=list)
    loads: list[LoadRecord] = field(default_factory=list)
    evictions: int = 0
    offloads: int = 0  # evictions that kept a warm copy (in host RAM, or on the device)
    peak_bytes: int = 0  # the most the device held (loading, hot, unloading, warm copies kept
    # on it) at any load
    end_s: float = 0.0

    def latencies(self, task: str | None = None) -> list[float]:
        return [s.latency_s for s in self.served if task is None or s.task == task]

    def attainment(self, slo_s: Mapping[str, float], task: str | None = None) -> float | None:
        rs = [s for s in self.served if task is None or s.task == task]
        if not rs:
            return None
        return sum(1 for s in rs if s.latency_s <= slo_s[s.task]) / len(rs)


def future_arrivals(box: Box, trace: Sequence[TraceRequest]) -> dict[str, list[float]]:
    """Arrival times per set of weights, sorted: what Belady's choice knows of the future."""
    weights_of = {m.name: m.weights for m in box.models}
    out: dict[str, list[float]] = {w.key: [] for w in box.weights}
    for r in sorted(trace, key=lambda r: r.at):
        out[weights_of[r.model]].append(r.at)
    return out


class Belady:
    """Belady's choice as a victim policy: idle residents whose next request comes furthest in
    the future leave first (never again: first of all), until the bytes fit. It reads the
    future from the trace and the time from the simulator's clock: a reference, not a policy a
    server can run.

    With `sized`, victims that turn out not to be needed for the bytes to fit stay (those
    needed soonest first), as `CostAware` does: with unequal sizes, plain Belady may evict a
    small model and then a large one that alone would have made room."""

    name = "belady"

    def __init__(self, future: Mapping[str, Sequence[float]], clock: Callable[[], float], *,
                 sized: bool = False) -> None:
        self._future = future
        self._clock = clock
        self._sized = sized

    def next_use(self, r: ResidentView) -> float:
        times = self._future.get(r.key, ())
        i = bisect_right(times, self._clock())
        return times[i] if i < len(times) else math.inf

    def __call__(self, residents: Sequence[ResidentView], need_bytes: int,
                 free_bytes: int) -> tuple[str, ...] | None:
        victims = choose_victims(residents, need_bytes, free_bytes,
                                 lambda r: (-self.next_use(r), -r.bytes))
        if not victims or not self._sized:
            return victims
        size = {r.key: r.bytes for r in residents}
        kept = list(victims)
        for key in reversed(victims):  # needed soonest first
            rest = [k for k in kept if k != key]
            if free_bytes + sum(size[k] for k in rest) >= need_bytes:
                kept = rest
        return tuple(kept)


def simulate(box: Box, trace: Sequence[TraceRequest], policy: VictimPolicy,
             options: SimOptions = SimOptions(), clock: SimClock | None = None) -> SimResult:
    """Replay `trace` on `box` under `policy`. Every model starts cold."""
    return _Sim(box, policy, options, clock or SimClock()).run(trace)


# ----------------------------------------------------------------------------- the engine


@dataclass
class _Req:
    at: float
    model: str
    task: str
    work_s: float


@dataclass
class _Res(Moves):
    """A resident as the simulator keeps it; its state moves along the scheduler's table."""

    w: Weights
    models: tuple[str, ...]
    queue: deque[_Req] = field(default_factory=deque)
    running: int = 0  # requests in running jobs
    jobs: int = 0  # running service jobs (at most `slots`)
    arrivals: deque[float] = field(default_factory=deque)
    last_used: float = 0.0
    loaded_at: float = -math.inf
    load_s: float = 0.0  # its last load's seconds (from disk, where warm copies stay on the
    # device; else the last load or restore, as before they could)
    warm: bool = False  # a warm copy waits (in host RAM, or on the device: state WARM)
    warm_since: float = 0.0
    kept: int = 0  # what its last warm copy held on the device (0: never went warm there)
    restore_s: float = 0.0  # its last restore's seconds (0: never restored)
    fresh: bool = False  # loaded from disk, no request served yet
    turn: _Res | None = None  # a load waits for it to drain: new requests are parked
    parked: list[tuple[float, _Req]] = field(default_factory=list)  # (held until, request)

    @property
    def in_flight(self) -> int:
        return len(self.queue) + self.running


@dataclass(eq=False)
class _Job:
    kind: str  # a task (serving), or STALL, "load", "restore", "unload", "offload"
    res: _Res
    work: float  # seconds left at full rate
    started: float
    reqs: list[_Req]
    rate: float = 0.0


class _Sim:
    def __init__(self, box: Box, policy: VictimPolicy, options: SimOptions,
                 clock: SimClock) -> None:
        self.box, self.policy, self.opt, self.clock = box, policy, options, clock
        names: dict[str, list[str]] = {w.key: [] for w in box.weights}
        for m in box.models:
            names[m.weights].append(m.name)
        self.res = {w.key: _Res(w, tuple(names[w.key]), arrivals=deque(
            maxlen=options.rate_window)) for w in box.weights}
        self.model = {m.name: m for m in box.models}
        self.slo = dict(options.slo_s)  # per task: a load's turn (`load_turn`)
        self.jobs: list[_Job] = []
        self.lock: deque[_Res] = deque()  # loads waiting for the device; the head holds it
        self.waiting: list[_Res] = []  # loads told to wait for busy models: outside the lock
        self.mover: _Job | None = None  # the load or unload the lock's holder runs
        self.timers: list[float] = []
        self.out = SimResult()
        self.dirty = True

    # -------------------------------------------------------------------- main loop

    def run(self, trace: Sequence[TraceRequest]) -> SimResult:
        arrivals = sorted(trace, key=lambda r: r.at)
        i = 0
        while True:
            if self.dirty:
                self._share()
            next_job = min((j for j in self.jobs if j.rate > 0),
                           key=lambda j: j.work / j.rate, default=None)
            t_job = (self.clock.now + next_job.work / next_job.rate if next_job is not None
                     else math.inf)
            t_arrival = arrivals[i].at if i < len(arrivals) else math.inf
            t_timer = self.timers[0] if self.timers else math.inf
            t = min(t_job, t_arrival, t_timer)
            if t == math.inf:
                break
            self._advance(t)
            if next_job is not None and t == t_job:
                next_job.work = 0.0  # whatever rounding left
                for job in [j for j in self.jobs if j.work <= _EPS]:
                    self._finish(job)
            elif t == t_timer:
                while self.timers and self.timers[0] <= t:
                    heapq.heappop(self.timers)
                self._changed()
            else:
                self._arrive(arrivals[i])
                i += 1
        for r in self.res.values():  # never served: their weights can never fit
            self.out.served += [Served(q.at, q.model, q.task, math.inf) for q in r.queue]
        self.out.end_s = self.clock.now
        return self.out

    def _advance(self, t: float) -> None:
        dt = t - self.clock.now
        if dt > 0:
            for j in self.jobs:
                j.work -= j.rate * dt
        self.clock.now = max(self.clock.now, t)

    def _start(self, job: _Job) -> None:
        self.jobs.append(job)
        self.dirty = True

    def _share(self) -> None:
        """Each job's rate: processor sharing of `cores` between the threads jobs want."""
        threads = self.box.threads
        cores = self.box.cores
        serving: dict[int, list[_Job]] = {}  # by weights: the requests on one set share a rate
        movers: list[_Job] = []
        for j in self.jobs:
            (movers if not j.reqs else serving.setdefault(id(j.res), [])).append(j)
        units = [(js, max(threads[j.kind] for j in js), js[0].kind in TIGHT)
                 for js in serving.values()]
        tight_busy = any(is_tight for _, _, is_tight in units)
        paused = self.opt.priority and tight_busy
        want_serve = sum(d for _, d, is_tight in units if is_tight or not paused)
        want_move = sum(threads[LOAD] for _ in movers)
        if self.opt.priority and want_move > 0:
            spare = max(cores - want_serve, self.opt.load_floor * want_move)
            move_rate = min(1.0, spare / want_move)
            serve_rate = self._fair(cores - move_rate * want_move, want_serve)
        else:
            move_rate = serve_rate = self._fair(cores, want_serve + want_move)
        for js, _, is_tight in units:
            rate = 0.0 if paused and not is_tight else serve_rate
            for j in js:
                j.rate = rate
        for j in movers:
            j.rate = move_rate if threads[LOAD] > 0 else 1.0
        if any(j.kind == STALL for j in movers):
            for j in self.jobs:
                j.rate = 1.0 if j.kind == STALL else 0.0
        self.dirty = False

    def _fair(self, cores: float, wanted: float) -> float:
        return 1.0 if wanted <= cores else self.box.oversubscribed * cores / wanted

    # -------------------------------------------------------------------- requests

    def _arrive(self, t: TraceRequest) -> None:
        m = self.model[t.model]
        r = self.res[m.weights]
        r.arrivals.append(self.clock.now)
        req = _Req(t.at, t.model, m.task, m.service.seconds(t.words, t.max_tokens))
        slo, turn = self.slo, self.opt.load_turn
        waiting = r.turn.queue if r.turn is not None else ()
        due = min((q.at + slo[q.task] for q in waiting), default=math.inf)
        at_risk = min((q.at + turn * slo[q.task] for q in waiting), default=math.inf)
        if self.clock.now >= at_risk and self.clock.now + slo[m.task] >= due:
            # behind a load that waits for it, one of whose requests has waited load_turn of
            # its SLO, and that serves requests due no later, as `acquire`
            until = self.clock.now + turn * slo[m.task]
            r.parked.append((until, req))
            self._hold(until)
            return
        r.queue.append(req)
        self._take(r)

    def _take(self, r: _Res, admit: bool = True) -> None:
        """Queued requests on `r`: serve them if it is hot, queue its load if it is cold (and
        plan at once unless the caller is about to, or is planning now)."""
        if not r.queue:
            return
        if r.state is State.HOT:
            self._serve(r)
        elif r.state in (State.COLD, State.WARM):
            self._want(r, admit)
        # ADMITTING, LOADING: served once hot; UNLOADING: loaded again once it has left

    def _serve(self, r: _Res) -> None:
        """Start jobs on hot `r` while it has free slots and queued requests."""
        while r.state is State.HOT and r.jobs < r.w.slots and r.queue:
            first = r.queue.popleft()
            batch = [first]
            if first.task == "embed" and r.w.max_batch > 1:
                rest = [q for q in r.queue if q.task == "embed"][:r.w.max_batch - 1]
                batch += rest
                r.queue = deque(q for q in r.queue if not any(q is b for b in rest))
            longest = max(q.work_s for q in batch)
            work = longest + self.box.merge_marginal * (sum(q.work_s for q in batch) - longest)
            if r.fresh:
                work += r.w.warmup_s
                r.fresh = False
            r.jobs += 1
            r.running += len(batch)
            self._start(_Job(first.task, r, work, self.clock.now, batch))

    def _finish(self, job: _Job) -> None:
        self.jobs.remove(job)
        self.dirty = True
        r, now = job.res, self.clock.now
        if job.reqs:
            r.jobs -= 1
            r.running -= len(job.reqs)
            r.last_used = now
            self.out.served += [Served(q.at, q.model, q.task, now - q.at) for q in job.reqs]
            self._serve(r)
            self._changed()
            return
        if job.kind == STALL:
            self.mover = _Job("load", r, r.w.load_s, job.started, [])
            self._start(self.mover)
            return
        self.mover = None
        seconds = now - job.started
        if job.kind in ("load", "restore"):
            self.out.loads.append(LoadRecord(job.started, r.w.key, seconds, r.w.bytes,
                                             warm=job.kind == "restore"))
            r.move(State.HOT)
            r.loaded_at = r.last_used = now
            if job.kind == "load" or not self._in_place(r):
                r.load_s = seconds
            r.fresh = job.kind == "load"
            if job.kind == "restore":
                r.warm, r.restore_s = False, seconds
            self.lock.popleft()
            self._serve(r)
        else:  # unload, offload, or a warm copy dropped
            if job.kind == "offload" and self._in_place(r):
                r.move(State.WARM)
                r.kept = r.w.keeps_bytes or 0
            else:
                r.move(State.COLD)
            if r.queue:  # requests came while it left: load it again
                self._want(r)
        self._changed()

    # -------------------------------------------------------------------- residency

    def _want(self, r: _Res, admit: bool = True) -> None:
        r.move(State.ADMITTING)
        self.lock.append(r)
        if admit:
            self._admit()

    def _changed(self) -> None:
        """Memory may have changed (a request, a load or an unload ended; a hold expired): the
        loads waiting for busy models queue for the lock again, as `_wait_memory` wakes them."""
        for r in self.res.values():  # parked requests whose share of their SLO is spent
            due = [q for until, q in r.parked if until <= self.clock.now]
            if due:
                r.parked = [(u, q) for u, q in r.parked if u > self.clock.now]
                r.queue.extend(due)
                self._take(r, admit=False)
        self.lock.extend(self.waiting)
        self.waiting.clear()
        self._admit()

    def _admit(self) -> None:
        """The lock's holder plans and acts, as `_admit_under_lock` does, until it loads,
        unloads, or must wait for busy models: then it lets the lock go to the next load."""
        while self.lock and self.mover is None:
            target = self.lock[0]
            views, hold_until = self._views(target)
            plan = plan_admission(self._view(target, 0), views, self.box.capacity_bytes,
                                  self.policy, turns=self.opt.load_turn > 0)
            if plan.verdict is Verdict.NEVER_FITS:
                self.lock.popleft()
                self._end_turns(target)
                # its requests stay queued: never served; a warm copy on the device stays
                target.move(State.WARM if target.warm and self._in_place(target)
                            else State.COLD)
                continue
            if plan.verdict is Verdict.WAIT_FOR_BUSY:
                self._end_turns(target, keep=plan.draining)
                if self.opt.wait_holds_lock:
                    self._hold(hold_until)
                    return
                self.waiting.append(self.lock.popleft())
                self._hold(hold_until)
                continue
            if plan.victims:
                if self._evict(self.res[plan.victims[0]], cold=plan.to_cold):
                    return
                continue  # a waiting load's warm copy let go at once: plan again
            target.move(State.LOADING)
            self._end_turns(target)
            held = sum(self._view(r, 0).held for r in self.res.values())
            self.out.peak_bytes = max(self.out.peak_bytes, held)
            restore = self.opt.warm_tier and target.warm and target.w.restore_s is not None
            seconds = target.w.restore_s if restore and target.w.restore_s else target.w.load_s
            kind = "restore" if restore else "load"
            if kind == "load" and target.w.stall_s > 0:
                kind, seconds = STALL, target.w.stall_s  # then the load itself, in _finish
            self.mover = _Job(kind, target, seconds, self.clock.now, [])
            self._start(self.mover)
            return

    def _end_turns(self, target: _Res, keep: Sequence[str] = ()) -> None:
        """`target`'s load holds the requests of `keep` from now on and lets the others go."""
        for r in self.res.values():
            if r.w.key in keep and r.turn is None:
                r.turn = target
            elif r.turn is target and r.w.key not in keep:
                r.turn = None
                r.queue.extend(q for _, q in r.parked)
                r.parked = []
                self._take(r, admit=False)

    def _hold(self, until: float) -> None:
        """Plan again when a hold ends (inf: none)."""
        if until < math.inf and until not in self.timers:
            heapq.heappush(self.timers, until)

    def _evict(self, v: _Res, cold: bool = False) -> bool:
        """Start `v`'s eviction (to cold with `cold`, as the policy said); False when there
        was nothing to run: a waiting load's warm copy, let go at once (its load becomes a
        whole one), as the scheduler's `_evict` does."""
        self.out.evictions += 1
        if v.state is State.ADMITTING:
            v.warm = False
            return False
        kind, seconds = "unload", v.w.unload_s
        if v.state is State.WARM:
            kind, seconds = "drop", v.w.drop_s
            v.warm = False
        elif (not cold if self._in_place(v) else self.opt.warm_tier
              and v.w.restore_s is not None and self._make_warm_room(v)):
            kind, seconds = "offload", v.w.offload_s
            v.warm, v.warm_since = True, self.clock.now
            self.out.offloads += 1
        v.move(State.UNLOADING)
        self.mover = _Job(kind, v, seconds, self.clock.now, [])
        self._start(self.mover)
        return True

    def _in_place(self, r: _Res) -> bool:
        """Whether `r`'s warm copy stays on the device (`Weights.keeps_bytes`)."""
        return self.opt.warm_tier and r.w.keeps_bytes is not None and r.w.restore_s is not None

    def _make_warm_room(self, v: _Res) -> bool:
        """Room in host RAM for `v`'s copy: the least recently kept copies leave for it."""
        need = v.w.host_bytes
        if v.warm or need > self.box.host_bytes:
            return v.warm
        held = sorted((r for r in self.res.values() if r.warm and not self._in_place(r)),
                      key=lambda r: r.warm_since)
        used = sum(r.w.host_bytes for r in held)
        for r in held:
            if used + need <= self.box.host_bytes:
                break
            r.warm = False
            used -= r.w.host_bytes
        return used + need <= self.box.host_bytes

    def _views(self, target: _Res) -> tuple[list[ResidentView], float]:
        """The others as the policy sees them, with the simulator's holds counted as busy; and
        when the first hold ends (inf: none)."""
        now = self.clock.now
        # The grace lasts until the resident has been idle for grace_s, or the target's oldest
        # request has waited that long, whichever comes first.
        since = target.queue[0].at if target.queue else -math.inf
        views: list[ResidentView] = []
        first_end = math.inf
        for r in self.res.values():
            if r is target:
                continue
            held = 0
            if r.state is State.HOT and r.in_flight == 0:
                ends = [end for end in (
                    r.loaded_at + self.opt.min_residency_s if self.opt.min_residency_s else 0.0,
                    min(r.last_used, since) + self.opt.grace_s if self.opt.grace_s else 0.0)
                    if end > now]
                if ends:
                    held = 1
                    first_end = min(first_end, max(ends))
            views.append(self._view(r, held))
        return views, first_end

    def _view(self, r: _Res, held: int) -> ResidentView:
        now = self.clock.now
        in_place = self._in_place(r)
        return ResidentView(
            key=r.w.key, device=self.box.name, state=r.state, bytes=r.w.bytes,
            in_flight=r.in_flight + held, last_used=r.last_used, models=r.models,
            reload_s=r.load_s, rate_per_s=arrival_rate(r.arrivals, now),
            goes_warm=in_place, keeps_bytes=r.kept, restore_s=r.restore_s,
            warm_bytes=(r.w.keeps_bytes or 0) if in_place and r.warm else 0)


