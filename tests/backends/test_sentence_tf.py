"""The sentence-transformers backend under concurrent calls on one load: the embedder and the
reranker share one tokenizer, whose padding setting is shared state (`bench soak` saw rerank
500s when a token count and an encode overlapped)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from packserve import backends
from packserve.config import load_config
from packserve.sources import resolve_source


@pytest.mark.real
def test_embed_rerank_and_count_tokens_can_overlap(tmp_path: Path) -> None:
    spec = next(m for m in load_config(None).models if m.name == "all-minilm-l6-v2")
    path = resolve_source(spec.source, base_dir=tmp_path, models_dir=tmp_path / "models",
                          roots=None)
    engine = backends.get("sentence-transformers")
    backend = engine.build(engine.load_spec(path, "cpu", 0, 64, {}))
    backend.prepare()
    backend.load()
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
