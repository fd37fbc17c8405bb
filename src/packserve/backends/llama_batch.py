"""Parallel decode for one llama.cpp load: several sequences in one batch, as llama.cpp's own
server decodes its parallel slots (Ollama's `OLLAMA_NUM_PARALLEL`).

A `BatchDecoder` owns the load's llama.cpp context, made with `n_seq_max = slots`, and one
thread that decodes. Requests (`Job`s) wait in a queue; each step of the thread

1. admits queued jobs to free slots: the free slot whose cached tokens share the longest prefix
   with the prompt, so a conversation's next turn reads only its new tokens (llama.cpp's
   server does the same; llama-cpp-python's `Llama` reuses its one sequence's prefix);
2. builds one `llama_batch` with the next token of every generating sequence and a slice of
   `PROMPT_SLICE` tokens of every prompt still being read;
3. calls `llama_decode` once and samples, holding the compute turn of the most urgent request
   (`core.compute.batch_turn`): one step is one engine call;
4. samples each sequence that has read all its input with its own sampler chain (temperature,
   top_p, seed and grammar kept apart), detokenises, applies its own stop strings, and hands
   its text to its request. A finished sequence frees its slot; its cells stay as a prefix
   cache until the room is needed.

The KV cache is either shared (`unified`, the default): `context` tokens for all the slots,
so parallel slots add no KV memory over one sequence (llama.cpp's server shares its cache
across slots by default); or one cache of `context` tokens per slot. Each sequence may grow to
`context` tokens either way. When a shared cache runs short, idle slots' caches go first, least
recently used first; then the youngest running sequence is preempted: its cells are dropped
and it goes back to the head of the queue with its prompt and the tokens it has generated, to
be read again when room frees up (vLLM's recompute preemption); its sampler, grammar state and
text so far are kept.

Numerics. llama.cpp's default CPU attention rounds differently when a sequence's token is
computed alone than beside others (a one-token step mid-prompt moves SmolLM2's logits), so in
a shared cache (which keeps llama-cpp-python's default attention) a greedy answer
computed beside other sequences can part from the one it gets alone after some tokens, as in
llama.cpp's server and vLLM, which are not batch-invariant either; an answer computed alone is
exactly llama-cpp-python's own, unless it reuses a cached prefix that was computed beside
others (prefixes are reused whatever computed them, as llama.cpp's server does). With a cache
per slot, attention runs with flash attention, with
which a sequence's logits do not depend on its neighbours: each greedy answer is exactly the one
it gets alone (flash attention rounds differently from the default path, so these answers can
differ from llama-cpp-python's own).

The request's own thread calls its `on_text` (`run`), so a slow client never stalls the batch;
when `on_text` says stop (the client left), the job is dropped at the next step and its slot
freed before `run` returns.

Lock order and invariants: `_cond` guards the queue, the slot table and the exclusive state;
it is never held during a decode, a sampling or a callback. Only the decode thread touches the
context and `_cached`, except inside `exclusive()`, which pauses admission, waits until no
slot is busy and lends the whole context to one caller (llama-cpp-python's `Llama`, which reads
a prompt in sequence 0 and cuts every sequence back when it evaluates).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import random
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from packserve.backends import llama_compat
from packserve.backends.llama_compat import SAMPLE_MIN_P, SAMPLE_TOP_K
from packserve.core.backend import Generated, OnText, TokenLogprob
from packserve.core.compute import Ticket, batch_turn, token_made

# A prompt is read this many tokens at a time (per sequence, per step here; llama.py's serial
# path likewise), so that a more urgent call (an embedding) waits for one slice of somebody
# else's prompt, not the whole of it (core.compute).
PROMPT_SLICE = 32

log = logging.getLogger("packserve.llama")


class Recorder(Protocol):
    """Logprobs of a job's sampled tokens (llama.py's `_Steps`): `row` reads the log-softmax
    of the logits at a batch index, `entry` makes a token's record from it."""

    def row(self, index: int) -> Any: ...

    def entry(self, row: Any, token: int) -> TokenLogprob: ...


@dataclass(eq=False)
class Job:
    """One request's sequence: what to read, how to sample it, and where its text goes.

    `max_tokens` is already capped so that prompt and answer fit the context."""

    prompt: Sequence[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = SAMPLE_TOP_K
    min_p: float = SAMPLE_MIN_P
    repeat_penalty: float = 1.0  # with the next two: over llama_compat.PENALTY_LAST_N tokens
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[bytes, ...] = ()
    grammar: Any = None  # a llama_cpp LlamaGrammar, used by this job only
    recorder: Recorder | None = None  # with logprobs
    ticket: Ticket | None = None
    cancelled: bool = False  # set by the request's thread: its client left
    events: queue.SimpleQueue[_Piece | Generated | BaseException] = field(
        default_factory=queue.SimpleQueue)


@dataclass(frozen=True)
class _Piece:
    text: str
    logprobs: tuple[TokenLogprob, ...]


@dataclass(eq=False)
class _Seq:
    """A job, in the queue (`slot` -1) or in a slot, and how far it has got."""

    job: Job
    history: list[int]  # the prompt and every token sampled since (end-of-generation aside)
    slot: int = -1
    admitted: int = 0  # the step it was (last) admitted at: the youngest is preempted first
    pending: list[int] = field(default_factory=list)  # to read before the next sample
    sampler: Any = None  # built when first admitted, kept across preemption
    out: bytearray = field(default_factory=bytearray)  # the answer's bytes so far
    sent: int = 0  # bytes of `out` handed to the request
    parts: list[str] = field(default_factory=list)
    generated: int = 0  # tokens sampled, end-of-generation excluded
    logprobs: list[TokenLogprob] = field(default_factory=list)
    unsent: int = 0  # index in `logprobs` of the first not yet sent with a piece


class BatchDecoder:
    """Decodes the jobs of one llama.cpp load `slots` at a time, in one batch per step.

    Built by the backend's `load()` on its `Llama`, whose one context was made with
    `n_seq_max = slots` (`unified`: one KV cache shared by the slots, else one per slot), so
    the `Llama` still tokenises, renders chat templates and runs the calls that are not
    batched, inside `exclusive()`, in sequence 0 of the same cache. Steps of one token per
    sequence run on `threads` threads, steps of several tokens on `batch_threads`."""

    def __init__(self, llm: Any, *, slots: int, threads: int, batch_threads: int,
                 unified: bool = True) -> None:
        import llama_cpp

        self._llm = llm
        self._units = (threads, batch_threads)
        self._shared = unified
        self._handle = llm.ctx  # the raw llama_context, the `Llama`'s until it is closed
        self.slots = slots
        self.context = int(llama_cpp.llama_n_ctx_seq(self._handle))
        self._n_batch = int(llm.context_params.n_batch)
        self._batch = llama_cpp.llama_batch_init(self._n_batch, 0, 1)
        self._vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self._pieces: dict[int, bytes] = {}
        self._cond = threading.Condition()
        self._queue: list[_Seq] = []
        self._busy: list[_Seq | None] = [None] * slots
        self._cached: list[list[int]] = [[] for _ in range(slots)]  # tokens in each slot's KV
        self._last_use = [0] * slots
        self._steps = 0
        self.preempted = 0  # sequences sent back to the queue for room (figures for tests)
        self._exclusive_waiting = 0
        self._exclusive = False
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="llama-batch", daemon=True)
        self._thread.start()

    @property
    def busy_slots(self) -> int:
        """Slots holding a sequence now (queued ones aside)."""
        with self._cond:
            return sum(s is not None for s in self._busy)

    # ------------------------------------------------------------------ called by requests

    def run(self, job: Job, on_text: OnText | None) -> Generated:
        """Queue `job`, pass its text to `on_text` as it comes (in this thread), and return
        the answer. Called in a request's worker thread; the job is dropped, its slot freed,
        before this returns when `on_text` says stop or raises."""
        with self._cond:
            if self._closing:
                raise RuntimeError("the model is being unloaded")
            self._queue.append(_Seq(job=job, history=list(job.prompt)))
            self._cond.notify_all()
        try:
            while True:
                event = job.events.get()
                if isinstance(event, _Piece):
                    if on_text is not None and not job.cancelled \
                            and not self._tell(job, on_text, event):
                        self._cancel(job)
                elif isinstance(event, Generated):
                    return event
                else:
                    raise event
        except BaseException:
            self._cancel(job)
            raise

    def _tell(self, job: Job, on_text: OnText, piece: _Piece) -> bool:
        """`on_text(piece)`. If it raises, the job is dropped and its slot freed before the
        exception goes on: the caller's lease must not end while the slot still decodes."""
        try:
            return on_text(piece.text, piece.logprobs)
        except BaseException:
            self._cancel(job)
            while isinstance(job.events.get(), _Piece):  # until its Generated or its error
                pass
            raise

    def _cancel(self, job: Job) -> None:
        with self._cond:
            job.cancelled = True
            self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The whole context for one caller: admission pauses, busy slots finish, and the
        caller runs alone with the cache empty; it is emptied again after."""
        with self._cond:
            self._exclusive_waiting += 1
            try:
                while self._exclusive or any(s is not None for s in self._busy):
                    self._cond.wait()
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            self._clear()
            yield
        finally:
            self._clear()
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    def _clear(self) -> None:
        """Empty the cache of every sequence: the one-sequence path gets all of it. (The
        context's `kv_cache_seq_rm(-1, ...)` that `Llama` uses reads -1 as sequence 0 and left
        the other slots' cells taken; llama.cpp's own call reads it as every sequence.)"""
        import llama_cpp

        self._llm.reset()
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self._llm.ctx), -1, 0, -1)
        self._cached = [[] for _ in range(self.slots)]

    def close(self) -> None:
        """Stop the decode thread (no job is in flight: unload waits for every lease) and free
        the batch. The context belongs to the `Llama` and goes with it."""
        with self._cond:
            self._closing = True
            for seq in self._queue:
                seq.job.events.put(RuntimeError("the model was unloaded"))
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=60)
        if self._thread.is_alive():  # still inside llama_decode: freeing would crash it
            log.error("the llama.cpp decode thread did not stop within 60 s; its batch is "
                      "left allocated")
            return
        import llama_cpp

        llama_cpp.llama_batch_free(self._batch)

    # ------------------------------------------------------------------ the decode thread

    def _loop(self) -> None:
        try:
            self._decode_forever()
        except BaseException as exc:  # a bug here: no request may wait for ever on its job
            log.exception("the llama.cpp decode thread failed")
            with self._cond:
                self._closing = True
                seqs = [*self._queue, *(s for s in self._busy if s is not None)]
                self._queue.clear()
                self._busy = [None] * self.slots
                self._cond.notify_all()
            error = RuntimeError(f"the model's decode thread failed: {exc!r}")
            for seq in seqs:
                seq.job.events.put(error)

    def _decode_forever(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._work_locked():
                    self._cond.wait()
                if self._closing and not any(s is not None for s in self._busy):
                    return
                admitted = self._admit_locked()
                live = [s for s in self._busy if s is not None]
            for seq in admitted:
                try:
                    self._prepare(seq)
                except Exception as exc:  # its sampler could not be built: it alone fails
                    self._fail([seq], exc)
            live = [s for s in live if self._busy[s.slot] is s]
            try:
                self._step(live)
            except Exception as exc:  # a failed decode: its jobs fail, the thread goes on
                self._fail([s for s in live if s.slot >= 0 and self._busy[s.slot] is s], exc)
            with self._cond:
                self._cond.notify_all()  # an exclusive caller may be waiting for idle slots

    def _work_locked(self) -> bool:
        if any(s is not None for s in self._busy):
            return True
        return bool(self._queue) and not (self._exclusive or self._exclusive_waiting)

    def _admit_locked(self) -> list[_Seq]:
        """Queued sequences into free slots, in queue order, while their input fits the cache
        beside the running ones' (idle caches are given up for it); with `_cond` held."""
        out: list[_Seq] = []
        claimed = sum(len(self._cached[s.slot]) for s in self._busy if s is not None)
        for seq in list(self._queue):
            if seq.job.cancelled:
                self._queue.remove(seq)
                self._done(seq, "stop")
                continue
            if self._exclusive or self._exclusive_waiting:
                break
            free = [i for i, s in enumerate(self._busy) if s is None]
            if not free:
                break
            slot = max(free, key=lambda i: (_common(self._cached[i], seq.history),
                                            -self._last_use[i]))
            if self._shared and claimed + len(seq.history) > self.context - 1:
                break  # its cells (reused or to read) do not fit beside the running ones
            claimed += len(seq.history)
            self._queue.remove(seq)
            seq.slot, seq.admitted = slot, self._steps
            self._busy[slot] = seq
            out.append(seq)
        return out

    def _prepare(self, seq: _Seq) -> None:
        """Cut the slot's cache back to what it shares with the sequence (at least one token
        is read, so there are logits to sample from); build the sampler on first admission."""
        cached = self._cached[seq.slot]
        keep = min(_common(cached, seq.history), len(seq.history) - 1)
        llama_compat.drop_cells(self._llm, seq.slot, keep)
        del cached[keep:]
        seq.pending = seq.history[keep:]
        if seq.sampler is None:
            seq.sampler = self._sampler(seq.job)

    def _sampler(self, job: Job) -> Any:
        """The chain llama-cpp-python would sample `job` with, with the job's own seed."""
        return llama_compat.sampler_chain(
            self._llm, temperature=job.temperature, top_k=job.top_k, top_p=job.top_p,
            min_p=job.min_p, repeat_penalty=job.repeat_penalty,
            frequency_penalty=job.frequency_penalty, presence_penalty=job.presence_penalty,
            grammar=job.grammar,
            seed=job.seed if job.seed is not None else random.randrange(2**32))

    # ..................................................................... one step

    def _free_cells(self) -> int:
        """Cells a step may fill: a shared cache's free ones; with a cache per slot, any step
        fits (a sequence's answer was capped to its slot's context)."""
        if not self._shared:
            return self._n_batch
        return self.context - sum(len(c) for c in self._cached)

    def _drop_idle_cache(self) -> bool:
        """Give up the least recently used idle slot's cached prefix; False: there is none."""
        idle = [i for i, s in enumerate(self._busy) if s is None and self._cached[i]]
        if not idle:
            return False
        i = min(idle, key=lambda j: self._last_use[j])
        llama_compat.drop_cells(self._llm, i, 0)
        self._cached[i] = []
        return True

    def _preempt(self, seq: _Seq) -> None:
        """Drop `seq`'s cells and queue it first, to read its history again later."""
        llama_compat.drop_cells(self._llm, seq.slot, 0)
        self._cached[seq.slot] = []
        with self._cond:
            self._busy[seq.slot] = None
            seq.slot, seq.pending = -1, []
            self._queue.insert(0, seq)
            self.preempted += 1

    def _plan(self, live: list[_Seq]) -> list[tuple[_Seq, list[int]]]:
        """What each sequence reads this step: generating ones one token each, oldest first,
        preempting the youngest when the cache is full; then prompt slices in what room is
        left (batch and cache), oldest first."""
        reads: list[tuple[_Seq, list[int]]] = []
        order = sorted(live, key=lambda s: s.admitted)
        left = self._n_batch
        for seq in [s for s in order if len(s.pending) == 1]:
            while seq.slot >= 0 and self._free_cells() < 1 and not self._drop_idle_cache():
                planned = {id(r) for r, _ in reads}  # older: kept
                self._preempt(max((s for s in order if s.slot >= 0 and id(s) not in planned),
                                  key=lambda s: s.admitted))
            if seq.slot < 0:  # preempted (for an older one, or for room for itself)
                continue
            reads.append((seq, seq.pending[:1]))
            left -= 1
        for seq in [s for s in order if len(s.pending) > 1]:
            if seq.slot < 0:
                continue
            while self._free_cells() < min(PROMPT_SLICE, len(seq.pending)) \
                    and self._drop_idle_cache():
                pass
            take = seq.pending[:min(PROMPT_SLICE, left, self._free_cells())]
            if take:
                reads.append((seq, take))
                left -= len(take)
        stuck = [s for s in live if s.slot >= 0]
        if not reads and len(stuck) > 1:  # readers holding every cell, none can go on
            self._preempt(max(stuck, key=lambda s: s.admitted))
        return reads

    def _step(self, live: list[_Seq]) -> None:
        import llama_cpp

        for seq in live:
            if seq.job.cancelled:
                self._finish(seq, "stop")
        live = [s for s in live if self._busy[s.slot] is s]
        if not live:
            return
        reads = self._plan(live)
        if not reads:
            return
        batch, n = self._batch, 0
        samples: list[tuple[_Seq, int]] = []  # sequences to sample, at their batch index
        for seq, take in reads:
            base = len(self._cached[seq.slot])
            for j, token in enumerate(take):
                batch.token[n + j] = token
                batch.pos[n + j] = base + j
                batch.n_seq_id[n + j] = 1
                batch.seq_id[n + j][0] = seq.slot
                batch.logits[n + j] = False
            n += len(take)
            if len(take) == len(seq.pending):
                batch.logits[n - 1] = True
                samples.append((seq, n - 1))
        batch.n_tokens = n
        self._steps += 1
        units = self._units[0] if n == 1 else self._units[1]
        with batch_turn((s.job.ticket for s, _ in reads), units):
            rc = llama_cpp.llama_decode(self._handle, batch)
            if rc == 1 and len(reads) > 1:  # no room in the cache after all: retry smaller
                self._preempt(max((s for s, _ in reads), key=lambda s: s.admitted))
                return
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc})")
            for seq, take in reads:
                self._cached[seq.slot].extend(take)
                del seq.pending[:len(take)]
                self._last_use[seq.slot] = self._steps
            sampled = [(seq, self._sample(seq, index)) for seq, index in samples]
        for seq, token in sampled:
            self._advance(seq, token)

    def _sample(self, seq: _Seq, index: int) -> int:
        rec = seq.job.recorder
        row = rec.row(index) if rec is not None else None
        token = llama_compat.sample(self._llm, seq.sampler, index)
        if rec is not None and not self._is_end(token):
            seq.logprobs.append(rec.entry(row, token))
        return token

    def _is_end(self, token: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def _advance(self, seq: _Seq, token: int) -> None:
        """After `token` was sampled for `seq`: stop, or hand out what text is safe to send
        (not the start of a stop string, no half a UTF-8 character) and read it next step."""
        job = seq.job
        token_made(job.ticket)
        if self._is_end(token):
            self._finish(seq, "stop")
            return
        seq.generated += 1
        seq.history.append(token)
        seq.out += self._piece(token)
        end = _stop_at(seq.out, job.stop)
        if end is not None:
            self._send(seq, end)
            self._finish(seq, "stop")
            return
        if seq.generated >= job.max_tokens:
            self._finish(seq, "length")
            return
        if not _incomplete_utf8(seq.out):
            self._send(seq, len(seq.out) - _held(seq.out, job.stop))
        seq.pending = [token]

    def _send(self, seq: _Seq, end: int) -> None:
        if end <= seq.sent:
            return
        text = bytes(seq.out[seq.sent:end]).decode("utf-8", errors="ignore")
        seq.sent = end
        made = tuple(seq.logprobs[seq.unsent:])
        seq.unsent = len(seq.logprobs)
        if text:
            seq.parts.append(text)
            seq.job.events.put(_Piece(text, made))

    def _finish(self, seq: _Seq, reason: str) -> None:
        """The answer is complete: send what is left (up to a stop string), free the slot."""
        if not seq.job.cancelled:
            end = _stop_at(seq.out, seq.job.stop)
            self._send(seq, len(seq.out) if end is None else end)
        with self._cond:
            self._busy[seq.slot] = None
            self._done(seq, reason)
            self._cond.notify_all()

    def _done(self, seq: _Seq, reason: str) -> None:
        job = seq.job
        job.events.put(Generated(
            text="".join(seq.parts), finish_reason="length" if reason == "length" else "stop",
            prompt_tokens=len(job.prompt), completion_tokens=seq.generated,
            logprobs=None if job.recorder is None else tuple(seq.logprobs[:seq.unsent])))

    def _fail(self, seqs: list[_Seq], exc: Exception) -> None:
        for seq in seqs:
            llama_compat.drop_cells(self._llm, seq.slot, 0)
            self._cached[seq.slot] = []
            with self._cond:
                if self._busy[seq.slot] is seq:
                    self._busy[seq.slot] = None
                self._cond.notify_all()
            seq.job.events.put(exc)

    def _piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            import llama_cpp

            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:  # longer than the buffer: ask again with room for it
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = self._pieces[token] = buf.raw[:n]
        return piece


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _stop_at(out: bytes | bytearray, stops: Sequence[bytes]) -> int | None:
    """Where the earliest stop string starts in `out`, or None."""
    found = [i for i in (out.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


def _held(out: bytes | bytearray, stops: Sequence[bytes]) -> int:
    """Bytes at the end of `out` that may be the start of a stop string: held back until the
    next token says whether they are."""
    held = 0
    for s in stops:
        for i in range(min(len(s) - 1, len(out)), held, -1):
            if out.endswith(s[:i]):
                held = i
                break
    return held


def _incomplete_utf8(out: bytes | bytearray) -> bool:
    """Whether `out` ends inside a multi-byte UTF-8 character (a token may carry part of one)."""
    for back in range(1, min(4, len(out)) + 1):
        byte = out[-back]
        if byte & 0xC0 != 0x80:  # a lead byte or ASCII: how long should its character be?
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 \
                else 4 if byte >> 3 == 0b11110 else 1
            return need > back
    return False
