"""A model's shape read from its own files, for the engines' sizers (`Engine.size`).

The scheduler admits a model by its engine's estimate (`server.build_entries`: the sizer's
total) until it has measured the real figure; `packserve plan` calls the same sizers. The
arithmetic lives in `packserve.planner.sizing`:
- llama.cpp: weights as stored (quantised bytes) + KV cache in f16
  (2 x layers x kv_heads x head_dim x context x 2 bytes, one sequence) + 20 MiB plus 122 bytes
  per vocabulary entry (vocabulary tables, output and touched compute buffers).
- sentence-transformers / cross-encoder: weights as stored + 2 MiB for tokenizer and modules;
  activations are transient and live in the device's headroom.
Calibrated on CPU with llama-cpp-python 0.3.36 and sentence-transformers 6.2 against what the
scheduler measures (RSS growth from a trimmed heap); tests/test_footprint_real.py holds every
default model to +-10%.
"""

from __future__ import annotations

from packserve.modelfiles import ModelFacts
from packserve.planner import sizing
from packserve.planner.sizing import Architecture, ModelShape

MIB = 1 << 20


def shape_of(facts: ModelFacts, name: str = "") -> ModelShape:
    """The planner's view of a model read from its files (exact stored bytes)."""
    heads = facts.hidden_size // facts.head_dim if facts.head_dim else 0
    return ModelShape(
        name=name or facts.path.name, n_params=facts.n_params, precision="file",
        stored_bytes=facts.weight_bytes,
        arch=Architecture(n_layers=facts.n_layers, hidden_size=facts.hidden_size,
                          n_heads=facts.n_heads or heads, n_kv_heads=facts.n_kv_heads,
                          head_dim=facts.head_dim, ffn_size=facts.ffn_size,
                          vocab_size=facts.vocab_size))


def kv_cache_bytes(facts: ModelFacts, context: int, sequences: int = 1) -> int:
    return sizing.kv_cache_bytes(shape_of(facts).arch, context, sequences)
