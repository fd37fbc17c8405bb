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
def test_every_forward_pass_of_a_load_runs_on_its_own_thread_with_the_ticket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's OpenMP workers belong to the thread that starts a parallel region: calls from a
    pool of request threads must still compute on one thread, or each brings a spinning team."""
    from packserve.core.compute import TICKET, ComputeGate, Ticket

    backend = minilm(tmp_path)
    seen: list[tuple[str, object]] = []
    model = backend._model  # type: ignore[attr-defined]
    encode = model.encode

    def recording(*args: object, **kwargs: object) -> object:
        seen.append((threading.current_thread().name, TICKET.get()))
        return encode(*args, **kwargs)

    monkeypatch.setattr(model, "encode", recording)
    gate = ComputeGate("cpu", capacity=2)
    try:
        def call(i: int) -> None:
            TICKET.set(Ticket(gate, "m", deadline=float(i), slo_s=0.5))
            if i % 2:
                backend.embed([f"sentence {i}"])
            else:
                backend.rerank("a query", [f"document {i}"])

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(call, range(12)))
    finally:
        backend.unload()
    assert len(seen) == 12
    assert {name for name, _ in seen} == {seen[0][0]} and seen[0][0].startswith("packserve-torch")
    assert all(isinstance(ticket, Ticket) for _, ticket in seen)
