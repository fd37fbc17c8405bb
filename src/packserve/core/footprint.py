"""Estimate a model's memory footprint before loading it, from the facts in its own files.

The scheduler admits a model by this estimate until it has measured the real figure. Each
engine declares its sizer (`Engine.size`); the arithmetic lives in `packserve.planner.sizing`,
shared with `packserve plan`:
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

from dataclasses import dataclass

from packserve.core.backend import LoadSpec
from packserve.core.engine import Engine
from packserve.modelfiles import ModelFacts
from packserve.planner import sizing
from packserve.planner.sizing import Architecture, ModelShape

MIB = 1 << 20


@dataclass(frozen=True)
class Footprint:
    weights: int
    kv_cache: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.overhead


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


def estimate(engine: Engine, facts: ModelFacts | None, load: LoadSpec) -> Footprint:
    """Bytes `engine` will hold for `load` (one sequence of KV cache at its context length)."""
    b = engine.size(facts, load, load.path.name, 1)
    return Footprint(weights=b.weights, kv_cache=b.kv_cache,
                     overhead=b.overhead + b.activations + b.gradients + b.optimizer)
