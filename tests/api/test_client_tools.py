"""The tools people point at a serving system, run as users run them, in their own environment
(`.venv-clients`, made by `scripts/setup.sh --dev`; docs/clients.md has the same commands): the
load generators guidellm and aiperf (the tokenizer saved offline by scripts/client_tokenizer.py)
answered on every request with output lengths as asked, and the frameworks' recipes. Never
timings: these runs are a few requests long."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.factories import Running, default_config, serve

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".venv-clients" / "bin"
CHAT, EMBED, RERANK = "smollm2-135m-instruct", "all-minilm-l6-v2", "minilm-rerank"
EXTRACT = "smollm2-extract"
OUTPUT_TOKENS = 24


@pytest.fixture(scope="module")
def server(models_dir: Path) -> Iterator[Running]:
    with serve(default_config(models_dir, only_models=[CHAT, EXTRACT, EMBED, RERANK])) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    """SmolLM2's tokenizer, read from its GGUF by the script the docs give users."""
    out = tmp_path_factory.mktemp("tokenizer")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "client_tokenizer.py"), str(out),
                    CHAT, "--data-dir", str(models_dir)], check=True)
    assert (out / "tokenizer.json").is_file()
    return out


def _tool(name: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = TOOLS / name
    assert exe.is_file(), f"{exe} is missing: run scripts/setup.sh --dev"
    env = {**os.environ, "NO_COLOR": "1"}
    if name == "guidellm":
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    else:  # aiperf reads a tokenizer folder only with the Hub's offline mode unset
        env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_guidellm_streams_chat_with_a_fixed_output_length(server: Running, tokenizer: Path,
                                                          tmp_path: Path) -> None:
    """guidellm sends `ignore_eos`, `stop: null` and `continuous_usage_stats`, and checks
    GET /health before its first request: each was a 400 or a 404 before."""
    out = tmp_path / "guidellm.json"
    _tool("guidellm", [
        "run", "--backend", f"kind=openai_http,target={server.url},model={CHAT}",
        "--profile", "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=6",
        "--data", f"kind=synthetic_text,prompt_tokens=48,output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--output", f"kind=json,path={out}", "--disable-progress"], tmp_path)
    (bench,) = json.loads(out.read_text())["benchmarks"]
    made = bench["scheduler_metrics"]["requests_made"]
    assert made["errored"] == 0 and made["successful"] == 6, made
    lengths = bench["metrics"]["output_token_count"]["successful"]
    assert lengths["min"] == lengths["max"] == OUTPUT_TOKENS, lengths


@pytest.mark.parametrize("endpoint,model,extra", [
    ("chat", CHAT, ["--streaming", "--osl", str(OUTPUT_TOKENS), "--extra-inputs",
                    "ignore_eos:true", "--extra-inputs", f"min_tokens:{OUTPUT_TOKENS}"]),
    ("embeddings", EMBED, []),
    ("cohere-rankings", RERANK, []),
])
def test_aiperf_runs_without_an_error(server: Running, tokenizer: Path, tmp_path: Path,
                                      endpoint: str, model: str, extra: list[str]) -> None:
    """aiperf's chat (its own advice for a fixed output length: ignore_eos and min_tokens),
    embeddings and Cohere-style rankings."""
    art = tmp_path / "aiperf"
    _tool("aiperf", [
        "profile", "--model", model, "--url", server.url, "--endpoint-type", endpoint,
        # with a rate, not concurrency alone: aiperf then sleeps between its credits instead
        # of spinning a core (docs/clients.md)
        "--tokenizer", str(tokenizer), "--request-count", "6", "--concurrency", "2",
        "--request-rate", "20",
        "--isl", "32", "--artifact-dir", str(art), "--ui", "none", *extra], tmp_path)
    report = json.loads((art / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == 6, report["request_count"]
    assert report["error_summary"] == [], report["error_summary"]
    assert report.get("request_error_rate", {"avg": 0})["avg"] == 0
    if endpoint == "chat":
        served = report["usage_completion_tokens"]
        assert served["min"] == served["max"] == OUTPUT_TOKENS, served
        # aiperf's own count re-tokenizes the text it got, and text made past the model's end
        # (ignore_eos) re-tokenizes loosely: its pieces merge into fewer tokens (22 for 24
        # once, on a fresh clone) or split into more. The server's count above is the exact one.
        counted = report["output_sequence_length"]
        assert OUTPUT_TOKENS - 4 <= counted["min"] <= counted["max"] <= OUTPUT_TOKENS + 4


def test_the_frameworks_recipes_work(server: Running, tmp_path: Path) -> None:
    """litellm (chat, stream, embeddings, rerank through its cohere and infinity adapters),
    instructor (JSON schema and tools modes) and llama-index (OpenAILike, embeddings), as
    docs/clients.md sets them up: scripts/client_recipes.py in .venv-clients."""
    done = _tool("python", [str(ROOT / "scripts" / "client_recipes.py"), server.url], tmp_path)
    assert done.stdout.split("\n")[:-1] == [
        f"ok {name}" for name in ("litellm_chat", "litellm_embedding", "litellm_rerank",
                                  "instructor_structured", "llama_index")], done.stdout
