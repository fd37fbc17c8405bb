"""sentence-transformers: embeddings, bi-encoder rerank scoring, and cross-encoder rerank.

Weights load only from safetensors unless the entry sets `allow_pickle = true`; remote code
runs only with `trust_remote_code = true`. Nothing is fetched from a hub.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from packserve.core.backend import Backend, Embeddings, LoadSpec, Ranking
from packserve.core.compute import turn
from packserve.core.engine import Engine
from packserve.core.footprint import shape_of
from packserve.errors import ConfigError, InputTooLong
from packserve.modelfiles import ModelFacts
from packserve.planner.sizing import Breakdown, encoder_breakdown
from packserve.types import Task

# Read by huggingface_hub and tokenizers at import: never reach a hub; no tokenizer threads
# forked into the engine's own thread pool.
_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

# A token is rarely longer than this many characters; longer inputs are refused before the
# tokenizer sees them, so a megabyte string costs nothing.
_MAX_CHARS_PER_TOKEN = 32

T = TypeVar("T")


class _TorchBackend(Backend):
    _model: Any = None

    def __post_init__(self) -> None:
        # One tokenizer per load, shared by every name that uses it (an embedder and a
        # reranker), and it keeps its padding setting as shared state: a call that tokenizes
        # without padding while another thread encodes with it makes that batch fail
        # (huggingface/transformers#47085; `packserve bench soak` found it as rerank 500s).
        # Calls into one load are serialised; the embedding batcher merges the waiting ones.
        self._lock = threading.Lock()
        self._thread: ThreadPoolExecutor | None = None

    def _compute(self, fn: Callable[[], T]) -> T:
        """`fn()` on this load's own thread, the caller waiting. torch's OpenMP workers belong
        to the thread that starts a parallel region: calls arriving from the event loop's
        thread pool ran on a different thread each time, each with its own team of workers,
        and the idle teams spun on the cores the running call needed (py-spy and /proc showed
        four busy compute threads for torch's two). The caller's context (its compute ticket)
        goes along."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="packserve-torch")
        return self._thread.submit(contextvars.copy_context().run, fn).result()

    def prepare(self) -> None:
        SENTENCE_TRANSFORMERS.prepare()  # torch, transformers: seconds, ~400 MiB

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

    def unload(self) -> None:
        self._model = None
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None

    def weight_bytes(self) -> int:
        if self._model is None:
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

    def load(self) -> None:
        from sentence_transformers import SentenceTransformer

        self._check_files()
        self.name = self.spec.path.name
        self._model = SentenceTransformer(str(self.spec.path), **self._kwargs())

    def embed(self, texts: Sequence[str]) -> Embeddings:
        import numpy as np

        with self._lock, turn():
            tokens = self._count_tokens(texts, "input")
            vectors = self._compute(lambda: self._model.encode(
                list(texts), batch_size=self.spec.max_batch, convert_to_numpy=True,
                show_progress_bar=False))
            return Embeddings(vectors=np.asarray(vectors, dtype=np.float32), tokens=tokens)

    def rerank(self, query: str, documents: Sequence[str]) -> Ranking:
        import numpy as np

        with self._lock, turn():
            tokens = sum(self._count_tokens([query], "query")) + sum(
                self._count_tokens(documents, "documents"))
            vectors = self._compute(lambda: self._model.encode(
                [query, *documents], batch_size=self.spec.max_batch, convert_to_numpy=True,
                normalize_embeddings=True, show_progress_bar=False))
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


def _size(facts: ModelFacts | None, load: LoadSpec, name: str, sequences: int) -> Breakdown:
    assert facts is not None  # reads_files
    return encoder_breakdown(shape_of(facts, name))


def _directory(path: Path) -> str | None:
    return None if path.is_dir() else "a model directory"


_TORCH_OPTIONS = frozenset({"trust_remote_code", "allow_pickle"})
# The embedders batch concurrent requests (api/batching.py), so many may wait on one load.
SENTENCE_TRANSFORMERS = Engine(
    name="sentence-transformers", tasks=frozenset({Task.EMBED, Task.RERANK}),
    default_concurrency=32, build=SentenceTransformerBackend, size=_size,
    check_source=_directory, load_options=_TORCH_OPTIONS, library="sentence_transformers",
    environment=_ENVIRONMENT)
CROSS_ENCODER = Engine(
    name="cross-encoder", tasks=frozenset({Task.RERANK}), default_concurrency=32,
    build=CrossEncoderBackend, size=_size, check_source=_directory,
    load_options=_TORCH_OPTIONS, library="sentence_transformers", environment=_ENVIRONMENT)
ENGINES = (SENTENCE_TRANSFORMERS, CROSS_ENCODER)
