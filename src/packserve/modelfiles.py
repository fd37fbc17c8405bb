"""Facts about a model read from its own files, without loading it.

GGUF: tensor sizes and architecture from the header (the `gguf` package).
safetensors: tensor sizes and dtypes from the header, architecture from `config.json`.
The footprint estimator (and later the planner) is arithmetic over these facts.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from packserve import atomic
from packserve.errors import ConfigError


@dataclass(frozen=True)
class ModelFacts:
    """What a model file says about itself. Sizes in bytes; architecture may be unknown (0)."""

    path: Path
    format: str  # "gguf" | "safetensors"
    weight_bytes: int
    file_bytes: int
    n_params: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context_length: int  # what the model was trained for
    n_heads: int = 0  # attention (query) heads
    ffn_size: int = 0  # feed-forward width
    dtype: str = ""  # how the weights are stored: "F32", "Q4_K_M", "BF16", ... ("" unknown)
    repacked_bytes: int = 0  # of a GGUF's, what llama.cpp's CPU backend copies (cpu_repacked)
    repacked_tied_bytes: int = 0  # of those, a tied output's duplicate (the rest: the file's)


GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what llama.cpp reads; version 1 files were dropped in 2023
SAFETENSORS_MAX_HEADER = 100 << 20  # the format's own limit on its JSON header


def check_header(path: Path) -> None:
    """Refuse a model file whose header is corrupt, truncated or of a version we cannot read.

    Called before every load (in a load thread), so it reads only what it must: 24 bytes of a
    GGUF file, the JSON header of a safetensors file, and, for a model directory, the headers
    of its `*.safetensors` files. Anything else (tokenizers, configs, pickles) is left to the
    engine. Raises ConfigError saying what is wrong with which file.
    """
    if path.is_dir():
        for file in sorted(path.glob("*.safetensors")):
            _check_safetensors(file)
    elif not path.exists():
        raise ConfigError(f"{path} does not exist")
    elif path.suffix == ".gguf":
        _check_gguf(path)
    elif path.suffix == ".safetensors":
        _check_safetensors(path)


def _check_gguf(path: Path) -> None:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(24)  # magic, version (u32), tensor count (u64), metadata count (u64)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise ConfigError(f"{path} is not a GGUF file: it starts with {head[:4]!r}, not "
                          f"{GGUF_MAGIC!r} (a truncated or failed download?)")
    version = int.from_bytes(head[4:8], "little")
    if version not in GGUF_VERSIONS:
        raise ConfigError(f"{path} is GGUF version {version}; packserve's llama.cpp reads "
                          f"versions {', '.join(map(str, GGUF_VERSIONS))}")
    tensors = int.from_bytes(head[8:16], "little")
    metadata = int.from_bytes(head[16:24], "little")
    if tensors > size or metadata > size:  # each entry takes several bytes of the file
        raise ConfigError(f"{path} has a corrupt GGUF header: it claims {tensors} tensors and "
                          f"{metadata} metadata entries in {size} bytes")


def _check_safetensors(file: Path) -> None:
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(SAFETENSORS_MAX_HEADER, size - 8):
            raise ConfigError(f"{file} has a corrupt safetensors header: it claims a "
                              f"{length}-byte header in a {size}-byte file")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        raise ConfigError(f"{file} has a corrupt safetensors header: not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ConfigError(f"{file} has a corrupt safetensors header: not a JSON object")
    data = size - 8 - length
    end = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise ConfigError(f"{file} has a corrupt safetensors header: tensor {name!r} has "
                              f"no valid data_offsets")
        end = max(end, offsets[1])
    if end > data:
        raise ConfigError(f"{file} is truncated: its tensors need {end} bytes of data and it "
                          f"holds {data}")


_CACHE_VERSION = 5  # bump when ModelFacts gains fields, so older rows are read again


def file_identity(path: Path) -> tuple[int, int, int, int]:
    """Which file `path` is, as it is now (device, inode, size, mtime): a weights file written
    over or replaced since an engine read it has another."""
    stat = path.stat()
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def read_facts_cached(path: Path, cache_file: Path) -> ModelFacts:
    """`read_facts`, remembered in `cache_file` by path, size and mtime.

    The gguf reader parses every metadata array (Gemma's 262k-token vocabulary takes ~10 s on
    a 2-core machine), so restarts reuse what an earlier start read.
    """
    stat = path.stat()
    stamp = f"{_CACHE_VERSION}:{stat.st_size}:{stat.st_mtime_ns}"
    try:
        cache: dict[str, dict[str, object]] = json.loads(cache_file.read_text("utf-8"))
    except (OSError, ValueError):
        cache = {}
    row = cache.get(str(path))
    if row is not None and row.get("stamp") == stamp:
        fields = {k: v for k, v in row.items() if k != "stamp"}
        return ModelFacts(**{**fields, "path": path})  # type: ignore[arg-type]
    facts = read_facts(path)
    cache[str(path)] = {**dataclasses.asdict(facts), "path": str(path), "stamp": stamp}
    atomic.write_text(cache_file, json.dumps(cache, indent=1, sort_keys=True))
    return facts


def read_facts(path: Path) -> ModelFacts:
    """Read a GGUF file or a safetensors model directory. Raises ConfigError if unreadable."""
    try:
        if path.is_file() and path.suffix == ".gguf":
            return _gguf_facts(path)
        if path.is_dir():
            return _safetensors_facts(path)
    except ConfigError:
        raise
    except Exception as exc:  # corrupt headers surface as many exception types
        raise ConfigError(f"cannot read the model header of {path}: {exc}") from exc
    raise ConfigError(f"{path} is neither a .gguf file nor a model directory")


def _gguf_facts(path: Path) -> ModelFacts:
    from gguf import GGUFReader  # imported here: it maps the whole file lazily

    return gguf_facts(GGUFReader(str(path)), path)


def gguf_facts(reader: Any, path: Path) -> ModelFacts:
    """The facts of the GGUF file `path` from its parsed header (a `gguf.GGUFReader`)."""
    def field(key: str, default: int = 0) -> int:
        f = reader.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        return int(value) if isinstance(value, int | float) else default

    arch = gguf_arch(reader)
    n_heads = field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    head_dim = field(f"{arch}.attention.key_length") or (hidden // n_heads if n_heads else 0)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = field(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else 0)
    file_type = field("general.file_type", -1)
    return ModelFacts(
        path=path,
        format="gguf",
        weight_bytes=sum(int(t.n_bytes) for t in reader.tensors),
        file_bytes=path.stat().st_size,
        n_params=sum(int(t.n_elements) for t in reader.tensors),
        n_layers=field(f"{arch}.block_count"),
        n_kv_heads=field(f"{arch}.attention.head_count_kv", n_heads),
        head_dim=head_dim,
        hidden_size=hidden,
        vocab_size=vocab,
        context_length=field(f"{arch}.context_length"),
        n_heads=n_heads,
        ffn_size=field(f"{arch}.feed_forward_length"),
        dtype=_GGUF_FILE_TYPES.get(file_type, ""),
        **repacked_of(gguf_tensors(reader), arch),
    )


def gguf_tensors(reader: Any) -> list[tuple[str, str, list[int], int]]:
    """(name, type, ggml dims, bytes) of each tensor of a parsed GGUF (`gguf.GGUFReader`)."""
    return [(t.name, t.tensor_type.name, [int(n) for n in t.shape], int(t.n_bytes))
            for t in reader.tensors]


def gguf_arch(reader: Any) -> str:
    """A parsed GGUF's `general.architecture` ("llama" when it does not say)."""
    arch_field = reader.fields.get("general.architecture")
    return str(arch_field.contents()) if arch_field is not None else "llama"


def repacked_of(tensors: Sequence[tuple[str, str, Sequence[int], int]], arch: str
                ) -> dict[str, int]:
    """`cpu_repacked` of the tensors of a model of architecture `arch` (a split GGUF's: every
    part's, so that a tied output is judged by all their names)."""
    return cpu_repacked(tensors, lm_head=not _encoder_only(arch))


# What llama.cpp's CPU backend repacks at load on the build packserve makes (x86-64 with AVX2,
# no AVX-512: scripts/setup.sh): matrices of these types whose rows come in eights
# (ggml-cpu/repack.cpp, ggml_repack_get_optimal_repack_type). Q2_K joins them with AVX-512.
REPACKED_TYPES = frozenset({"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"})
# Matrices read by row lookup (GGML_OP_GET_ROWS), never multiplied: the CPU's repacked buffers
# take only matrix products, so these stay in the file's mapping as they are.
_LOOKUP_TENSORS = ("token_embd.", "pos_embd.", "token_types.", "per_layer_token_embd.")


def _encoder_only(arch: str) -> bool:
    """An architecture with no output layer (BERT and its kin, T5's encoder). A decoder used
    for embeddings (Qwen3, Gemma's embedding models) still builds the tied output."""
    return "bert" in arch or arch == "t5encoder"


def cpu_repacked(tensors: Sequence[tuple[str, str, Sequence[int], int]],
                 lm_head: bool) -> dict[str, int]:
    """Bytes of a GGUF's weights that llama.cpp's CPU backend copies at load into the
    interleaved layout of its kernels, from the tensors' (name, type, ggml dims, bytes):
    `repacked_bytes`, and of them `repacked_tied_bytes`, a tied output's (ModelFacts' fields).

    Every multiplied matrix of a repacked type whose row count (dims[1]) is a multiple of 8:
    the 2-D weights and the 3-D experts of a mixture (`*_exps.*`); not the layers llama.cpp
    skips at load (`*.nextn.*`, the multi-token-prediction heads). A model that ties its output
    to its token embeddings (`lm_head` and no `output.weight`: Llama 3.2, Gemma) multiplies by a
    duplicate of them, which is repacked like any other. The copy is anonymous memory; with the
    file mapped (llama.cpp's default) the pages it was read from stay mapped too, so a resident
    set holds these bytes twice (`backends.gguf.maps_weights` says when packserve reads the
    file into memory instead)."""
    def repacked(name: str, kind: str, dims: Sequence[int]) -> bool:
        matrix = len(dims) == 2 or (len(dims) == 3 and "_exps." in name)
        return kind in REPACKED_TYPES and matrix and dims[1] % 8 == 0

    total = tied = 0
    names = {name for name, *_ in tensors}
    for name, kind, dims, n_bytes in tensors:
        if ".nextn." in name:
            continue
        if name.startswith(_LOOKUP_TENSORS):
            if name == "token_embd.weight" and lm_head and "output.weight" not in names \
                    and repacked(name, kind, dims):
                tied = n_bytes  # the tied output's duplicate
            continue
        if repacked(name, kind, dims):
            total += n_bytes
    return {"repacked_bytes": total + tied, "repacked_tied_bytes": tied}


# llama.cpp's `general.file_type` (enum llama_ftype) for the common cases.
_GGUF_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 30: "IQ4_XS", 32: "BF16",
}


_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1,
    "BOOL": 1,
}


def _safetensors_facts(folder: Path) -> ModelFacts:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} holds no .safetensors file")
    headers: list[dict[str, Any]] = []
    for file in files:
        with safe_open(str(file), framework="numpy") as st:
            headers.append({name: {"dtype": st.get_slice(name).get_dtype(),
                                   "shape": st.get_slice(name).get_shape()}
                            for name in st.keys()})  # noqa: SIM118 - safe_open is not a Mapping
    cfg_path = folder / "config.json"
    cfg: dict[str, object] = json.loads(cfg_path.read_text("utf-8")) if cfg_path.exists() else {}
    return safetensors_facts(folder, headers, sum(f.stat().st_size for f in files), cfg)


def safetensors_facts(folder: Path, headers: Sequence[Mapping[str, Any]], file_bytes: int,
                      cfg: Mapping[str, object]) -> ModelFacts:
    """The facts of a safetensors model from its files' JSON headers (tensor name -> dtype and
    shape; `__metadata__` skipped), their bytes and its `config.json`: arithmetic only, so the
    headers may come from local files or from ranged reads of the Hub's (packserve.hub)."""
    weight_bytes = n_params = 0
    dtypes: dict[str, int] = {}
    for header in headers:
        for name, tensor in header.items():
            if name == "__metadata__" or not isinstance(tensor, Mapping):
                continue
            count = 1
            for dim in tensor.get("shape", ()):
                count *= int(dim)
            dtype = str(tensor.get("dtype", ""))
            n_params += count
            weight_bytes += count * _DTYPE_BYTES.get(dtype, 4)
            dtypes[dtype] = dtypes.get(dtype, 0) + count

    def num(key: str, default: int = 0) -> int:
        value = cfg.get(key, default)
        return int(value) if isinstance(value, int | float) else default

    heads = num("num_attention_heads")
    hidden = num("hidden_size")
    return ModelFacts(
        path=folder,
        format="safetensors",
        weight_bytes=weight_bytes,
        file_bytes=file_bytes,
        n_params=n_params,
        n_layers=num("num_hidden_layers"),
        n_kv_heads=num("num_key_value_heads", heads),
        head_dim=num("head_dim") or (hidden // heads if heads else 0),
        hidden_size=hidden,
        vocab_size=num("vocab_size"),
        context_length=num("max_position_embeddings"),
        n_heads=heads,
        ffn_size=num("intermediate_size"),
        dtype=max(dtypes, key=lambda k: dtypes[k]) if dtypes else "",
    )
