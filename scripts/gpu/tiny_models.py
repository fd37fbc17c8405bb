"""Tiny models made on the spot, for the prepared GPU check (scripts/gpu-check.sh): nothing is
downloaded and nothing of the packaged models is copied to the GPU machine.

- `write_gguf(path)`: a llama-architecture GGUF with random weights (f16) and a SentencePiece
  vocabulary llama.cpp accepts (byte fallback, a ChatML template), about 26 MB at the default
  shape: big enough that its device bytes stand out of NVML's granularity, small enough to load
  in well under a second.
- `write_bert(folder)`: a random BERT saved by sentence-transformers (safetensors, a WordPiece
  tokenizer, mean pooling), about 28 MB, loadable with `SentenceTransformer(folder)`.

The GGUF needs only numpy and the `gguf` package; the BERT needs transformers and
sentence-transformers (which the GPU machine has, torch with them).

    python3 scripts/gpu/tiny_models.py OUT   # writes OUT/tiny-llama.gguf and OUT/tiny-bert/
"""

from __future__ import annotations

import argparse
import json
import string
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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
    `LLAMA_3_2_1B` is Llama-3.2-1B's. `vocab` None is the SentencePiece vocabulary's own size
    (about 450 pieces); a larger one is padded with pieces of their own text, so the embedding
    and the output matrix have the real model's rows. `tied` leaves output.weight out
    (llama.cpp then multiplies by token_embd, as Llama 3.2 does)."""

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


# Llama-3.2-1B (config.json of meta-llama/Llama-3.2-1B): 1.24B parameters, 1.31 GB in Q8_0
LLAMA_3_2_1B = LlamaShape(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192,
                          context=131072, vocab=128256, tied=True, rope_base=500000.0)


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


QUANTS = ("f16", "q8_0")
_POOL_BYTES = 16 << 20  # random bytes drawn once, then written again at shifting offsets


def _tensor_bytes(rows: int, cols: int, quant: str) -> int:
    if quant == "f16":
        return rows * cols * 2
    if cols % 32:
        raise ValueError(f"q8_0 needs rows of a multiple of 32 values, not {cols}")
    return rows * cols // 32 * 34


def _pool(quant: str, rng: np.random.Generator) -> bytes:
    """Random weights, `_POOL_BYTES` of them: f16 values of about N(0, 0.02); or Q8_0 blocks,
    each a small finite fp16 scale (2**-12 to 2**-11, so that |w| < 0.07) and 32 random int8."""
    if quant == "f16":
        values = rng.standard_normal(_POOL_BYTES // 2, dtype=np.float32) * 0.02
        return values.astype(np.float16).tobytes()
    blocks = np.frombuffer(rng.bytes(_POOL_BYTES // 34 * 34), np.uint8).reshape(-1, 34).copy()
    scales = (rng.uniform(2.0**-12, 2.0**-11, len(blocks))).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.tobytes()


def write_llama_gguf(path: Path, shape: LlamaShape = LlamaShape(), quant: str = "f16",
                     seed: int = 0) -> Path:
    """A random-weight llama GGUF at `path`: matrices in `quant` ("f16" or "q8_0"), norms in
    f32, a SentencePiece vocabulary llama.cpp accepts (byte fallback, a ChatML template) padded
    to `shape.vocab`. The tensor data is streamed to the file from a 16 MiB pool of random
    values, never held whole in memory: Llama-3.2-1B's shape in Q8_0 (1.31 GB) is written in
    seconds. Issue 41's real-size models use this writer too."""
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
    raw = gguf.GGMLQuantizationType.F16 if quant == "f16" else gguf.GGMLQuantizationType.Q8_0

    w = gguf.GGUFWriter(str(path), "llama")
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
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if quant == "f16"
                    else gguf.LlamaFileType.MOSTLY_Q8_0)
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

    # (name, rows, cols) in numpy's order (ggml's ne is (cols, rows)); cols 0: an f32 norm
    tensors: list[tuple[str, int, int]] = [("token_embd.weight", n_vocab, shape.n_embd)]
    for i in range(shape.n_layer):
        tensors += [(f"blk.{i}.attn_norm.weight", shape.n_embd, 0),
                    (f"blk.{i}.attn_q.weight", shape.n_embd, shape.n_embd),
                    (f"blk.{i}.attn_k.weight", kv, shape.n_embd),
                    (f"blk.{i}.attn_v.weight", kv, shape.n_embd),
                    (f"blk.{i}.attn_output.weight", shape.n_embd, shape.n_embd),
                    (f"blk.{i}.ffn_norm.weight", shape.n_embd, 0),
                    (f"blk.{i}.ffn_gate.weight", shape.n_ff, shape.n_embd),
                    (f"blk.{i}.ffn_up.weight", shape.n_ff, shape.n_embd),
                    (f"blk.{i}.ffn_down.weight", shape.n_embd, shape.n_ff)]
    tensors.append(("output_norm.weight", shape.n_embd, 0))
    if not shape.tied:
        tensors.append(("output.weight", n_vocab, shape.n_embd))
    for name, rows, cols in tensors:
        if cols == 0:
            w.add_tensor_info(name, (rows,), np.dtype(np.float32), rows * 4)
        else:
            w.add_tensor_info(name, (rows, cols), np.dtype(np.float16),
                              _tensor_bytes(rows, cols, quant), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    out = w.fout[0]
    pool = _pool(quant, np.random.default_rng(seed))
    ones = np.ones(max(shape.n_embd, shape.n_ff), dtype=np.float32).tobytes()
    align = w.data_alignment
    at = 0  # where the next piece of the pool starts: a multiple of 34 (a Q8_0 block; even)
    for _name, rows, cols in tensors:
        out.write(b"\0" * (-out.tell() % align))
        if cols == 0:
            out.write(ones[:rows * 4])
            continue
        left = _tensor_bytes(rows, cols, quant)
        while left:
            piece = pool[at:at + left]
            out.write(piece)
            left -= len(piece)
            at = (at + len(piece) + 34 * 7) % (len(pool) // 34 * 34)
    out.write(b"\0" * (-out.tell() % align))
    w.close()
    return path


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for tiny-llama.gguf and tiny-bert/")
    parser.add_argument("--only", choices=("gguf", "bert"), help="write one of the two")
    args = parser.parse_args(argv)
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
