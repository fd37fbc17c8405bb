"""The real engines' warm state: `release_weights()` gives most of a load's memory back and
keeps the engine objects; `restore_weights()` brings the same model back, answering exactly as
before. Memory is read as the scheduler reads it (the process's resident size after a trim)."""

from __future__ import annotations

from pathlib import Path

import pytest

from packserve import backends
from packserve.config import load_config
from packserve.core.backend import Backend, GenerationParams, Message
from packserve.core.memory import SystemProbe
from packserve.sources import resolve_source

pytestmark = pytest.mark.real


def _load(tmp_path: Path, name: str, parallel: int = 1) -> Backend:
    spec = next(m for m in load_config(None).models if m.name == name)
    path = resolve_source(spec.source, base_dir=tmp_path, models_dir=tmp_path / "models",
                          roots=None)
    # The warm states are the in-process engines' (a runner that leaves is cold): llama.cpp's
    # in the worker, and sentence-transformers' for MiniLM (its source is the safetensors).
    engine = backends.get({"llama-server": "llama-cpp",
                           "llama-server-embed": "sentence-transformers"}.get(spec.backend,
                                                                              spec.backend))
    backend = engine.build(engine.load_spec(path, "cpu", 1024, 64, {}, parallel=parallel))
    backend.prepare()
    backend.load()
    return backend


def _released(backend: Backend) -> int:
    """Release the weights; the bytes that went back to the OS."""
    probe = SystemProbe()
    probe.release("cpu")
    before = probe.used_bytes("cpu")
    assert backend.release_weights()
    probe.release("cpu")
    return before - probe.used_bytes("cpu")


def test_minilm_gives_its_weights_back_and_embeds_the_same_after_a_restore(
        tmp_path: Path) -> None:
    backend = _load(tmp_path, "all-minilm-l6-v2")
    try:
        texts = ["a cat sat on the mat", "the weather is fine"]
        before = backend.embed(texts).vectors
        scores = backend.rerank("cat", ["a cat", "a car"]).scores
        weights = backend.weight_bytes()
        # The pass started a trace of the encoder (backends/sentence_tf.py), whose own
        # allocations would land between the two readings below; a release comes to an idle
        # model, long after its trace.
        assert backend.graph_settled.wait(120)  # type: ignore[attr-defined]
        # transformers maps the safetensors file: only the pages a pass read are resident
        # (a few rows of the 47 MiB token-embedding table), and those are what goes back
        assert _released(backend) > weights // 3
        assert backend.weight_bytes() == 0
        assert all(p.is_meta for p in backend._model.parameters())  # type: ignore[attr-defined]
        backend.restore_weights()
        assert (backend.embed(texts).vectors == before).all()
        assert backend.weight_bytes() == weights
        assert backend.release_weights()  # and again
        backend.restore_weights()
        assert backend.rerank("cat", ["a cat", "a car"]).scores == pytest.approx(scores)
    finally:
        backend.unload()


@pytest.mark.parametrize("parallel", [1, 2])
def test_smollm2_gives_its_pages_and_cache_back_and_answers_the_same(
        tmp_path: Path, parallel: int) -> None:
    backend = _load(tmp_path, "smollm2-135m-instruct", parallel=parallel)
    try:
        ask = [Message(role="user", content="Name three colours.")]
        params = GenerationParams(max_tokens=16, temperature=0)
        before = backend.chat(ask, params).text
        weights = backend.weight_bytes()
        assert _released(backend) > weights // 2
        assert backend.weight_bytes() == 0
        backend.restore_weights()
        assert backend.chat(ask, params).text == before
        assert backend.weight_bytes() == weights
    finally:
        backend.unload()


def test_a_warm_model_can_be_unloaded_without_a_restore(tmp_path: Path) -> None:
    backend = _load(tmp_path, "smollm2-135m-instruct")
    assert backend.release_weights()
    backend.unload()
