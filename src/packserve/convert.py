"""A BERT-family sentence embedder's safetensors folder as one GGUF file llama.cpp serves.

The default catalog's embedder ships as a sentence-transformers folder (safetensors, WordPiece
vocabulary, a pooling config). llama.cpp serves the same model from GGUF in a runner process,
which needs neither torch nor transformers in packserve's processes (docs/engines.md,
"Embeddings through llama.cpp"). This writes that GGUF with the `gguf` package alone: tensor
names through gguf's own map of Hugging Face names, the vocabulary in llama.cpp's WordPiece
form (a word-initial piece carries the phantom space U+2581, a continuation `##x` becomes `x`),
the special tokens, the pooling of `1_Pooling/config.json`, and as the context length the
longest input sentence-transformers reads (`max_seq_length`, 256 for MiniLM), not the 512
positions BERT has (llama.cpp wants a position embedding per position of the context, so the
rows past it are left out): inputs over it are refused as they were with the torch engine.

Matrices are stored as F16 (norms, biases and the position and token-type tables as F32):
vectors stay within cosine 0.9999 of sentence-transformers' (tests/backends/test_embed_runner.py),
at half the bytes. One difference is known: a word of over 100 characters is one [UNK] token
to BertTokenizer and pieces of the word to llama.cpp.

The file is written once, atomically, into `DATA_DIR/models/`, named after the folder and a
hash of what it was made from: another start finds it; a changed source is converted anew.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packserve import atomic
from packserve.errors import ConfigError

log = logging.getLogger("packserve.convert")

# Bump when the output changes for the same input: the cached file's name changes with it.
VERSION = 2
ARCHITECTURES = ("BertModel", "BertForMaskedLM")  # a plain BERT encoder; others are refused
_POOLING = {"pooling_mode_mean_tokens": 1, "pooling_mode_cls_token": 2}  # llama.cpp's codes
_GENERIC = {"model", "models", "weights", "snapshot"}  # folder names that name nothing
# Tables llama.cpp adds to the activations rather than multiplies by: they stay F32 (its CPU
# backend adds no F16 to F32).
_ADDED = {"position_embd.weight", "token_types.weight"}
# Files whose content decides the output (with the safetensors).
_INPUTS = ("config.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
           "sentence_bert_config.json", "modules.json", "1_Pooling/config.json")

Announce = Callable[[str], None] | None


def convertible(folder: Path) -> str | None:
    """Why `folder` cannot be converted (None when it can): a BERT encoder with a WordPiece
    vocabulary, safetensors weights, and sentence-transformers' mean or CLS pooling."""
    config = _read_json(folder / "config.json")
    if config is None:
        return f"{folder} has no config.json"
    if config.get("model_type") != "bert" or not set(config.get("architectures") or ["BertModel"]
                                                     ) <= set(ARCHITECTURES):
        return (f"{folder} is a {config.get('model_type')!r} model "
                f"({', '.join(config.get('architectures') or [])}); only BERT encoders are "
                f"converted to GGUF here")
    if not (folder / "vocab.txt").is_file():
        return f"{folder} has no vocab.txt (a WordPiece vocabulary)"
    if not sorted(folder.glob("*.safetensors")):
        return f"{folder} has no *.safetensors weights"
    if _pooling(folder) is None:
        return f"{folder}'s pooling is neither mean nor CLS (1_Pooling/config.json)"
    return None


def gguf_for(folder: Path, models_dir: Path, announce: Announce = None) -> Path:
    """The GGUF file of the sentence-transformers folder `folder`, converted into `models_dir`
    the first time. Raises ConfigError when it cannot be converted."""
    problem = convertible(folder)
    if problem is not None:
        raise ConfigError(problem)
    name = folder.name if folder.name.lower() not in _GENERIC else folder.parent.name
    target = models_dir / f"{name.replace('_', '-')}-f16-{_fingerprint(folder)}.gguf"
    if target.is_file():
        return target.resolve()
    message = f"converting {folder} to GGUF for llama.cpp into {target} (first start only)"
    log.info("%s", message)
    if announce is not None:
        announce(message)
    with atomic.replacing(target, suffix=".partial") as partial:
        write(folder, partial)
    return target.resolve()


def write(folder: Path, target: Path) -> None:
    """Write `folder`'s model to `target` as GGUF (see the module's docstring)."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    config = _read_json(folder / "config.json") or {}
    tokenizer = _read_json(folder / "tokenizer_config.json") or {}
    sentence = _read_json(folder / "sentence_bert_config.json") or {}
    layers = int(config["num_hidden_layers"])
    positions = int(config.get("max_position_embeddings", 512))
    context = min(positions, int(sentence.get("max_seq_length") or positions))

    writer = gguf.GGUFWriter(str(target), "bert")
    writer.add_name(folder.name if folder.name.lower() not in _GENERIC else folder.parent.name)
    writer.add_context_length(context)
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_block_count(layers)
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_layer_norm_eps(float(config.get("layer_norm_eps", 1e-12)))
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(_pooling(folder) or 1))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    # The vocabulary, in the order of the token ids.
    words = (folder / "vocab.txt").read_text("utf-8").splitlines()
    special = _special_tokens(folder, tokenizer)
    control = set(special.values())
    ids = {word: i for i, word in enumerate(words)}
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_type_count(int(config.get("type_vocab_size", 1)))
    writer.add_token_list([w if w in control else w[2:] if w.startswith("##") else "\u2581" + w
                           for w in words])
    writer.add_token_types([int(gguf.TokenType.CONTROL if w in control else gguf.TokenType.NORMAL)
                            for w in words])
    for role, add in (("cls_token", writer.add_bos_token_id),
                      ("sep_token", writer.add_eos_token_id),
                      ("sep_token", writer.add_sep_token_id),
                      ("unk_token", writer.add_unk_token_id),
                      ("pad_token", writer.add_pad_token_id),
                      ("mask_token", writer.add_mask_token_id)):
        token = special.get(role)
        if token is not None and token in ids:
            add(ids[token])
    writer.add_add_bos_token(True)  # [CLS] text [SEP], as BertTokenizer makes it
    writer.add_add_eos_token(True)
    writer.add_add_sep_token(False)
    lowercase = bool(tokenizer.get("do_lower_case", True))
    writer.add_bool("tokenizer.ggml.normalizer.lowercase", lowercase)
    if tokenizer.get("strip_accents") is not None:
        writer.add_bool("tokenizer.ggml.normalizer.strip_accents",
                        bool(tokenizer["strip_accents"]))

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, layers)
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open has no __iter__)
                hf = key.removeprefix("bert.")
                if hf.startswith(("pooler.", "cls.")) or hf.endswith("position_ids"):
                    continue  # what an embedder does not use
                mapped = names.get_name(hf, try_suffixes=(".weight", ".bias"))
                if mapped is None:
                    raise ConfigError(f"{file}: no GGUF name for the tensor {key!r}")
                data = f.get_tensor(key)
                if mapped == "position_embd.weight":
                    data = data[:context]  # llama.cpp wants a row per position it may use
                half = data.ndim == 2 and mapped not in _ADDED
                data = data.astype(np.float16 if half else np.float32)
                writer.add_tensor(mapped, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _pooling(folder: Path) -> int | None:
    pooling = _read_json(folder / "1_Pooling" / "config.json")
    if pooling is None:
        return 1  # no pooling module: sentence-transformers pools by the mean
    on = [code for flag, code in _POOLING.items() if pooling.get(flag)]
    others = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v
              and k not in _POOLING]
    return on[0] if len(on) == 1 and not others else None


def _special_tokens(folder: Path, tokenizer: dict[str, Any]) -> dict[str, str]:
    """Role -> token text (`cls_token` -> "[CLS]"), from special_tokens_map.json or the
    tokenizer config."""
    found = {**{k: v for k, v in tokenizer.items() if k.endswith("_token")},
             **(_read_json(folder / "special_tokens_map.json") or {})}
    roles = {role: (v["content"] if isinstance(v, dict) else v) for role, v in found.items()
             if isinstance(v, str | dict)}
    return {role: str(text) for role, text in roles.items() if text}


def _fingerprint(folder: Path) -> str:
    digest = hashlib.sha256(f"packserve-convert-{VERSION}".encode())
    for file in [*(folder / n for n in _INPUTS), *sorted(folder.glob("*.safetensors"))]:
        if file.is_file():
            stat = file.stat()
            digest.update(f"{file.relative_to(folder)}|{stat.st_size}|{stat.st_mtime_ns}"
                          .encode())
            if stat.st_size < 1 << 20:  # the small ones by content
                digest.update(file.read_bytes())
    return digest.hexdigest()[:12]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
