"""Facts read from the default models' own headers, the facts cache, and the estimate."""

from __future__ import annotations

from pathlib import Path

import pytest

from packserve import backends, modelfiles
from packserve.config import load_config
from packserve.core.footprint import kv_cache_bytes
from packserve.errors import ConfigError
from packserve.modelfiles import read_facts, read_facts_cached
from packserve.sources import resolve_source

MIB = 1 << 20


def source_path(name: str, tmp_path: Path) -> Path:
    spec = next(m for m in load_config(None).models if m.name == name)
    return resolve_source(spec.source, base_dir=tmp_path, models_dir=tmp_path / "models",
                          roots=None)


def test_gguf_header_facts_of_smollm2(tmp_path: Path) -> None:
    facts = read_facts(source_path("smollm2-135m-instruct", tmp_path))
    assert facts.format == "gguf"
    assert (facts.n_layers, facts.n_kv_heads, facts.head_dim, facts.hidden_size) == (30, 3, 64, 576)
    assert facts.vocab_size == 49152
    assert 130e6 < facts.n_params < 140e6  # SmolLM2-135M
    assert facts.weight_bytes < facts.file_bytes  # Q4_1: about 4.5 bits per weight
    # KV cache at 2048 tokens, f16: 2 x 30 layers x 3 heads x 64 dims x 2048 x 2 bytes = 45 MiB
    assert kv_cache_bytes(facts, 2048) == 45 * MIB
    engine = backends.get("llama-server")
    fp = engine.size(facts, engine.load_spec(facts.path, "cpu", 2048, 1, {}), "smollm2", 1)
    assert fp.total == fp.weights + fp.kv_cache + fp.overhead and fp.kv_cache == 45 * MIB


def test_safetensors_header_facts_of_minilm(tmp_path: Path) -> None:
    facts = read_facts(source_path("all-minilm-l6-v2", tmp_path))
    assert facts.format == "safetensors"
    assert (facts.n_layers, facts.hidden_size, facts.vocab_size) == (6, 384, 30522)
    assert 22e6 < facts.n_params < 23e6  # all-MiniLM-L6-v2 has 22.7M parameters
    # Stored as F32, plus one int64 `position_ids` buffer of 512 entries.
    assert facts.weight_bytes == facts.n_params * 4 + 512 * 4
    engine = backends.get("sentence-transformers")
    assert engine.size(facts, engine.load_spec(facts.path, "cpu", 0, 1, {}), "minilm", 1
                       ).kv_cache == 0


def test_facts_cache_is_reused_and_invalidated(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model = source_path("smollm2-135m-instruct", tmp_path)
    copy = tmp_path / "m.gguf"
    copy.write_bytes(model.read_bytes())
    cache = tmp_path / "facts.json"
    first = read_facts_cached(copy, cache)

    def refuse(path: Path) -> modelfiles.ModelFacts:
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(modelfiles, "read_facts", refuse)
    assert read_facts_cached(copy, cache) == first
    with copy.open("ab") as f:  # a changed file is read again
        f.write(b"\0")
    with pytest.raises(AssertionError, match="cache"):
        read_facts_cached(copy, cache)


def test_unreadable_model_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(ConfigError, match=r"bad\.gguf"):
        read_facts(bad)


def test_what_the_cpu_backend_repacks_counts_multiplied_matrices_and_a_tied_output() -> None:
    """llama.cpp's AVX2 kernels take Q4_0/Q4_K/IQ4_NL/MXFP4 matrices of rows in eights in their
    own layout: a copy of each at load (ggml-cpu/repack.cpp). Row lookups are never copied,
    except the tied output's duplicate of the token embeddings, which is multiplied."""
    q4 = [("token_embd.weight", "Q4_0", [2048, 128256], 100),
          ("blk.0.attn_q.weight", "Q4_0", [2048, 2048], 10),
          ("blk.0.ffn_down.weight", "Q4_K", [8192, 2048], 20),
          ("blk.0.attn_norm.weight", "F32", [2048], 1),
          ("blk.0.attn_k.weight", "Q4_0", [2048, 4], 3),  # 4 rows: not in eights
          ("blk.0.attn_v.weight", "Q8_0", [2048, 512], 7)]
    assert modelfiles.cpu_repacked(q4, lm_head=True) == {
        "repacked_bytes": 10 + 20 + 100, "repacked_tied_bytes": 100}
    assert modelfiles.cpu_repacked(q4, lm_head=False) == {  # an encoder
        "repacked_bytes": 10 + 20, "repacked_tied_bytes": 0}
    untied = [*q4, ("output.weight", "Q6_K", [2048, 128256], 50)]
    assert modelfiles.cpu_repacked(untied, lm_head=True)["repacked_bytes"] == 10 + 20
    moe = [("blk.0.ffn_up_exps.weight", "Q4_K", [2048, 768, 64], 40),  # experts: copied
           ("blk.0.attn_k_b.weight", "Q4_0", [128, 512, 16], 5),  # a 3-D product: not
           ("blk.9.nextn.eh_proj.weight", "Q4_0", [4096, 2048], 9)]  # skipped at load
    assert modelfiles.cpu_repacked(moe, lm_head=True)["repacked_bytes"] == 40


def test_the_default_gguf_models_repack_what_their_headers_say(tmp_path: Path) -> None:
    gemma = read_facts(source_path("gemma-3-270m", tmp_path))
    assert 11 * MIB < gemma.repacked_bytes < 13 * MIB  # its 27 Q4_K matrices; Q8_0 embeddings
    assert read_facts(source_path("smollm2-135m-instruct", tmp_path)).repacked_bytes == 0  # Q4_1
