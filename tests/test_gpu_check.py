"""The prepared GPU check (scripts/gpu-check.sh, scripts/gpu/): what of it runs without a card.

The tiny GGUF it generates on the card loads in llama.cpp's server (here the CPU build of
`.venv/bin/llama-server`) and answers a chat through its template; `--dry-run` runs every step
that needs no card and then fails, saying that no NVIDIA driver was found; `--prepared` refuses
a folder `--prepare` did not make. The test marked `gpu` loads the GGUF on the card with the
CUDA build (`PACKSERVE_LLAMA_SERVER`, which `--prepared` sets) and is skipped here.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"
CPU_SERVER = str(Path(sys.prefix) / "bin" / "llama-server")


def module(name: str) -> ModuleType:
    """A module of scripts/gpu/, imported as the check imports it: by its plain name, from
    its folder (the check ships it as plain files, not a package)."""
    if str(GPU) not in sys.path:
        sys.path.insert(0, str(GPU))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = module("tiny_models").write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path


def test_the_tiny_gguf_is_a_llama_with_a_vocabulary_and_a_template(tiny_gguf: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(tiny_gguf))
    fields = reader.fields
    arch = fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "llama"
    tokens = fields["tokenizer.ggml.tokens"]
    names = [bytes(tokens.parts[i]).decode() for i in tokens.data]
    assert {"<0x00>", "<0xFF>", "<|im_start|>", "<|im_end|>"} <= set(names)
    assert "tokenizer.chat_template" in fields
    assert len(reader.tensors) == 2 + 9 * 4 + 1  # embeddings, 4 blocks of 9, output norm
    assert 20 << 20 < tiny_gguf.stat().st_size < 40 << 20  # above NVML's granularity, loads fast


@pytest.mark.skipif(not Path(CPU_SERVER).exists(), reason=f"no llama-server at {CPU_SERVER}")
def test_the_tiny_gguf_answers_a_chat_in_the_cpu_llama_server(tiny_gguf: Path) -> None:
    got = module("load_check").gguf_answers(tiny_gguf, CPU_SERVER)
    assert got["completion_tokens"] == 8  # ignore_eos: the random model runs to max_tokens
    assert int(got["prompt_tokens"]) > 5  # the ChatML template, tokenised


@pytest.mark.skipif(not Path(CPU_SERVER).exists(), reason=f"no llama-server at {CPU_SERVER}")
def test_a_one_layer_gguf_of_llama_3_2_1b_width_answers_in_the_cpu_llama_server(
        tmp_path: Path) -> None:
    """The check's 1B-class writer (Q8_0, the real vocabulary and width, tied output) with one
    block instead of 16: llama.cpp reads every tensor of it, and a stream as the check reads
    one carries text (a random model samples the padded vocabulary: its pieces must render)."""
    tiny_models = module("tiny_models")
    check = module("check")
    shape = dataclasses.replace(tiny_models.LLAMA_3_2_1B, n_layer=1)
    path = tiny_models.write_llama_gguf(tmp_path / "one-layer.gguf", shape, "q8_0")
    # 128256 x 2048 embeddings and one block, in Q8_0 (34 bytes per 32 values)
    assert path.stat().st_size > shape.params() * 34 // 32
    port = check.free_port()
    proc = subprocess.Popen([CPU_SERVER, "--model", str(path), "--host", "127.0.0.1", "--port",
                             str(port), "--device", "none", "--ctx-size", "512", "--jinja",
                             "--no-webui", "--offline", "--threads", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        check.wait_healthy(port, proc, 60, "/health")
        got = check.stream_chat(port, None, max_tokens=8)
    finally:
        proc.kill()
        proc.wait(10)
    assert got["tokens"] == 8 and got["first_token_s"] > 0


def test_the_1b_shape_is_llama_3_2_1b() -> None:
    shape = module("tiny_models").LLAMA_3_2_1B
    assert (shape.n_layer, shape.n_embd, shape.n_ff, shape.n_head, shape.n_head_kv,
            shape.vocab, shape.tied) == (16, 2048, 8192, 32, 8, 128256, True)
    assert 1.23e9 < shape.params() < 1.24e9  # Llama-3.2-1B: 1.236 B


def test_llama_buffers_reads_the_cards_lines_of_a_llama_cpp_log() -> None:
    log = """load_tensors:        CUDA0 model buffer size =  1252.41 MiB
load_tensors:   CPU_Mapped model buffer size =   250.00 MiB
llama_kv_cache:      CUDA0 KV buffer size =    64.00 MiB
llama_context:  CUDA_Host  output buffer size =     1.96 MiB
llama_context:      CUDA0 compute buffer size =   258.50 MiB
"""
    got = module("check").llama_buffers(log)
    assert got == {"model": int(1252.41 * (1 << 20)), "KV": 64 << 20,
                   "compute": int(258.5 * (1 << 20))}


def test_the_router_gets_the_runners_options_less_where_it_listens() -> None:
    check = module("check")
    argv = ["/x/llama-server", "--model", "/m.gguf", "--host", "/tmp/packserve-runner-1/s",
            "--parallel", "4", "--threads", "2", "--alias", "llama", "--no-webui", "--fit",
            "off", "--log-verbosity", "2", "--device", "CUDA0", "--n-gpu-layers", "all",
            "--ctx-size", "2048", "--jinja", "--cache-ram", "0", "--kv-unified"]
    args = check.runner_args(argv)
    assert "--host" not in args and "--log-verbosity" not in args and args[:2] == [
        "--model", "/m.gguf"]
    assert check.preset_keys(args) == {
        "parallel": "4", "threads": "2", "fit": "off", "device": "CUDA0",
        "n-gpu-layers": "all", "ctx-size": "2048", "jinja": "true", "cache-ram": "0",
        "kv-unified": "true"}


def test_dry_run_runs_what_needs_no_card_then_fails_for_the_driver(tmp_path: Path) -> None:
    prepared = tmp_path / "prepared"
    (prepared / "wheels").mkdir(parents=True)
    (prepared / "gpu").mkdir()
    (prepared / "gpu" / "check.py").write_text("")
    (prepared / "llama-server.xz").write_bytes(b"\0" * 1000)
    env = {**os.environ, "PATH": "/usr/bin:/bin",  # no nvidia-smi
           # the suite's own interpreter and server: the checkout may be a worktree without .venv
           "PACKSERVE_GPU_CHECK_PYTHON": sys.executable, "PACKSERVE_LLAMA_SERVER": CPU_SERVER}
    run = subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run", str(prepared)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 1, run.stderr
    assert "no NVIDIA driver was found" in run.stderr
    assert "dry run passed" in run.stderr
    assert "(0 MiB; the limit is 64 MiB)" in run.stdout
    loads = json.loads(next(line for line in run.stderr.splitlines() if line.startswith("{")))
    assert loads["gguf"]["completion_tokens"] == 8
    assert loads["bert"]["dimensions"] == 384
    if not (ROOT / "tests" / "core" / "test_fake_cuda.py").exists():
        assert "fake-CUDA tests: skipped" in run.stderr


@pytest.mark.skipif(not Path(CPU_SERVER).exists(), reason=f"no llama-server at {CPU_SERVER}")
def test_dry_run_after_a_serve_only_setup_names_what_it_skips(tmp_path: Path) -> None:
    """README's serve command alone installs neither pytest nor sentence-transformers: here a
    sitecustomize hides them, and the dry run says which steps it skipped for want of them."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('pytest', 'sentence_transformers'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n", "utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACKSERVE_")}
    env.update({"PATH": "/usr/bin:/bin", "PYTHONPATH": str(hide),
                "PACKSERVE_GPU_CHECK_PYTHON": sys.executable,
                "PACKSERVE_LLAMA_SERVER": CPU_SERVER})
    run = subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 1, run.stderr
    assert ("skipped for want of the dev install (scripts/setup.sh --dev): fake-CUDA tests "
            "(no pytest); the BERT (no sentence-transformers)") in run.stderr
    assert "dry run passed" in run.stderr and "no NVIDIA driver was found" in run.stderr
    loads = json.loads(next(line for line in run.stderr.splitlines() if line.startswith("{")))
    assert loads["gguf"]["completion_tokens"] == 8 and "bert" not in loads


def test_the_size_check_fails_a_folder_over_64_mib(tmp_path: Path) -> None:
    """The size step's own verdict (gpu-check.sh's helper, run alone) on a sparse 65 MiB file."""
    big = tmp_path / "big"
    big.mkdir()
    with (big / "blob").open("wb") as f:
        f.truncate(65 << 20)
    script = (ROOT / "scripts" / "gpu-check.sh").read_text("utf-8")
    helpers = script[:script.index("\nprepare() {")]  # the definitions before the modes
    run = subprocess.run(["bash", "-c", f'{helpers}\ncheck_size "{big}"\n', "gpu-check.sh",
                          "--dry-run"], capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode == 1
    assert "is over 64 MiB" in run.stderr


def test_prepared_refuses_a_folder_prepare_did_not_make(tmp_path: Path) -> None:
    run = subprocess.run(["bash", "scripts/gpu-check.sh", "--prepared", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode == 1
    assert "is not a prepared folder" in run.stderr


@pytest.mark.parametrize("args", [["--prepare", "DIR", "--no-compil"],
                                  ["--prepared", "--no-compile", "DIR"],
                                  ["--prepare", "DIR", "OTHER"]])
def test_an_argument_it_does_not_know_is_refused_before_anything_runs(
        tmp_path: Path, args: list[str]) -> None:
    """A mistyped flag once meant an hour-long CUDA build where `--no-compile` was meant."""
    argv = [str(tmp_path / a) if a.isupper() else a for a in args]
    run = subprocess.run(["bash", "scripts/gpu-check.sh", *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=30, check=False)
    assert run.returncode == 2, run.stderr
    assert "usage:" in run.stderr and not any(tmp_path.iterdir())


def test_setup_server_only_finds_the_cached_cuda_build_and_touches_nothing(tmp_path: Path) -> None:
    """`setup.sh --server-only` (what --prepare builds llama-server with) answers with the
    folder `--plan` names for the same build, here already holding a binary: no build runs, no
    .venv is read or written."""
    bin_dir = tmp_path / "bin"  # a stand-in nvcc: setup asks for one before a CUDA build
    bin_dir.mkdir()
    (bin_dir / "nvcc").write_text("#!/bin/sh\necho nvcc 13.0\n")
    (bin_dir / "nvcc").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACKSERVE_")}
    env.update({"PACKSERVE_DEVICE": "cuda", "PACKSERVE_CUDA_ARCH": "90",
                "PACKSERVE_WHEEL_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path),
                "PATH": f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"})
    plan = subprocess.run(["bash", "scripts/setup.sh", "--plan"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    cached = Path(next(line for line in plan.stdout.splitlines()
                       if line.startswith("llama-server cache: ")).split(": ", 1)[1])
    cached.mkdir(parents=True)
    (cached / "llama-server").write_text("#!/bin/sh\n")
    (cached / "llama-server").chmod(0o755)
    stamp = ROOT / ".venv" / ".packserve-setup"
    before = stamp.read_bytes() if stamp.exists() else None
    run = subprocess.run(["bash", "scripts/setup.sh", "--server-only"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(cached / "llama-server")
    assert "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90" in plan.stdout
    assert (stamp.read_bytes() if stamp.exists() else None) == before


@pytest.mark.gpu
def test_the_cuda_llama_server_holds_the_tiny_gguf_on_the_card(tiny_gguf: Path) -> None:
    """On the card (scripts/gpu-check.sh --prepared): the CUDA build lists CUDA0, offloads
    every layer, and NVML charges the weights to its process."""
    import pynvml  # type: ignore[import-untyped]

    check = module("check")
    binary = os.environ.get("PACKSERVE_LLAMA_SERVER", CPU_SERVER)
    listed = subprocess.run([binary, "--list-devices"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert "CUDA0" in listed.stdout + listed.stderr
    port = check.free_port()
    proc = subprocess.Popen([binary, "--model", str(tiny_gguf), "--host", "127.0.0.1", "--port",
                             str(port), "--device", "CUDA0", "--n-gpu-layers", "all",
                             "--ctx-size", "512", "--jinja", "--no-webui", "--offline"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        check.wait_healthy(port, proc, 60, "/health")
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        deadline = time.monotonic() + 10
        held = 0
        while time.monotonic() < deadline and held < tiny_gguf.stat().st_size:
            held = next((int(p.usedGpuMemory or 0) for p in
                         pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                         if p.pid == proc.pid), 0)
            time.sleep(0.2)
        assert held >= tiny_gguf.stat().st_size
        got = check.stream_chat(port, None, max_tokens=16)
        assert got["tokens"] == 16
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
