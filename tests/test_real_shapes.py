"""Issue 41's models of real shape with random weights (scripts/gpu/tiny_models.py): the shapes
have the published models' parameter counts; each writer's file holds exactly its tensors, in
the types and shapes it declares, with finite block scales; the 1B Q4_0 carries Llama 3's
128,256 tokens; the catalog writes a file once; and llama.cpp's server generates from a Q4_0
file and embeds with the BERT file.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"
CPU_SERVER = Path(sys.prefix) / "bin" / "llama-server"
needs_server = pytest.mark.skipif(not CPU_SERVER.exists(), reason=f"no {CPU_SERVER}")

# small enough to write and load in well under a second; rows of a multiple of 32 values
SMALL = {"n_embd": 256, "n_layer": 2, "n_head": 4, "n_head_kv": 2, "n_ff": 512, "vocab": 1024}


def module(name: str) -> ModuleType:
    """A module of scripts/gpu/, imported by its plain name from its folder, as the GPU check
    imports it."""
    if str(GPU) not in sys.path:
        sys.path.insert(0, str(GPU))
    return importlib.import_module(name)


def scalar(reader: Any, key: str) -> Any:
    value = reader.fields[key]
    return value.parts[value.data[0]][0]


def text(reader: Any, key: str) -> str:
    value = reader.fields[key]
    return bytes(value.parts[value.data[0]]).decode()


def tokens(reader: Any) -> list[str]:
    value = reader.fields["tokenizer.ggml.tokens"]
    return [bytes(value.parts[i]).decode() for i in value.data]


def test_the_shapes_have_the_published_parameter_counts() -> None:
    tm = module("tiny_models")
    # Llama-3.2-1B 1.24B, Llama-3.2-3B 3.21B, Llama-3.1-8B 8.03B (their model cards)
    assert tm.LLAMA_3_2_1B.params() == 1_235_814_400
    assert tm.LLAMA_3_2_3B.params() == 3_212_749_824
    assert tm.LLAMA_3_1_8B.params() == 8_030_261_248
    assert [round(s.params() / 1e9, 2) for s in (tm.LLAMA_3_2_1B, tm.LLAMA_3_2_3B,
                                                 tm.LLAMA_3_1_8B)] == [1.24, 3.21, 8.03]
    # bert-base-uncased: 109,482,240 with its pooler (768 x 768 and a bias), left out here
    assert tm.BERT_BASE.params() + 768 * 768 + 768 == 109_482_240


def test_the_catalog_is_issue_41s_set() -> None:
    catalog = module("tiny_models").REAL_SHAPES
    assert {name: (m.quant, m.file) for name, m in catalog.items()} == {
        "random-llama-3.2-1b-q4_0": ("q4_0", "random-llama-3.2-1b-q4_0.gguf"),
        "random-llama-3.2-1b-q8_0": ("q8_0", "random-llama-3.2-1b-q8_0.gguf"),
        "random-llama-3.2-3b-q4_0": ("q4_0", "random-llama-3.2-3b-q4_0.gguf"),
        "random-llama-3.2-3b-q8_0": ("q8_0", "random-llama-3.2-3b-q8_0.gguf"),
        "random-llama-3.1-8b-q4_0": ("q4_0", "random-llama-3.1-8b-q4_0.gguf"),
        "random-bert-base-f16": ("f16", "random-bert-base-f16.gguf")}
    assert not catalog["random-llama-3.1-8b-q4_0"].shape.tied


def assert_whole(reader: Any, path: Path) -> None:
    """The file is its header, then each tensor's bytes at the alignment, and nothing more."""
    align = 32
    ends = [t.data_offset + t.n_bytes for t in reader.tensors]
    assert ends == sorted(ends)
    assert path.stat().st_size == reader.data_offset + sum(
        -(-t.n_bytes // align) * align for t in reader.tensors)
    assert not path.with_name(path.name + ".partial").exists()


@pytest.mark.parametrize(("quant", "tied"), [("f16", False), ("q8_0", True), ("q4_0", False)])
def test_a_llama_file_holds_its_tensors_in_their_types_with_finite_scales(
        tmp_path: Path, quant: str, tied: bool) -> None:
    import gguf

    tm = module("tiny_models")
    shape = tm.LlamaShape(**SMALL, tied=tied)
    path = tm.write_llama_gguf(tmp_path / "small.gguf", shape, quant)
    reader = gguf.GGUFReader(str(path))
    assert_whole(reader, path)
    raw = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
           "q4_0": gguf.GGMLQuantizationType.Q4_0}[quant]
    assert scalar(reader, "general.file_type") == {"f16": 1, "q8_0": 7, "q4_0": 2}[quant]
    kv = 2 * 256 // 4
    want = [("token_embd.weight", [256, 1024])]
    for i in range(2):
        want += [(f"blk.{i}.attn_norm.weight", [256]), (f"blk.{i}.attn_q.weight", [256, 256]),
                 (f"blk.{i}.attn_k.weight", [256, kv]), (f"blk.{i}.attn_v.weight", [256, kv]),
                 (f"blk.{i}.attn_output.weight", [256, 256]), (f"blk.{i}.ffn_norm.weight", [256]),
                 (f"blk.{i}.ffn_gate.weight", [256, 512]), (f"blk.{i}.ffn_up.weight", [256, 512]),
                 (f"blk.{i}.ffn_down.weight", [512, 256])]
    want += [("output_norm.weight", [256])] + ([] if tied else [("output.weight", [256, 1024])])
    assert [(t.name, t.shape.tolist()) for t in reader.tensors] == want  # ggml's order: ne
    for t in reader.tensors:
        n = int(np.prod(t.shape))
        if len(t.shape) == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32 and np.all(t.data == 1.0)
            continue
        block, size = gguf.GGML_QUANT_SIZES[raw]
        assert t.tensor_type == raw and t.n_bytes == n // block * size
        data = np.asarray(reader.data[t.data_offset:t.data_offset + t.n_bytes])
        if quant == "f16":
            values = data.view(np.float16)
            assert np.isfinite(values).all() and 0.01 < float(values.std()) < 0.03
            continue
        scales = data.reshape(-1, size)[:, :2].copy().view(np.float16).ravel()
        low = 2.0**-12 if quant == "q8_0" else 2.0**-8
        assert np.isfinite(scales).all() and low <= scales.min() and scales.max() <= 2 * low
        assert len(np.unique(scales)) > 100  # random blocks, not one repeated


def test_a_bert_file_has_the_tensors_and_metadata_llama_cpps_bert_reads(tmp_path: Path) -> None:
    import gguf

    tm = module("tiny_models")
    shape = tm.BertShape(n_embd=128, n_layer=2, n_head=2, n_ff=512, vocab=2000)
    path = tm.write_bert_gguf(tmp_path / "bert.gguf", shape)
    reader = gguf.GGUFReader(str(path))
    assert_whole(reader, path)
    assert text(reader, "general.architecture") == "bert"
    assert text(reader, "tokenizer.ggml.model") == "bert"
    assert scalar(reader, "bert.pooling_type") == 1  # mean
    assert not scalar(reader, "bert.attention.causal")
    assert scalar(reader, "bert.attention.layer_norm_epsilon") > 0
    assert scalar(reader, "tokenizer.ggml.token_type_count") == 2
    vocab = tokens(reader)
    assert len(vocab) == len(set(vocab)) == 2000
    assert vocab[scalar(reader, "tokenizer.ggml.bos_token_id")] == "[CLS]"
    assert vocab[scalar(reader, "tokenizer.ggml.seperator_token_id")] == "[SEP]"
    assert vocab[scalar(reader, "tokenizer.ggml.unknown_token_id")] == "[UNK]"
    assert vocab[scalar(reader, "tokenizer.ggml.padding_token_id")] == "[PAD]"
    assert {"▁hello", "▁world", "▁a", "a"} <= set(vocab)  # phantom-space WordPiece
    bert = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.BERT]}
    got = {t.name: t for t in reader.tensors}
    assert {re.sub(r"\.\d+\.", ".{bid}.", n.rsplit(".", 1)[0]) for n in got} <= bert
    assert len(got) == 5 + 16 * 2
    f16, f32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
    assert (got["token_embd.weight"].shape.tolist(), got["token_embd.weight"].tensor_type) == (
        [128, 2000], f16)
    assert got["position_embd.weight"].shape.tolist() == [128, 512]
    assert got["token_types.weight"].tensor_type == f32  # added to f32 activations
    assert got["blk.1.ffn_up.weight"].shape.tolist() == [128, 512]
    assert (got["blk.1.ffn_up.bias"].shape.tolist(), got["blk.1.ffn_up.bias"].tensor_type) == (
        [512], f32)
    assert got["blk.0.layer_output_norm.weight"].data.tolist() == [1.0] * 128


def test_an_interrupted_write_leaves_no_file(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    tm = module("tiny_models")

    def broken(quant: str, rng: np.random.Generator) -> bytes:
        raise OSError("the disk is full")

    monkeypatch.setattr(tm, "_pool", broken)
    with pytest.raises(OSError, match="disk is full"):
        tm.write_llama_gguf(tmp_path / "small.gguf", tm.LlamaShape(**SMALL), "q4_0")
    assert list(tmp_path.iterdir()) == []


def test_the_1b_q4_0_carries_llama_3s_vocabulary(tmp_path: Path) -> None:
    import gguf

    path = module("tiny_models").ensure_real_shape("random-llama-3.2-1b-q4_0", tmp_path)
    assert path == tmp_path / "random-llama-3.2-1b-q4_0.gguf"
    reader = gguf.GGUFReader(str(path))
    assert_whole(reader, path)
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 128256
    assert len(reader.tensors) == 1 + 16 * 9 + 1  # tied: no output.weight
    assert 0.69e9 < path.stat().st_size < 0.71e9  # 1.236 B values, 18 bytes per 32


def test_the_catalog_writes_a_file_once_and_again_when_it_changed(tmp_path: Path) -> None:
    tm = module("tiny_models")
    said: list[str] = []
    path = tm.ensure_real_shape("random-bert-base-f16", tmp_path, said.append)
    written = path.stat()
    assert tm.ensure_real_shape("random-bert-base-f16", tmp_path, said.append) == path
    assert path.stat().st_mtime_ns == written.st_mtime_ns
    assert said[0].startswith("random-bert-base-f16.gguf: 0.22 GB written in ")
    assert said[1] == "random-bert-base-f16.gguf: 0.22 GB, already there"
    with path.open("ab") as f:
        f.write(b"\0")
    tm.ensure_real_shape("random-bert-base-f16", tmp_path, said.append)
    assert path.stat().st_size == written.st_size and "written" in said[2]
    with pytest.raises(ValueError, match="no model 'random-gpt'"):
        tm.ensure_real_shape("random-gpt", tmp_path)


def test_the_cli_writes_catalog_files_into_a_folder(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    tm = module("tiny_models")
    assert tm.main(["--real", "random-bert-base-f16", "--into", str(tmp_path)]) == 0
    assert (tmp_path / "random-bert-base-f16.gguf").exists()
    assert "random-bert-base-f16.gguf: 0.22 GB written in" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tm.main(["--real", "random-bert-base-f16"])  # no --into


@contextlib.contextmanager
def llama_server(path: Path, *args: str) -> Iterator[int]:
    """llama.cpp's server (the CPU build) on `path`, healthy; its port."""
    check = module("check")
    port = check.free_port()
    proc = subprocess.Popen([str(CPU_SERVER), "--model", str(path), "--host", "127.0.0.1",
                             "--port", str(port), "--device", "none", "--ctx-size", "512",
                             "--threads", "2", "--no-webui", "--offline", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        check.wait_healthy(port, proc, 60, "/health")
        yield port
    finally:
        proc.kill()
        proc.wait(10)


@needs_server
@pytest.mark.process
def test_llama_server_generates_from_a_q4_0_file(tmp_path: Path) -> None:
    tm = module("tiny_models")
    path = tm.write_llama_gguf(tmp_path / "small.gguf", tm.LlamaShape(**SMALL), "q4_0")
    with llama_server(path) as port:
        status, body = module("check").call(port, "POST", "/completion", {
            "prompt": "hello", "n_predict": 8, "ignore_eos": True})
    assert status == 200 and body["tokens_predicted"] == 8


@needs_server
@pytest.mark.process
def test_llama_server_embeds_with_the_bert_base_file(tmp_path: Path) -> None:
    path = module("tiny_models").write_bert_gguf(tmp_path / "bert.gguf")
    with llama_server(path, "--embeddings", "--pooling", "mean") as port:
        status, body = module("check").call(port, "POST", "/embedding",
                                            {"content": "hello world"})
    assert status == 200
    (vector,) = body[0]["embedding"]  # one pooled vector
    assert len(vector) == 768 and np.isfinite(vector).all() and np.abs(vector).sum() > 0
