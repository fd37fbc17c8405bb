"""Memory per model: weights, KV cache, activations, runtime overhead, and for training the
gradients and optimizer states. Pure functions over small frozen dataclasses.

Every figure carries the assumptions that produced it (`Breakdown.assumptions`), so a table
printed from it can say why a number is what it is.

Sources for the rules (see docs/plan-and-audit.md): weights = parameters x bytes per weight
(FP16 = 2 bytes); INT4 about 4x less than FP16; full training 4-6x inference because of
gradients and Adam's two extra copies per parameter; LoRA/QLoRA train small adapters over a
frozen (QLoRA: 4-bit) base (reference: gpu-vps-training-vs-inference.md). Activation memory of
training follows Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (2022): s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit, 2*s*b*h with full recompute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from packserve.units import format_bytes

MIB = 1 << 20
GIB = 1 << 30

Task = Literal["inference", "lora", "qlora", "full"]
TASKS: tuple[Task, ...] = ("inference", "lora", "qlora", "full")
Optimizer = Literal["adam", "adam-fp32", "adam-8bit"]

# Bits per weight as stored, scales and zero points included. GGUF figures are llama.cpp's own
# (`llama-quantize --help` lists them); "int4" is AWQ/GPTQ with group size 128 (4 + 16/128 +
# ...); "nf4" is bitsandbytes 4-bit NormalFloat with double quantisation (QLoRA paper).
BITS_PER_WEIGHT: dict[str, float] = {
    "fp32": 32.0, "fp16": 16.0, "bf16": 16.0, "fp8": 8.0, "int8": 8.0,
    "int4": 4.25, "nf4": 4.127, "fp4": 4.25,
    "q8_0": 8.5, "q6_k": 6.5625, "q5_k_m": 5.69, "q5_k_s": 5.54, "q5_1": 6.0, "q5_0": 5.5,
    "q4_k_m": 4.85, "q4_k_s": 4.58, "q4_1": 5.0, "q4_0": 4.5, "iq4_xs": 4.25,
    "q3_k_m": 3.91, "q3_k_s": 3.5, "q2_k": 3.35,
}

# Runtime constants, each documented where it is used.
GPU_RUNTIME_BYTES = 512 * MIB  # CUDA context, cuBLAS workspaces: one per process and GPU
FRAGMENTATION = 0.05  # allocator slack over weights + KV cache + trainable state
INFERENCE_UBATCH = 512  # prompt tokens processed per step (llama.cpp's and vLLM's order)
LORA_BYTES_PER_ADAPTER_PARAM = 16  # fp32 weight + fp32 gradient + Adam's two fp32 moments

# llama.cpp, calibrated on CPU with llama-cpp-python 0.3.36 against the RSS growth packserve
# measures (tests/test_footprint_real.py): vocabulary tables, output and touched compute buffers.
LLAMA_FIXED_OVERHEAD = 20 * MIB
LLAMA_BYTES_PER_VOCAB = 122
KV_BYTES_PER_ELEMENT = 2  # f16 KV cache, llama.cpp's and vLLM's default
# sentence-transformers: tokenizer and module objects beside the tensors.
ENCODER_OVERHEAD = 2 * MIB
# An embedding runner (llama-server --embeddings, CPU): the process's own code and heap beside
# the vocabulary tables, as measured after its load; fitted to MiniLM's runner (63 MiB resident
# for 43 MiB of F16 tensors, tests/test_footprint_real.py, 2026-12-03). Its compute buffers
# (70 MiB more after long inputs: scripts/runner_checks.py embed) are activations: they live
# in the headroom.
LLAMA_EMBED_OVERHEAD = 16 * MIB


@dataclass(frozen=True)
class Architecture:
    """The shape of a transformer, as far as memory is concerned. 0 means unknown."""

    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int


@dataclass(frozen=True)
class ModelShape:
    """One model to size: how many parameters, stored how, with which architecture."""

    name: str
    n_params: int
    precision: str  # a key of BITS_PER_WEIGHT, or "file" when `stored_bytes` is exact
    arch: Architecture
    stored_bytes: int = 0  # exact tensor bytes when read from the model's files

    @property
    def weight_bytes(self) -> int:
        if self.stored_bytes:
            return self.stored_bytes
        return math.ceil(self.n_params * bits_per_weight(self.precision) / 8)


@dataclass(frozen=True)
class Workload:
    """What the model will be doing."""

    task: Task = "inference"
    context: int = 4096  # tokens per sequence
    sequences: int = 1  # concurrent sequences (inference) -- each holds its own KV cache
    batch: int = 1  # training micro-batch
    gradient_checkpointing: bool = True
    lora_rank: int = 16
    optimizer: Optimizer = "adam"
    kv_bytes: int = KV_BYTES_PER_ELEMENT


@dataclass(frozen=True)
class Breakdown:
    """Bytes one model needs, by kind, and the assumptions behind them."""

    name: str
    weights: int
    kv_cache: int = 0
    activations: int = 0
    overhead: int = 0
    gradients: int = 0
    optimizer: int = 0
    repacked: int = 0  # a second copy of weights, laid out for the CPU's kernels (llama.cpp)
    assumptions: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return (self.weights + self.kv_cache + self.activations + self.overhead
                + self.gradients + self.optimizer + self.repacked)


def bits_per_weight(precision: str) -> float:
    try:
        return BITS_PER_WEIGHT[precision.lower()]
    except KeyError:
        known = ", ".join(sorted(BITS_PER_WEIGHT))
        raise ValueError(f"unknown precision {precision!r} (known: {known})") from None


def parse_params(text: str) -> int:
    """`7B`, `0.5b`, `135M`, `70e9` or a plain count -> parameters."""
    t = text.strip().upper().replace("_", "")
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(t[-1:], 1.0)
    number = t[:-1] if t[-1:] in "KMBT" else t
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a parameter count (write it like 7B or 135M)") from None
    if value <= 0:
        raise ValueError("a parameter count must be positive")
    return round(value)


def kv_cache_bytes(arch: Architecture, context: int, sequences: int = 1,
                   kv_bytes: int = KV_BYTES_PER_ELEMENT) -> int:
    """K and V for every layer: 2 x layers x kv_heads x head_dim x context x bytes x sequences."""
    return (2 * arch.n_layers * arch.n_kv_heads * arch.head_dim * context * kv_bytes
            * sequences)


def lora_adapter_params(arch: Architecture, rank: int) -> int:
    """Rank-r adapters on every linear layer (q, k, v, o, gate, up, down): r x (in + out) each."""
    h, kv = arch.hidden_size, arch.n_kv_heads * arch.head_dim
    q_out = arch.n_heads * arch.head_dim or h
    per_layer = (h + q_out) + 2 * (h + kv) + (q_out + h) + 3 * (h + arch.ffn_size)
    return rank * arch.n_layers * per_layer


def training_activation_bytes(arch: Architecture, work: Workload) -> int:
    """Korthikanti et al. (2022), 16-bit activations, plus fp32 logits and their gradient."""
    s, b, h = work.context, work.batch, arch.hidden_size
    heads = arch.n_heads or max(1, h // max(arch.head_dim, 1))
    one_layer = s * b * h * (34 + 5 * heads * s // max(h, 1))
    if work.gradient_checkpointing:
        stored = arch.n_layers * 2 * s * b * h + one_layer  # layer inputs + one recomputed
    else:
        stored = arch.n_layers * one_layer
    return stored + 2 * s * b * arch.vocab_size * 4


def inference_activation_bytes(arch: Architecture, work: Workload) -> int:
    """One prompt step of `INFERENCE_UBATCH` tokens: f32 hidden states in and out of a layer,
    one layer's attention scores over the context, and f32 logits for every sequence."""
    u = min(INFERENCE_UBATCH, work.context)
    heads = arch.n_heads or max(1, arch.hidden_size // max(arch.head_dim, 1))
    return (u * (arch.hidden_size * 4 * 4 + heads * work.context * 4)
            + work.sequences * arch.vocab_size * 4)


def size_model(shape: ModelShape, work: Workload) -> Breakdown:
    """A generic GPU engine (vLLM, TGI, transformers, llama.cpp on CUDA) sized for `work`.

    Runtime overhead: `FRAGMENTATION` of what stays resident; the per-GPU CUDA context is added
    once per card by the plan, not per model.
    """
    arch = shape.arch
    base = [f"{shape.name}: {shape.n_params / 1e9:.2f}B parameters"
            f"{'' if shape.stored_bytes else f' at {bits_per_weight(shape.precision):g} bits'}"
            f"{' (bytes read from the model files)' if shape.stored_bytes else ''}",
            f"architecture: {arch.n_layers} layers, {arch.n_kv_heads} KV heads x "
            f"{arch.head_dim} dims, hidden {arch.hidden_size}, vocabulary {arch.vocab_size}"]
    if work.task == "inference":
        kv = kv_cache_bytes(arch, work.context, work.sequences, work.kv_bytes)
        weights = shape.weight_bytes
        return Breakdown(
            name=shape.name, weights=weights, kv_cache=kv,
            activations=inference_activation_bytes(arch, work),
            overhead=math.ceil(FRAGMENTATION * (weights + kv)),
            assumptions=(*base,
                         f"KV cache: {work.context} tokens x {work.sequences} sequences at "
                         f"{work.kv_bytes} bytes per element",
                         f"activations: one {min(INFERENCE_UBATCH, work.context)}-token prompt "
                         f"step; overhead: {FRAGMENTATION:.0%} allocator slack"))
    acts = training_activation_bytes(arch, work)
    ckpt = "on" if work.gradient_checkpointing else "off"
    train_notes = (f"training: micro-batch {work.batch} x {work.context} tokens, gradient "
                   f"checkpointing {ckpt} (activations per Korthikanti et al. 2022)",)
    if work.task in ("lora", "qlora"):
        if work.task == "qlora":
            shape = replace(shape, precision="nf4", stored_bytes=0)
        weights = shape.weight_bytes
        adapters = lora_adapter_params(arch, work.lora_rank)
        a_weights = adapters * 4
        return Breakdown(
            name=shape.name, weights=weights + a_weights, activations=acts,
            gradients=adapters * 4, optimizer=adapters * 8,
            overhead=math.ceil(FRAGMENTATION * (weights + adapters * LORA_BYTES_PER_ADAPTER_PARAM)),
            assumptions=(*base, *train_notes,
                         f"{work.task}: frozen base at {shape.precision} "
                         f"({bits_per_weight(shape.precision):g} bits), rank-{work.lora_rank} "
                         f"adapters on q,k,v,o,gate,up,down = {adapters / 1e6:.1f}M params, "
                         f"each fp32 weight + gradient + two Adam moments (16 bytes)"))
    # full training: weights and gradients at the training precision, Adam's two moments
    weights = shape.weight_bytes
    per_param = bits_per_weight(shape.precision) / 8
    grads = math.ceil(shape.n_params * per_param)
    if work.optimizer == "adam":
        opt, how = math.ceil(2 * shape.n_params * per_param), "two moments at that precision"
    elif work.optimizer == "adam-8bit":
        opt, how = 2 * shape.n_params, "two 8-bit moments"
    else:
        opt, how = 12 * shape.n_params, "fp32 master copy + two fp32 moments"
    return Breakdown(
        name=shape.name, weights=weights, activations=acts, gradients=grads, optimizer=opt,
        overhead=math.ceil(FRAGMENTATION * (weights + grads + opt)),
        assumptions=(*base, *train_notes,
                     f"full training: weights and gradients at {shape.precision}, "
                     f"Adam keeps {how}"))


def llama_cpp_breakdown(shape: ModelShape, context: int, sequences: int = 1,
                        shared_cache: bool = False, repacked: int = 0) -> Breakdown:
    """What llama.cpp (llama-cpp-python 0.3.36, CPU) holds for a GGUF at `context` tokens,
    decoding `sequences` at once: each with its own KV cache, or with `shared_cache` all in
    one of `context` tokens (llama.cpp's unified KV cache).

    Weights as stored; KV cache in f16 for every layer at the full context (llama-cpp-python
    keeps Gemma 3's sliding-window layers full size); 20 MiB plus 122 bytes per vocabulary
    entry for vocabulary tables, output and the touched part of the compute buffer, fitted to
    packserve's own measurements of the default models; one more f32 row of logits per
    sequence after the first (llama.cpp reserves its output buffer for `n_seq_max` rows).

    `repacked`: bytes of weights held twice because the CPU backend copies them at load into
    the layout of its kernels, as the file's header says (`modelfiles.cpu_repacked`, read into
    `ModelFacts`; `backends.gguf.repacked` says how many count twice): the copy is anonymous
    memory, and with the file mapped, the pages it was read from stay resident beside it. 0 on
    a GPU, where the weights go to the card as they are.
    """
    arch = shape.arch
    caches = 1 if shared_cache else sequences
    how = (f"{context} tokens shared by {sequences} sequences" if shared_cache and sequences > 1
           else f"{context} tokens x {sequences} sequence(s)")
    return Breakdown(
        name=shape.name, weights=shape.weight_bytes,
        kv_cache=kv_cache_bytes(arch, context, caches),
        overhead=(LLAMA_FIXED_OVERHEAD + LLAMA_BYTES_PER_VOCAB * arch.vocab_size
                  + (sequences - 1) * arch.vocab_size * 4),
        repacked=repacked,
        assumptions=(f"{shape.name}: llama.cpp, "
                     f"{format_bytes(shape.weight_bytes, compact=True)} of tensors "
                     f"from the GGUF header"
                     + (f" ({format_bytes(repacked, compact=True)} of them held twice: "
                        f"repacked for the CPU's kernels)" if repacked else "")
                     + f", f16 KV cache for {how}, 20 MiB + 122 B per vocabulary entry of "
                     f"runtime",))


def llama_encoder_breakdown(shape: ModelShape, repacked: int = 0) -> Breakdown:
    """An embedding model in a llama-server runner: tensors as stored in the GGUF (no KV
    cache: an encoder attends within its batch) plus the runner's process, compute buffer
    and vocabulary tables; `repacked` as for `llama_cpp_breakdown` (on the CPU only)."""
    return Breakdown(
        name=shape.name, weights=shape.weight_bytes, repacked=repacked,
        overhead=LLAMA_EMBED_OVERHEAD + LLAMA_BYTES_PER_VOCAB * shape.arch.vocab_size,
        assumptions=(f"{shape.name}: llama.cpp embedding runner, "
                     f"{format_bytes(shape.weight_bytes, compact=True)} of tensors from the "
                     f"GGUF header, 16 MiB + 122 B per vocabulary entry of runtime",))


def encoder_breakdown(shape: ModelShape) -> Breakdown:
    """sentence-transformers / cross-encoder: tensors as stored plus tokenizer and modules.
    Activations are transient and live in the device's headroom."""
    return Breakdown(
        name=shape.name, weights=shape.weight_bytes, overhead=ENCODER_OVERHEAD,
        assumptions=(f"{shape.name}: sentence-transformers, "
                     f"{format_bytes(shape.weight_bytes, compact=True)} of tensors from the "
                     f"safetensors header + 2 MiB of tokenizer and modules",))
