"""The well-known sizing tables, reproduced with the assumptions that give each number.

Tables: reference gpu-vps-training-vs-inference.md (FP16, INT4, fine-tuning, full training)
and gpu-servers-phases.md (4-bit 8B / 32B / 70B). GB are decimal, as the tables print them.
"""

from __future__ import annotations

import pytest

from packserve.planner import catalog, sizing
from packserve.planner.sizing import ModelShape, Workload

GB = 1e9
FAMILIES = catalog.load_families()


def shape(params: str, precision: str) -> ModelShape:
    n = sizing.parse_params(params)
    fam = catalog.typical_family(n, FAMILIES)
    return ModelShape(name=params, n_params=n, precision=precision, arch=fam.arch)


def total_with_runtime(b: sizing.Breakdown) -> float:
    """What one GPU must hold: the model plus the CUDA context of its process."""
    return (b.total + sizing.GPU_RUNTIME_BYTES) / GB


@pytest.mark.parametrize(("params", "table_gb"), [("7B", 14), ("13B", 26), ("34B", 68),
                                                  ("70B", 140)])
def test_fp16_inference_is_two_bytes_per_parameter(params: str, table_gb: int) -> None:
    # Assumption: the FP16 column counts the weights only (2 bytes per parameter).
    b = sizing.size_model(shape(params, "fp16"), Workload(context=2048))
    assert b.weights / GB == pytest.approx(table_gb, abs=0.5)


@pytest.mark.parametrize(("params", "table_gb"), [
    ("7B", 5), ("13B", 9), ("34B", 20), ("70B", 40), ("8B", 6), ("32B", 20)])
def test_int4_inference_is_about_four_times_less_plus_overhead(params: str,
                                                               table_gb: int) -> None:
    # Assumptions: int4 = 4.25 bits per weight (group-128 scales), the typical architecture
    # for the size, 2048-token context, one sequence, 5% allocator slack, one CUDA context.
    b = sizing.size_model(shape(params, "int4"), Workload(context=2048))
    assert total_with_runtime(b) == pytest.approx(table_gb, rel=0.10)
    fp16 = sizing.size_model(shape(params, "fp16"), Workload(context=2048))
    assert fp16.weights / b.weights == pytest.approx(4, rel=0.1)  # "about 4x less"


@pytest.mark.parametrize(("params", "table_gb"), [("7B", 16), ("13B", 28)])
def test_lora_fine_tuning(params: str, table_gb: int) -> None:
    # Assumptions: FP16 frozen base, rank-16 adapters on every linear layer trained in fp32
    # with Adam, micro-batch 1 x 512 tokens, gradient checkpointing on.
    work = Workload(task="lora", context=512, batch=1)
    b = sizing.size_model(shape(params, "fp16"), work)
    assert total_with_runtime(b) == pytest.approx(table_gb, rel=0.10)
    assert b.gradients < 0.02 * b.weights  # only the adapters (fp32) have gradients


def test_qlora_7b_fits_in_16_gb() -> None:
    # Assumptions: NF4 base (QLoRA), the same adapters and batch as LoRA.
    b = sizing.size_model(shape("7B", "fp16"), Workload(task="qlora", context=512))
    assert total_with_runtime(b) <= 16
    lora = sizing.size_model(shape("7B", "fp16"), Workload(task="lora", context=512))
    assert b.total < lora.total / 2


@pytest.mark.parametrize(("params", "table_gb"), [("7B", 56), ("13B", 104)])
def test_full_training_is_four_to_six_times_inference(params: str, table_gb: int) -> None:
    # Assumptions: BF16 weights and gradients, Adam's two moments in BF16 (8 bytes per
    # parameter in all), micro-batch 1 x 512 tokens, gradient checkpointing on.
    b = sizing.size_model(shape(params, "bf16"), Workload(task="full", context=512))
    assert total_with_runtime(b) == pytest.approx(table_gb, rel=0.10)
    inference = sizing.size_model(shape(params, "fp16"), Workload(context=2048)).weights
    assert 4 <= b.total / inference <= 6
    assert b.optimizer == 2 * b.gradients  # Adam: two extra copies per parameter


def test_kv_cache_formula() -> None:
    arch = FAMILIES["llama-3.1-70b"].arch  # 80 layers, 8 KV heads, 128 dims
    assert sizing.kv_cache_bytes(arch, 4096, 2) == 2 * 80 * 8 * 128 * 4096 * 2 * 2
    work = Workload(context=4096, sequences=8)
    one = sizing.size_model(shape("70B", "int4"), Workload(context=4096))
    eight = sizing.size_model(shape("70B", "int4"), work)
    assert eight.kv_cache == 8 * one.kv_cache


def test_optimizer_choices_and_checkpointing() -> None:
    s = shape("7B", "bf16")
    adam = sizing.size_model(s, Workload(task="full"))
    fp32 = sizing.size_model(s, Workload(task="full", optimizer="adam-fp32"))
    eight = sizing.size_model(s, Workload(task="full", optimizer="adam-8bit"))
    assert fp32.optimizer == 12 * s.n_params and eight.optimizer == 2 * s.n_params
    assert eight.optimizer < adam.optimizer < fp32.optimizer
    off = sizing.size_model(s, Workload(task="full", gradient_checkpointing=False))
    assert off.activations > adam.activations


def test_parse_params_and_precisions() -> None:
    assert sizing.parse_params("7B") == 7_000_000_000
    assert sizing.parse_params("135M") == 135_000_000
    assert sizing.parse_params("0.5b") == 500_000_000
    with pytest.raises(ValueError, match="parameter count"):
        sizing.parse_params("seven")
    with pytest.raises(ValueError, match="unknown precision"):
        sizing.bits_per_weight("int3")


def test_typical_family_is_nearest_in_size() -> None:
    assert catalog.typical_family(7_000_000_000, FAMILIES).name == "mistral-7b"
    assert catalog.typical_family(70_000_000_000, FAMILIES).name == "llama-3.1-70b"
    assert all(f.source.startswith("https://") for f in FAMILIES.values())
