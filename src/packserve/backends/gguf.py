"""What the llama.cpp engines read of a GGUF model before a load: the source check, the
context a load gets and the footprint it is admitted by (`planner.sizing`'s llama.cpp terms)."""

from __future__ import annotations

from pathlib import Path

from packserve.core.backend import LoadSpec
from packserve.core.footprint import shape_of
from packserve.modelfiles import ModelFacts
from packserve.planner.sizing import Breakdown, llama_cpp_breakdown

DEFAULT_CONTEXT = 2048  # tokens of KV cache unless the entry or the model asks for fewer


def check_source(path: Path) -> str | None:
    """Why `path` cannot be loaded (it is not a GGUF file), or None."""
    return None if path.suffix == ".gguf" else f"a .gguf file, got {path}"


def context(requested: int | None, facts: ModelFacts | None) -> int:
    """The entry's `context_length`, else DEFAULT_CONTEXT or the model's own if shorter."""
    trained = facts.context_length if facts is not None else 0
    return requested or min(DEFAULT_CONTEXT, trained or DEFAULT_CONTEXT)


def repacked(facts: ModelFacts, load: LoadSpec) -> int:
    """The bytes the load's kernels copy into their own layout: on the CPU, what the header
    says it repacks; on a GPU none (the weights go to the card as they are)."""
    return facts.repacked_bytes if load.device == "cpu" else 0


def size(facts: ModelFacts | None, load: LoadSpec, name: str, sequences: int) -> Breakdown:
    """One load's footprint from the file's header: `sequences` slots sharing one KV cache of
    the load's context, or each its own (`parallel_cache = "per_slot"`), and the copies its
    kernels repack."""
    assert facts is not None  # reads_files
    return llama_cpp_breakdown(shape_of(facts, name), load.context_length, sequences,
                               shared_cache=sequences > 1 and not load.cache_per_slot,
                               repacked=repacked(facts, load))
