"""llama.cpp in runner processes: each load is one `llama-server` child of the worker.

The design of Ollama and of llama.cpp's own router, which beat an in-process engine (packserve's
first, through llama-cpp-python, since removed) in docs/engines.md: the engine's loop (decode,
sampling, detokenising, continuous batching of the load's `parallel` slots, prompt-prefix
reuse, grammars) runs in C++ with every core, and no Python runs per token inside it. The
worker relays a plain generation's bytes (`wire`) or reads the runner's server-sent events and
hands each piece of text to the request, as it does for any engine.

This module holds what is llama-server's own: its command line, its routes, its JSON, its pages
API. The process itself (spawn, readiness, stop, log, reaper, CPU turns) is `backends.runner`'s.

What a runner is to the scheduler: its bytes are the child's resident set size on the CPU
(`weight_bytes` reads /proc/PID/smaps_rollup, so a load's measured footprint is the process it
started, not the worker's growth) and what NVML says its pid holds on a card; an unload stops
the process. Its warm state is the process itself, kept with less (`WarmState`):
- on the CPU, a mapped file's pages dropped from its resident set (the page cache keeps them
  while the kernel has room): `release_weights` asks the runner to let them go (a patched
  route, scripts/patches/llama-server-release-pages.patch), `restore_weights` to read them back,
  each in milliseconds where a start takes up to half a second; a warm runner holds its buffers
  (KV cache, compute) and code;
- on a card, llama-server's sleeping state (scripts/patches/llama-server-sleep.patch): the
  model, its context, KV cache and compute buffers are freed on the card, the process and its
  CUDA context stay; the wake is a load of the model from the page cache without a new process
  or context. A wake that fails aborts the runner: a death (`EngineDied`), which the scheduler
  counts as any other.
A runner that dies (SIGSEGV, an OOM kill) is reported by its
reaper at once: the scheduler takes the model out of service, counts the death and loads it
again through its one load path (core.crashes); its requests in flight get a 503
(`RunnerGone`), and those it had not begun are sent again once after the reload.

The binary is built by scripts/setup.sh from the vendored llama.cpp of the pinned
llama-cpp-python sdist (its source only: the Python package is not installed), with portable
flags and packserve's patches, into the virtual environment's `bin/` (`PACKSERVE_LLAMA_SERVER`
names another).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.client
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packserve.backends import gguf
from packserve.backends.runner import Child, RunnerHost, UnixHTTP
from packserve.core.backend import (
    EXTENSIONS,
    Alternative,
    Backend,
    Embeddings,
    EngineDied,
    EngineExit,
    ExitReport,
    FinishReason,
    Generated,
    GenerationParams,
    LoadSpec,
    Message,
    OnText,
    Ranking,
    TokenLogprob,
    Wire,
)
from packserve.core.compute import usable_cores
from packserve.core.engine import Engine
from packserve.core.footprint import shape_of
from packserve.core.memory import GpuMemory, Nvml, process_device_bytes
from packserve.errors import ConfigError, EngineCrashed, InputTooLong, InvalidRequest
from packserve.modelfiles import ModelFacts
from packserve.planner.sizing import Breakdown, llama_encoder_breakdown
from packserve.types import Task

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from packserve.core.request import GenerationRequest

BINARY_ENV = "PACKSERVE_LLAMA_SERVER"
# A warm runner's release or restore of its weights' pages: milliseconds from the page cache; a
# restore whose pages the kernel took back reads the file. A sleep frees the model: the same.
PAGES_TIMEOUT_S = 60.0
# Slots one runner decodes together (continuous batching), sharing one KV cache of the entry's
# `context_length` (llama-server's own default: four, unified).
DEFAULT_PARALLEL = 4
# A token is rarely longer than this many characters: an embedding input longer than its
# model's limit times this is refused before it is sent to be tokenized.
_MAX_CHARS_PER_TOKEN = 32

log = logging.getLogger(__name__)


class RunnerGone(EngineCrashed):
    """The runner process of a model died: its requests in flight get 503 `engine_crashed`."""


class WarmState(StrEnum):
    """What a runner keeps while warm (`RunnerBackend.warm_state`)."""

    PAGES = "pages"  # all but its weights file's pages (CPU, a mapped file)
    SLEEP = "sleep"  # the process and its device contexts: llama-server's sleeping state


# What a restore from each warm state costs, as a share of a load's seconds, until one is
# measured (then `restore_seconds` is used). PAGES: reading the pages back from the page
# cache, 10-56 ms against 0.16-0.75 s for a new runner, 0.02-0.08 of it (`python -m
# benchmarks.runner_checks sleep`, docs/gpu.md; `runner_checks warm` for docs/engines.md's
# table). SLEEP: a whole load of the model from the page cache without the
# process start: 0.66-1.12 of a new runner's seconds on the CPU, median 0.87 (`runner_checks
# sleep`, docs/gpu.md); a wake on a card also skips the CUDA context's creation, so this is
# an upper bound there until the prepared check measures one.
RESTORE_SHARE = {WarmState.PAGES: 0.05, WarmState.SLEEP: 0.87}


def binary() -> Path:
    """The llama-server to run: `PACKSERVE_LLAMA_SERVER`, else the one setup built into the
    virtual environment."""
    named = os.environ.get(BINARY_ENV)
    path = Path(named) if named else Path(sys.prefix) / "bin" / "llama-server"
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ConfigError(f"llama-server not found at {path}: run scripts/setup.sh (it builds "
                          f"it from llama.cpp's source) or set {BINARY_ENV}")
    return path


@functools.cache
def list_devices(exe: Path) -> tuple[str, ...]:
    """The devices a llama-server build can offload to ("CUDA0", ...), from its own
    `--list-devices` (17 ms for a CPU build: it prints "(none)"). The build's devices, not the
    flags it was configured with: the same answer for a binary built elsewhere
    (`PACKSERVE_LLAMA_SERVER`), and a CUDA build on a machine whose driver is gone lists none."""
    try:
        out = subprocess.run([str(exe), "--list-devices"], capture_output=True, text=True,
                             timeout=30, check=False, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(line.strip().partition(":")[0] for line in out.splitlines()
                 if line.startswith("  ") and ":" in line)


def runner_cuda(device: str = "cuda:0") -> str | None:
    """Why the llama-server runner cannot run on `device`, or None when its build lists it."""
    try:
        exe = binary()
    except ConfigError as exc:
        return exc.message
    devices = list_devices(exe)
    want = "CUDA" + (device.partition(":")[2] or "0")
    if want in devices:
        return None
    if not any(d.startswith("CUDA") for d in devices):
        return f"{exe} was built without CUDA, or sees no card (its --list-devices names none)"
    return f"{exe} lists {', '.join(devices)}, not {want}"


def runner_device_bytes(pid: int, device: str, gpu: Callable[[], GpuMemory] = Nvml) -> int:
    """What runner `pid` holds on `device` by NVML's per-process figure; where NVML gives none,
    0: the loader then counts the device's used-memory growth over the load instead (its
    fallback, reported as `device_total`)."""
    return process_device_bytes(gpu(), int(device.partition(":")[2] or 0), pid) or 0


class RunnerBackend(Backend):
    """One load: one llama-server process serving the weights on a unix socket. What a runner
    is to the scheduler and to a request's connection; the subclasses say what it serves."""

    n_vocab: int = 0
    out_of_process = True
    _host: RunnerHost | None = None
    _child: Child | None = None

    def __post_init__(self) -> None:
        self.name = self.spec.path.name

    @property
    def host(self) -> RunnerHost:
        """The worker's runner host (the server's backend factory sets it), else the default."""
        return self._host or RunnerHost.default()

    @host.setter
    def host(self, host: RunnerHost) -> None:
        self._host = host

    @property
    def child(self) -> Child:
        if self._child is None:
            self._child = Child(self.host, self.name,
                                self.host.log_folder(self.spec.path.stem, self.spec.key))
        return self._child

    # -- lifecycle (the scheduler's) -----------------------------------------------------------

    def load(self) -> None:
        why = runner_cuda(self.spec.device) if self.spec.device != "cpu" else None
        if why is not None:
            raise ConfigError(f"{self.name}: device {self.spec.device} asked, but {why}")
        exe = binary()
        threads = self.spec.threads or usable_cores()
        slots = max(1, self.spec.parallel)

        def argv(sock: Path) -> list[str]:
            return [str(exe), "--model", str(self.spec.path), "--host", str(sock),
                    "--parallel", str(slots), "--threads", str(threads),
                    "--threads-batch", str(threads), "--alias", self.name,
                    "--no-webui", "--no-slots", "--offline",
                    # No trial load to fit the context to free device memory: the context is
                    # set, and the trial read Gemma's 262k-token vocabulary a second time (a
                    # start took 0.95 s with it, 0.59 s without, docs/engines.md).
                    "--fit", "off",
                    # warnings and errors only: a line per request would grow the log without end
                    "--log-verbosity", "2", *self._device_args(), *self._mode_args(slots)]

        self.child.start(argv, self._serving)
        try:
            self.n_vocab = self._read_vocab()
        except BaseException:
            self.child.stop()
            raise

    def _serving(self) -> bool:
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn = UnixHTTP(str(self.child.socket), timeout=5)
            try:
                conn.request("GET", "/health")
                return conn.getresponse().status == 200
            finally:
                conn.close()
        return False

    def _device_args(self) -> list[str]:
        """Where the weights go: every layer on the card, or none offloaded (a CUDA build's
        default, `-ngl auto`, would put a CPU model's layers on the card)."""
        if self.spec.device == "cpu":
            # mostly repacked weights are read, not mapped (gguf.maps_weights)
            return ["--device", "none", *([] if self.spec.mapped else ["--load-mode", "none"])]
        return ["--device", "CUDA" + (self.spec.device.partition(":")[2] or "0"),
                "--n-gpu-layers", "all"]

    def _mode_args(self, slots: int) -> list[str]:
        """What this kind of runner adds to the command line (its context, its mode)."""
        raise NotImplementedError

    def _read_vocab(self) -> int:
        """The model's vocabulary size, as the runner reports it (token ids are below it)."""
        # Not the health poll's 5 s: a start may be held for its turn (runner.Turns) meanwhile.
        conn = UnixHTTP(str(self.child.socket), timeout=self.host.start_timeout_s)
        try:
            conn.request("GET", "/v1/models")
            rows = _json(conn.getresponse().read()).get("data") or [{}]
            return int((rows[0].get("meta") or {}).get("n_vocab", 0))
        finally:
            conn.close()

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        """Refuse token ids outside the model's vocabulary, naming the first."""
        for token in ids:
            if not 0 <= token < self.n_vocab:
                raise InvalidRequest(f"{param} has token id {token}, outside the vocabulary "
                                     f"of {self.name} (ids 0 to {self.n_vocab - 1})",
                                     param=param)

    def unload(self) -> None:
        if self._child is not None:
            self._child.stop()

    def watch(self, report: ExitReport) -> None:
        self.child.watch(report)

    def exited(self, timeout_s: float) -> EngineExit | None:
        return self.child.exited(timeout_s)

    def log(self) -> str | None:
        return str(self._child.log) if self._child is not None and self._child.log else None

    @property
    def warm_state(self) -> WarmState | None:
        """How this runner goes warm: asleep on a card (what it holds there is most of its
        bytes, and only the sleeping state frees it); its file's pages given back on the CPU
        where the file is mapped; None where it is read into memory on the CPU (no mapping to
        give back, and a sleep there saves little over a new runner: docs/gpu.md)."""
        if self.spec.device != "cpu":
            return WarmState.SLEEP
        return WarmState.PAGES if self.spec.mapped else None

    def parks_on_host(self) -> bool:
        return False  # each warm state reads the weights file again: nothing is parked

    def restore_share(self) -> float | None:
        state = self.warm_state
        return RESTORE_SHARE[state] if state is not None else None

    def release_weights(self) -> bool:
        """Hot -> warm (`warm_state`): the runner drops its weights file's pages from its
        resident set, or goes to sleep, and keeps running. False if it could not, or has no
        warm state: the scheduler unloads it. Raises EngineDied if the runner died (hot, and
        its reaper's report may still be on its way: the scheduler counts it here)."""
        state = self.warm_state
        if state is None:
            return False
        if not self.child.alive():
            died = self._died_warm(None, "while idle", "idle")
            if isinstance(died, EngineDied):
                raise died
            return False
        self.host.turns.forget(self.child.turn)  # it is idle: if its turn had it stopped, it runs
        try:
            if state is WarmState.SLEEP:
                return self.sleep()
            done = self.pages("release")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            died = self._died_warm(exc, "going warm", "going warm")
            if isinstance(died, EngineDied):  # it crashed (freeing its buffers): a death
                raise died from exc
            log.warning("the runner of %s could not go warm (%s, %s); it is unloaded",
                        self.name, state.value, exc)
            return False
        return bool(done.get("bytes")) and not done.get("errors")

    def restore_weights(self) -> None:
        """Warm -> hot: the runner reads its weights' pages back (from the page cache, or the
        file where the kernel took them), so the first request after does not fault them in;
        or it wakes, loading the model again, and answers once it serves. Raises EngineDied
        if the runner died (while warm, or in its wake: a reload that fails aborts it), for
        the scheduler to count; RunnerGone if it could not and lives."""
        if not self.child.alive():  # it died warm: the reaper's report may be on its way
            raise self._died_warm(None, "while warm", "warm")
        try:
            if self.warm_state is WarmState.SLEEP:
                self.wake()
            else:
                self.pages("restore")
        except TimeoutError as exc:  # a wake that never ends is a death too, as a hung start
            raise self.child.hung(f"did not come back from warm ({self.warm_state}) in "
                                  f"time") from exc
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise self._died_warm(exc, "coming back from warm", "waking") from exc

    def _died_warm(self, exc: BaseException | None, words: str, doing: str) -> Exception:
        """A move to or from warm that failed: EngineDied (`doing`, the crash's label) if the
        runner is gone (waiting a moment for its reaper where the connection broke), else
        RunnerGone (it answered an error, or was stopped)."""
        done = self.child.exited(0.0 if isinstance(exc, ValueError) else 2.0)
        if done is None:
            return self._gone(exc)
        return EngineDied(f"the llama-server runner of {self.name} died {words} "
                          f"({self.warm_state}; {done.cause})", done, doing)

    def sleep(self, busy_s: float = 30.0) -> bool:
        """llama-server's sleeping state: its model, context, KV cache and compute buffers
        freed, the process kept (scripts/patches/llama-server-sleep.patch). True once asleep;
        raises OSError, HTTPException or ValueError (409: a request or a slot stayed busy for
        `busy_s`) if not."""
        return bool(self._call("/packserve/sleep", {"timeout_s": busy_s},
                               PAGES_TIMEOUT_S + busy_s).get("sleeping"))

    def wake(self) -> None:
        """Out of the sleeping state: the model loaded again; returns once it serves. A reload
        that fails aborts the runner (the connection breaks: OSError)."""
        self._call("/packserve/wake", {}, self.host.start_timeout_s)

    def pages(self, action: str) -> dict[str, Any]:
        """"release" or "restore" the weights file's pages (the patched /packserve/pages):
        the bytes of mappings it went over, and how many of them it could not."""
        return self._call("/packserve/pages", {"action": action}, PAGES_TIMEOUT_S)

    def _call(self, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """POST one of packserve's own routes; its JSON, or ValueError for another status."""
        conn = UnixHTTP(str(self.child.socket), timeout=timeout_s)
        try:
            response = self._send(conn, path, body)
            data = _json(response.read())
            if response.status != 200:
                raise ValueError(f"{response.status}: {data.get('error')}")
            return data
        finally:
            conn.close()

    def weight_bytes(self) -> int:
        """The runner's resident set: its weights' pages, its KV cache and buffers, and its
        code. Not its proportional share: a weights file another process maps too (another
        server, a second runner of the same file) would halve it, and the model could not be
        loaded again in the room that figure reserves once the other process is gone."""
        pid = self.child.pid
        if pid is None or not self.child.alive():
            return 0
        if self.spec.device != "cpu":  # what the runner's pid holds on the card, by NVML
            return runner_device_bytes(pid, self.spec.device)
        return self.child.rss_bytes()

    def working(self, deadline: float, slo_s: float) -> contextlib.AbstractContextManager[None]:
        turns = self.host.turns
        if not turns.enabled or self.spec.device != "cpu":
            return contextlib.nullcontext()
        return turns.working(self.child.turn, deadline, slo_s)

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    def dead(self) -> bool:
        """The runner is not serving: never started, stopped, or died after it loaded."""
        return self._child is None or not self._child.alive()

    # -- requests (a lease's) ---------------------------------------------------------------

    def _post(self, conn: UnixHTTP, path: str, body: dict[str, Any], param: str
              ) -> http.client.HTTPResponse:
        """POST `body` as JSON; the response once it is a 200 (its body unread). A runner that
        is gone is a RunnerGone: its death is the scheduler's to handle."""
        try:
            response = self._send(conn, path, body)
        except (OSError, http.client.HTTPException) as exc:
            raise self._gone(exc) from exc
        if response.status != 200:
            data = _json(response.read())
            raise _error(data.get("error", {}), param, self.name)
        return response

    @staticmethod
    def _send(conn: UnixHTTP, path: str, body: dict[str, Any]) -> http.client.HTTPResponse:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        return conn.getresponse()

    def _connect(self) -> UnixHTTP:
        if self.dead():
            raise self._gone(None)
        return UnixHTTP(str(self.child.socket), timeout=None)

    def _gone(self, exc: BaseException | None) -> RunnerGone:
        if exc is not None and self.child.alive():
            return RunnerGone(f"the llama-server runner of {self.name} failed: {exc}",
                              retry_after_s=1)
        done = self.child.exited(0.5)
        why = done.cause if done is not None else "stopped"
        return RunnerGone(f"the llama-server runner of {self.name} is gone ({why})",
                          retry_after_s=1)

    def _get(self, path: str) -> dict[str, Any]:
        conn = self._connect()
        try:
            conn.request("GET", path)
            return _json(conn.getresponse().read())
        finally:
            conn.close()

    def _post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        conn = self._connect()
        try:
            response = self._post(conn, path, body, "input")
            try:
                return _json(response.read())
            except (OSError, http.client.HTTPException) as exc:
                raise self._gone(exc) from exc
        finally:
            conn.close()


class LlamaServerBackend(RunnerBackend):
    """A generation runner: chats and completions, `parallel` slots decoded together."""

    # Whether the model's chat template shows the tools it is given: llama.cpp's own probe of
    # the template it renders with (`/props`' `chat_template_caps`), read once per load.
    _renders_tools: bool = False

    def load(self) -> None:
        super().load()
        try:
            caps = self._get("/props").get("chat_template_caps") or {}
            self._renders_tools = bool(caps.get("supports_tools"))
        except BaseException:
            self.unload()
            raise

    def _mode_args(self, slots: int) -> list[str]:
        per_slot = self.spec.cache_per_slot
        args = ["--ctx-size", str(self.spec.context_length * (slots if per_slot else 1)),
                "--jinja",
                # No prompt cache in RAM beside the KV cache (llama-server keeps up to 8 GiB by
                # default, filled as requests come): a runner's bytes stay what the scheduler
                # measured after its load. Each slot still reuses its own cached prefix.
                "--cache-ram", "0"]
        # A cache per slot with flash attention: each sequence's answer is the one it gets
        # alone (docs/engines.md measured it); one shared cache is the leaner default.
        return args + (["--flash-attn", "on"] if per_slot else ["--kv-unified"])

    def renders_tools(self) -> bool:
        return self._renders_tools

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(self._post_json("/tokenize", {"content": t, "add_special": False,
                                                  "parse_special": False})["tokens"])
                for t in texts]

    def chat(self, messages: Sequence[Message], params: GenerationParams,
             on_text: OnText | None = None) -> Generated:
        body: dict[str, Any] = {"messages": [_message(m) for m in messages],
                                **self._sampling(params)}
        if params.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.parameters}}
                for t in params.tools]
        if params.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = params.logprobs
        return self._generate("/v1/chat/completions", body, on_text, "messages")

    def wire(self, request: GenerationRequest) -> Wire | None:
        """Plain chats and completions go to the runner as they are and its answer is relayed
        (`api.relay`): no thread, no decoding of each event in the worker."""
        stream = request.stream
        body: dict[str, Any] = {**self._sampling(request.params), "stream": stream}
        completion = request.task is Task.COMPLETE
        if completion:
            body["prompt"], path = self._prompt(request.prompts[0]), "/v1/completions"
        else:
            body["messages"] = [_message(m) for m in request.messages]
            path = "/v1/chat/completions"
        if stream:
            body["stream_options"] = {"include_usage": True}  # counted on the lease
            if request.usage_per_chunk:
                body["timings_per_token"] = True  # api.relay makes them usage
        return Wire(socket=str(self.child.socket), path=path, body=json.dumps(body).encode(),
                    served_as=self.name, usage_per_chunk=stream and request.usage_per_chunk,
                    # llama-server names text completions as it names chats
                    id_prefix=("chatcmpl-", "cmpl-") if completion else None)

    def _prompt(self, prompt: str | Sequence[int]) -> str | list[int]:
        """A completion's prompt as the runner takes it: text, or token ids (checked against
        the vocabulary; taken as they are, no special token added)."""
        if isinstance(prompt, str):
            return prompt
        self.check_ids(prompt, "prompt")
        return list(prompt)

    def _sampling(self, params: GenerationParams) -> dict[str, Any]:
        body = _sampling(params)
        if params.logit_bias:
            self.check_ids([token for token, _ in params.logit_bias], "logit_bias")
            body["logit_bias"] = [[token, bias] for token, bias in params.logit_bias]
        return body

    def complete(self, prompt: str | Sequence[int], params: GenerationParams,
                 on_text: OnText | None = None) -> Generated:
        body: dict[str, Any] = {"prompt": self._prompt(prompt), **self._sampling(params)}
        if params.logprobs is not None:
            body["logprobs"] = params.logprobs
        return self._generate("/v1/completions", body, on_text, "prompt")

    def _generate(self, path: str, body: dict[str, Any], on_text: OnText | None,
                  param: str) -> Generated:
        text: list[str] = []
        tokens: list[TokenLogprob] = []
        finish: FinishReason = "stop"
        prompt_tokens = completion_tokens = 0
        with self._stream(path, body, param) as events:
            for event in events:
                if "error" in event:
                    raise _error(event["error"], param, self.name)
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") \
                        if "delta" in choice else choice.get("text")
                    lp = _logprobs(choice.get("logprobs"))
                    tokens.extend(lp)
                    if piece:
                        text.append(piece)
                        if on_text is not None and not on_text(piece, lp):
                            # The client left: closing the connection stops the slot at once.
                            return Generated(text="".join(text), finish_reason="stop",
                                             prompt_tokens=prompt_tokens,
                                             completion_tokens=len(tokens) or len(text),
                                             logprobs=tuple(tokens))
                    if choice.get("finish_reason"):
                        finish = "length" if choice["finish_reason"] == "length" else "stop"
                usage = event.get("usage")
                if usage:
                    prompt_tokens = int(usage.get("prompt_tokens", 0))
                    completion_tokens = int(usage.get("completion_tokens", 0))
        wanted = "logprobs" in body
        return Generated(text="".join(text), finish_reason=finish, prompt_tokens=prompt_tokens,
                         completion_tokens=completion_tokens,
                         logprobs=tuple(tokens) if wanted else None)

    @contextlib.contextmanager
    def _stream(self, path: str, body: dict[str, Any], param: str
                ) -> Iterator[Iterator[dict[str, Any]]]:
        """POST `body` with `stream` on; yields the decoded events. Closing the connection
        (leaving the block early) cancels the generation in the runner."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        conn = self._connect()
        try:
            yield _events(self._post(conn, path, body, param), self)
        finally:
            conn.close()



class LlamaEmbedBackend(RunnerBackend):
    """An embedding runner (llama-server --embeddings): a GGUF encoder's pooled, normalised
    sentence vectors, and reranking by their cosine similarity (a bi-encoder, not a
    cross-encoder). Each input is tokenized by the runner first, so that an input over the
    model's context is refused by its index and every input's tokens are counted; the vectors
    are then computed from those token ids, `parallel` inputs in one batch."""

    def _mode_args(self, slots: int) -> list[str]:
        # A slot's context is the model's (capped by llama.cpp at the GGUF's context length,
        # which packserve's converter sets to the longest input the model was made for).
        # llama-server's own 512-token batch. Its compute buffers are touched by the requests,
        # not at load: the load is measured without them (~63 MiB for MiniLM), and what long
        # inputs add (70 MiB more for MiniLM's 256-token ones: scripts/runner_checks.py embed)
        # lives in the device's headroom, as any engine's activations do. Reserving them (a
        # 256-token batch, touched at load: 97 MiB) made the bursty trace evict MiniLM eleven
        # times a run where it had stayed (docs/engines.md).
        return ["--embeddings", "--ctx-size", str(self.spec.context_length * slots)]

    def embed_passes(self) -> int:
        return max(1, self.spec.parallel)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        conn = self._connect()
        try:
            return [len(self._tokens(conn, t, special=False)) for t in texts]
        finally:
            conn.close()

    def embed(self, texts: Sequence[str]) -> Embeddings:
        vectors, tokens = self._vectors(texts, "input")
        return Embeddings(vectors=vectors, tokens=tokens)

    def embed_ids(self, ids: Sequence[Sequence[int]]) -> Embeddings:
        """Vectors of inputs given as token ids, taken as they are (no [CLS] or [SEP] added)."""
        limit = self.spec.context_length
        for i, row in enumerate(ids):
            self.check_ids(row, f"input[{i}]" if len(ids) > 1 else "input")
            if len(row) > limit:
                raise InputTooLong(f"input[{i}] is {len(row)} tokens; {self.name} reads at "
                                   f"most {limit} tokens (shorten or split it)", param="input")
        conn = self._connect()
        try:
            vectors = self._embed_rows(conn, [list(row) for row in ids])
        finally:
            conn.close()
        return Embeddings(vectors=vectors, tokens=[len(row) for row in ids])

    def rerank(self, query: str, documents: Sequence[str]) -> Ranking:
        vectors, tokens = self._vectors([query, *documents], "documents", first="query")
        return Ranking(scores=[float(s) for s in vectors[1:] @ vectors[0]],
                       tokens=sum(tokens))

    def _vectors(self, texts: Sequence[str], what: str, first: str = ""
                 ) -> tuple[npt.NDArray[np.float32], list[int]]:

        limit = self.spec.context_length

        def named(i: int) -> str:
            return first if first and i == 0 else f"{what}[{i - bool(first)}]"

        for i, text in enumerate(texts):
            if len(text) > limit * _MAX_CHARS_PER_TOKEN:
                raise InputTooLong(f"{named(i)} has {len(text)} characters; {self.name} reads "
                                   f"at most {limit} tokens", param="input")
        conn = self._connect()
        try:
            ids = [self._tokens(conn, t, special=True) for t in texts]
            for i, row in enumerate(ids):
                if len(row) > limit:
                    raise InputTooLong(f"{named(i)} is {len(row)} tokens; {self.name} reads at "
                                       f"most {limit} tokens (shorten or split it)",
                                       param="input")
            vectors = self._embed_rows(conn, ids)
        finally:
            conn.close()
        return vectors, [len(row) for row in ids]

    def _embed_rows(self, conn: UnixHTTP, ids: list[list[int]]) -> npt.NDArray[np.float32]:
        """The runner's vectors for token-id rows, in their order."""
        import numpy as np

        response = self._post(conn, "/v1/embeddings",
                              {"input": ids, "encoding_format": "base64"}, "input")
        try:
            data = _json(response.read()).get("data") or []
        except (OSError, http.client.HTTPException) as exc:
            raise self._gone(exc) from exc
        if len(data) != len(ids):
            raise RuntimeError(f"llama-server for {self.name} answered {len(data)} vectors "
                               f"for {len(ids)} inputs")
        rows = sorted(data, key=lambda d: int(d.get("index", 0)))
        return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.float32)
                         for d in rows])

    def _tokens(self, conn: UnixHTTP, text: str, *, special: bool) -> list[int]:
        """`text`'s token ids as the runner reads it (with [CLS] and [SEP] when `special`),
        on `conn` (kept open between the calls of one request)."""
        # Special tokens written in the text ("[SEP]") are read as such, as BertTokenizer does.
        response = self._post(conn, "/tokenize", {"content": text, "add_special": special,
                                                  "parse_special": True}, "input")
        try:
            return list(_json(response.read()).get("tokens") or [])
        except (OSError, http.client.HTTPException) as exc:
            raise self._gone(exc) from exc


def _sampling(params: GenerationParams) -> dict[str, Any]:
    body: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                            "cache_prompt": True}
    if params.max_tokens is not None:
        body["max_tokens"] = params.max_tokens
    if params.stop:
        body["stop"] = list(params.stop)
    if params.seed is not None:
        body["seed"] = params.seed % 2**32
    if params.json_schema is not None:
        body["json_schema"] = params.json_schema
    elif params.json_object:
        body["json_schema"] = {"type": "object"}
    # Beyond OpenAI's, by llama.cpp's names; absent, llama-server's defaults hold.
    body["frequency_penalty"] = params.frequency_penalty
    body["presence_penalty"] = params.presence_penalty
    if params.top_k is not None:
        body["top_k"] = params.top_k
    if params.min_p is not None:
        body["min_p"] = params.min_p
    if params.repetition_penalty is not None:
        body["repeat_penalty"] = params.repetition_penalty
    if params.ignore_eos:
        body["ignore_eos"] = True  # every end-of-generation token banned (llama.cpp's list)
    if params.min_tokens:
        body["min_tokens"] = params.min_tokens  # scripts/patches/llama-server-min-tokens.patch
    return body


def _message(m: Message) -> dict[str, Any]:
    """A message as chat templates read it (Hugging Face's convention: a call's arguments as
    an object, a tool result with its call's id)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _object(c.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _object(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _events(response: http.client.HTTPResponse, backend: RunnerBackend
            ) -> Iterator[dict[str, Any]]:
    while True:
        try:
            line = response.readline()
        except (OSError, http.client.HTTPException) as exc:
            raise backend._gone(exc) from exc
        if not line:  # the answer ended before its [DONE]: the runner died (it may not
            raise backend._gone(None)  # have been reaped yet, so do not ask whether it did)
        if not line.startswith(b"data: "):
            if line.startswith(b"error: "):
                yield {"error": _json(line[7:]).get("error", _json(line[7:]))}
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            return
        yield _json(payload)


def _json(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        return {"message": data.decode("utf-8", "replace")}
    return value if isinstance(value, dict) else {"value": value}


def _error(error: object, param: str, name: str) -> Exception:
    """A runner's error as packserve's: a prompt over the window is InputTooLong, any other
    400 InvalidRequest, anything else a failure of the engine (500)."""
    info = error if isinstance(error, dict) else {"message": str(error)}
    message = str(info.get("message", "")) or "llama-server refused the request"
    kind = str(info.get("type", ""))
    if kind == "exceed_context_size_error" or ("context" in message and "exceed" in message):
        return InputTooLong(f"{message} ({name})", param=param)
    if info.get("code") == 400 or kind == "invalid_request_error":
        return InvalidRequest(f"{name}: {message}", param=param)
    return RuntimeError(f"llama-server for {name} failed: {message}")


def _logprobs(shape: object) -> list[TokenLogprob]:
    """llama-server's OpenAI-shaped logprobs (`{"content": [...]}`) as TokenLogprobs."""
    if not isinstance(shape, dict):
        return []
    out = []
    for entry in shape.get("content") or ():
        out.append(TokenLogprob(
            token=entry.get("token", ""), bytes=bytes(entry.get("bytes") or b""),
            logprob=float(entry.get("logprob", 0.0)),
            top=tuple(Alternative(token=a.get("token", ""), bytes=bytes(a.get("bytes") or b""),
                                  logprob=float(a.get("logprob", 0.0)))
                      for a in entry.get("top_logprobs") or ())))
    return out


def _embed_context(requested: int | None, facts: ModelFacts | None) -> int:
    """The longest input: the entry's `context_length`, else the model's own."""
    return requested or (facts.context_length if facts is not None else 0) or 512


def _embed_size(facts: ModelFacts | None, load: LoadSpec, name: str, sequences: int
                ) -> Breakdown:
    assert facts is not None  # reads_files
    return llama_encoder_breakdown(shape_of(facts, name), repacked=gguf.repacked(facts, load))


def _embed_source(path: Path) -> str | None:
    return None if path.suffix == ".gguf" else f"a .gguf file (or a BERT safetensors folder " \
        f"it converts), got {path}"


def _to_gguf(path: Path, models_dir: Path, announce: Callable[[str], None] | None) -> Path:
    """A sentence-transformers BERT folder, converted once into `models_dir`; a file as is."""
    from packserve.convert import gguf_for

    return gguf_for(path, models_dir, announce) if path.is_dir() else path


ENGINE = Engine(name="llama-server", tasks=frozenset({Task.CHAT, Task.COMPLETE}),
                default_concurrency=DEFAULT_PARALLEL, build=LlamaServerBackend, size=gguf.size,
                check_source=gguf.check_source, context=gguf.context,
                default_parallel=DEFAULT_PARALLEL,
                sampling=frozenset({*EXTENSIONS, "continuous_usage_stats"}), token_ids=True,
                cuda=runner_cuda, own_process=True, maps_weights=gguf.maps_weights)
# Embeddings and bi-encoder rerank from a GGUF encoder (the default catalog's MiniLM, converted
# from its safetensors folder): requests are batched (api/batching.py) into the runner's slots.
EMBED_ENGINE = Engine(name="llama-server-embed", tasks=frozenset({Task.EMBED, Task.RERANK}),
                      default_concurrency=32, build=LlamaEmbedBackend, size=_embed_size,
                      check_source=_embed_source, context=_embed_context, convert=_to_gguf,
                      default_parallel=DEFAULT_PARALLEL, token_ids=True, cuda=runner_cuda,
                      own_process=True, maps_weights=gguf.maps_weights)
ENGINES = (ENGINE, EMBED_ENGINE)
