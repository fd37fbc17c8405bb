"""Everything the llama.cpp engine (`llama.py`, `llama_batch.py`) assumes about
llama-cpp-python beyond its public `Llama` API: each use of a private attribute, each
monkeypatch, each piece of upstream code copied here, and each upstream default relied on.

Every item says what it does, why the public API does not do, and the version it was read
against (`CHECKED`, pinned in requirements.txt). `check()` tests every item's assumptions
against the installed llama_cpp and names each one that broke; tests/backends/test_llama_compat.py
runs it, so an upgrade of the pin fails there, not in a request. On an upgrade: run that test,
re-read the upstream code each failure names, update the item, then its probe in `_PROBES`.

The engine's other patches are to llama.cpp's C++ source, applied before the wheel is built
(scripts/patches/llama-cpp-python-*.patch, checked by scripts/setup.sh and
tests/test_engine_build.py); none of them changes the Python API.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

CHECKED = "0.3.36"  # the llama-cpp-python every item below was read against

__all__ = [
    "CHECKED",
    "PENALTY_LAST_N",
    "SAMPLE_MIN_P",
    "SAMPLE_TOP_K",
    "TEMPLATE_FORMAT",
    "LlamaCompatError",
    "chat_formatter",
    "check",
    "completion_tokens",
    "context_fields",
    "drop_cells",
    "free_context",
    "new_context",
    "sample",
    "sampler_chain",
    "sampling_hook",
    "set_sequence_window",
    "strict_json_strings",
    "wrap_eval",
]

# ---------------------------------------------------------------------- upstream defaults

SAMPLE_TOP_K = 40
"""`top_k` of `Llama.create_completion` / `create_chat_completion` when not given: the batch
decoder samples as they do (`Job`'s default)."""

SAMPLE_MIN_P = 0.05
"""`min_p` of `Llama.create_completion` / `create_chat_completion` when not given."""

PENALTY_LAST_N = 64
"""`Llama(last_n_tokens_size=)`'s default: the window the repetition penalties look back on."""

TEMPLATE_FORMAT = "chat_template.default"
"""The `Llama.chat_format` that `Llama.__init__` gives a model whose GGUF carries a Jinja chat
template (`tokenizer.chat_template`) and no built-in format matched: the only way to tell a
template-driven chat from a built-in format, which the public API does not say otherwise."""

# ---------------------------------------------------------------------- the load


_BUILD = threading.Lock()  # held while a `Llama` is built inside `context_fields`


@contextlib.contextmanager
def context_fields(fields: Mapping[str, object]) -> Iterator[None]:
    """While inside (holding a lock: one build at a time), `llama_cpp.llama_cpp`'s
    `llama_context_default_params` returns its defaults with `fields` set, so a `Llama` built
    meanwhile makes its one context with them.

    Why: `Llama` takes neither `n_seq_max` nor `kv_unified` (parallel slots), and setting them
    on a context made after would mean a second context: a KV cache made and freed. Monkeypatch
    of a module attribute, which `Llama.__init__` reads once, at call time."""
    import llama_cpp.llama_cpp as low

    module: Any = low
    with _BUILD:
        real = module.llama_context_default_params

        def with_fields() -> Any:
            params = real()
            for name, value in fields.items():
                setattr(params, name, value)
            return params

        module.llama_context_default_params = with_fields
        try:
            yield
        finally:
            module.llama_context_default_params = real


def set_sequence_window(llm: Any, tokens: int) -> None:
    """Make `llm` check prompts and answers against a window of `tokens` (one sequence's,
    when its context holds several sequences' cells) instead of the whole context's.

    Why: `Llama` keeps the window its checks read in the private `_n_ctx`, set once from the
    context's size; there is no public setter."""
    llm._n_ctx = tokens


EvalFn = Callable[[Sequence[int]], None]


def wrap_eval(llm: Any, wrap: Callable[[EvalFn], EvalFn]) -> None:
    """Replace `llm.eval` by `wrap(llm.eval)` for the life of `llm`.

    Why: `Llama.generate` reads the prompt and each new token through `self.eval(tokens)`, and
    offers no hook between its reads; an instance attribute of that name is seen by every
    generation (monkeypatch of an instance)."""
    llm.eval = wrap(llm.eval)


SampleHook = Callable[[int, Callable[[], int]], int]


@contextlib.contextmanager
def sampling_hook(llm: Any, hook: SampleHook) -> Iterator[None]:
    """While inside, each token `llm`'s generation samples goes through `hook(index, sample)`:
    `index` is the row of the last batch's logits it is sampled from (-1: the batch's last),
    `sample()` samples it (`Llama.sample`), and `hook` returns the token.

    Why: llama-cpp-python gives logprobs only with the logits of every position kept
    (`logits_all`, context x vocabulary floats) and has no per-token callback; `Llama.generate`
    calls `self.sample(..., idx=<absolute position>)`, so an instance attribute of that name
    sees every step (monkeypatch of an instance, undone on the way out)."""
    sample = type(llm).sample.__get__(llm)

    def hooked(*args: Any, **kwargs: Any) -> int:
        idx = kwargs.get("idx")
        return hook(-1 if idx is None else idx - llm.n_tokens,
                    lambda: sample(*args, **kwargs))

    llm.sample = hooked
    try:
        yield
    finally:
        del llm.sample  # back to the class's method


# ---------------------------------------------------------------------- the warm tier


def free_context(llm: Any) -> None:
    """Free `llm`'s context (`llama_free`: the KV cache and the compute buffers), keeping its
    model; nothing of a previous prompt counts as cached any more.

    Why: `Llama` frees its context only with its model (`close()`). Closing the private
    `_ctx` early is safe: its close is idempotent, so `Llama.close()` closing it again later
    does nothing."""
    llm._ctx.close()
    llm.n_tokens = 0


def new_context(llm: Any) -> None:
    """Give `llm` a new context with the parameters it was built with (after
    `free_context`).

    Why: `Llama` makes its context once, in `__init__`. The private `LlamaContext` (from
    `llama_cpp._internals`) is what `__init__` makes, over the private model `_model`; a
    context made here is freed with its model (it registers its close with the model's)."""
    from llama_cpp._internals import LlamaContext

    llm._ctx = LlamaContext(model=llm._model, params=llm.context_params, verbose=False)
    llm.n_tokens = 0


# ---------------------------------------------------------------------- parallel decode


def drop_cells(llm: Any, seq: int, start: int) -> None:
    """Drop sequence `seq`'s cells from position `start` on out of `llm`'s KV cache.

    Why: `Llama` reads one sequence and exposes no per-sequence cache call; the private
    context's `kv_cache_seq_rm` does it. Note its quirk, which callers inherit: a negative
    `seq` means sequence 0 (llama.cpp itself reads -1 as every sequence)."""
    llm._ctx.kv_cache_seq_rm(seq, start, -1)


def sampler_chain(llm: Any, *, temperature: float, top_k: int, top_p: float, min_p: float,
                  repeat_penalty: float, frequency_penalty: float, presence_penalty: float,
                  grammar: Any, seed: int) -> Any:
    """The sampler chain `Llama._init_sampler` builds for these settings (its penalties left
    out when they change nothing), seeded with `seed`, for one sequence of a batch.

    Why: `Llama` keeps one sampler, for its one sequence, and builds it inside `sample`; a
    batch needs one chain per sequence. A copy of `_init_sampler` (no logits processors, no
    mirostat), over the private `_internals.LlamaSampler` and `_model`."""
    from llama_cpp import _internals

    internals: Any = _internals  # its classes are untyped
    sampler = internals.LlamaSampler()
    if (repeat_penalty, frequency_penalty, presence_penalty) != (1.0, 0.0, 0.0):
        sampler.add_penalties(llm.n_vocab(), PENALTY_LAST_N, repeat_penalty,
                              frequency_penalty, presence_penalty)
    if grammar is not None:
        sampler.add_grammar(llm._model, grammar)
    if temperature < 0:
        sampler.add_dist(seed)
    elif temperature == 0:
        sampler.add_greedy()
    else:
        sampler.add_top_k(top_k)
        sampler.add_typical(1.0, 1)
        sampler.add_top_p(top_p, 1)
        sampler.add_min_p(min_p, 1)
        sampler.add_temp(temperature)
        sampler.add_dist(seed)
    return sampler


def sample(llm: Any, sampler: Any, index: int) -> int:
    """A token from `sampler` (a `sampler_chain`), over the logits at `index` of `llm`'s last
    batch.

    Why: `LlamaSampler.sample` takes the private context object `_ctx`, not the raw pointer
    `Llama.ctx`."""
    return int(sampler.sample(llm._ctx, index))


# ---------------------------------------------------------------------- prompts


def chat_formatter(llm: Any) -> Any:
    """The formatter behind llama-cpp-python's handler for the model's own Jinja chat template
    (as `Llama.__init__` builds it), or None when the model uses a built-in chat format.

    Why: `Llama` keeps the formatter inside a chat handler that also generates; the batch
    decoder needs the rendered prompt alone. A copy of `__init__`'s construction, with the
    private `_model.token_get_text` for the BOS and EOS texts."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata.get("tokenizer.chat_template")
    if llm.chat_format != TEMPLATE_FORMAT or llm.chat_handler is not None or not template:
        return None
    eos, bos = llm.token_eos(), llm.token_bos()
    return Jinja2ChatFormatter(template=template,
                               eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
                               bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
                               stop_token_ids=[eos])


def completion_tokens(llm: Any, prompt: str) -> list[int]:
    """The tokens llama-cpp-python's `create_completion` reads for a non-empty text prompt
    without a suffix: a BOS (or CLS) when the model adds one, the text with special tokens
    parsed, and an EOS (or SEP) when the model adds one.

    Why: `create_completion` tokenises and generates in one call; the batch decoder needs the
    tokens alone. A copy of `Llama._create_completion`'s framing, over the private `_model`."""
    model = llm._model
    cls, sep = model.token_cls(), model.token_sep()
    bos = cls if cls != -1 else llm.token_bos()
    head = [bos] if model.add_bos_token() and bos != -1 else []
    tail = [] if not model.add_eos_token() and sep == -1 else [sep if sep != -1
                                                               else llm.token_eos()]
    text: list[int] = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
    return head + text + tail


_LOOSE_CHAR = 'char ::= [^"\\\\]'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F]'


def strict_json_strings(gbnf: str) -> str:
    """`gbnf` (from `llama_grammar.json_schema_to_gbnf`) with its string characters limited to
    what JSON allows.

    Why: the converter's `char` rule admits raw control characters, which JSON strings may not
    hold and which let a small model wander inside a string until max_tokens. A patch of the
    converter's output text, a no-op should that rule read otherwise."""
    return gbnf.replace(_LOOSE_CHAR, _JSON_CHAR)


# ---------------------------------------------------------------------- the check


class LlamaCompatError(RuntimeError):
    """The installed llama-cpp-python breaks one or more of this module's assumptions."""


# sha256 of `Llama._init_sampler`'s source, whitespace removed, as `sampler_chain` copied it
_INIT_SAMPLER_SHA = "af3862a2e6c4ed9b"


def _source(fn: Any) -> str:
    return "".join(inspect.getsource(fn).split())


def _unread(fn: Any, *fragments: str) -> str | None:
    """None if `fn`'s source holds every fragment (whitespace aside), else the first missing."""
    source = _source(fn)
    for fragment in fragments:
        if "".join(fragment.split()) not in source:
            return f"{fn.__qualname__} no longer reads `{fragment}`"
    return None


def _untaken(fn: Any, *names: str) -> str | None:
    params = inspect.signature(fn).parameters
    missing = [n for n in names if n not in params]
    return f"{fn.__qualname__} takes no {', '.join(missing)}" if missing else None


def _absent(owner: Any, *names: str) -> str | None:
    missing = [n for n in names if not hasattr(owner, n)]
    label = getattr(owner, "__qualname__", getattr(owner, "__name__", repr(owner)))
    return f"{label} has no {', '.join(missing)}" if missing else None


def _default(fn: Any, name: str, value: object) -> str | None:
    found = inspect.signature(fn).parameters[name].default
    return None if found == value else f"{fn.__qualname__}'s {name} defaults to {found!r}"


def _probe_context_fields() -> str | None:
    import llama_cpp
    import llama_cpp.llama as high

    if getattr(high, "llama_cpp", None) is not llama_cpp.llama_cpp:
        return "llama_cpp.llama no longer reads the low-level module as `llama_cpp`"
    fields = {field[0] for field in llama_cpp.llama_context_params._fields_}
    missing = {"n_seq_max", "kv_unified"} - fields
    return (_absent(llama_cpp.llama_cpp, "llama_context_default_params")
            or (f"llama_context_params has no {', '.join(sorted(missing))}" if missing else None)
            or _unread(high.Llama.__init__,
                       "self.context_params = llama_cpp.llama_context_default_params()"))


def _probe_set_sequence_window() -> str | None:
    from llama_cpp import Llama

    return (_unread(Llama.__init__, "self._n_ctx = self.n_ctx()")
            or _unread(Llama._create_completion, "if len(prompt_tokens) >= self._n_ctx:"))


def _probe_wrap_eval() -> str | None:
    from llama_cpp import Llama

    return _untaken(Llama.eval, "tokens") or _unread(Llama.generate, "self.eval(tokens)")


def _probe_sampling_hook() -> str | None:
    from llama_cpp import Llama

    return (_untaken(Llama.sample, "idx")
            or _unread(Llama.generate, "token = self.sample(", "idx=sample_idx,"))


def _probe_free_context() -> str | None:
    from llama_cpp import Llama
    from llama_cpp._internals import LlamaContext

    return (_absent(LlamaContext, "close")
            or _unread(LlamaContext.__init__, "if self.ctx is None: return")
            or _unread(Llama.__init__, "self._ctx = self._stack.enter_context("))


def _probe_new_context() -> str | None:
    from llama_cpp import Llama
    from llama_cpp._internals import LlamaContext

    return (_untaken(LlamaContext.__init__, "model", "params", "verbose")
            or _unread(LlamaContext.__init__, "self.model._exit_stack.callback(self.close)")
            or _unread(Llama.__init__, "internals.LlamaContext( model=self._model,"
                                       " params=self.context_params,"))


def _probe_drop_cells() -> str | None:
    from llama_cpp._internals import LlamaContext

    return (_absent(LlamaContext, "kv_cache_seq_rm")
            or _unread(LlamaContext.kv_cache_seq_rm, "seq_id = seq_id if seq_id >= 0 else 0"))


def _probe_sampler_chain() -> str | None:
    from llama_cpp import Llama
    from llama_cpp._internals import LlamaSampler

    digest = hashlib.sha256(_source(Llama._init_sampler).encode()).hexdigest()[:16]
    return (_absent(LlamaSampler, "add_penalties", "add_grammar", "add_dist", "add_greedy",
                    "add_top_k", "add_typical", "add_top_p", "add_min_p", "add_temp")
            or (None if digest == _INIT_SAMPLER_SHA else
                f"Llama._init_sampler changed (source sha256 {digest}, copied from "
                f"{_INIT_SAMPLER_SHA}): compare it with sampler_chain"))


def _probe_sample() -> str | None:
    from llama_cpp._internals import LlamaSampler

    return _untaken(LlamaSampler.sample, "ctx", "idx")


def _probe_chat_formatter() -> str | None:
    from llama_cpp import Llama
    from llama_cpp._internals import LlamaModel

    return (_absent(LlamaModel, "token_get_text")
            or _unread(Llama.__init__,
                       'self._model.token_get_text(eos_token_id) if eos_token_id != -1 else ""',
                       'self._model.token_get_text(bos_token_id) if bos_token_id != -1 else ""',
                       "llama_chat_format.Jinja2ChatFormatter( template=template,"
                       " eos_token=eos_token, bos_token=bos_token,"
                       " stop_token_ids=[eos_token_id], )"))


def _probe_completion_tokens() -> str | None:
    from llama_cpp import Llama
    from llama_cpp._internals import LlamaModel

    return (_absent(LlamaModel, "token_cls", "token_sep", "add_bos_token", "add_eos_token")
            or _unread(Llama._create_completion,
                       "cls_token_id: int = self._model.token_cls()",
                       "sep_token_id: int = self._model.token_sep()",
                       "bos_tokens: List[int] = [cls_token_id if cls_token_id != -1"
                       " else bos_token_id]",
                       "eos_tokens: List[int] = [ sep_token_id if sep_token_id != -1"
                       " else self.token_eos() ]",
                       "or not self._model.add_bos_token() or bos_tokens[:1] == [-1]",
                       "not self._model.add_eos_token() and sep_token_id == -1",
                       "special=(prefix_token_id < 0 or suffix is None)",
                       "prefix_token_id: int = 0"))


def _probe_template_format() -> str | None:
    from llama_cpp import Llama

    return _unread(Llama.__init__, f'template_choices["{TEMPLATE_FORMAT}"] =',
                   f'self.chat_format = "{TEMPLATE_FORMAT}"')


def _probe_sample_top_k() -> str | None:
    from llama_cpp import Llama

    return (_default(Llama.create_completion, "top_k", SAMPLE_TOP_K)
            or _default(Llama.create_chat_completion, "top_k", SAMPLE_TOP_K))


def _probe_sample_min_p() -> str | None:
    from llama_cpp import Llama

    return (_default(Llama.create_completion, "min_p", SAMPLE_MIN_P)
            or _default(Llama.create_chat_completion, "min_p", SAMPLE_MIN_P))


def _probe_penalty_last_n() -> str | None:
    from llama_cpp import Llama

    return (_default(Llama.__init__, "last_n_tokens_size", PENALTY_LAST_N)
            or _unread(Llama._init_sampler, "penalty_last_n=self.last_n_tokens_size"))


def _probe_strict_json_strings() -> str | None:
    from llama_cpp import llama_grammar

    text = llama_grammar.json_schema_to_gbnf(json.dumps({"type": "string"}))
    return None if _LOOSE_CHAR in text else (
        f"json_schema_to_gbnf no longer writes `{_LOOSE_CHAR}`")


# Each item above, with what breaks it: None while its assumptions hold, else what changed.
_PROBES: dict[str, Callable[[], str | None]] = {
    "SAMPLE_TOP_K": _probe_sample_top_k,
    "SAMPLE_MIN_P": _probe_sample_min_p,
    "PENALTY_LAST_N": _probe_penalty_last_n,
    "TEMPLATE_FORMAT": _probe_template_format,
    "context_fields": _probe_context_fields,
    "set_sequence_window": _probe_set_sequence_window,
    "wrap_eval": _probe_wrap_eval,
    "sampling_hook": _probe_sampling_hook,
    "free_context": _probe_free_context,
    "new_context": _probe_new_context,
    "drop_cells": _probe_drop_cells,
    "sampler_chain": _probe_sampler_chain,
    "sample": _probe_sample,
    "chat_formatter": _probe_chat_formatter,
    "completion_tokens": _probe_completion_tokens,
    "strict_json_strings": _probe_strict_json_strings,
}


def check() -> None:
    """Test every item's assumptions against the installed llama-cpp-python; raise
    `LlamaCompatError` naming each item that broke and what changed. Called by the tests, not
    at load: a different llama-cpp-python is the operator's choice, this says what to re-read."""
    import llama_cpp

    broken: list[str] = []
    for item, probe in _PROBES.items():
        try:
            problem = probe()
        except Exception as exc:  # an attribute gone, a source unreadable: the item broke
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            broken.append(f"  {item}: {problem}")
    if broken:
        raise LlamaCompatError(
            f"llama-cpp-python {llama_cpp.__version__} breaks {len(broken)} item(s) of "
            f"packserve.backends.llama_compat (read against {CHECKED}):\n" + "\n".join(broken))
