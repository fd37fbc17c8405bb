"""llama.cpp through llama-cpp-python: chat, completions, streaming, JSON-schema output.

Weights are memory-mapped from the GGUF file (llama.cpp's `use_mmap`, its pages read in at load,
so they count in the process's resident size as the scheduler measures it). Formats that
llama.cpp's CPU backend repacks for its kernels (Q4_0, Q4_K...) are also copied once into the
repacked layout. Mapped weights are what makes the warm tier possible: `release_weights()` frees
the context (KV cache, compute buffers) and hands the mapped pages back to the OS while the
model (vocabulary, tensor layout) stays; `restore_weights()` reads the pages back and makes a new
context (`bench coldstart` measures both against a read of the file).
With `parallel` slots (the load's `LoadSpec.parallel` > 1) chats and completions are decoded
together, several sequences per llama.cpp batch (`llama_batch.BatchDecoder`); echo scoring,
completions of an empty prompt and chats in a built-in (non-Jinja) chat format go through
llama-cpp-python's own one-sequence path, alone in the context (`BatchDecoder.exclusive`).
With one slot every call takes that path, serialised by a lock. Each call computes in its
device's compute turn (`core.compute`; a batched step in the most urgent one's) and hands the
turn over between tokens when a request with an earlier deadline waits. Threads: the entry's
`threads`, else llama-cpp-python's default (half the cores): on a 2-core box, 2 decode threads
beside any other busy thread (a load, the HTTP front) stalled a 0.4 s generation for 6-13 s now
and then (llama.cpp's threads spin at each barrier while one of them waits for a core).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from packserve.backends import llama_compat
from packserve.backends.llama_batch import PROMPT_SLICE, BatchDecoder, Job
from packserve.core.backend import (
    Alternative,
    Backend,
    Generated,
    GenerationParams,
    LoadSpec,
    Message,
    OnText,
    TokenLogprob,
)
from packserve.core.compute import (
    TICKET,
    between_slices,
    between_tokens,
    step_units,
    turn,
    usable_cores,
)
from packserve.core.engine import Engine
from packserve.core.footprint import shape_of
from packserve.core.memory import file_mappings
from packserve.errors import ConfigError, InputTooLong, InvalidRequest
from packserve.modelfiles import ModelFacts, file_identity
from packserve.planner.sizing import Breakdown, llama_cpp_breakdown
from packserve.types import Task

DEFAULT_CONTEXT = 2048  # tokens of KV cache unless the entry or the model asks for fewer


def schema_grammar(schema: dict[str, object] | None) -> Any:
    """A llama.cpp grammar for `schema`, or for any JSON object when `schema` is None."""
    from llama_cpp import llama_grammar as lg

    if schema is None:
        text = lg.JSON_GBNF
    else:
        try:
            text = lg.json_schema_to_gbnf(json.dumps(schema))
        except Exception as exc:  # the converter raises bare Exceptions for unsupported schemas
            raise InvalidRequest(f"unsupported JSON schema: {exc}",
                                 param="response_format") from exc
    return lg.LlamaGrammar.from_string(llama_compat.strict_json_strings(text), verbose=False)


class LlamaCppBackend(Backend):
    _llm: Any = None
    _mapped: tuple[tuple[int, int], ...] = ()  # where this model maps its weights file
    _file: tuple[int, int, int, int] = (0, 0, 0, 0)  # the file's identity when it was loaded
    _released: bool = False  # warm: the mapped pages and the context were given back
    _threads: int = 1
    _decoder: BatchDecoder | None = None
    _formatter: Any = None  # the model's Jinja chat template, with parallel slots

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.name = self.spec.path.name

    def prepare(self) -> None:
        ENGINE.prepare()

    def load(self) -> None:
        from llama_cpp import Llama

        on_gpu = self.spec.device.startswith("cuda")
        why = _gpu_offload() if on_gpu else None
        if why is not None:
            raise ConfigError(f"{self.name}: device {self.spec.device} asked, but {why}")
        slots, per_slot = self.spec.parallel, self.spec.cache_per_slot
        threads = self.spec.threads or max(1, usable_cores() // 2)  # llama-cpp-python's default
        # A prompt is read on every core (llama-cpp-python's default; docs/tuning.md,
        # "Prompts on every core"), the compute gate lending the call that many for
        # each slice it reads (`_sliced`). With parallel slots every step is several tokens
        # long: every core helped four streams on a quiet 2-core box but hurt them while
        # another process held a core (docs/tuning.md, parallel decode), so there, and
        # where the operator sets `threads`, steps of several tokens run `threads` too.
        batch_threads = threads if self.spec.threads or slots > 1 else max(threads,
                                                                            usable_cores())
        context = self.spec.context_length
        # Slots sharing one cache: `context` cells for all; a cache per slot: `context` each.
        fields = {} if slots == 1 else {"n_seq_max": slots, "kv_unified": not per_slot}
        with llama_compat.context_fields(fields):
            # The model's own mappings of its file are those that appear while it is built (a
            # header reader, or another load of the same file, may map it too).
            mapped_before = file_mappings(self.spec.path)
            self._llm = Llama(
                model_path=str(self.spec.path),
                n_ctx=context * slots if per_slot else context,
                n_gpu_layers=-1 if on_gpu else 0,
                main_gpu=int(self.spec.device.partition(":")[2] or 0) if on_gpu else 0,
                use_mmap=True,
                n_threads=threads,
                n_threads_batch=batch_threads,
                flash_attn=slots > 1 and per_slot,  # batch-invariant (llama_batch's doc)
                verbose=False,
            )
            mapped = file_mappings(self.spec.path) - mapped_before
        llama_compat.set_sequence_window(self._llm, context)
        llama_compat.wrap_eval(self._llm, functools.partial(_sliced,
                                                            batch_threads=batch_threads))
        self._mapped = () if on_gpu else tuple(sorted(mapped))
        self._file = file_identity(self.spec.path)
        self._threads = threads
        self._start_decoder()
        if slots > 1:
            self._formatter = llama_compat.chat_formatter(self._llm)

    def _start_decoder(self) -> None:
        if self.spec.parallel > 1:
            self._decoder = BatchDecoder(self._llm, slots=self.spec.parallel,
                                         threads=self._threads, batch_threads=self._threads,
                                         unified=not self.spec.cache_per_slot)

    def release_weights(self) -> bool:
        """Warm: free the context and give the mapped weight pages back; the model stays.
        Only on CPU with the weights mapped from the file (on a GPU they live in device
        memory, which llama.cpp cannot drop while keeping the model)."""
        mapped = file_mappings(self.spec.path)
        if not self._mapped or not mapped.issuperset(self._mapped):
            return False  # mapped no longer as at load (or never): unload it instead
        decoder, self._decoder = self._decoder, None
        if decoder is not None:
            decoder.close()
        llama_compat.free_context(self._llm)  # the KV cache and the compute buffers
        _advise(self._mapped, _MADV_DONTNEED)
        self._released = True
        return True

    def restore_weights(self) -> None:
        """Warm -> hot: read the mapped pages back in (from the page cache, or the file), then
        a new context with the same parameters."""
        if file_identity(self.spec.path) != self._file:
            raise RuntimeError(f"{self.spec.path} changed since it was loaded; replace model "
                               f"files by renaming a new one into place, never by writing "
                               f"over them")
        # The pages are read on a thread of their own while the context (KV cache, compute
        # buffers) is made here: both are native calls that let the GIL go, so they overlap
        # (`bench coldstart` measures restores against a read of the file).
        reader = threading.Thread(target=_populate, args=(self._mapped,),
                                  name="packserve-restore", daemon=True)
        reader.start()
        try:
            llama_compat.new_context(self._llm)
        finally:
            reader.join()
        self._start_decoder()
        self._released = False

    def unload(self) -> None:
        decoder, self._decoder = self._decoder, None
        if decoder is not None:
            decoder.close()
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.close()

    def _alone(self) -> contextlib.AbstractContextManager[Any]:
        """The context to one call of llama-cpp-python's own path: the lock, or with parallel
        slots the decoder's exclusive turn (which waits for the batch to drain)."""
        return self._decoder.exclusive() if self._decoder is not None else self._lock

    def _n_ctx(self) -> int:
        return self._decoder.context if self._decoder is not None else int(self._llm.n_ctx())

    def weight_bytes(self) -> int:
        if self._llm is None or self._released:
            return 0
        import llama_cpp

        return int(llama_cpp.llama_model_size(self._llm.model))

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(self._llm.tokenize(t.encode("utf-8"), add_bos=False, special=False))
                for t in texts]

    def renders_tools(self) -> bool:
        llm = self._llm
        if llm.chat_format != llama_compat.TEMPLATE_FORMAT:  # no template: a built-in format
            return False
        return template_renders_tools(str(llm.metadata.get("tokenizer.chat_template", "")))

    def chat(self, messages: Sequence[Message], params: GenerationParams,
             on_text: OnText | None = None) -> Generated:
        wire = [_wire(m) for m in messages]
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.parameters}}
                 for t in params.tools] or None
        if self._decoder is not None and self._formatter is not None:
            try:
                rendered = self._formatter(messages=wire, tools=tools)
            except ValueError as exc:  # the chat template's raise_exception
                raise InvalidRequest(f"the chat template of {self.name} refused the "
                                     f"messages: {exc}", param="messages") from exc
            tokens = self._llm.tokenize(rendered.prompt.encode("utf-8"),
                                        add_bos=not rendered.added_special, special=True)
            extra = rendered.stop if isinstance(rendered.stop, list) else [rendered.stop or ""]
            return self._batched(tokens, params, on_text, (*params.stop, *extra), "messages")
        return self._run(lambda **kw: self._llm.create_chat_completion(messages=wire,
                                                                       tools=tools, **kw),
                         params, on_text, chat=True)

    def complete(self, prompt: str | Sequence[int], params: GenerationParams,
                 on_text: OnText | None = None) -> Generated:
        assert isinstance(prompt, str), "this engine does not declare token_ids"
        if not params.echo:
            if self._decoder is not None and prompt:
                return self._batched(llama_compat.completion_tokens(self._llm, prompt),
                                     params, on_text, params.stop, "prompt")
            return self._run(lambda **kw: self._llm.create_completion(prompt=prompt, **kw),
                             params, on_text, chat=False)
        # No echo with a stream (the route refuses it): `on_text` only says whether to go on.
        go_on = (lambda: on_text("", ())) if on_text is not None else (lambda: True)
        with self._alone(), turn(units=int(self._llm.n_threads)):
            read, scored, whole = self._score(prompt, params.logprobs, go_on)
        if params.max_tokens == 0 or not whole:  # scoring only, or the client left
            return Generated(text="", finish_reason="length", prompt_tokens=read,
                             completion_tokens=0, logprobs=(), prompt_logprobs=scored)
        out = self._run(lambda **kw: self._llm.create_completion(prompt=prompt, **kw),
                        params, on_text, chat=False)
        return dataclasses.replace(out, prompt_logprobs=scored)

    def _score(self, prompt: str, top: int | None, go_on: Callable[[], bool]
               ) -> tuple[int, tuple[TokenLogprob, ...], bool]:
        """The prompt's length in tokens (its BOS included); its tokens (without the BOS)
        with, given `top`, the logprob of each given the ones before it; and whether all were
        read: it stops early once `go_on` says the client has gone (checked every slice).

        llama.cpp keeps the logits of the last token of each batch only (logits for every
        position, `logits_all`, would cost context x vocabulary x 4 bytes: 2 GiB for Gemma), so
        the prompt is read one token at a time and each step's row is read before the next.
        Slower than a batched read; the KV cache it leaves is reused by the generation after."""
        llm = self._llm
        text = prompt.encode("utf-8")
        tokens = llm.tokenize(text, add_bos=True, special=True)
        lead = len(tokens) - len(llm.tokenize(text, add_bos=False, special=True))  # BOS
        if len(tokens) > self._n_ctx():
            raise InputTooLong(f"prompt of {len(tokens)} tokens exceeds the context window "
                               f"({self._n_ctx()}) of {self.name}", param="prompt")
        steps = _Steps(llm, top)
        row = None
        llm.reset()
        scored: list[TokenLogprob] = []
        for i, token in enumerate(tokens):
            if i >= lead:
                scored.append(steps.entry(row, token) if top is not None and row is not None
                              else steps.bare(token))
            if i + 1 < len(tokens) and top is not None:
                if i and i % PROMPT_SLICE == 0:
                    if not go_on():
                        break
                    between_slices()
                llm.eval([token])
                row = steps.row(-1)
        return len(tokens), tuple(scored), len(scored) + lead == len(tokens)

    def _run(self, call: Any, params: GenerationParams, on_text: OnText | None,
             chat: bool) -> Generated:
        grammar = None
        if params.json_schema is not None or params.json_object:
            grammar = schema_grammar(params.json_schema)
        kwargs: dict[str, Any] = {
            "max_tokens": params.max_tokens if params.max_tokens is not None else 0,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stop": list(params.stop) or None,
            "seed": None if params.seed is None else params.seed % 2**32,
            "grammar": grammar,
            **sampling_extensions(params),
        }
        llm = self._llm
        steps = _Steps(llm, params.logprobs)  # counts the tokens; their logprobs if asked
        with self._alone(), turn(units=int(llm.n_threads)), \
                llama_compat.sampling_hook(llm, steps.step):
            try:
                if on_text is None:
                    out = call(stream=False, **kwargs)
                    choice = out["choices"][0]
                    text = choice["message"]["content"] if chat else choice["text"]
                    completion = out["usage"]["completion_tokens"]
                    return Generated(text=text or "", finish_reason=_finish(choice),
                                     prompt_tokens=out["usage"]["prompt_tokens"],
                                     completion_tokens=completion,
                                     logprobs=None if params.logprobs is None
                                     else tuple(steps.sampled[:completion]))
                return self._stream(call(stream=True, **kwargs), on_text, chat, steps)
            except ValueError as exc:
                if "exceed context window" in str(exc):
                    raise InputTooLong(f"{exc} of {self.name}; shorten the prompt or lower "
                                       f"max_tokens", param="messages" if chat else "prompt"
                                       ) from exc
                if chat:  # the chat template's raise_exception: it refuses these messages
                    raise InvalidRequest(f"the chat template of {self.name} refused the "
                                         f"messages: {exc}", param="messages") from exc
                raise

    def _batched(self, tokens: list[int], params: GenerationParams, on_text: OnText | None,
                 stop: Sequence[str], param: str) -> Generated:
        """Generate through the decoder's parallel slots, as llama-cpp-python's
        `create_completion` would for these tokens (its sampler chain, stop strings, context
        checks), beside other requests' sequences. Waits in this thread for the answer, holding
        no compute turn (the decoder holds one per step)."""
        n_ctx = self._n_ctx()
        assert self._decoder is not None
        if len(tokens) >= n_ctx:
            raise InputTooLong(f"Requested tokens ({len(tokens)}) exceed context window of "
                               f"{n_ctx} of {self.name}; shorten the prompt or lower "
                               f"max_tokens", param=param)
        room = n_ctx - len(tokens)
        grammar = None
        if params.json_schema is not None or params.json_object:
            grammar = schema_grammar(params.json_schema)
        job = Job(prompt=tokens,
                  max_tokens=min(params.max_tokens, room) if params.max_tokens else room,
                  temperature=params.temperature, top_p=params.top_p, **sampling_extensions(params),
                  seed=None if params.seed is None else params.seed % 2**32,
                  stop=tuple(s.encode("utf-8") for s in stop if s), grammar=grammar,
                  recorder=None if params.logprobs is None else _Steps(self._llm,
                                                                       params.logprobs),
                  ticket=TICKET.get())
        return self._decoder.run(job, on_text)

    def _stream(self, chunks: Iterator[dict[str, Any]], on_text: OnText,
                chat: bool, steps: _Steps) -> Generated:
        parts: list[str] = []
        finish = "length"
        sent = 0  # tokens whose logprobs went out with a piece
        try:
            for chunk in chunks:
                choice = chunk["choices"][0]
                piece = (choice["delta"].get("content") if chat else choice["text"]) or ""
                if piece:
                    parts.append(piece)
                    # The tokens sampled since the last piece made this one (llama-cpp-python
                    # holds text back while it could still be the start of a stop string).
                    made = steps.sampled[sent:]
                    sent += len(made)
                    if not on_text(piece, made):
                        finish = "stop"
                        break
                    between_tokens()
                if choice.get("finish_reason"):
                    finish = _finish(choice)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        # Streams carry no usage: the sampler counted (end-of-generation tokens aside).
        return Generated(text="".join(parts), finish_reason="stop" if finish == "stop"
                         else "length", prompt_tokens=steps.prompt, completion_tokens=steps.count,
                         logprobs=None if steps.top is None else tuple(steps.sampled[:sent]))


class _Steps:
    """What the sampler chose at each step of a generation: how many tokens, how long the prompt
    was, and with `top` (not None) each token's logprob and the `top` most likely ones.

    Logprobs come from the logits llama.cpp computed for the step: one row of the vocabulary,
    read while it is current (llama.cpp keeps the last token's logits only); float32, so a row
    and its temporaries are a few MiB for Gemma's 262k tokens, held for one step and freed.
    Nothing is kept for the whole context."""

    def __init__(self, llm: Any, top: int | None) -> None:
        import llama_cpp

        self._llm = llm
        self.top = top
        self._vocab = int(llm.n_vocab())
        self._tokens = llama_cpp.llama_model_get_vocab(llm.model)  # the model's vocabulary
        self._pieces: dict[int, bytes] = {}
        self.sampled: list[TokenLogprob] = []  # with `top`: each generated token
        self.count = 0  # tokens generated, end-of-generation excluded
        self.prompt = 0  # tokens in the context when the first token was sampled

    def row(self, index: int) -> Any:
        """The log-softmax of the logits at `index` of the last batch (-1: its last token)."""
        import llama_cpp
        import numpy as np

        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._llm.ctx, index),
                                       shape=(self._vocab,))
        peak = logits.max()
        total = np.exp(logits - peak).sum(dtype=np.float64)
        return logits - np.float32(peak + np.log(total))

    def step(self, index: int, sample: Callable[[], int]) -> int:
        """One step of llama-cpp-python's generation (`llama_compat.sampling_hook`): `sample()`
        the token at `index` of the last batch, counted and recorded as `top` asks."""
        from llama_cpp import llama_vocab_is_eog

        if not self.count and not self.sampled:
            self.prompt = int(self._llm.n_tokens)
        row = None if self.top is None else self.row(index)
        token = sample()
        if not llama_vocab_is_eog(self._tokens, token):
            self.count += 1
            if row is not None:
                self.sampled.append(self.entry(row, token))
        return token

    def entry(self, row: Any, token: int) -> TokenLogprob:
        import numpy as np

        top: tuple[Alternative, ...] = ()
        if self.top:
            best = np.argpartition(row, -self.top)[-self.top:]
            best = best[np.argsort(-row[best], kind="stable")]
            top = tuple(Alternative(*self._text(int(t)), float(row[t])) for t in best)
        return TokenLogprob(*self._text(token), float(row[token]), top)

    def bare(self, token: int) -> TokenLogprob:
        """A token with no logprob: a prompt's first, or any prompt token without `logprobs`."""
        return TokenLogprob(*self._text(token), None)

    def _text(self, token: int) -> tuple[str, bytes]:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = bytes(self._llm.detokenize([token]))
        return piece.decode("utf-8", errors="replace"), piece


_PROBE_TOOL = "packserve_probe_tool"


@functools.lru_cache(maxsize=16)
def template_renders_tools(template: str) -> bool:
    """Whether a Jinja chat template shows the `tools` it is given: rendered with one probe
    tool, the prompt names it (as llama.cpp's server probes a template's capabilities)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    probe: Any = [{"type": "function", "function": {
        "name": _PROBE_TOOL, "description": "a probe",
        "parameters": {"type": "object", "properties": {}}}}]
    try:
        prompt = Jinja2ChatFormatter(template, eos_token="", bos_token="")(
            messages=[{"role": "user", "content": "hi"}], tools=probe).prompt
    except Exception:  # a template that fails when given tools cannot use them
        return False
    return _PROBE_TOOL in prompt


_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux 5.14+
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _advise(ranges: Sequence[tuple[int, int]], advice: int) -> bool:
    """madvise(2) over `ranges`; False if the kernel refused any."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return all(libc.madvise(start, end - start, advice) == 0 for start, end in ranges)


def _populate(ranges: Sequence[tuple[int, int]]) -> None:
    """Read `ranges` of a file mapping into memory (from the page cache or the disk)."""
    if not _advise(ranges, _MADV_POPULATE_READ):
        for start, end in ranges:  # kernels before 5.14: touch each page
            for address in range(start, end, _PAGE):
                ctypes.string_at(address, 1)


def _wire(m: Message) -> dict[str, Any]:
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


def _sliced(evaluate: Any, batch_threads: int) -> Any:
    """`Llama.eval` reading its tokens `PROMPT_SLICE` at a time, offering the compute turn
    between slices, each slice of several tokens holding `batch_threads` units of it (llama.cpp
    runs a step of several tokens on `n_threads_batch`, one token on `n_threads`, which the
    turn holds). llama-cpp-python's generation calls `self.eval` with the prompt, then with
    each new token; consecutive calls are the same as one (it keeps the tokens it has read)."""

    def eval_in_slices(tokens: Sequence[int]) -> None:
        for start in range(0, len(tokens), PROMPT_SLICE):
            if start:
                between_slices()
            piece = tokens[start:start + PROMPT_SLICE]
            if len(piece) > 1:
                with step_units(batch_threads):
                    evaluate(piece)
            else:
                evaluate(piece)

    return eval_in_slices


def _finish(choice: dict[str, Any]) -> Any:
    return "length" if choice.get("finish_reason") == "length" else "stop"


def _context(requested: int | None, facts: ModelFacts | None) -> int:
    trained = facts.context_length if facts is not None else 0
    return requested or min(DEFAULT_CONTEXT, trained or DEFAULT_CONTEXT)


def _size(facts: ModelFacts | None, load: LoadSpec, name: str, sequences: int) -> Breakdown:
    assert facts is not None  # reads_files
    return llama_cpp_breakdown(shape_of(facts, name), load.context_length, sequences,
                               shared_cache=sequences > 1 and not load.cache_per_slot)


def _gguf(path: Path) -> str | None:
    return None if path.suffix == ".gguf" else f"a .gguf file, got {path}"


# Sequences decoded together unless the entry sets `parallel`: one, so far. On the 2-core build
# machine four slots made four concurrent chats 1.15x one stream (the goal is 2x), and a shared
# cache lets greedy answers drift with their neighbours (docs/tuning.md, parallel decode);
# an operator opts in per model until a machine with more cores, or a GPU, says otherwise.
DEFAULT_PARALLEL = 1

def sampling_extensions(params: GenerationParams) -> dict[str, Any]:
    """The extensions this engine honours (`SAMPLING`), by llama.cpp's names (llama-cpp-python's
    arguments, the batch decoder's `Job` fields and llama-server's request fields); absent,
    llama.cpp's defaults."""
    out: dict[str, Any] = {"frequency_penalty": params.frequency_penalty,
                           "presence_penalty": params.presence_penalty}
    if params.top_k is not None:
        out["top_k"] = params.top_k
    if params.min_p is not None:
        out["min_p"] = params.min_p
    if params.repetition_penalty is not None:
        out["repeat_penalty"] = params.repetition_penalty
    return out


@functools.cache
def _gpu_offload() -> str | None:
    """llama-cpp-python's build offloads to a GPU (a CUDA build: scripts/setup.sh on a GPU box)."""
    try:
        from llama_cpp import llama_supports_gpu_offload
    except ImportError:
        return "llama-cpp-python is not installed (scripts/setup.sh)"
    if not llama_supports_gpu_offload():
        return "llama-cpp-python was built without GPU support (scripts/setup.sh on this machine)"
    return None


# logit_bias (llama-cpp-python applies it through a Python logits processor per token),
# ignore_eos and min_tokens are not honoured in the worker: the llama-server engine takes them.
SAMPLING = frozenset({"top_k", "min_p", "repetition_penalty", "presence_penalty",
                      "frequency_penalty"})
ENGINE = Engine(name="llama-cpp", tasks=frozenset({Task.CHAT, Task.COMPLETE}),
                default_concurrency=1, build=LlamaCppBackend, size=_size, check_source=_gguf,
                context=_context, library="llama_cpp", default_parallel=DEFAULT_PARALLEL,
                sampling=SAMPLING, cuda=_gpu_offload)
ENGINES = (ENGINE,)
