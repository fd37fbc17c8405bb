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


# A CPU load reads the weights into memory, not mapping the file, where at least this share of
# the file's tensors is repacked: those pages would stay mapped beside their copies for nothing.
READ_REPACKED_SHARE = 0.5


def maps_weights(facts: ModelFacts | None, device: str) -> bool:
    """Whether a load on `device` maps the GGUF file (llama.cpp's default) rather than reading
    it into the runner's memory (`--load-mode none`): on the CPU, a file whose tensors are
    mostly repacked at load (Q4_0, Q4_K, IQ4_NL) is read. Mapped, its resident set holds those
    tensors twice, the file's pages beside the copies its kernels use; read, once, and the
    unrepacked rest in anonymous memory too (a runner of Llama-3.2-3B's shape in Q4_0: 3,738
    MiB mapped, 2,233 read, the same decode rate; docs/tuning.md). What it gives up is the warm
    tier: no mapping leaves nothing to give back, so an eviction unloads it. Mapped, that warm
    copy would have kept the copies, more than half of the bytes it held."""
    if facts is None or device != "cpu":
        return True
    in_file = facts.repacked_bytes - facts.repacked_tied_bytes
    return in_file < READ_REPACKED_SHARE * facts.weight_bytes


def repacked(facts: ModelFacts, load: LoadSpec) -> int:
    """The bytes a load holds twice because its kernels copy them into their own layout: on
    the CPU, what the header says it repacks, the tied output's duplicate alone where the file
    is read into memory (the rest are copied from a buffer that is then freed); on a GPU
    none (the weights go to the card as they are)."""
    if load.device != "cpu":
        return 0
    return facts.repacked_bytes if load.mapped else facts.repacked_tied_bytes


def size(facts: ModelFacts | None, load: LoadSpec, name: str, sequences: int) -> Breakdown:
    """One load's footprint from the file's header: `sequences` slots sharing one KV cache of
    the load's context, or each its own (`parallel_cache = "per_slot"`), and the copies its
    kernels repack."""
    assert facts is not None  # reads_files
    return llama_cpp_breakdown(shape_of(facts, name), load.context_length, sequences,
                               shared_cache=sequences > 1 and not load.cache_per_slot,
                               repacked=repacked(facts, load))
