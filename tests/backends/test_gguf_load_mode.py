"""Whether a CPU load maps its GGUF or reads it into the runner's memory (`backends.gguf.
maps_weights`): a file whose tensors are mostly repacked at load is read, its estimate holds
the repacked tensors once, its runner is told so, and it has no warm copy to keep."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from packserve import backends
from packserve.backends import gguf
from packserve.backends.llama_server import LlamaServerBackend
from packserve.modelfiles import ModelFacts, read_facts
from tests.test_modelfiles import source_path

MIB = 1 << 20


def _facts(repacked_mib: int, tied_mib: int = 0, weights_mib: int = 100) -> ModelFacts:
    return ModelFacts(path=Path("/models/m.gguf"), format="gguf", weight_bytes=weights_mib * MIB,
                      file_bytes=weights_mib * MIB, n_params=0, n_layers=16, n_kv_heads=8,
                      head_dim=64, hidden_size=2048, vocab_size=128256, context_length=8192,
                      repacked_bytes=repacked_mib * MIB, repacked_tied_bytes=tied_mib * MIB)


def test_a_mostly_repacked_file_is_read_on_the_cpu_and_mapped_elsewhere() -> None:
    assert gguf.maps_weights(_facts(60), "cpu") is False
    assert gguf.maps_weights(_facts(49), "cpu") is True
    # the tied output's duplicate is not in the file: 60 copied, 40 of them the file's
    assert gguf.maps_weights(_facts(60, tied_mib=20), "cpu") is True
    assert gguf.maps_weights(_facts(90), "cuda:0") is True  # a card takes the file as it is
    assert gguf.maps_weights(None, "cpu") is True


def test_a_read_load_counts_its_repacked_tensors_once_and_a_tied_duplicate_twice() -> None:
    engine = backends.get("llama-server")
    facts = _facts(80, tied_mib=10)
    read = engine.load_spec(facts.path, "cpu", 2048, 64, {}, facts=facts)
    mapped = dataclasses.replace(read, mapped=True)
    assert read.mapped is False and read.key == mapped.key + "|read"
    assert gguf.repacked(facts, read) == 10 * MIB
    assert gguf.repacked(facts, mapped) == 80 * MIB
    assert gguf.repacked(facts, dataclasses.replace(read, device="cuda:0")) == 0
    assert gguf.size(facts, read, "m", 1).total == gguf.size(facts, mapped, "m", 1).total \
        - 70 * MIB


def test_a_read_runner_is_told_so_and_has_no_warm_copy() -> None:
    engine = backends.get("llama-server")
    facts = _facts(80)
    backend = engine.build(engine.load_spec(facts.path, "cpu", 2048, 64, {}, facts=facts))
    assert isinstance(backend, LlamaServerBackend)
    assert backend._device_args() == ["--device", "none", "--load-mode", "none"]
    assert backend.release_weights() is False
    assert backend._child is None  # decided by the load, not by asking a process
    mapped = engine.build(engine.load_spec(facts.path, "cpu", 2048, 64, {}))
    assert isinstance(mapped, LlamaServerBackend)
    assert mapped._device_args() == ["--device", "none"]


def test_the_default_gguf_models_stay_mapped(tmp_path: Path) -> None:
    """Gemma's 12 MiB of repacked Q4_K beside its Q8_0 embeddings, SmolLM2's Q4_1: their warm
    copies give their pages back."""
    for name in ("gemma-3-270m", "smollm2-135m-instruct"):
        assert gguf.maps_weights(read_facts(source_path(name, tmp_path)), "cpu"), name
