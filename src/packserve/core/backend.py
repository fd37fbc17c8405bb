"""The contract between the scheduler and the engines (sentence-transformers, llama.cpp, fake).

Who calls what, and when:
- The scheduler's factory builds a backend from a `LoadSpec`, then calls `load()` once, in a
  worker thread, while the scheduler holds its device lock. `unload()` is called once, in a worker
  thread, only when no lease is out. Between them, an eviction to the warm tier may call
  `release_weights()` and a later load `restore_weights()`, any number of times, under the same
  rules. Nothing else touches the lifecycle.
- Request handlers never see a backend. A `Lease` lends them its `Runner`, which has the task
  methods and nothing of the lifecycle; they call it in a worker thread (never on the event
  loop) and may assume `load()` has returned and `unload()` has not started. A chat or a
  completion reaches it as one `GenerationRequest` (core.request), which `Runner.generate`
  hands to the backend's `chat` or `complete` and `Runner.wire` to its `wire`.
- An engine that runs in a process of its own (a runner) reports that process's death: after
  each load or restore the scheduler calls `watch()`, and the backend calls the report it was
  given once, from any thread, if the process ends while the scheduler holds it (not when the
  backend stops it). The scheduler then takes the model out of service at once and loads it
  again through its one load path (core.crashes says when). A request that found the engine
  gone asks `exited()` before it is sent again.
- A backend that serves several tasks or several catalog names (shared weights) must tolerate
  concurrent task calls; llama.cpp's and sentence-transformers' backends serialise them
  with their own lock (one context; one tokenizer with shared padding state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from packserve.errors import InvalidRequest, TaskNotSupported
from packserve.types import Task

if TYPE_CHECKING:  # numpy is imported by the engines that make vectors, not by the config
    import numpy as np
    import numpy.typing as npt

    from packserve.core.request import GenerationRequest  # which is made of this module's types


@dataclass(frozen=True)
class LoadSpec:
    """Everything a backend needs to load one set of weights.

    `key` is packserve's one definition of "one load": the engine, the weights, the device and
    the settings that change what is loaded. Catalog names whose specs have equal keys share
    one load (the scheduler, the planner and the audit all count it once). `max_batch` is a
    per-entry limit, not part of the key: a shared load runs with the first entry's; so is
    `threads`."""

    backend: str
    path: Path
    device: str  # "cpu" or "cuda:N", never "auto"
    context_length: int
    max_batch: int = 64
    threads: int = 0  # compute threads for engines that take a count (llama.cpp); 0: all cores
    trust_remote_code: bool = False
    allow_pickle: bool = False
    # Sequences decoded together in one batch (llama.cpp's parallel slots), and whether they
    # share one KV cache of `context_length` tokens or each has its own; part of the key.
    parallel: int = 1
    cache_per_slot: bool = False
    # The weights file mapped into the engine's memory (its pages in the page cache, which a
    # warm copy gives back), or read into memory of the engine's own (`Engine.maps_weights`).
    # The file decides, so two entries of one file agree; part of the key all the same, so
    # that a footprint remembered from a mapped load is never taken for a read one.
    mapped: bool = True

    @property
    def key(self) -> str:
        flags = "".join(f"|{name}" for name, on in (("trust_remote_code", self.trust_remote_code),
                                                    ("allow_pickle", self.allow_pickle)) if on)
        slots = f"|par={self.parallel}" if self.parallel > 1 else ""
        slots += "|kv=per_slot" if self.parallel > 1 and self.cache_per_slot else ""
        slots += "" if self.mapped else "|read"
        return f"{self.backend}|{self.path}|{self.device}|ctx={self.context_length}{slots}{flags}"


@dataclass(frozen=True)
class Embeddings:
    vectors: npt.NDArray[np.float32]  # shape (n_inputs, dim)
    tokens: list[int]  # per input


@dataclass(frozen=True)
class Ranking:
    scores: list[float]  # one per document, in input order
    tokens: int


@dataclass(frozen=True)
class ToolCall:
    """A call of a function tool: by the model (in `Generated`) or, earlier in a conversation,
    by the assistant (in its `Message`). `arguments` is JSON text, as OpenAI carries it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Message:
    role: str  # system, user, assistant, or tool (a tool's result, for `tool_call_id`)
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str | None = None  # a tool result's call


# The generation fields beyond OpenAI's own that the common servers (vLLM, llama.cpp's, SGLang)
# take, by their request names; an engine honours those it declares (`Engine.sampling`), and a
# request that sets another is refused by name.
EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
              "logit_bias", "ignore_eos", "min_tokens")


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int | None = None
    temperature: float = 0.7
    top_p: float = 0.95
    stop: tuple[str, ...] = ()
    seed: int | None = None
    json_schema: dict[str, object] | None = None  # constrain output to this schema
    json_object: bool = False  # constrain output to any JSON object
    # Log-probabilities of each generated token and of this many alternatives (OpenAI's
    # top_logprobs); None: none are computed.
    logprobs: int | None = None
    # Chat: tools for the model's own chat template to show it; only given to a backend whose
    # `renders_tools()` is True. What the output may be is `json_schema`'s business.
    tools: tuple[Tool, ...] = ()
    # Beyond OpenAI's (an engine gets only those its `Engine.sampling` declares): None or the
    # neutral value keeps the engine's default.
    top_k: int | None = None  # 0: every token
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    ignore_eos: bool = False  # generate past end-of-generation tokens, to max_tokens
    min_tokens: int = 0  # no end-of-generation token before this many


FinishReason = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True)
class Alternative:
    """A token the model could have produced at a step, and its log-probability."""

    token: str
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One token of a text, the log-probability the model gave it (None for a prompt's first
    token, which nothing precedes), and the most likely tokens at its step."""

    token: str
    bytes: bytes
    logprob: float | None
    top: tuple[Alternative, ...] = ()


@dataclass(frozen=True)
class Generated:
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None  # per generated token, when asked
    tool_calls: tuple[ToolCall, ...] = ()  # the answer is these calls (then `text` is "")


@dataclass(frozen=True)
class Wire:
    """A generation an engine serves in OpenAI's own shape over HTTP on a unix socket (a
    llama-server runner): the route sends `body` to `path` and relays the answer's bytes, with
    the catalog's name for `served_as`, instead of building the answer from a `Generated`."""

    socket: str
    path: str
    body: bytes
    served_as: str  # the model name the engine writes into its answers
    # The start of the engine's answer ids and OpenAI's for this route, where they differ.
    id_prefix: tuple[str, str] | None = None
    usage_per_chunk: bool = False  # its events carry the counts so far (llama.cpp's timings)


@dataclass(frozen=True)
class EngineExit:
    """An engine process that ended on its own: how, and what its log said last."""

    pid: int
    status: int | None  # its exit status; None when a signal ended it
    signal: str | None  # the signal's name ("SIGKILL"), when one did
    # The kernel's OOM killer did it, by the evidence an unprivileged process can read (its
    # cgroup's `memory.events` oom_kill count rose while it ran); None: no cgroup to read.
    oom_kill: bool | None
    log_tail: str  # the last lines of its log
    log: str  # where its log is kept
    hung: bool = False  # killed by its backend for not serving within its start deadline

    @property
    def cause(self) -> str:
        """"SIGKILL (OOM kill)", "SIGSEGV", "exit status 1", "hung": the label metrics and
        logs use."""
        if self.hung:
            return "hung"
        what = self.signal if self.signal is not None else f"exit status {self.status}"
        return f"{what} (OOM kill)" if self.oom_kill else what


ExitReport = Callable[[EngineExit], None]


class EngineDied(RuntimeError):
    """Raised by `load()` or `restore_weights()` of an engine in a process of its own when that
    process ended before it served, or was killed for not serving within its start deadline
    (`exit.hung`). The scheduler counts it as a death of the model (core.crashes) besides a failed
    load. `doing`: what the process was doing when it died, where the raiser knows better than
    its caller ("warm": found dead before a restore began, its reaper's report still on its
    way); None: what the caller was asking of it."""

    def __init__(self, message: str, exit: EngineExit, doing: str | None = None) -> None:
        super().__init__(message)
        self.exit = exit
        self.doing = doing

# Called with each new piece of text and the logprobs of the tokens that made it (empty unless
# asked); returning False asks the backend to stop early.
OnText = Callable[[str, Sequence[TokenLogprob]], bool]


@dataclass(eq=False)  # compared and hashed by identity: one object per load
class Backend:
    """Base class for engines. Task methods a backend lacks raise TaskNotSupported (400)."""

    spec: LoadSpec
    name: str = field(default="backend", init=False)
    # The memory is another process's (a runner's): `weight_bytes()` is all of it, then and
    # after a `release_weights()`; the serving process's own growth or fall says nothing.
    out_of_process: ClassVar[bool] = False

    def __post_init__(self) -> None:
        """Subclasses set up per-instance state here (locks, names); no I/O."""

    def prepare(self) -> None:
        """Import the engine's library. Called once per load, in a worker thread, just before
        `load()` and before the load's memory is measured; importing twice costs nothing."""

    def load(self) -> None:
        """Read the weights onto `spec.device`. Called once, in a worker thread."""
        raise NotImplementedError

    def unload(self) -> None:
        """Drop every reference to the weights so their memory can be returned."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes of tensors the engine holds now; a floor for the measured footprint."""
        raise NotImplementedError

    def release_weights(self) -> bool:
        """Hot -> warm: give the weights' memory back and keep the engine objects (tokenizer,
        vocabulary, module graph), so that `restore_weights()` costs a read of the weights and
        not a whole load. False: this engine (or this load) has no warm state, and nothing
        changed; the scheduler unloads it. Called like `unload()`."""
        return False

    def host_bytes(self) -> int:
        """Bytes of host RAM its warm copy keeps: a model on a GPU that parked its weights in
        host memory to come back by a copy; 0 where the warm copy keeps none there
        (an engine that reads its weights back from their file). They count against the
        `cpu` device's budget."""
        return 0

    def parks_on_host(self) -> bool:
        """Whether a warm copy of this load would keep bytes in host RAM (`host_bytes`), asked
        before its first one, to know whether the `cpu` budget must have room: True unless the
        engine knows it parks nothing there (a runner whose warm state reads its file again)."""
        return True

    def restore_weights(self) -> None:
        """Warm -> hot, after a `release_weights()` that returned True; called like `load()`.
        If it raises, the scheduler unloads the backend and loads the model anew; EngineDied
        (its process died warm or restoring) also counts as a death of the model."""
        raise NotImplementedError

    def restore_share(self) -> float | None:
        """Until a restore from warm is measured, the victim policy expects one to take this
        share of a load's seconds, on this load's device; None: as long as a whole load (an
        engine that reads its weights back)."""
        return None

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text as this engine reads it (no special tokens, no template).
        Called in a worker thread, only for models with a `max_input_tokens` limit."""
        raise TaskNotSupported(f"{self.name} cannot count tokens")

    def embed(self, texts: Sequence[str]) -> Embeddings:
        raise TaskNotSupported(f"{self.name} cannot embed")

    def embed_ids(self, ids: Sequence[Sequence[int]]) -> Embeddings:
        """Vectors of inputs given as token ids of the model's vocabulary, taken as they are;
        only for an engine that declares `token_ids`."""
        raise TaskNotSupported(f"{self.name} cannot embed token ids")

    def embed_passes(self) -> int:
        """How many `embed` calls may compute at once on this load (the embedding batcher
        keeps that many passes in flight); 1: one after another."""
        return 1

    def rerank(self, query: str, documents: Sequence[str]) -> Ranking:
        raise TaskNotSupported(f"{self.name} cannot rerank")

    def renders_tools(self) -> bool:
        """Whether `chat()` shows `params.tools`, assistant tool calls and tool results to the
        model through the model's own chat template. Called in a worker thread under a lease,
        before a chat that has tools or tool turns; False: the chat gets the request's generic
        tool prompt (api.tools) instead, or is refused (`GenerationRequest.conversation`)."""
        return False

    def chat(self, messages: Sequence[Message], params: GenerationParams,
             on_text: OnText | None = None) -> Generated:
        raise TaskNotSupported(f"{self.name} cannot chat")

    def wire(self, request: GenerationRequest) -> Wire | None:
        """The request to relay for this chat or completion (its one prompt: text, or token ids
        where the engine declares `token_ids`), if the engine answers in OpenAI's shape itself;
        None: the route calls `chat` or `complete`. With `request.usage_per_chunk`, each
        streamed event carries the engine's counts so far (`api.relay` makes them usage).
        Called on the event loop under a lease, only for a `request.plain` one (no tools, no
        structured output, no logprobs); no I/O."""
        return None

    def complete(self, prompt: str | Sequence[int], params: GenerationParams,
                 on_text: OnText | None = None) -> Generated:
        raise TaskNotSupported(f"{self.name} cannot complete text")

    def watch(self, report: ExitReport) -> None:
        """Called by the scheduler, on the event loop, after each `load()` or
        `restore_weights()` that succeeded: an engine in a process of its own calls `report`
        once, from any thread, when that process ends on its own while loaded or warm (at once:
        a reaper waits on it). Not called again for the same process; an `unload()` disarms
        it. Engines in the worker process have no process to watch."""

    def log(self) -> str | None:
        """Where the engine's process writes its log, for an engine in a process of its own
        (the newest, kept after the process ends); None for one in the worker."""
        return None

    def exited(self, timeout_s: float) -> EngineExit | None:
        """How the engine's process ended, waiting up to `timeout_s` for it to; None while it
        runs, and always for an engine in the worker. Called in a worker thread by a request
        that found the engine unreachable, to tell a death (the request is sent again after
        the reload) from another failure."""
        return None

    def working(self, deadline: float, slo_s: float) -> contextlib.AbstractContextManager[None]:
        """Held by a request for as long as it uses this load, and by the scheduler around
        `load` and `restore_weights`: the deadline (time.monotonic() seconds) and SLO of the
        request served (for a load, of the earliest one waiting when it starts; a pin's or an
        operator's competes as due now), for an engine that shares compute between its loads
        by deadline (llama-server runners). Any thread; no I/O, no waiting."""
        return contextlib.nullcontext()


class Runner:
    """What a lease lends: one loaded backend's task methods, and nothing of its lifecycle.

    The scheduler makes one per load, when the load succeeds, and lends that same object to
    every lease on it until it is unloaded; so its identity names the load (catalog names that
    share weights share one runner, and the embedding batcher keys on it). Called in worker
    threads, never on the event loop (but `wire`, which does no I/O), only while a lease on it
    is held.
    """

    __slots__ = ("__weakref__", "_backend")

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    @property
    def name(self) -> str:
        return self._backend.name

    @property
    def device(self) -> str:
        return self._backend.spec.device

    @property
    def max_batch(self) -> int:
        """The most inputs one embedding call should take."""
        return self._backend.spec.max_batch

    @property
    def embed_passes(self) -> int:
        """How many embedding calls may compute at once (the batcher's passes in flight)."""
        return self._backend.embed_passes()

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return self._backend.count_tokens(texts)

    def embed(self, texts: Sequence[str]) -> Embeddings:
        return self._backend.embed(texts)

    def embed_ids(self, ids: Sequence[Sequence[int]]) -> Embeddings:
        return self._backend.embed_ids(ids)

    def rerank(self, query: str, documents: Sequence[str]) -> Ranking:
        return self._backend.rerank(query, documents)

    def working(self, deadline: float, slo_s: float) -> contextlib.AbstractContextManager[None]:
        return self._backend.working(deadline, slo_s)

    def generate(self, request: GenerationRequest, on_text: OnText | None = None,
                 choice: int = 0) -> Generated:
        """Run `request`: a completion's prompt number `choice`, or the chat, its tools shown
        as `GenerationRequest.conversation` says for this engine."""
        if request.task is Task.COMPLETE:
            return self._backend.complete(request.prompts[choice], request.params, on_text)
        messages, params = request.conversation(
            request.tools is not None and self._backend.renders_tools())
        try:
            return self._backend.chat(messages, params, on_text)
        except InvalidRequest as exc:  # the engine could not make a grammar of the envelope
            if exc.param != "response_format" or request.output != "tool_call":
                raise  # without an envelope the grammar is response_format's own
            raise InvalidRequest(f"{exc.message} (in tools)", param="tools") from exc

    def wire(self, request: GenerationRequest) -> Wire | None:
        """The request to relay, for a plain one (`GenerationRequest.plain`) whose engine
        answers in OpenAI's shape itself; else None. On the event loop."""
        return self._backend.wire(request) if request.plain else None


BackendFactory = Callable[[LoadSpec], Backend]
