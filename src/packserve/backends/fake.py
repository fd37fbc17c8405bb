"""A fake engine with a declared footprint, for scheduler-policy and HTTP-shape tests only.

In a config: `backend = "fake"`, `source = "fake:64MiB"` declares 64 MiB, and
`source = "fake:64MiB?load_s=1.5"` also declares that a load takes 1.5 s (the load thread
sleeps); `warm=4MiB` gives it a warm state that keeps 4 MiB (`release_weights`). Two
entries with the same source share one load, as two with the same weights would.
It embeds by hashing, reranks by word overlap and echoes prompts. Tests steer it through a
shared `FakeControl`, or, across processes, with directives in the text it is given (fault
injection, never in a real engine; in an embedding input, a rerank query or a prompt):
`@@sleep=S` takes S seconds (a stream yields a word every 0.1 s meanwhile) and `@@signal=NAME`
sends itself that signal (`SEGV`, `ILL`, `ABRT`, `KILL`), as a native crash would.
A `FakeControl(directives=False)` ignores them, so that text from a fuzzer can never stop the
process that runs it (tests/api/test_fuzz.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from packserve.core.backend import (
    Backend,
    Embeddings,
    Generated,
    GenerationParams,
    LoadSpec,
    Message,
    OnText,
    Ranking,
)
from packserve.core.engine import Engine
from packserve.modelfiles import ModelFacts
from packserve.planner.sizing import Breakdown
from packserve.types import Task
from packserve.units import parse_bytes


def _out_of_memory(name: str) -> Exception:
    return MemoryError(f"fake out of memory loading {name}")


@dataclass
class FakeControl:
    """Shared knobs: block loads and restores (and unloads) until released, fail the next N
    loads or restores with `failure(name)` (out of memory unless a test says otherwise), count
    loads, unloads, releases to warm and restores, record who computed at which deadline and SLO
    (`turns`: what `working` was given), obey the `@@` directives in texts or not
    (`directives`)."""

    gate: threading.Event = field(default_factory=threading.Event)
    unload_gate: threading.Event = field(default_factory=threading.Event)
    fail_next: int = 0
    failure: Callable[[str], Exception] = _out_of_memory
    loads: dict[str, int] = field(default_factory=dict)
    unloads: dict[str, int] = field(default_factory=dict)
    releases: dict[str, int] = field(default_factory=dict)  # to warm
    restores: dict[str, int] = field(default_factory=dict)  # from warm
    turns: list[tuple[str, float, float]] = field(default_factory=list)  # name, deadline, SLO
    lock: threading.Lock = field(default_factory=threading.Lock)
    directives: bool = True

    def __post_init__(self) -> None:
        self.gate.set()
        self.unload_gate.set()


DEFAULT_CONTROL = FakeControl()


def declared_bytes(spec: LoadSpec) -> int:
    """The size a fake source declares: `fake:SIZE` or `fake:SIZE?load_s=S`."""
    return parse_bytes(_declared(spec)[0])


def declared_load_s(spec: LoadSpec) -> float:
    """The seconds a load of a fake source takes: its `load_s` (0 when not given)."""
    return float(_declared(spec)[1].get("load_s", 0.0))


def declared_warm_bytes(spec: LoadSpec) -> int | None:
    """What a fake source keeps while warm (`warm=SIZE`); None: it has no warm state."""
    warm = _declared(spec)[1].get("warm")
    return parse_bytes(warm) if warm is not None else None


def _declared(spec: LoadSpec) -> tuple[str, dict[str, str]]:
    size, _, query = spec.path.name.removeprefix("fake:").partition("?")
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - {"load_s", "warm"})
    if unknown:
        raise ValueError(f"fake source {spec.path.name!r}: unknown option(s) "
                         f"{', '.join(unknown)} (only load_s, warm)")
    return size, options


_LIVE: weakref.WeakSet[FakeBackend] = weakref.WeakSet()


def held_bytes(device: str) -> int:
    """What the fake backends alive on `device` hold now: a test probe's reading."""
    return sum(b.weight_bytes() for b in list(_LIVE) if b.spec.device == device)


class FakeBackend(Backend):
    control: FakeControl = DEFAULT_CONTROL
    _loaded: bool = False
    _warm: bool = False

    def __post_init__(self) -> None:
        self.name = self.spec.path.name
        _LIVE.add(self)

    def load(self) -> None:
        self.control.gate.wait(timeout=30)
        time.sleep(declared_load_s(self.spec))  # in the scheduler's load thread
        self._count(self.control.loads, fallible=True)
        self._loaded = True

    def _count(self, counts: dict[str, int], *, fallible: bool = False) -> None:
        """One more in `counts`; with `fallible`, fail as the control says."""
        with self.control.lock:
            counts[self.name] = counts.get(self.name, 0) + 1
            if fallible and self.control.fail_next > 0:
                self.control.fail_next -= 1
                raise self.control.failure(self.name)

    def unload(self) -> None:
        self.control.unload_gate.wait(timeout=30)
        if self._loaded:
            self._count(self.control.unloads)
        self._loaded = self._warm = False

    def release_weights(self) -> bool:
        if declared_warm_bytes(self.spec) is None or not self._loaded:
            return False
        self._count(self.control.releases)
        self._warm = True
        return True

    def restore_weights(self) -> None:
        self.control.gate.wait(timeout=30)
        self._count(self.control.restores, fallible=True)
        self._warm = False

    def working(self, deadline: float, slo_s: float) -> contextlib.AbstractContextManager[None]:
        with self.control.lock:
            self.control.turns.append((self.name, deadline, slo_s))
        return contextlib.nullcontext()

    def weight_bytes(self) -> int:
        if not self._loaded:
            return 0
        if self._warm:
            return declared_warm_bytes(self.spec) or 0
        return declared_bytes(self.spec)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(t.split()) for t in texts]

    def embed(self, texts: Sequence[str]) -> Embeddings:
        import numpy as np

        if self.control.directives:
            for t in texts:
                _directives(t, None)
        rows = [np.frombuffer(hashlib.sha256(t.encode()).digest(), dtype=np.uint8)[:8]
                for t in texts]
        return Embeddings(vectors=np.asarray(rows, dtype=np.float32) / 255.0,
                          tokens=[len(t.split()) for t in texts])

    def rerank(self, query: str, documents: Sequence[str]) -> Ranking:
        if self.control.directives:
            _directives(query, None)
        q = set(query.lower().split())
        return Ranking(scores=[len(q & set(d.lower().split())) / (len(q) or 1) for d in documents],
                       tokens=len(query.split()) + sum(len(d.split()) for d in documents))

    def chat(self, messages: Sequence[Message], params: GenerationParams,
             on_text: OnText | None = None) -> Generated:
        return self.complete(messages[-1].content if messages else "", params, on_text)

    def complete(self, prompt: str | Sequence[int], params: GenerationParams,
                 on_text: OnText | None = None) -> Generated:
        assert isinstance(prompt, str), "this engine does not declare token_ids"
        if self.control.directives:
            _directives(prompt, on_text)
        words = prompt.split()[: params.max_tokens or None]
        for w in words:
            if on_text is not None and not on_text(w + " ", ()):
                break
        return Generated(text=" ".join(words), finish_reason="stop",
                         prompt_tokens=len(prompt.split()), completion_tokens=len(words))


def _size(facts: ModelFacts | None, load: LoadSpec, name: str, sequences: int) -> Breakdown:
    return Breakdown(name=name, weights=declared_bytes(load),
                     assumptions=(f"{name}: the fake engine's declared size",))


ENGINE = Engine(name="fake", tasks=frozenset(Task), default_concurrency=4, build=FakeBackend,
                size=_size, reads_files=False)
ENGINES = (ENGINE,)


_DIRECTIVE = re.compile(r"@@(sleep|signal)=([A-Za-z0-9.]+)")


def _directives(text: str, on_text: OnText | None) -> None:
    for kind, arg in _DIRECTIVE.findall(text):
        if kind == "signal":
            os.kill(os.getpid(), signal.Signals[f"SIG{arg.upper()}"])
            time.sleep(5)  # the signal is delivered to this thread's process; never returns
        else:
            end = time.monotonic() + float(arg)
            while time.monotonic() < end:
                time.sleep(min(0.1, max(0.0, end - time.monotonic())))
                if on_text is not None and not on_text(".", ()):
                    return
