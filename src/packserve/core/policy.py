"""Pure scheduling policy: plain data in, plain data out. No asyncio, no devices, no clock.

The scheduler takes a snapshot of its residents, asks these functions what to do, and applies
the answer. Tests call them with hand-written tables (tests/core/test_policy.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from packserve.types import State
from packserve.units import format_bytes


@dataclass(frozen=True)
class ResidentView:
    """One set of loaded weights as the policy sees it."""

    key: str
    device: str
    state: State
    bytes: int  # hot: measured if known, else estimated
    pinned: bool = False
    in_flight: int = 0  # requests holding or waiting on a lease
    last_used: float = 0.0  # scheduler clock; larger is more recent
    models: tuple[str, ...] = ()  # catalog names served by these weights
    reload_s: float = 0.0  # seconds its last load took here (0: never loaded here)
    rate_per_s: float = 0.0  # recent requests per second, falling while it stays idle
    # The warm tier: an eviction of a hot one that `goes_warm` keeps its engine objects
    # (`keeps_bytes`, as last measured; 0 before its first time) and a later load restores it
    # in `restore_s`; a warm one (or one loading from warm) holds `warm_bytes`.
    goes_warm: bool = False
    keeps_bytes: int = 0
    restore_s: float = 0.0
    warm_bytes: int = 0

    @property
    def holds_memory(self) -> bool:
        """Its bytes count as used: reserved for a load, serving, or not yet let go by an unload;
        or a warm copy's. A load still waiting for admission (ADMITTING) holds nothing more."""
        return self.held > 0

    @property
    def held(self) -> int:
        """The bytes it holds now."""
        if self.state in (State.LOADING, State.HOT, State.UNLOADING):
            return self.bytes
        return self.warm_bytes

    @property
    def evictable(self) -> bool:
        """Idle, unpinned, and hot (to warm, or to cold) or warm (to cold); or a warm copy whose
        own load waits for memory (its copy goes cold, its load becomes a whole one: were it
        kept, two warm models asked at once could each wait for the other's copy). A warm copy
        counted at 0 bytes never is: dropping it frees nothing and would only make its next
        load a whole one."""
        if self.pinned:
            return False
        if self.state in (State.ADMITTING, State.WARM):
            return self.warm_bytes > 0 and (self.state is State.ADMITTING or self.in_flight == 0)
        return self.state is State.HOT and self.in_flight == 0

    @property
    def frees(self) -> int:
        """The bytes its eviction gives back: all but what a warm copy keeps."""
        if self.state in (State.WARM, State.ADMITTING):
            return self.warm_bytes
        return self.bytes - (self.keeps_bytes if self.goes_warm else 0)

    @property
    def evicted_to(self) -> str:
        return "warm" if self.state is State.HOT and self.goes_warm else "cold"

    @property
    def comeback_s(self) -> float:
        """Seconds its eviction adds to its next load: a restore, a whole load, or (from warm to
        cold) the difference. Unknown restore times count as whole loads."""
        restore = self.restore_s or self.reload_s
        if self.state in (State.WARM, State.ADMITTING):
            return max(self.reload_s - restore, 0.0)
        return restore if self.goes_warm else self.reload_s


class Verdict(StrEnum):
    ALREADY_LOADED = "already_loaded"
    FITS = "fits"  # fits in free memory now
    FITS_AFTER_EVICTION = "fits_after_eviction"
    WAIT_FOR_BUSY = "wait_for_busy"  # fits once busy models finish their requests
    NEVER_FITS = "never_fits"  # larger than capacity minus what is pinned


@dataclass(frozen=True)
class Admission:
    """The answer to "what would you evict to load X on its device, and why"."""

    target: str
    device: str
    verdict: Verdict
    need_bytes: int
    capacity_bytes: int  # budget minus headroom
    used_bytes: int
    pinned_bytes: int
    busy_bytes: int
    victims: tuple[str, ...]
    reason: str
    # The victims go to cold even where they could stay warm: warm copies would not leave room.
    to_cold: bool = False
    # WAIT_FOR_BUSY: the busy models it waits for, those the policy would evict were they idle.
    # The scheduler holds requests that arrive for them afterwards, so that they drain.
    draining: tuple[str, ...] = ()


VictimOrder = Callable[[ResidentView], tuple[float, ...]]


def lru_order(r: ResidentView) -> tuple[float, ...]:
    """packserve's rule: least recently used first; among equals, the larger frees more."""
    return (r.last_used, -r.bytes)


def choose_victims(
    residents: Sequence[ResidentView], need_bytes: int, free_bytes: int,
    order: VictimOrder = lru_order,
) -> tuple[str, ...] | None:
    """Idle, unpinned, hot or warm residents in `order` until `need_bytes` fit; None if they
    cannot."""
    if need_bytes <= free_bytes:
        return ()
    victims: list[str] = []
    freed = free_bytes
    for r in sorted((r for r in residents if r.evictable), key=order):
        victims.append(r.key)
        freed += r.frees
        if freed >= need_bytes:
            return tuple(victims)
    return None


# ------------------------------------------------------------------ victim policies
#
# A VictimPolicy answers "which residents leave so that `need_bytes` fit, given `free_bytes`"
# over the other residents of one device: a tuple of keys in eviction order, () when nothing
# has to leave, None when it cannot fit until busy models finish. Every policy keeps the two
# safety rules of the scheduler contract: it never names a resident that is pinned, busy or
# neither hot nor warm (`ResidentView.evictable`), and it never answers with victims that leave
# too few bytes (counting what each frees: a hot one going warm keeps its copy's bytes),
# so the process cannot overcommit its budget whatever the policy. They differ only in whom
# they choose. A device's config picks one (`make_policy`); the benchmarks' baselines (other
# engines' rules, benchmarks/baselines.py) are more, replayed through the same scheduler.

VictimPolicy = Callable[[Sequence[ResidentView], int, int], tuple[str, ...] | None]


def lru_by_bytes(
    residents: Sequence[ResidentView], need_bytes: int, free_bytes: int,
) -> tuple[str, ...] | None:
    """packserve's rule: evict only when bytes do not fit, least recently used first."""
    return choose_victims(residents, need_bytes, free_bytes, lru_order)


DEFAULT_HORIZON_S = 60.0
RATE_WINDOW = 8  # arrivals the rate estimate keeps per resident
MIN_RATE_SPAN_S = 1.0  # a burst of arrivals in one instant is not an infinite rate


def arrival_rate(arrivals: Sequence[float], now: float) -> float:
    """Requests per second from the last arrivals (oldest first) as seen at `now`.

    `k` arrivals over the span from the oldest to now: it falls while the model stays idle, so a
    model that was busy an hour ago and silent since looks rarely used."""
    if not arrivals:
        return 0.0
    return len(arrivals) / max(now - arrivals[0], MIN_RATE_SPAN_S)



class CostAware:
    """packserve's default rule: keep what would cost most to bring back, per byte it holds.

    For each idle candidate, the expected cost of evicting it is the seconds a reload takes
    (`reload_s`, measured at its last load) times the chance it is needed again within
    `horizon_s` (requests arriving as a Poisson process at `rate_per_s`, the scheduler's estimate
    from its recent inter-arrival times, which falls while the model stays idle):
    `reload_s * (1 - exp(-rate * horizon))`. Victims go cheapest per byte first until the bytes
    fit; then any victim that is no longer needed for the bytes to fit is kept (a small cheap one
    chosen before a large one). The size-aware cost-per-byte order is GreedyDual-Size-Frequency's
    idea from web caching, with the frequency replaced by a probability of reuse soon. Among
    equal costs (nothing measured yet), least recently used goes first, as in `lru_by_bytes`.
    """

    name = "cost"

    def __init__(self, horizon_s: float = DEFAULT_HORIZON_S) -> None:
        if horizon_s <= 0:
            raise ValueError("horizon_s must be positive")
        self.horizon_s = horizon_s

    def reuse_chance(self, r: ResidentView) -> float:
        return 1.0 - math.exp(-max(r.rate_per_s, 0.0) * self.horizon_s)

    def expected_cost_s(self, r: ResidentView) -> float:
        """Expected seconds its eviction adds to its next load, within the horizon."""
        return r.comeback_s * self.reuse_chance(r)

    def order(self, r: ResidentView) -> tuple[float, ...]:
        return (self.expected_cost_s(r) / max(r.frees, 1), r.last_used, -r.frees)

    def __call__(self, residents: Sequence[ResidentView], need_bytes: int,
                 free_bytes: int) -> tuple[str, ...] | None:
        victims = choose_victims(residents, need_bytes, free_bytes, self.order)
        if not victims:
            return victims
        by_key = {r.key: r for r in residents}
        kept = list(victims)
        # The most expensive first: keep it if the others still make room.
        for key in sorted(victims, key=lambda k: self.order(by_key[k]), reverse=True):
            rest = [k for k in kept if k != key]
            if free_bytes + sum(by_key[k].frees for k in rest) >= need_bytes:
                kept = rest
        return tuple(kept)

    def explain(self, r: ResidentView) -> str:
        if r.rate_per_s <= 0:
            soon = "no use seen since it loaded"
        else:
            soon = f"next use expected in {_seconds(1.0 / r.rate_per_s)}"
        if r.state in (State.WARM, State.ADMITTING):
            back = "reload beyond a restore"
        else:
            back = "restore" if r.goes_warm else "reload"
        return (f"{back} {r.comeback_s:.1f} s, {soon}, expected cost "
                f"{self.expected_cost_s(r):.2f} s")


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 600 else f"{s / 60:.0f} min"


def explain_victim(policy: VictimPolicy, r: ResidentView) -> str:
    """Why `policy` chose `r`, in words for the dry-run plan and the eviction log."""
    explain = getattr(policy, "explain", None)
    if explain is not None:
        return str(explain(r))
    if policy is lru_by_bytes:
        return "least recently used"
    return "chosen by the victim policy"


def policy_name(policy: VictimPolicy) -> str:
    """A short label for metrics: `cost`, `lru`, or `other` (the bench's baselines)."""
    if policy is lru_by_bytes:
        return "lru"
    return str(getattr(policy, "name", "other"))


def make_policy(name: str, horizon_s: float = DEFAULT_HORIZON_S) -> VictimPolicy:
    """The victim policy a device's config names: `cost` (default) or `lru`."""
    if name == "lru":
        return lru_by_bytes
    if name == "cost":
        return CostAware(horizon_s)
    raise ValueError(f"unknown eviction policy {name!r}; use 'cost' or 'lru'")


def plan_admission(
    target: ResidentView, residents: Sequence[ResidentView], capacity_bytes: int,
    policy: VictimPolicy = lru_by_bytes, *, turns: bool = True,
) -> Admission:
    """Decide how `target` gets onto its device. `residents` are the others on that device.
    With `turns` (the scheduler's `load_turn` > 0), a load that must wait for busy models
    names those it drains."""
    others = [r for r in residents if r.key != target.key and r.device == target.device]
    # A warm target already holds part of what it needs: its engine objects.
    used = sum(r.held for r in others) + (target.held if target.state is not State.HOT else 0)
    pinned = sum(r.held for r in others if r.pinned)
    busy = sum(r.held for r in others if not r.pinned and not r.evictable)
    pinned_names = ", ".join(f"{_label(r)} ({format_bytes(r.bytes)})"
                             for r in others if r.pinned) or "none"

    to_cold = False
    needs = f"{_label(target)} needs {format_bytes(target.bytes)}"
    if target.state is not State.HOT and target.held:
        needs += f" (its warm copy holds {format_bytes(target.held)} of it)"

    def answer(verdict: Verdict, victims: tuple[str, ...], reason: str,
               draining: tuple[str, ...] = ()) -> Admission:
        return Admission(
            target=target.key, device=target.device, verdict=verdict,
            need_bytes=target.bytes, capacity_bytes=capacity_bytes, used_bytes=used,
            pinned_bytes=pinned, busy_bytes=busy, victims=victims, reason=reason,
            to_cold=to_cold, draining=draining,
        )

    if target.state is State.HOT:
        return answer(Verdict.ALREADY_LOADED, (), f"{_label(target)} is already loaded")
    if target.bytes > capacity_bytes - pinned:
        return answer(Verdict.NEVER_FITS, (), (
            f"{needs} but {target.device} has a "
            f"budget of {format_bytes(capacity_bytes)} after headroom, of which pinned models "
            f"hold {format_bytes(pinned)} (pinned: {pinned_names})"
        ))
    free = capacity_bytes - used
    victims = policy(others, target.bytes - target.held, free)
    if victims is None and any(r.goes_warm for r in others if r.evictable):
        # Warm copies of the victims would leave too little: they go to cold instead.
        others = [replace(r, goes_warm=False) for r in others]
        victims = policy(others, target.bytes - target.held, free)
        to_cold = victims is not None
    if victims is None:
        draining = _draining(others, target.bytes - target.held, free, policy) if turns else ()
        by_key = {r.key: r for r in others}
        drained = ""
        if draining:
            drained = (f"; once its own requests are at risk of missing their SLO, new requests "
                       f"for {', '.join(_label(by_key[k]) for k in draining)} wait behind it")
        return answer(Verdict.WAIT_FOR_BUSY, (), (
            f"{needs}; {format_bytes(free)} is free "
            f"and models with requests in flight hold {format_bytes(busy)}; it loads when they "
            f"finish{drained}"
        ), draining)
    if not victims:
        return answer(Verdict.FITS, (), (
            f"{needs} and {format_bytes(free)} is free"
        ))
    by_key = {r.key: r for r in others}
    named = ", ".join(
        f"{_label(by_key[k])} ({format_bytes(by_key[k].frees)} to {by_key[k].evicted_to}, "
        f"idle, {explain_victim(policy, by_key[k])})"
        for k in victims
    )
    return answer(Verdict.FITS_AFTER_EVICTION, victims, (
        f"{needs} and {format_bytes(free)} is free; "
        f"evicting {named} makes room"
    ))


def _draining(others: Sequence[ResidentView], need_bytes: int, free_bytes: int,
              policy: VictimPolicy) -> tuple[str, ...]:
    """The busy residents that `policy` would evict, with the others it names, were every
    busy hot one idle: the ones a waiting load waits for. () if that would not make room
    either (the load then waits for something else: a load or an unload to finish)."""
    busy = {r.key for r in others
            if r.state is State.HOT and not r.pinned and r.in_flight > 0}
    if not busy:
        return ()
    idle = [replace(r, in_flight=0) if r.key in busy else r for r in others]
    victims = policy(idle, need_bytes, free_bytes)
    if victims is None:
        idle = [replace(r, goes_warm=False) for r in idle]
        victims = policy(idle, need_bytes, free_bytes)
    return tuple(k for k in victims or () if k in busy)


def pins_fit(pinned: Sequence[ResidentView], capacity_bytes: int) -> str | None:
    """None if the pinned residents of one device fit together, else the reason they do not."""
    total = sum(r.bytes for r in pinned)
    if total <= capacity_bytes:
        return None
    listing = ", ".join(f"{_label(r)} {format_bytes(r.bytes)}" for r in pinned)
    device = pinned[0].device if pinned else "?"
    return (
        f"pinned models on {device} need {format_bytes(total)} together but the budget after "
        f"headroom is {format_bytes(capacity_bytes)}: {listing}"
    )


@dataclass(frozen=True)
class QuotaDecision:
    """Run now, wait in the queue, or refuse with a Retry-After in seconds."""

    run: bool
    queue: bool
    retry_after_s: int = 0


def admit_request(
    in_flight: int, queued: int, max_concurrency: int, max_queue: int, mean_service_s: float,
) -> QuotaDecision:
    """Per-model quota. Retry-After is the time the queue ahead needs at the observed rate."""
    if in_flight < max_concurrency and queued == 0:
        return QuotaDecision(run=True, queue=False)
    if queued < max_queue:
        return QuotaDecision(run=False, queue=True)
    waves = (queued + 1) / max_concurrency
    return QuotaDecision(run=False, queue=False,
                         retry_after_s=max(1, math.ceil(waves * max(mean_service_s, 0.0))))


def _label(r: ResidentView) -> str:
    return "+".join(r.models) if r.models else r.key


