"""Tiny models made on the spot, for the prepared GPU check (scripts/gpu-check.sh): nothing is
downloaded and nothing of the packaged models is copied to the GPU machine.

- `write_gguf(path)`: a llama-architecture GGUF with random weights (f16) and a SentencePiece
  vocabulary llama.cpp accepts (byte fallback, a ChatML template), about 26 MB at the default
  shape: big enough that its device bytes stand out of NVML's granularity, small enough to load
  in well under a second.
- `write_bert(folder)`: a random BERT saved by sentence-transformers (safetensors, a WordPiece
  tokenizer, mean pooling), about 28 MB, loadable with `SentenceTransformer(folder)`.

And issue 41's models of real shape, random weights at real sizes (`REAL_SHAPES`, written by
`ensure_real_shape`): Llama-3.2-1B and -3B shapes in Q4_0 and Q8_0, a Llama-3.1-8B shape in
Q4_0 (`write_llama_gguf`), and a BERT-base embedder in F16 (`write_bert_gguf`); about 12 GB
together. Each file is streamed to disk, fsynced and renamed into place when whole.

The GGUFs need only numpy and the `gguf` package; the BERT folder needs transformers and
sentence-transformers (which the GPU machine has, torch with them).

    python3 scripts/gpu/tiny_models.py OUT   # writes OUT/tiny-llama.gguf and OUT/tiny-bert/
    python3 scripts/gpu/tiny_models.py --real random-llama-3.2-1b-q4_0 [NAME...|all] --into DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import string
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import gguf

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

_WORD_TEXT = ("the of and to in is that for it as with was on be by this are or from at an "
              "which have not but all they one you were can there what more when will would "
              "about has been their if some into so its other than then out only time these "
              "model memory card load hello world answer question packserve")
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class LlamaShape:
    """A llama GGUF's architecture. The default is about 13M parameters (26 MB in f16);
    `LLAMA_3_2_1B`, `LLAMA_3_2_3B` and `LLAMA_3_1_8B` are those models'. `vocab` None is the
    SentencePiece vocabulary's own size (about 450 pieces); a larger one is padded with pieces
    of their own text, so the embedding and the output matrix have the real model's rows.
    `tied` leaves output.weight out (llama.cpp then multiplies by token_embd, as Llama 3.2
    does)."""

    n_embd: int = 512
    n_layer: int = 4
    n_head: int = 8
    n_head_kv: int = 4
    n_ff: int = 1408
    context: int = 2048
    vocab: int | None = None
    tied: bool = False
    rope_base: float = 10000.0

    def params(self) -> int:
        """Parameters, norms included."""
        vocab = self.vocab or len(_spm_vocab()[0])
        kv = self.n_head_kv * (self.n_embd // self.n_head)
        block = 2 * self.n_embd * self.n_embd + 2 * kv * self.n_embd \
            + 3 * self.n_embd * self.n_ff + 2 * self.n_embd
        return vocab * self.n_embd * (1 if self.tied else 2) + self.n_layer * block + self.n_embd


# The config.json of Meta's models: Llama-3.2-1B, 1.24B parameters (1.31 GB in Q8_0, 0.70 GB
# in Q4_0); Llama-3.2-3B, 3.21B; both with tied embeddings. Llama-3.1-8B, 8.03B, has its own
# output matrix.
LLAMA_3_2_1B = LlamaShape(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192,
                          context=131072, vocab=128256, tied=True, rope_base=500000.0)
LLAMA_3_2_3B = LlamaShape(n_embd=3072, n_layer=28, n_head=24, n_head_kv=8, n_ff=8192,
                          context=131072, vocab=128256, tied=True, rope_base=500000.0)
LLAMA_3_1_8B = LlamaShape(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336,
                          context=131072, vocab=128256, tied=False, rope_base=500000.0)


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary: specials, the 256 byte-fallback pieces llama.cpp needs, then
    single characters and some words with `▁` for the space, scored so longer pieces win."""
    tt = {"normal": 1, "unknown": 2, "control": 3, "byte": 6}
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [tt["unknown"], tt["control"], tt["control"], tt["control"], tt["control"]]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [tt["byte"]] * 256
    pieces = ["▁", *string.ascii_letters, *string.digits, *string.punctuation]
    pieces += ["▁" + c for c in string.ascii_letters + string.digits]
    pieces += ["▁" + w for w in WORDS]
    pieces += WORDS
    seen: set[str] = set()
    for piece in pieces:
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(tt["normal"])
    scores = [0.0] * 261 + [float(len(t)) - 100.0 for t in tokens[261:]]
    return tokens, scores, types


QUANTS = ("f16", "q8_0", "q4_0")
# The bytes of one block: an f16 value, or a Q8_0 / Q4_0 block of 32 values (an fp16 scale, then
# 32 int8 or 16 bytes of 4-bit values). The pool is walked in whole blocks, so every scale the
# file holds is one the pool drew.
_BLOCK_BYTES = {"f16": 2, "q8_0": 34, "q4_0": 18}
_POOL_BYTES = 16 << 20  # random bytes drawn once, then written again at shifting offsets


def _tensor_bytes(rows: int, cols: int, quant: str) -> int:
    if quant == "f16":
        return rows * cols * 2
    if cols % 32:
        raise ValueError(f"{quant} needs rows of a multiple of 32 values, not {cols}")
    return rows * cols // 32 * _BLOCK_BYTES[quant]


def _pool(quant: str, rng: np.random.Generator) -> bytes:
    """Random weights, about `_POOL_BYTES` of them in whole blocks: f16 values of about
    N(0, 0.02); or Q8_0 / Q4_0 blocks, each a small finite fp16 scale and random quants, so that
    |w| < 0.07: Q8_0's scale is 2**-12 to 2**-11 (times an int8), Q4_0's 2**-8 to 2**-7 (times a
    nibble less 8, -8 to 7). Random bytes in the scale's place would give Inf and NaN."""
    if quant == "f16":
        values = rng.standard_normal(_POOL_BYTES // 2, dtype=np.float32) * 0.02
        return values.astype(np.float16).tobytes()
    block = _BLOCK_BYTES[quant]
    low = 2.0**-12 if quant == "q8_0" else 2.0**-8
    blocks = np.frombuffer(rng.bytes(_POOL_BYTES // block * block), np.uint8)
    blocks = blocks.reshape(-1, block).copy()
    scales = rng.uniform(low, 2 * low, len(blocks)).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.tobytes()


@dataclass(frozen=True)
class _Tensor:
    """A tensor to write: its name, its shape in numpy's order (a matrix's rows, then its
    columns; ggml's ne is the reverse) and its fill: "random" (a matrix in the file's
    quantisation, from the pool), or f32 "ones" / "zeros" (a norm's weight, a bias) or
    "normal" (values of about N(0, 0.02): a small matrix llama.cpp reads only in f32)."""

    name: str
    shape: tuple[int, ...]
    fill: str = "random"

    def nbytes(self, quant: str) -> int:
        if self.fill == "random":
            rows, cols = self.shape
            return _tensor_bytes(rows, cols, quant)
        return math.prod(self.shape) * 4


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_streamed(w: gguf.GGUFWriter, path: Path, tensors: list[_Tensor], quant: str,
                    seed: int) -> Path:
    """Write the GGUF whose metadata `w` holds (it has no file yet) with `tensors` in that
    order, their data streamed from a pool of random blocks: never the whole file in memory.
    The file is written as `path` + ".partial", fsynced, then renamed to `path`, so a file at
    `path` is always a whole one; an interrupted write leaves nothing behind."""
    import gguf

    raw = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
           "q4_0": gguf.GGMLQuantizationType.Q4_0}[quant]
    for t in tensors:
        if t.fill == "random":
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float16), t.nbytes(quant),
                              raw_dtype=raw)
        else:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes(quant))
    partial = path.with_name(path.name + ".partial")
    try:
        w.write_header_to_file(partial)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None
        out = w.fout[0]
        rng = np.random.default_rng(seed)
        pool = memoryview(_pool(quant, rng))
        block = _BLOCK_BYTES[quant]
        f32 = max((math.prod(t.shape) for t in tensors if t.fill != "random"), default=0)
        fills = {"ones": np.ones(f32, dtype=np.float32).tobytes(), "zeros": bytes(f32 * 4),
                 "normal": (rng.standard_normal(f32, dtype=np.float32) * 0.02).tobytes()}
        align = w.data_alignment
        at = 0  # where the next piece of the pool starts: a whole number of blocks in
        for t in tensors:
            out.write(b"\0" * (-out.tell() % align))
            left = t.nbytes(quant)
            if t.fill != "random":
                out.write(fills[t.fill][:left])
                continue
            while left:
                piece = pool[at:at + left]
                out.write(piece)
                left -= len(piece)
                at = (at + len(piece) + block * 7) % len(pool)
        out.write(b"\0" * (-out.tell() % align))
        out.flush()
        os.fsync(out.fileno())
        w.close()
        os.replace(partial, path)
    finally:
        w.close()
        partial.unlink(missing_ok=True)
    _fsync_dir(path.parent)  # the rename, too, outlives a crash
    return path


def write_llama_gguf(path: Path, shape: LlamaShape = LlamaShape(), quant: str = "f16",
                     seed: int = 0) -> Path:
    """A random-weight llama GGUF at `path`: matrices in `quant` ("f16", "q8_0" or "q4_0"),
    norms in f32, a SentencePiece vocabulary llama.cpp accepts (byte fallback, a ChatML
    template) padded to `shape.vocab`. The tensor data is streamed to the file from a 16 MiB
    pool of random values, never held whole in memory: Llama-3.2-1B's shape in Q8_0 (1.31 GB)
    is written in seconds. Issue 41's real-size models use this writer too."""
    import gguf

    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, not {quant!r}")
    tokens, scores, types = _spm_vocab()
    if shape.vocab is not None:
        if shape.vocab < len(tokens):
            raise ValueError(f"vocab {shape.vocab} is below the {len(tokens)} pieces needed")
        # normal pieces that render as text: a random model samples from the whole vocabulary,
        # and unused or control pieces would stream as empty text; scored below every other
        # piece, so the tokenizer reaches for them only for their own text
        pad = shape.vocab - len(tokens)
        tokens += [f"▁t{i}" for i in range(pad)]
        scores += [-1000.0] * pad
        types += [1] * pad
    n_vocab = len(tokens)
    head_dim = shape.n_embd // shape.n_head
    kv = shape.n_head_kv * head_dim
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                 "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[quant]

    w = gguf.GGUFWriter(None, "llama")
    w.add_name("packserve-gpu-check-llama")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_vocab_size(n_vocab)
    w.add_file_type(file_type)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    e = shape.n_embd
    tensors = [_Tensor("token_embd.weight", (n_vocab, e))]
    for i in range(shape.n_layer):
        tensors += [_Tensor(f"blk.{i}.attn_norm.weight", (e,), "ones"),
                    _Tensor(f"blk.{i}.attn_q.weight", (e, e)),
                    _Tensor(f"blk.{i}.attn_k.weight", (kv, e)),
                    _Tensor(f"blk.{i}.attn_v.weight", (kv, e)),
                    _Tensor(f"blk.{i}.attn_output.weight", (e, e)),
                    _Tensor(f"blk.{i}.ffn_norm.weight", (e,), "ones"),
                    _Tensor(f"blk.{i}.ffn_gate.weight", (shape.n_ff, e)),
                    _Tensor(f"blk.{i}.ffn_up.weight", (shape.n_ff, e)),
                    _Tensor(f"blk.{i}.ffn_down.weight", (e, shape.n_ff))]
    tensors.append(_Tensor("output_norm.weight", (e,), "ones"))
    if not shape.tied:
        tensors.append(_Tensor("output.weight", (n_vocab, e)))
    return _write_streamed(w, path, tensors, quant, seed)


def write_gguf(path: Path, shape: LlamaShape = LlamaShape(), seed: int = 0) -> Path:
    """The tiny llama GGUF (f16, untied, the SentencePiece vocabulary's own size)."""
    return write_llama_gguf(path, shape, "f16", seed)


def _wordpiece_vocab() -> list[str]:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab += ["##" + c for c in string.ascii_lowercase + string.digits]
    vocab += [w for w in WORDS if w not in vocab]
    return vocab


def write_bert(folder: Path, hidden: int = 384, layers: int = 4, seed: int = 0) -> Path:
    """A random BERT as a sentence-transformers folder (model.safetensors, a WordPiece
    tokenizer, mean pooling) at `folder`."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models  # type: ignore[attr-defined]
    from transformers import BertConfig, BertModel

    # transformers 5 folds the fast tokenizer into BertTokenizer; 4.x names it BertTokenizerFast
    bert_tokenizer = (getattr(transformers, "BertTokenizerFast", None)
                      or transformers.BertTokenizer)

    torch.manual_seed(seed)
    vocab = _wordpiece_vocab()
    with tempfile.TemporaryDirectory(prefix="tiny-bert-hf-") as tmp:
        hf = Path(tmp)
        (hf / "vocab.txt").write_text("\n".join(vocab) + "\n", "utf-8")
        tokenizer = bert_tokenizer(vocab_file=str(hf / "vocab.txt"), do_lower_case=True,
                                   model_max_length=512)
        config = BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=max(1, hidden // 64),
                            intermediate_size=4 * hidden, max_position_embeddings=512)
        BertModel(config).save_pretrained(str(hf), safe_serialization=True)
        tokenizer.save_pretrained(str(hf))
        encoder = models.Transformer(str(hf), max_seq_length=256)
        # renamed in sentence-transformers 6 (the old name warns there)
        dim = (getattr(encoder, "get_embedding_dimension", None)
               or encoder.get_word_embedding_dimension)
        pooling = models.Pooling(dim(), pooling_mode="mean")
        SentenceTransformer(modules=[encoder, pooling], device="cpu").save(str(folder))
    return folder


@dataclass(frozen=True)
class BertShape:
    """A BERT encoder GGUF's architecture, as llama.cpp's "bert" reads it: learned positions and
    token types, post-norm blocks with biases, separate q, k and v. The default is BERT-base's
    (bert-base-uncased: 109.48M parameters with its pooler, which llama.cpp does not read and
    the file leaves out)."""

    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_ff: int = 3072
    vocab: int = 30522
    context: int = 512
    token_types: int = 2

    def params(self) -> int:
        """Parameters, norms and biases included."""
        e, f = self.n_embd, self.n_ff
        embeddings = (self.vocab + self.context + self.token_types) * e + 2 * e
        block = 4 * (e * e + e) + 2 * e + (e * f + f) + (f * e + e) + 2 * e
        return embeddings + self.n_layer * block


BERT_BASE = BertShape()
_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _wpm_vocab(size: int) -> tuple[list[str], list[int]]:
    """`_wordpiece_vocab()` as llama.cpp's WPM tokenizer reads it, the form llama.cpp's
    converter gives BERT's vocabulary: a piece that starts a word gains `▁`, a `##` continuation
    loses its `##`. Padded to `size` with `[unusedN]` pieces typed UNUSED, as BERT's own
    vocabulary pads; and the pieces' types (specials control, [UNK] unknown)."""
    tokens: list[str] = []
    types: list[int] = []
    for piece in _wordpiece_vocab():
        if piece in _BERT_SPECIALS:
            tokens.append(piece)
            types.append(2 if piece == "[UNK]" else 3)
        else:
            tokens.append(piece[2:] if piece.startswith("##") else "▁" + piece)
            types.append(1)
    if size < len(tokens):
        raise ValueError(f"vocab {size} is below the {len(tokens)} pieces needed")
    pad = size - len(tokens)
    tokens += [f"[unused{i}]" for i in range(pad)]
    types += [5] * pad
    return tokens, types


def write_bert_gguf(path: Path, shape: BertShape = BERT_BASE, seed: int = 0) -> Path:
    """A random-weight BERT embedder GGUF at `path` for llama-server's embedding mode
    (`--embeddings`; mean pooling, non-causal attention are in its metadata): matrices in f16
    but the token types' (f32, as llama.cpp's converter writes them), norms and biases in f32
    (norms one, biases zero), a WordPiece vocabulary padded to
    `shape.vocab`. Streamed like `write_llama_gguf`: BERT-base's shape is 218 MB."""
    import gguf

    tokens, types = _wpm_vocab(shape.vocab)
    w = gguf.GGUFWriter(None, "bert")
    w.add_name("packserve-random-bert")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_type_count(shape.token_types)
    # [CLS] text [SEP], as BERT was trained: llama.cpp's WPM takes [CLS] as its BOS
    w.add_bos_token_id(tokens.index("[CLS]"))
    w.add_sep_token_id(tokens.index("[SEP]"))
    w.add_unk_token_id(tokens.index("[UNK]"))
    w.add_pad_token_id(tokens.index("[PAD]"))
    w.add_mask_token_id(tokens.index("[MASK]"))
    w.add_add_bos_token(True)
    w.add_add_sep_token(True)

    e, f = shape.n_embd, shape.n_ff
    # the order of llama.cpp's converter: the embeddings, then each block as transformers
    # lists it
    tensors = [_Tensor("token_embd.weight", (shape.vocab, e)),
               _Tensor("position_embd.weight", (shape.context, e)),
               # llama.cpp adds a row of it to f32 activations, which needs it in f32
               _Tensor("token_types.weight", (shape.token_types, e), "normal"),
               _Tensor("token_embd_norm.weight", (e,), "ones"),
               _Tensor("token_embd_norm.bias", (e,), "zeros")]
    for i in range(shape.n_layer):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensors += [_Tensor(f"blk.{i}.{part}.weight", (e, e)),
                        _Tensor(f"blk.{i}.{part}.bias", (e,), "zeros")]
        tensors += [_Tensor(f"blk.{i}.attn_output_norm.weight", (e,), "ones"),
                    _Tensor(f"blk.{i}.attn_output_norm.bias", (e,), "zeros"),
                    _Tensor(f"blk.{i}.ffn_up.weight", (f, e)),
                    _Tensor(f"blk.{i}.ffn_up.bias", (f,), "zeros"),
                    _Tensor(f"blk.{i}.ffn_down.weight", (e, f)),
                    _Tensor(f"blk.{i}.ffn_down.bias", (e,), "zeros"),
                    _Tensor(f"blk.{i}.layer_output_norm.weight", (e,), "ones"),
                    _Tensor(f"blk.{i}.layer_output_norm.bias", (e,), "zeros")]
    return _write_streamed(w, path, tensors, "f16", seed)


@dataclass(frozen=True)
class RealShape:
    """One of issue 41's models of real shape with random weights (their answers are noise:
    generate with `ignore_eos` to fixed lengths), as `ensure_real_shape` writes it."""

    name: str
    shape: LlamaShape | BertShape
    quant: str

    @property
    def file(self) -> str:
        return f"{self.name}.gguf"

    def write(self, path: Path, seed: int = 0) -> Path:
        if isinstance(self.shape, BertShape):
            return write_bert_gguf(path, self.shape, seed)
        return write_llama_gguf(path, self.shape, self.quant, seed)


# About 12 GB together; the 1B Q4_0 alone 0.7 GB.
REAL_SHAPES = {m.name: m for m in (
    RealShape("random-llama-3.2-1b-q4_0", LLAMA_3_2_1B, "q4_0"),
    RealShape("random-llama-3.2-1b-q8_0", LLAMA_3_2_1B, "q8_0"),
    RealShape("random-llama-3.2-3b-q4_0", LLAMA_3_2_3B, "q4_0"),
    RealShape("random-llama-3.2-3b-q8_0", LLAMA_3_2_3B, "q8_0"),
    RealShape("random-llama-3.1-8b-q4_0", LLAMA_3_1_8B, "q4_0"),
    RealShape("random-bert-base-f16", BERT_BASE, "f16"),
)}
# Raised whenever the writers' bytes change, so that files written before are written again.
_WRITER_VERSION = 1


def ensure_real_shape(name: str, folder: Path,
                      say: Callable[[str], None] | None = None) -> Path:
    """The path of the catalog's model `name` in `folder`, written there first unless a whole
    copy is there already: one its stamp (`FILE.stamp`, written after the file) describes, same
    model, writer and size. `say` gets a line per file: its size and the seconds it took."""
    if name not in REAL_SHAPES:
        raise ValueError(f"no model {name!r} in the catalog: {', '.join(REAL_SHAPES)}")
    model = REAL_SHAPES[name]
    path = folder / model.file
    stamp = folder / f"{model.file}.stamp"
    want = {"name": model.name, "quant": model.quant, "shape": asdict(model.shape),
            "writer": _WRITER_VERSION}
    if path.exists() and stamp.exists():
        try:
            got = json.loads(stamp.read_text("utf-8"))
        except ValueError:
            got = None
        if got == {**want, "bytes": path.stat().st_size}:
            if say:
                say(f"{model.file}: {path.stat().st_size / 1e9:.2f} GB, already there")
            return path
    folder.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    began = time.monotonic()
    model.write(path)
    seconds = time.monotonic() - began
    size = path.stat().st_size
    stamp.write_text(json.dumps({**want, "bytes": size}) + "\n", "utf-8")
    if say:
        say(f"{model.file}: {size / 1e9:.2f} GB written in {seconds:.1f} s")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?",
                        help="folder for tiny-llama.gguf and tiny-bert/")
    parser.add_argument("--only", choices=("gguf", "bert"), help="write one of the two")
    parser.add_argument("--real", nargs="+", metavar="NAME", choices=(*REAL_SHAPES, "all"),
                        help=f"instead, issue 41's models of real shape (or all): "
                             f"{', '.join(REAL_SHAPES)}")
    parser.add_argument("--into", type=Path, help="the folder for --real's files")
    args = parser.parse_args(argv)
    if args.real:
        if args.into is None or args.out is not None:
            parser.error("--real NAME... takes its folder as --into DIR, and no OUT")
        names = list(REAL_SHAPES) if "all" in args.real else list(dict.fromkeys(args.real))
        for name in names:
            ensure_real_shape(name, args.into, say=lambda line: print(line, flush=True))
        return 0
    if args.out is None:
        parser.error("give OUT, or --real NAME... --into DIR")
    args.out.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    if args.only in (None, "gguf"):
        written["gguf"] = str(write_gguf(args.out / "tiny-llama.gguf"))
    if args.only in (None, "bert"):
        written["bert"] = str(write_bert(args.out / "tiny-bert"))
    json.dump(written, sys.stdout)
    print()
    return 0

if __name__ == "__main__":
    sys.exit(main())
