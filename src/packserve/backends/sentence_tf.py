"""sentence-transformers: embeddings, bi-encoder rerank scoring, and cross-encoder rerank.

Weights load only from safetensors unless the entry sets `allow_pickle = true`; remote code
runs only with `trust_remote_code = true`. Nothing is fetched from a hub.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from packserve.core.backend import Backend, Embeddings, LoadSpec, Ranking
from packserve.core.compute import turn, usable_cores
from packserve.core.engine import Engine
from packserve.core.footprint import shape_of
from packserve.errors import ConfigError, InputTooLong
from packserve.modelfiles import ModelFacts, file_identity
from packserve.planner.sizing import Breakdown, encoder_breakdown
from packserve.types import Task

# Read by huggingface_hub and tokenizers at import: never reach a hub; no tokenizer threads
# forked into the engine's own thread pool.
_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

# The fewest texts worth a core of their own: on one torch thread MiniLM spent 10.8 ms of CPU
# per sentence in passes of 4 and 8.7 in passes of 8 (8.1 in passes of 32) on the build machine
# (by hand, in one process).
_MIN_SHARD = 4

# A CPU bi-encoder's passes run through its encoder traced into a TorchScript graph once one
# is built and checked (`_traced_encoder`): the graph runs without Python between operators,
# so a pass holds the GIL only to start, and neither the event loop's work nor the other
# passes wait on it (docs/tuning.md, "Embedding passes through a traced encoder"). These
# are the inputs the graph takes; a tokenizer that gives others keeps the eager passes.
_GRAPH_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# The batches a traced encoder must embed as the eager model does (within 1e-5) before any
# pass uses it: padded, unpadded, one text, eight of mixed lengths, and (added in
# `_traced_encoder`) one long text, cut at the model's longest input up to 1024 tokens. The
# trace records Python's decisions on its example (a padded batch) as constants; these are the
# shapes where a decision could go the other way.
_PROBES = (
    ("short", "a longer sentence, with more words in it than the first has"),
    ("the same four words", "the same four words"),
    ("one",),
    ("a b c d e f g h", "x", "two words", "a sentence of six words here", "k", "l m",
     "n o p", "q r s t"),
)

log = logging.getLogger("packserve.sentence_tf")

# torch's own thread count in this process, read at the first prepare, before any shard thread
# set its own to 1: torch.set_num_threads also sets the default of every thread that runs torch
# later, so each thread that computes or loads sets its count explicitly.
_torch_threads = 0


def _default_threads() -> None:
    """Give the calling thread torch's own thread count (what it had before the shards)."""
    import torch

    if _torch_threads:
        torch.set_num_threads(_torch_threads)

# A token is rarely longer than this many characters; longer inputs are refused before the
# tokenizer sees them, so a megabyte string costs nothing.
_MAX_CHARS_PER_TOKEN = 32

T = TypeVar("T")


@dataclass(frozen=True)
class _WarmPart:
    """One module of a warm model: where each of its weights is read back from (file ->
    state-dict name -> key in the file), its non-persistent buffers (kept), and each file's
    identity when it went warm."""

    module: Any
    files: dict[Path, dict[str, str]]
    buffers: dict[str, Any]
    identity: dict[Path, tuple[int, int, int, int]]


def _warm_plan(model: Any, root: Path) -> tuple[_WarmPart, ...] | None:
    """How to read `model`'s weights back from the safetensors files under `root`, module by
    module (sentence-transformers' modules.json gives each its directory). None, and no warm
    state, unless every weight matches exactly one tensor of one file by name (the state-dict
    name or a tail of it), shape and dtype, no tensor serves two weights, and no weights are
    tied."""
    from safetensors import safe_open

    directories: dict[str, str] = {}
    listing = root / "modules.json"
    if listing.is_file():
        directories = {str(m.get("name", m.get("idx"))): str(m.get("path", ""))
                       for m in json.loads(listing.read_text("utf-8"))}
    parts = []
    for name, module in model.named_children():
        state = module.state_dict()
        if not state:
            continue  # pooling, normalisation: nothing to give back
        tied = len(dict(module.named_parameters(remove_duplicate=False)))
        if tied != len(dict(module.named_parameters())):
            return None
        found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
        for file in sorted((root / directories.get(name, "")).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safe_open has no __iter__)
                    if key in found:
                        return None  # two files hold it: which one transformers read is unknown
                    piece = f.get_slice(key)
                    found[key] = (file, tuple(piece.get_shape()), str(piece.get_dtype()))
        files: dict[Path, dict[str, str]] = {}
        used: set[str] = set()
        for key, tensor in state.items():
            pieces = key.split(".")
            match = next((tail for tail in (".".join(pieces[i:]) for i in range(len(pieces)))
                          if tail in found), None)
            if match is None or match in used:
                return None
            file, shape, dtype = found[match]
            if shape != tuple(tensor.shape) or _DTYPES.get(dtype) != str(tensor.dtype):
                return None
            used.add(match)
            files.setdefault(file, {})[key] = match
        persistent = set(state)
        buffers = {n: b.clone() for n, b in module.named_buffers() if n not in persistent}
        parts.append(_WarmPart(module=module, files=files, buffers=buffers,
                               identity={f: file_identity(f) for f in files}))
    return tuple(parts) if parts else None


# safetensors' dtype names -> torch's
_DTYPES = {"F64": "torch.float64", "F32": "torch.float32", "F16": "torch.float16",
           "BF16": "torch.bfloat16", "I64": "torch.int64", "I32": "torch.int32",
           "I16": "torch.int16", "I8": "torch.int8", "U8": "torch.uint8", "BOOL": "torch.bool"}


class _TorchBackend(Backend):
    _model: Any = None
    _warm: tuple[_WarmPart, ...] = ()  # while its weights are given back
    _parked: int = 0  # on a GPU, while warm: bytes of its weights parked in host RAM

    def __post_init__(self) -> None:
        # One tokenizer per load, shared by every name that uses it (an embedder and a
        # reranker), and it keeps its padding setting as shared state: a call that tokenizes
        # without padding while another thread encodes with it makes that batch fail
        # (huggingface/transformers#47085; `python -m benchmarks soak` found it as rerank 500s).
        # Whatever tokenizes is serialised under this lock (on a GPU, and for a cross-encoder,
        # the whole call); a bi-encoder on a CPU then runs the forward passes of several calls
        # at once (`_encode`).
        self._lock = threading.Lock()
        self._thread: ThreadPoolExecutor | None = None
        self._shards: ThreadPoolExecutor | None = None  # CPU: one-thread forward passes
        self._workers = 1
        self._passes = 0  # calls computing now (CPU), under _counting
        self._counting = threading.Lock()
        # CPU bi-encoder: its traced encoder, built in the background after the first pass of
        # a load or a restore ("none" -> "tracing" -> "used" or "refused"), under _counting.
        # The weights going (release, unload) drop it and bump the generation, so a trace
        # that started before is discarded.
        self._graph: Any = None
        self._graph_state = "none"
        self._graph_generation = 0
        self.graph_settled = threading.Event()  # the last trace ended (used or refused)
        self._tracer: threading.Thread | None = None  # the trace's thread, joined on a drop

    def _compute(self, fn: Callable[[], T]) -> T:
        """`fn()` on this load's own thread, the caller waiting. torch's OpenMP workers belong
        to the thread that starts a parallel region: calls arriving from the event loop's
        thread pool ran on a different thread each time, each with its own team of workers,
        and the idle teams spun on the cores the running call needed (py-spy and /proc showed
        four busy compute threads for torch's two). The caller's context (its compute ticket)
        goes along."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="packserve-torch",
                                              initializer=_default_threads)
        return self._thread.submit(contextvars.copy_context().run, fn).result()

    def _encode(self, texts: Sequence[str], count: Callable[[], T], normalize: bool = False
                ) -> tuple[Any, T]:
        """The sentence embeddings of `texts` (float32, one row each), as the model's `encode`
        gives them, and `count()`, the texts' tokens, counted (and refused past the model's
        limit) under the lock first.

        On a CPU a call is cut into shards, and each shard's forward pass runs on a thread of
        the load's own (one per core) with one torch thread (each thread sets its own count:
        see `_torch_threads`), the shards at once; several calls may compute at once
        (`embed_passes`), and then each takes fewer shards, so that every core runs one. A
        small model gains more from that than from torch's own threads in one pass, whose
        workers wait for each other at every operator (`benchmarks/compare_embeddings.py`;
        docs/tuning.md, "Embedding passes on one thread each"). The shards are cut from
        the texts sorted by length, as `encode` sorts its batches, and tokenized under the
        lock: the tokenizer's padding setting is shared state (see __post_init__). Only the
        forward passes run outside it."""
        import numpy as np

        model = self._model
        if not self.spec.device.startswith("cpu"):
            with self._lock, turn():
                tokens = count()
                return np.asarray(self._compute(lambda: model.encode(
                    list(texts), batch_size=self.spec.max_batch, convert_to_numpy=True,
                    normalize_embeddings=normalize, show_progress_bar=False)),
                    dtype=np.float32), tokens
        import torch
        from sentence_transformers.util import truncate_embeddings

        with self._lock:
            tokens = count()
            if not texts:
                return np.empty((0, model.get_sentence_embedding_dimension() or 0),
                                dtype=np.float32), tokens
            if self._shards is None:
                self._workers = usable_cores()
                self._shards = ThreadPoolExecutor(
                    self._workers, thread_name_prefix="packserve-torch",
                    initializer=torch.set_num_threads, initargs=(1,))
            pool = self._shards
            with self._counting:
                self._passes += 1
                # Alone, a call takes every core, in shards of at least _MIN_SHARD texts
                # (fewer are not worth a core); beside other calls, its share of the cores.
                shards = max(1, min(self._workers // self._passes,
                                    -(-len(texts) // _MIN_SHARD)))
            try:
                size = max(1, min(self.spec.max_batch, -(-len(texts) // shards)))
                order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
                prompt = (model.prompts.get(model.default_prompt_name)
                          if model.default_prompt_name else None)
                features = [model.preprocess([texts[i] for i in order[at:at + size]],
                                             prompt=prompt)
                            for at in range(0, len(texts), size)]
            except BaseException:
                self._ended_pass()
                raise

        graph = self._graph

        def forward(batch: dict[str, Any]) -> Any:
            with torch.inference_mode():
                out = _pass(model, graph, batch)
                out = truncate_embeddings(out, model.truncate_dim)
                if normalize:
                    out = torch.nn.functional.normalize(out, p=2, dim=1)
                return out.float().numpy()

        try:
            with turn(units=min(len(features), self._workers)):
                futures = [pool.submit(forward, batch) for batch in features]
                wait(futures)  # every shard, even after one failed: none runs past the turn
                rows = np.concatenate([f.result() for f in futures])
        finally:
            self._ended_pass()
        self._start_graph()
        vectors = np.empty_like(rows)
        vectors[order] = rows
        return vectors, tokens

    def _ended_pass(self) -> None:
        with self._counting:
            self._passes -= 1

    def _start_graph(self) -> None:
        """After a pass: trace the encoder on a thread of its own, once per load or restore
        (about half a second of one core for MiniLM, beside the passes, which stay eager
        until it is checked)."""
        with self._counting:
            model = self._model
            if self._graph_state != "none" or model is None or self._warm:
                return
            self._graph_state = "tracing"
            self.graph_settled.clear()
            generation = self._graph_generation
            self._tracer = threading.Thread(target=self._build_graph, args=(model, generation),
                                            name="packserve-trace", daemon=True)
        try:
            self._tracer.start()
        except RuntimeError as exc:  # no thread to be had: the passes stay eager
            self._settle_graph(generation, None, f"no thread to trace its encoder on: {exc}")

    def _build_graph(self, model: Any, generation: int) -> None:
        import torch

        graph: Any = None
        failed = "its traced encoder did not embed the probe batches as the model does"
        try:
            torch.set_num_threads(1)
            graph = _traced_encoder(model, self._lock)
        except Exception as exc:  # the weights went meanwhile, or the model cannot be traced
            failed = f"tracing its encoder failed: {exc}"
        finally:
            self._settle_graph(generation, graph, failed)

    def _settle_graph(self, generation: int, graph: Any, failed: str) -> None:
        """Use `graph` (None: the passes stay eager, for the reason `failed`), unless the
        weights went since the trace started."""
        with self._counting:
            current = generation == self._graph_generation
            if current:
                self._graph = graph
                self._graph_state = "used" if graph is not None else "refused"
        if current and graph is not None:
            log.info("%s: forward passes go through its traced encoder", self.spec.path)
        elif current:
            log.warning("%s: forward passes stay eager: %s", self.spec.path, failed)
        self.graph_settled.set()

    def _drop_graph(self) -> None:
        """Before the weights go: the graph holds them too, and so does a trace under way,
        which this waits for (it is discarded). Never called holding `_lock`: the trace
        tokenizes its probes under it."""
        with self._counting:
            self._graph = None
            self._graph_state = "none"
            self._graph_generation += 1
            tracer, self._tracer = self._tracer, None
        if tracer is not None and tracer is not threading.current_thread():
            tracer.join(timeout=120)
            if tracer.is_alive():
                log.warning("%s: a trace of its encoder is still running after 120 s; its "
                            "weights go now all the same", self.spec.path)

    def prepare(self) -> None:
        global _torch_threads
        SENTENCE_TRANSFORMERS.prepare()  # torch, transformers: seconds, ~400 MiB
        if not _torch_threads:  # before any load's shard threads exist (see _torch_threads)
            import torch

            _torch_threads = torch.get_num_threads()
        _default_threads()  # the load and the restore run on the caller's thread

    def _check_files(self) -> None:
        path = self.spec.path
        if not any(path.rglob("*.safetensors")) and not self.spec.allow_pickle:
            raise ConfigError(
                f"{path} has no .safetensors weights; packserve does not load pickled weights "
                f"unless the model entry sets allow_pickle = true")

    def _kwargs(self) -> dict[str, Any]:
        return {
            "device": self.spec.device,
            "local_files_only": True,
            "trust_remote_code": self.spec.trust_remote_code,
            "model_kwargs": {"use_safetensors": not self.spec.allow_pickle},
        }

    def release_weights(self) -> bool:
        """Warm: on a GPU, park every weight and buffer in host RAM (they come back by a copy,
        as vLLM's sleep level 1 does); on the CPU, swap every weight for a meta tensor (no
        storage) and keep the modules and the tokenizer, only when each weight can be read back
        from a safetensors file of its module's directory, by name and shape (no tied
        weights); otherwise False and nothing changed."""
        if self.spec.device.startswith("cuda"):
            self._park()
            return True
        plan = _warm_plan(self._model, self.spec.path)
        if plan is None:
            return False
        self._drop_graph()
        for part in plan:
            part.module.to("meta")
        self._warm = plan
        return True

    def _park(self) -> None:
        """Move the weights and buffers to host RAM and hand the device's blocks back.

        Pageable memory, not pinned: torch's pinned-memory allocator rounds every block up to a
        power of two and keeps freed blocks for the process's life, so a parked copy would hold
        up to twice what it counts, and keep it after its restore. A copy back from pageable
        memory is slower (measured by the prepared GPU check, docs/gpu.md)."""
        import torch

        self._drop_graph()
        self._model.to("cpu")
        tensors = [*self._model.parameters(), *self._model.buffers()]
        self._parked = int(sum(t.numel() * t.element_size() for t in tensors))
        torch.cuda.empty_cache()

    def host_bytes(self) -> int:
        return self._parked

    def restore_weights(self) -> None:
        """Warm -> hot: on a GPU, copy the parked weights back; on the CPU, read each module's
        weights back from its safetensors files (the same files, or it raises and the
        scheduler loads the model anew)."""
        if self._parked:
            import torch

            self._model.to(self.spec.device)
            torch.cuda.synchronize(self.spec.device)
            self._parked = 0
            return
        from safetensors import safe_open

        _default_threads()  # a scheduler thread, maybe new since the shard threads

        for part in self._warm:
            for file, identity in part.identity.items():
                if file_identity(file) != identity:
                    raise RuntimeError(f"{file} changed since {self.name} went warm")
        for part in self._warm:
            state: dict[str, Any] = {}
            for file, names in part.files.items():
                with safe_open(str(file), framework="pt", device=self.spec.device) as f:
                    for name, key in names.items():
                        state[name] = f.get_tensor(key)
            part.module.load_state_dict(state, strict=True, assign=True)
            for name, buffer in part.buffers.items():
                owner, _, leaf = name.rpartition(".")
                part.module.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)
        self._warm = ()

    def unload(self) -> None:
        self._drop_graph()
        self._model = None
        self._warm = ()
        self._parked = 0
        for pool in (self._thread, self._shards):
            if pool is not None:  # idle (no lease is left): its threads end before the next
                pool.shutdown(wait=True)  # load is measured, not during it
        self._thread = self._shards = None

    def weight_bytes(self) -> int:
        if self._model is None or self._warm or self._parked:
            return 0
        tensors = [*self._model.parameters(), *self._model.buffers()]
        return int(sum(t.numel() * t.element_size() for t in tensors))

    def _max_tokens(self) -> int:
        return int(self._model.max_seq_length or self._model.tokenizer.model_max_length)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        with self._lock:
            ids = self._model.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
            return [len(row) for row in ids]

    def _count_tokens(self, texts: Sequence[str], what: str) -> list[int]:
        limit = self._max_tokens()
        for i, text in enumerate(texts):
            if len(text) > limit * _MAX_CHARS_PER_TOKEN:
                raise InputTooLong(
                    f"{what}[{i}] has {len(text)} characters; {self.name} reads at most "
                    f"{limit} tokens", param="input")
        ids = self._model.tokenizer(list(texts), add_special_tokens=True)["input_ids"]
        for i, row in enumerate(ids):
            if len(row) > limit:
                raise InputTooLong(
                    f"{what}[{i}] is {len(row)} tokens; {self.name} reads at most {limit} "
                    f"tokens (shorten or split it)", param="input")
        return [len(row) for row in ids]


class SentenceTransformerBackend(_TorchBackend):
    """Embeddings, and reranking by bi-encoder cosine similarity (not a cross-encoder)."""

    def embed_passes(self) -> int:
        return usable_cores() if self.spec.device.startswith("cpu") else 1

    def load(self) -> None:
        from sentence_transformers import SentenceTransformer

        self._check_files()
        self.name = self.spec.path.name
        self._model = SentenceTransformer(str(self.spec.path), **self._kwargs())

    def embed(self, texts: Sequence[str]) -> Embeddings:
        import numpy as np

        vectors, tokens = self._encode(texts, lambda: self._count_tokens(texts, "input"))
        return Embeddings(vectors=np.asarray(vectors, dtype=np.float32), tokens=tokens)

    def rerank(self, query: str, documents: Sequence[str]) -> Ranking:
        import numpy as np

        vectors, tokens = self._encode(
            [query, *documents], lambda: sum(self._count_tokens([query], "query")) + sum(
                self._count_tokens(documents, "documents")), normalize=True)
        scores = np.asarray(vectors[1:], dtype=np.float32) @ np.asarray(vectors[0])
        return Ranking(scores=[float(s) for s in scores], tokens=tokens)


class CrossEncoderBackend(_TorchBackend):
    """A cross-encoder reranker loaded from a local directory the operator gives."""

    def load(self) -> None:
        from sentence_transformers import CrossEncoder

        self._check_files()
        self.name = self.spec.path.name
        self._model = CrossEncoder(str(self.spec.path), **self._kwargs())

    def rerank(self, query: str, documents: Sequence[str]) -> Ranking:
        import numpy as np

        with self._lock, turn():
            tokens = sum(self._count_tokens([query], "query")) + sum(
                self._count_tokens(documents, "documents"))
            scores = self._compute(lambda: self._model.predict(
                [(query, d) for d in documents], batch_size=self.spec.max_batch,
                show_progress_bar=False))
            flat = np.asarray(scores).reshape(-1)
            return Ranking(scores=[float(s) for s in flat], tokens=tokens)


def _pass(model: Any, graph: Any, batch: dict[str, Any]) -> Any:
    """The sentence embeddings of one tokenized batch: through the traced encoder and the
    model's other modules (pooling, normalizing) when there is one, else the eager model."""
    if graph is None:
        return model(batch)["sentence_embedding"]
    features = dict(batch)
    features["token_embeddings"] = graph(
        **{k: batch[k] for k in _GRAPH_INPUTS if k in batch})["last_hidden_state"]
    for module in list(model)[1:]:
        features = module(features)
    return features["sentence_embedding"]


def _traced_encoder(model: Any, tokenizing: threading.Lock) -> Any:
    """`model`'s first module's encoder traced with torch.jit (deprecated in torch 2.13 in
    favour of torch.compile, which needs a C++ toolchain and seconds of compiling per shape,
    and torch.export, which does not run a model faster by itself), or None when the
    traced passes do not embed `_PROBES` as the eager model does, within 1e-5. The probes are
    tokenized under `tokenizing`, the load's lock."""
    import torch

    with tokenizing:
        probes = [model.preprocess(list(texts)) for texts in
                  (*_PROBES, ("word " * 2 * min(int(model.max_seq_length or 512), 512),))]
    if any(set(k for k, v in p.items() if isinstance(v, torch.Tensor)) - set(_GRAPH_INPUTS)
           for p in probes):
        return None  # the encoder takes inputs the graph would not pass
    example = {k: probes[0][k] for k in _GRAPH_INPUTS if k in probes[0]}
    # The deprecation, and the tracer's notes on the Python decisions it records (the probes
    # check those). Filters for these alone: `catch_warnings` would change every thread's.
    warnings.filterwarnings("ignore", category=torch.jit._trace.TracerWarning)
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.trace", category=DeprecationWarning)
    with torch.inference_mode():
        graph = torch.jit.trace(  # type: ignore[no-untyped-call]
            model[0].auto_model, example_kwarg_inputs=example, strict=False,
            check_trace=False)
        for p in probes:
            want = model(dict(p))["sentence_embedding"]
            got = _pass(model, graph, p)
            if got.shape != want.shape or (got - want).abs().max().item() > 1e-5:
                return None
    return graph


def _size(facts: ModelFacts | None, load: LoadSpec, name: str, sequences: int) -> Breakdown:
    assert facts is not None  # reads_files
    return encoder_breakdown(shape_of(facts, name))


def _directory(path: Path) -> str | None:
    return None if path.is_dir() else "a model directory"


@functools.cache
def _torch_cuda() -> str | None:
    """torch's build sees a CUDA device (imports torch: only asked where NVIDIA's driver is)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (scripts/setup.sh --dev)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device" + (
            "" if torch.version.cuda else " (a CPU build: scripts/setup.sh --dev on this machine)")
    return None


_TORCH_OPTIONS = frozenset({"trust_remote_code", "allow_pickle"})
# The embedders batch concurrent requests (api/batching.py), so many may wait on one load.
SENTENCE_TRANSFORMERS = Engine(
    name="sentence-transformers", tasks=frozenset({Task.EMBED, Task.RERANK}),
    default_concurrency=32, build=SentenceTransformerBackend, size=_size,
    check_source=_directory, load_options=_TORCH_OPTIONS, library="sentence_transformers",
    environment=_ENVIRONMENT, cuda=_torch_cuda)
CROSS_ENCODER = Engine(
    name="cross-encoder", tasks=frozenset({Task.RERANK}), default_concurrency=32,
    build=CrossEncoderBackend, size=_size, check_source=_directory,
    load_options=_TORCH_OPTIONS, library="sentence_transformers", environment=_ENVIRONMENT,
    cuda=_torch_cuda)
ENGINES = (SENTENCE_TRANSFORMERS, CROSS_ENCODER)
