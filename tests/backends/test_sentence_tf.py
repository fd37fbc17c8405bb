"""The sentence-transformers backend under concurrent calls on one load: the embedder and the
reranker share one tokenizer, whose padding setting is shared state (`bench soak` saw rerank
500s when a token count and an encode overlapped)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from packserve import backends
from packserve.config import load_config
from packserve.core.backend import Backend
from packserve.sources import resolve_source


def minilm(tmp_path: Path) -> Backend:
    """The default catalog's MiniLM, loaded on the CPU."""
    spec = next(m for m in load_config(None).models if m.name == "all-minilm-l6-v2")
    path = resolve_source(spec.source, base_dir=tmp_path, models_dir=tmp_path / "models",
                          roots=None)
    engine = backends.get("sentence-transformers")
    backend = engine.build(engine.load_spec(path, "cpu", 0, 64, {}))
    backend.prepare()
    backend.load()
    return backend


@pytest.mark.real
def test_embed_rerank_and_count_tokens_can_overlap(tmp_path: Path) -> None:
    backend = minilm(tmp_path)
    try:
        short, long = "a cat", "a much longer sentence about a cat that sat on a mat " * 3

        def embed(i: int) -> int:
            return len(backend.embed([short, long][: 1 + i % 2] * 3).vectors)

        def rerank(i: int) -> int:
            return len(backend.rerank(short if i % 2 else long, [long, short]).scores)

        def count(i: int) -> int:
            return sum(backend.count_tokens([short, long]))

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(fn, i) for i in range(40) for fn in (embed, rerank, count)]
            results = [f.result(timeout=120) for f in futures]  # any failure raises here
        assert len(results) == 120 and all(r > 0 for r in results)
    finally:
        backend.unload()


@pytest.mark.real
def test_forward_passes_run_on_the_loads_own_one_torch_thread_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's OpenMP workers belong to the thread that starts a parallel region: calls from a
    pool of request threads must compute on the load's own threads (or each brings a spinning
    team), each shard of a batch on one of them with one torch thread."""
    import torch

    from packserve.backends import sentence_tf
    from packserve.core.compute import usable_cores

    # The eager passes (the traced encoder's are the test below's)
    monkeypatch.setattr(sentence_tf, "_traced_encoder", lambda model, lock: None)
    backend = minilm(tmp_path)
    seen: list[tuple[str, int, int]] = []
    model = backend._model  # type: ignore[attr-defined]
    forward = model.forward

    def recording(features: dict[str, torch.Tensor], **kwargs: object) -> object:
        seen.append((threading.current_thread().name, torch.get_num_threads(),
                     len(features["input_ids"])))
        return forward(features, **kwargs)

    monkeypatch.setattr(model, "forward", recording)
    try:
        def call(i: int) -> None:
            if i % 2:
                backend.embed([f"sentence {i}", "another one", "and a third"])
            else:
                backend.rerank("a query", [f"document {i}"])

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(call, range(12)))
        concurrent = list(seen)
        seen.clear()
        backend.embed([f"sentence number {i}" for i in range(16)])  # alone: every core
        # A thread that loads after the shard threads set theirs to 1 (torch's default for
        # every new thread then) computes with torch's own count again.
        counts: list[int] = []

        def load_thread() -> None:
            backend.prepare()
            counts.append(torch.get_num_threads())

        t = threading.Thread(target=load_thread)
        t.start()
        t.join(60)
    finally:
        backend.unload()
    assert counts == [sentence_tf._torch_threads] and sentence_tf._torch_threads >= 1
    cores = usable_cores()
    names = {name for name, _, _ in [*concurrent, *seen]}
    assert all(name.startswith("packserve-torch") for name in names) and len(names) <= cores
    assert {threads for _, threads, _ in [*concurrent, *seen]} == {1}
    # Calls of 2 or 3 texts are one shard each (too few to share); 16 texts alone: a shard
    # per core, of at least 4 texts.
    assert sorted(rows for _, _, rows in concurrent) == [2] * 6 + [3] * 6
    assert len(seen) == min(cores, 4) and sum(rows for _, _, rows in seen) == 16


def _mixed_texts() -> list[str]:
    """150 texts of 2 to 41 words."""
    return [("word " * (1 + (i * 7) % 40)).strip() + f" {i}" for i in range(150)]


@pytest.mark.real
def test_sharded_passes_give_what_encode_gives(tmp_path: Path) -> None:
    """The shards (sorted by length, tokenized apart, padded to their own longest) give the
    vectors and the scores of sentence-transformers' own `encode`, for more texts than one
    pass takes (max_batch 64)."""
    import numpy as np

    backend = minilm(tmp_path)
    model = backend._model  # type: ignore[attr-defined]
    texts = _mixed_texts()
    try:
        got = backend.embed(texts).vectors
        want = model.encode(texts, batch_size=64, convert_to_numpy=True,
                            show_progress_bar=False)
        assert got.dtype == np.float32 and got.shape == want.shape == (150, 384)
        assert np.abs(got - want).max() < 1e-5
        scores = backend.rerank(texts[0], texts[1:40]).scores
        vectors = model.encode(texts[:40], convert_to_numpy=True, normalize_embeddings=True,
                               show_progress_bar=False)
        assert np.abs(np.asarray(scores) - vectors[1:] @ vectors[0]).max() < 1e-5
    finally:
        backend.unload()


def _traced(backend: Backend) -> str:
    """Start the trace with a pass, wait for it to end: its outcome."""
    backend.embed(["the first pass starts the trace"])
    assert backend.graph_settled.wait(120)  # type: ignore[attr-defined]
    return str(backend._graph_state)  # type: ignore[attr-defined]


@pytest.mark.real
def test_passes_go_through_the_traced_encoder_and_give_what_encode_gives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from packserve.backends import sentence_tf

    backend = minilm(tmp_path)
    model = backend._model  # type: ignore[attr-defined]
    passes: list[bool] = []  # each pass: through a graph?
    through = sentence_tf._pass

    def recording(model: object, graph: object, batch: dict[str, object]) -> object:
        if threading.current_thread().name.startswith("packserve-torch"):
            passes.append(graph is not None)
        return through(model, graph, batch)

    monkeypatch.setattr(sentence_tf, "_pass", recording)
    try:
        assert _traced(backend) == "used"
        passes.clear()
        texts = _mixed_texts()
        got = backend.embed(texts).vectors
        want = model.encode(texts, batch_size=64, convert_to_numpy=True,
                            show_progress_bar=False)
        assert np.abs(got - want).max() < 1e-5
        scores = backend.rerank(texts[0], texts[1:40]).scores
        vectors = model.encode(texts[:40], convert_to_numpy=True, normalize_embeddings=True,
                               show_progress_bar=False)
        assert np.abs(np.asarray(scores) - vectors[1:] @ vectors[0]).max() < 1e-5
        assert passes and all(passes)
    finally:
        backend.unload()


@pytest.mark.real
def test_a_traced_encoder_that_embeds_otherwise_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    """The probes catch a graph whose vectors differ by more than 1e-5: passes stay eager."""
    import numpy as np
    import torch

    trace = torch.jit.trace

    def skewed(module: object, **kwargs: object) -> object:
        graph = trace(module, **kwargs)  # type: ignore[no-untyped-call]

        def call(**inputs: torch.Tensor) -> dict[str, torch.Tensor]:
            hidden = graph(**inputs)["last_hidden_state"]
            # (pooling normalizes: a shift, not a scale, shows in the vectors)
            return {"last_hidden_state": hidden + 1e-2 * (hidden.shape[0] == 1)}
        return call

    monkeypatch.setattr(torch.jit, "trace", skewed)  # wrong for one-text batches only
    backend = minilm(tmp_path)
    model = backend._model  # type: ignore[attr-defined]
    try:
        with caplog.at_level("WARNING", logger="packserve.sentence_tf"):
            assert _traced(backend) == "refused"
        assert "did not embed the probe batches as the model does" in caplog.text
        assert backend._graph is None  # type: ignore[attr-defined]
        texts = _mixed_texts()[:20]
        want = model.encode(texts, convert_to_numpy=True, show_progress_bar=False)
        assert np.abs(backend.embed(texts).vectors - want).max() < 1e-5
    finally:
        backend.unload()


@pytest.mark.real
def test_the_traced_encoder_goes_with_the_weights_and_comes_back_after_a_restore(
        tmp_path: Path) -> None:
    """The graph holds the weights' tensors: a warm release drops it (else the memory stays),
    and a restore traces anew from the restored weights."""
    backend = minilm(tmp_path)
    try:
        assert _traced(backend) == "used"
        assert backend.release_weights()
        assert backend._graph is None  # type: ignore[attr-defined]
        backend.restore_weights()
        assert _traced(backend) == "used"
    finally:
        backend.unload()


@pytest.mark.real
def test_a_trace_under_way_when_the_weights_go_is_discarded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A release during a trace waits for it and does not let its graph (which would hold the
    weights) be used; the next load's pass traces anew."""
    from packserve.backends import sentence_tf

    started, go = threading.Event(), threading.Event()
    trace = sentence_tf._traced_encoder

    def held(model: object, lock: threading.Lock) -> object:
        started.set()
        assert go.wait(120)
        return trace(model, lock)

    monkeypatch.setattr(sentence_tf, "_traced_encoder", held)
    backend = minilm(tmp_path)
    try:
        backend.embed(["the first pass starts the trace"])
        assert started.wait(120)
        with ThreadPoolExecutor(1) as pool:
            released = pool.submit(backend.release_weights)
            go.set()
            assert released.result(timeout=180)
        assert backend.graph_settled.is_set()  # type: ignore[attr-defined]
        assert backend._graph is None  # type: ignore[attr-defined]
        assert backend._graph_state == "none"  # type: ignore[attr-defined]
        backend.restore_weights()
        started.clear()
        assert _traced(backend) == "used" and started.is_set()
    finally:
        go.set()
        backend.unload()
