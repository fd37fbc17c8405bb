"""`packserve audit`: processes (fake NVML, real /proc), duplicated weights, what fits together."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from packserve import audit
from packserve.audit import GpuDevice, Load
from packserve.cli import main
from packserve.config import default_catalog_text
from tests.factories import TEST_DEVICE, default_config, serve
from tests.factories.fake_cuda import FakeCuda, Tenant

GB = 1_000_000_000
MIB = 1 << 20


class FakeNvml:
    """One 80 GB card: a vLLM holding 90% of it for a 0.6B model, and a modest neighbour."""

    def __init__(self, pids: tuple[int, int]) -> None:
        self.pids = pids

    def devices(self) -> list[GpuDevice]:
        return [GpuDevice(index=0, name="H100", total_bytes=80 * GB, used_bytes=76 * GB)]

    def processes(self, index: int) -> list[tuple[int, int]]:
        assert index == 0
        return [(self.pids[0], 72 * GB), (self.pids[1], 4 * GB)]


def fake_proc(tmp_path: Path, commands: dict[int, str], rss_pages: int = 1000) -> Path:
    for pid, command in commands.items():
        d = tmp_path / "proc" / str(pid)
        d.mkdir(parents=True)
        (d / "cmdline").write_bytes(command.replace(" ", "\0").encode())
        (d / "statm").write_text(f"99999 {rss_pages} 0 0 0 0 0\n")
    return tmp_path / "proc"


def test_nvml_path_lists_processes_and_flags_the_preallocating_engine(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {101: "python -m vllm.entrypoints.openai.api_server "
                                     "--model Qwen/Qwen3-0.6B",
                                202: "python -m packserve.cli serve --port 8000"})
    rows = audit.audit_processes(FakeNvml((101, 202)), proc)
    assert [(r.pid, r.device, r.bytes) for r in rows] == [(101, "cuda:0", 72 * GB),
                                                          (202, "cuda:0", 4 * GB)]
    vllm, packserve = rows
    assert vllm.waste is not None and "0.6B" in vllm.waste and "90% of the card" in vllm.waste
    assert packserve.waste is None


def test_the_audit_reads_the_card_through_the_probes_nvml_reader(tmp_path: Path) -> None:
    """`audit.NvmlProbe` over the one NVML reader (`core.memory.Nvml`'s interface), here a
    fake card: every process with its context and blocks, the card's name and total."""
    cuda = FakeCuda(totals={0: 16 << 30})
    Tenant(cuda, 101).allocate(12 << 30)
    Tenant(cuda, 202).allocate(1 << 30)
    proc = fake_proc(tmp_path, {101: "python -m vllm.entrypoints.openai.api_server "
                                     "--model Qwen/Qwen3-0.6B",
                                202: "python -m packserve.cli serve --port 8000"})
    nvml = audit.NvmlProbe(cuda.nvml())
    assert nvml.devices() == [GpuDevice(index=0, name="Fake CUDA 0", total_bytes=16 << 30,
                                        used_bytes=13 * (1 << 30) + 2 * cuda.context_bytes)]
    rows = audit.audit_processes(nvml, proc)
    assert [(r.pid, r.bytes) for r in rows] == [(101, (12 << 30) + cuda.context_bytes),
                                                (202, (1 << 30) + cuda.context_bytes)]
    assert rows[0].waste is not None and rows[1].waste is None


def test_waste_rules() -> None:
    assert audit.model_params_in("vllm serve meta-llama/Llama-3.1-70B-Instruct") == 70 * 10**9
    assert audit.model_params_in("llama-server -m model.gguf") is None
    # a 70B at FP16 needs ~169 GB: 72 GB is not waste
    assert audit.waste_reason(72 * GB, 80 * GB, "vllm serve llama-70b") is None
    # unknown model, 90% of the card: flagged as preallocating
    assert "preallocating" in (audit.waste_reason(72 * GB, 80 * GB, "tritonserver") or "")
    assert audit.waste_reason(10 * GB, 80 * GB, "tritonserver") is None


def test_cpu_path_reads_inference_like_processes(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {7: "ollama serve", 8: "bash", 9: "llama-server -m x.gguf"})
    rows = audit.audit_processes(None, proc)
    page = os.sysconf("SC_PAGE_SIZE")
    assert [(r.pid, r.device, r.bytes) for r in rows] == [(7, "cpu", 1000 * page),
                                                          (9, "cpu", 1000 * page)]


def test_cpu_path_on_the_real_proc_finds_a_running_packserve(tmp_path: Path) -> None:
    from tests.factories import fake_config, serve_process

    with serve_process(fake_config(tmp_path), tmp_path) as srv:
        rows = audit.audit_processes(None)
        pids = {r.pid for r in rows}
        assert srv.proc.pid in pids and srv.worker_pid() in pids  # the front and the worker
    assert all(r.device == "cpu" and r.bytes > 0 for r in rows)
    assert all(audit.looks_like_engine(r.command) for r in rows)


def load(where: str, model: str, key: str, digest: str, base: str = "") -> Load:
    return Load(where=where, model=model, load_key=key, path=f"/m/{digest}", digest=digest,
                bytes=100 * MIB, base=base)


def test_duplicates_shared_within_one_process_duplicated_across() -> None:
    one = [load("a.toml", "embed", "k1", "h1"), load("a.toml", "rerank", "k1", "h1")]
    (shared,) = audit.find_duplicates(one)
    assert shared.kind == "shared" and shared.loads == 1 and shared.wasted_bytes == 0
    two = [*one, load("b.toml", "embed", "k1", "h1")]
    (dup,) = audit.find_duplicates(two)
    assert dup.kind == "duplicated" and dup.loads == 2 and dup.wasted_bytes == 100 * MIB
    # same file, different load settings in one process: loaded twice too
    (dup,) = audit.find_duplicates([load("a", "x", "ctx=2048", "h"), load("a", "y", "ctx=4096",
                                                                          "h")])
    assert dup.kind == "duplicated"
    same_base = audit.find_duplicates([load("a", "x", "k1", "h1", base="llama-3-8b"),
                                       load("a", "y", "k2", "h2", base="llama-3-8b")])
    assert [d.kind for d in same_base] == ["same-base"]


def test_together_verdict_counts_shared_loads_once() -> None:
    rows = [("embed", "k1", 90 * MIB, True), ("rerank", "k1", 90 * MIB, False),
            ("gen", "k2", 320 * MIB, False)]
    fits = audit.together_verdict("cpu", rows, 450 * MIB)
    assert fits.fits and fits.need_bytes == 410 * MIB
    assert "rerank: shares the load of embed" in fits.detail
    assert not audit.together_verdict("cpu", rows, 400 * MIB).fits


def catalog(tmp_path: Path, models_dir: Path, name: str, budget: str = "auto") -> Path:
    text = default_catalog_text().replace("[server]", f'[server]\ndata_dir = "{models_dir}"', 1)
    text = text.replace('memory_budget = "auto"', f'memory_budget = "{budget}"')
    path = tmp_path / name
    path.write_text(text, "utf-8")
    return path


def args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {"config": None, "server": [], "together": [], "json": True}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.real
def test_default_catalog_shares_minilm_and_smollm2_once(tmp_path: Path,
                                                        models_dir: Path) -> None:
    a = catalog(tmp_path, models_dir, "a.toml")
    report: dict[str, Any] = audit.build_audit(args(config=[str(a)]), None)
    kinds = sorted((d["kind"], len(d["holders"])) for d in report["duplicates"])
    assert kinds == [("shared", 2), ("shared", 2)]
    # two configs = two processes: the same files are loaded twice, three times over
    b = catalog(tmp_path, models_dir, "b.toml")
    both: dict[str, Any] = audit.build_audit(args(config=[str(a), str(b)]), None)
    dups = [d for d in both["duplicates"] if d["kind"] == "duplicated"]
    assert len(dups) == 3 and all(d["loads"] == 2 for d in dups)


@pytest.mark.real
def test_together_verdicts_against_the_budget(tmp_path: Path, models_dir: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    small = catalog(tmp_path, models_dir, "small.toml", budget="700MiB")  # 444 MiB usable
    assert main(["audit", "--config", str(small), "--together",
                 "minilm-rerank,smollm2-135m-instruct"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "minilm-rerank" in out
    assert main(["audit", "--config", str(small), "--together",
                 "minilm-rerank,smollm2-135m-instruct,gemma-3-270m", "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    (verdict,) = report["together"]
    assert not verdict["fits"] and verdict["need_bytes"] > verdict["capacity_bytes"]
    assert main(["audit", "--config", str(small), "--together", "nope"]) == 2


@pytest.mark.real
def test_two_running_servers_loading_the_same_file_are_duplicated(
        tmp_path: Path, models_dir: Path) -> None:
    config = default_config(models_dir, only_models=["all-minilm-l6-v2"])
    a = catalog(tmp_path, models_dir, "a.toml")
    body = {"model": "all-minilm-l6-v2", "input": "hello"}
    with serve(config) as one, serve(config) as two:
        for s in (one, two):
            with s.client() as c:
                assert c.post("/v1/embeddings", json=body).status_code == 200
        report: dict[str, Any] = audit.build_audit(args(config=[str(a)], server=[one.url, two.url],
                                        together=["all-minilm-l6-v2"]), None)
    (dup,) = report["duplicates"]
    assert dup["kind"] == "duplicated" and dup["loads"] == 2
    assert TEST_DEVICE in {t["device"] for t in report["together"]}
    (t,) = report["together"]
    assert "measured" in t["detail"][0]
