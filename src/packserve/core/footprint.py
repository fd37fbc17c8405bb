"""Estimate a model's memory footprint before loading it, from the facts in its own files.

The scheduler admits a model by this estimate until it has measured the real figure.
Assumptions (calibrated on CPU with llama-cpp-python 0.3.36 and sentence-transformers 6.2):
- llama.cpp: weights as stored (quantised bytes) + KV cache in f16
  (2 x layers x kv_heads x head_dim x context x 2 bytes, one sequence) + compute and output
  buffers, about 20 MiB plus 122 bytes per vocabulary entry at the default 512-token batch.
- sentence-transformers / cross-encoder: weights as stored + 8 MiB for tokenizer and modules;
  activations are transient and live in the device's headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

from packserve.modelfiles import ModelFacts

MIB = 1 << 20
LLAMA_FIXED_OVERHEAD = 20 * MIB
LLAMA_BYTES_PER_VOCAB = 122
ENCODER_OVERHEAD = 8 * MIB
KV_BYTES_PER_ELEMENT = 2  # f16


@dataclass(frozen=True)
class Footprint:
    weights: int
    kv_cache: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.overhead


def kv_cache_bytes(facts: ModelFacts, context: int, sequences: int = 1) -> int:
    return (2 * facts.n_layers * facts.n_kv_heads * facts.head_dim * context
            * KV_BYTES_PER_ELEMENT * sequences)


def estimate(backend: str, facts: ModelFacts, context: int) -> Footprint:
    """Bytes `backend` will hold for this model at `context` tokens of KV cache."""
    if backend == "llama-cpp":
        return Footprint(
            weights=facts.weight_bytes,
            kv_cache=kv_cache_bytes(facts, context),
            overhead=LLAMA_FIXED_OVERHEAD + LLAMA_BYTES_PER_VOCAB * facts.vocab_size,
        )
    return Footprint(weights=facts.weight_bytes, kv_cache=0, overhead=ENCODER_OVERHEAD)
