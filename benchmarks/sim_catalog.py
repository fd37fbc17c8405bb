"""What `bench sim` simulates: two boxes (the default catalog on this CPU machine, as measured;
a 24 GiB GPU with fifteen common serving models, from published figures) and three traces.

Pure: figures and arithmetic. `bench.sim` measures the CPU box (`--calibrate`) and runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from benchmarks.common import (
    CHAT_MODEL,
    COMPLETE_MODEL,
    EMBED_MODEL,
    EXTRACT_MODEL,
    MIB,
    RERANK_MODEL,
    TASK_OF,
)
from benchmarks.simulator import LOAD, Box, ServiceModel, SimModel, Weights
from benchmarks.trace import POPULARITY
from packserve.replay import TraceRequest, make_trace

GIB = 1 << 30
GB = 10**9

# ------------------------------------------------------------------------------ the CPU box

# Which weights each default-catalog name uses (the catalog shares two of them).
WEIGHTS_OF = {EMBED_MODEL: EMBED_MODEL, RERANK_MODEL: EMBED_MODEL, CHAT_MODEL: CHAT_MODEL,
              EXTRACT_MODEL: CHAT_MODEL, COMPLETE_MODEL: COMPLETE_MODEL}
# Threads a job wants on the CPU box: torch uses every core for a MiniLM forward pass;
# llama.cpp's default n_threads is cores // 2 (its prompt pass, n_threads_batch, uses all:
# ignored); a load mostly reads and copies on one thread.
CPU_THREADS = {"embed": 2.0, "rerank": 2.0, "chat": 1.0, "complete": 1.0, LOAD: 1.0}
CPU_CORES = 2.0
CPU_MAX_BATCH = 64  # the embedder's max_batch (config default): queued embeddings merge
CPU_MERGE_MARGINAL = 0.3  # assumed: each merged embedding adds 30% of its own time

# Measured with `python -m benchmarks sim --calibrate` (its `calibrate`) on the 2-core AMD EPYC of
# this project, 2026-12-02, three times on a quiet machine (nothing else running) with the
# server code of commit 119abae; each figure is the median of the three runs. `bench sim
# --quick` uses these when its output folder has no calibration.
# Bytes: the scheduler's measured footprints. Loads: the scheduler's load seconds (median of
# 3 per run); unloads: the admin route's wall time. Stall: the longest embedding sent while a
# GGUF loads, less the median one. Warm-up: what a request to a cold model pays beyond the
# stall, the load and a same-sized request once hot. The warm tier: the admin `offload` route's
# wall time, what the warm copy then held (`bytes_warm`), the scheduler's restore seconds, and
# the `unload` route's wall time from warm. Requests: alone, through the HTTP API, at the
# trace's prompt and output sizes, each with a text of its own, fitted linearly. Contention: a
# 96-word embedding alone and beside a 64-token completion, and that completion alone and
# beside them.
BUILTIN_CALIBRATION: dict[str, Any] = {
    "weights": {
        EMBED_MODEL: {"bytes": 90861056, "load_s": 0.158, "unload_s": 0.017, "warmup_s": 0.007,
                      "restore_s": 0.012, "offload_s": 0.028, "keeps_bytes": 0, "drop_s": 0.016},
        CHAT_MODEL: {"bytes": 168034304, "load_s": 0.18, "unload_s": 0.033, "stall_s": 0.014,
                     "warmup_s": 0.101, "restore_s": 0.063, "offload_s": 0.03,
                     "keeps_bytes": 19943424, "drop_s": 0.021},
        COMPLETE_MODEL: {"bytes": 350736384, "load_s": 0.875, "unload_s": 0.096, "stall_s": 0.029,
                         "warmup_s": 0.0, "restore_s": 0.049, "offload_s": 0.039,
                         "keeps_bytes": 65183744, "drop_s": 0.074},
    },
    "service": {
        EMBED_MODEL: {"base_s": 0.0204, "per_word_s": 0.000396, "per_token_s": 0.0},
        RERANK_MODEL: {"base_s": 0.02986, "per_word_s": 0.002161, "per_token_s": 0.0},
        CHAT_MODEL: {"base_s": 0.04992, "per_word_s": 0.00692, "per_token_s": 0.01448},
        EXTRACT_MODEL: {"base_s": 0.06484, "per_word_s": 0.008351, "per_token_s": 0.01768},
        COMPLETE_MODEL: {"base_s": -0.00451, "per_word_s": 0.004571, "per_token_s": 0.031704},
    },
    "contention": {"embed_alone_s": 0.0612, "embed_beside_generation_s": 0.0643,
                   "generation_alone_s": 2.3363, "generation_beside_embeds_s": 2.4806},
}


def oversubscribed(calibration: Mapping[str, Any]) -> float:
    """The share of the cores that oversubscribed jobs get, from the contention measurement:
    an embedding (2 threads) beside a generation (1) on 2 cores should each run at 2/3 speed;
    the measured slowdowns, against that, give the loss (1.0: none measured)."""
    c = calibration.get("contention") or {}
    try:
        slowdowns = [float(c["embed_beside_generation_s"]) / float(c["embed_alone_s"]),
                     float(c["generation_beside_embeds_s"]) / float(c["generation_alone_s"])]
    except (KeyError, TypeError, ZeroDivisionError):
        return 1.0
    expected = (CPU_THREADS["embed"] + CPU_THREADS["chat"]) / CPU_CORES
    return min(1.0, max(0.5, expected / (sum(slowdowns) / len(slowdowns))))


def cpu_box(calibration: Mapping[str, Any], *, capacity_bytes: int | None = None,
            budget_fraction: float = 0.75, sizes: Mapping[str, int] | None = None) -> Box:
    """The default catalog on this machine. The budget as `bench trace` sets it: a fraction of
    the footprints' sum, never less than the largest (or `capacity_bytes`). `sizes` (bytes per
    weights key) overrides the calibration's, e.g. those a real trace run measured."""
    measured = calibration["weights"]
    weights = tuple(
        Weights(key=key, bytes=int((sizes or {}).get(key, m["bytes"])), load_s=m["load_s"],
                unload_s=m["unload_s"], warmup_s=m.get("warmup_s", 0.0),
                stall_s=m.get("stall_s", 0.0), restore_s=m.get("restore_s"),
                offload_s=m.get("offload_s", 0.0), keeps_bytes=m.get("keeps_bytes"),
                drop_s=m.get("drop_s", 0.0),
                max_batch=CPU_MAX_BATCH if key == EMBED_MODEL else 1)
        for key, m in measured.items())
    if capacity_bytes is None:
        total = sum(w.bytes for w in weights)
        capacity_bytes = max(max(w.bytes for w in weights), int(total * budget_fraction))
    models = tuple(
        SimModel(name, TASK_OF[name], WEIGHTS_OF[name], ServiceModel(**s))
        for name, s in calibration["service"].items())
    return Box("cpu", capacity_bytes, CPU_CORES, CPU_THREADS, weights, models,
               merge_marginal=CPU_MERGE_MARGINAL, oversubscribed=oversubscribed(calibration))


# ------------------------------------------------------------------------------ the GPU box
#
# A 24 GiB GPU of the NVIDIA L4 class (the common cloud inference card: 24 GB, 300 GB/s of
# memory bandwidth, 121 TFLOPS dense FP16 on its tensor cores, FP8 capable; NVIDIA's L4
# datasheet). Everything below derives from those figures and the stated assumptions.

GPU_CAPACITY = 22 * GIB  # 24 GiB less 2 GiB for the CUDA context and activations
HOST_TIER = 64 * GIB  # host RAM the warm tier may hold
DISK_BYTES_PER_S = 2 * GB  # a local NVMe, page cache cold (safetensors and GGUF read as is)
INIT_S = {"embed": 1.0, "rerank": 1.0, "chat": 6.0, "complete": 6.0}  # engine start per load
# (assumed: allocator, KV cache, warm-up pass; no CUDA graph capture. vLLM's sleep-mode post
# reports 30-100+ s for a full vLLM reload, https://blog.vllm.ai/2025/10/26/sleep-mode.html;
# a lighter engine in one process that keeps its CUDA context pays much less.)
PCIE_BYTES_PER_S = 6 * GB  # host RAM <-> device, effective: vLLM's sleep mode wakes
# Qwen3-0.6B (about 1.2 GB of bf16 weights) in 0.26 s from host RAM (same post), about
# 5-6 GB/s with its fixed costs; PCIe 4.0 x16 peaks at 32 GB/s.
RESTORE_FIXED_S = 0.05
GPU_UNLOAD_S = 0.3  # free the tensors and return the cache (assumed)
BANDWIDTH = 300 * GB * 0.6  # decode reads every weight once per token, at 60% of the peak
FLOPS = 121e12 * 0.4  # prefill and encoders: 40% of the dense FP16 peak
TOKENS_PER_WORD = 1.3
GEN_BASE_S, ENC_BASE_S = 0.02, 0.005  # fixed cost of one request (assumed)
RERANK_DOCS = 8  # as `bench trace` sends: 8 (query, document) pairs
KV_TOKENS = 16_384  # KV cache reserved per generator: 8 sequences of 2k tokens
GPU_SLOTS = {"embed": 1, "rerank": 1, "chat": 8, "complete": 8}  # generators batch
# continuously; encoders merge queued embeddings into one pass instead
GPU_THREADS = {"embed": 1.0, "rerank": 1.0, "chat": 1.0, "complete": 1.0, LOAD: 0.0}
# (loads and restores move bytes over the disk and PCIe, not through the SMs)


@dataclass(frozen=True)
class Published:
    """One serving model at its published size."""

    name: str
    task: str
    weight_bytes: int
    params: float  # for compute
    kv_bytes_per_token: int  # 2 (K, V) x layers x KV heads x head dim x 2 bytes; 0: encoder
    source: str


def _kv(layers: int, kv_heads: int, head_dim: int) -> int:
    return 2 * layers * kv_heads * head_dim * 2


# Sizes: bf16/fp16 weights are parameters x 2 bytes (parameter counts from the model cards on
# Hugging Face); GGUF Q4_K_M sizes as Ollama's library lists them; the FP8 checkpoint's files.
# KV figures from each model's config.json (layers, KV heads, head dim).
GPU_MODELS = (
    Published("bge-small-en-v1.5", "embed", int(33.4e6 * 2), 33.4e6, 0,
              "BAAI/bge-small-en-v1.5: 33.4M parameters, fp16"),
    Published("bge-base-en-v1.5", "embed", int(109e6 * 2), 109e6, 0,
              "BAAI/bge-base-en-v1.5: 109M parameters, fp16"),
    Published("multilingual-e5-large", "embed", int(560e6 * 2), 560e6, 0,
              "intfloat/multilingual-e5-large: 560M parameters, fp16"),
    Published("bge-m3", "embed", int(568e6 * 2), 568e6, 0,
              "BAAI/bge-m3: 568M parameters, fp16"),
    Published("bge-reranker-base", "rerank", int(278e6 * 2), 278e6, 0,
              "BAAI/bge-reranker-base: 278M parameters, fp16"),
    Published("bge-reranker-v2-m3", "rerank", int(568e6 * 2), 568e6, 0,
              "BAAI/bge-reranker-v2-m3: 568M parameters, fp16"),
    Published("qwen2.5-0.5b-instruct", "chat", int(494e6 * 2), 494e6, _kv(24, 2, 64),
              "Qwen/Qwen2.5-0.5B-Instruct: 494M parameters, bf16"),
    Published("qwen2.5-1.5b-instruct", "chat", int(1.54e9 * 2), 1.54e9, _kv(28, 2, 128),
              "Qwen/Qwen2.5-1.5B-Instruct: 1.54B parameters, bf16"),
    Published("qwen2.5-coder-1.5b", "complete", int(1.54e9 * 2), 1.54e9, _kv(28, 2, 128),
              "Qwen/Qwen2.5-Coder-1.5B (base, completion): 1.54B parameters, bf16"),
    Published("llama-3.2-1b-instruct", "chat", int(1.24e9 * 2), 1.24e9, _kv(16, 8, 64),
              "meta-llama/Llama-3.2-1B-Instruct: 1.24B parameters, bf16"),
    Published("llama-3.2-3b-instruct", "chat", int(3.21e9 * 2), 3.21e9, _kv(28, 8, 128),
              "meta-llama/Llama-3.2-3B-Instruct: 3.21B parameters, bf16"),
    Published("llama-3.2-3b-instruct-q4", "chat", int(2.0 * GB), 3.21e9, _kv(28, 8, 128),
              "ollama llama3.2:3b, Q4_K_M GGUF: 2.0 GB"),
    Published("qwen2.5-7b-instruct-q4", "chat", int(4.7 * GB), 7.62e9, _kv(28, 4, 128),
              "ollama qwen2.5:7b, Q4_K_M GGUF: 4.7 GB"),
    Published("llama-3.1-8b-instruct-q4", "chat", int(4.9 * GB), 8.03e9, _kv(32, 8, 128),
              "ollama llama3.1:8b, Q4_K_M GGUF: 4.9 GB"),
    Published("llama-3.1-8b-instruct-fp8", "chat", int(9.08 * GB), 8.03e9, _kv(32, 8, 128),
              "neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8: 5.0 + 4.08 GB of safetensors"),
)


def gpu_weights(m: Published) -> Weights:
    footprint = m.weight_bytes + m.kv_bytes_per_token * KV_TOKENS
    return Weights(
        key=m.name, bytes=footprint,
        load_s=round(INIT_S[m.task] + m.weight_bytes / DISK_BYTES_PER_S, 3),
        unload_s=GPU_UNLOAD_S,
        restore_s=round(RESTORE_FIXED_S + m.weight_bytes / PCIE_BYTES_PER_S, 3),
        offload_s=round(RESTORE_FIXED_S + m.weight_bytes / PCIE_BYTES_PER_S, 3),
        host_bytes=m.weight_bytes, slots=GPU_SLOTS[m.task],
        max_batch=32 if m.task == "embed" else 1)


def gpu_service(m: Published) -> ServiceModel:
    """Decode: every weight read once per output token; prefill and encoders: 2 FLOPs per
    parameter per token; a reranker reads RERANK_DOCS (query, document) pairs."""
    per_token_flops = 2 * m.params / FLOPS
    if m.task in ("chat", "complete"):
        return ServiceModel(GEN_BASE_S, TOKENS_PER_WORD * per_token_flops,
                            m.weight_bytes / BANDWIDTH)
    pairs = 2 * RERANK_DOCS if m.task == "rerank" else 1
    return ServiceModel(ENC_BASE_S, pairs * TOKENS_PER_WORD * per_token_flops)


def gpu_box(*, capacity_bytes: int = GPU_CAPACITY, host_bytes: int = HOST_TIER) -> Box:
    return Box("gpu", capacity_bytes, 1.0, GPU_THREADS,
               tuple(gpu_weights(m) for m in GPU_MODELS),
               tuple(SimModel(m.name, m.task, m.name, gpu_service(m)) for m in GPU_MODELS),
               host_bytes=host_bytes, merge_marginal=0.1)


# ------------------------------------------------------------------------------ traces


@dataclass(frozen=True)
class TraceShape:
    name: str
    cv: float  # of inter-arrival times: 1 Poisson, above 1 bursty
    phases: int = 1  # the popularity ranks rotate this many times over the trace


TRACES = (TraceShape("steady", 1.0), TraceShape("bursty", 4.0),
          TraceShape("shifting", 1.0, phases=4))
ALPHA = 0.9


def sim_trace(shape: TraceShape, models: Sequence[str], *, seed: int, duration_s: float,
              rate: float, alpha: float = ALPHA) -> list[TraceRequest]:
    """`make_trace` over `models` (most popular first); a shifting trace is cut in `phases`
    equal phases, each drawing from the ranks rotated by len(models) / phases."""
    if shape.phases <= 1:
        return make_trace(seed=seed, duration_s=duration_s, rate=rate, alpha=alpha,
                          cv=shape.cv, models=tuple(models))
    out: list[TraceRequest] = []
    span = duration_s / shape.phases
    step = max(1, math.ceil(len(models) / shape.phases))
    for i in range(shape.phases):
        k = (i * step) % len(models)
        order = (*models[k:], *models[:k])
        phase = make_trace(seed=seed + i, duration_s=span, rate=rate, alpha=alpha,
                           cv=shape.cv, models=order)
        out += [replace(r, at=r.at + i * span) for r in phase]
    return out


def cpu_popularity() -> tuple[str, ...]:
    return POPULARITY


def gpu_popularity(seed: int) -> tuple[str, ...]:
    """The GPU catalog in Zipf rank order: a seeded shuffle, so that no one picks it."""
    order = np.random.default_rng(seed).permutation(len(GPU_MODELS))
    return tuple(GPU_MODELS[int(i)].name for i in order)


def describe_gpu_catalog() -> list[list[object]]:
    """Rows for the docs: name, task, footprint, cold load, warm restore, decode or pass."""
    rows: list[list[object]] = []
    for m in GPU_MODELS:
        w, s = gpu_weights(m), gpu_service(m)
        rows.append([m.name, m.task, f"{m.weight_bytes / GB:.2f}", f"{w.bytes / GIB:.2f}",
                     w.load_s, w.restore_s, round(s.seconds(32, 16), 3), m.source])
    return rows


def total_mib(box: Box) -> float:
    return sum(w.bytes for w in box.weights) / MIB
