"""`device = "auto"` resolves per engine (server.resolve_device): a model goes to the GPU only where
NVIDIA's driver is there and its engine's build can run there (`Engine.cuda`). Each engine's
answer is read from its library or binary: fakes stand in for torch and llama-server."""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from packserve import backends
from packserve.backends import llama_server, sentence_tf
from packserve.config import ModelSpec
from packserve.core.backend import LoadSpec
from packserve.core.engine import Engine
from packserve.planner.sizing import GPU_RUNTIME_BYTES, Breakdown
from packserve.server import Resolved, as_written, resolve_device

FAKE = backends.get("fake")


def engine(answer: str | None) -> Engine:
    return dataclasses.replace(FAKE, cuda=lambda: answer)


@pytest.mark.parametrize(("requested", "driver", "why", "device"), [
    ("auto", False, None, "cpu"),                   # no driver: no engine is asked
    ("auto", True, None, "cuda:0"),                 # the engine's build runs on the card
    ("auto", True, "built without CUDA", "cpu"),    # it would fail there: the CPU
    ("cpu", True, None, "cpu"),                     # as written
    ("cuda:1", False, "built without CUDA", "cuda:1"),  # as written: the load says why not
])
def test_auto_resolves_per_engine(requested: str, driver: bool, why: str | None,
                                  device: str) -> None:
    asked = []

    def cuda() -> str | None:
        asked.append(1)
        return why

    got = resolve_device(requested, dataclasses.replace(FAKE, cuda=cuda), driver=lambda: driver)
    assert got == device
    assert asked == ([1] if requested == "auto" and driver else [])


def test_one_config_splits_torch_and_llama_models_by_what_their_builds_can_do() -> None:
    torch_engine, llama_engine = engine(None), engine("llama-server lists no CUDA device")
    assert [resolve_device("auto", e, driver=lambda: True)
            for e in (torch_engine, llama_engine)] == ["cuda:0", "cpu"]
    assert as_written("auto", llama_engine) == "auto"


def test_the_fake_engine_runs_on_the_cpu_only() -> None:
    assert resolve_device("auto", FAKE, driver=lambda: True) == "cpu"


@pytest.fixture
def fresh_checks() -> Iterator[None]:
    for check in (sentence_tf._torch_cuda, llama_server.list_devices):
        check.cache_clear()
    yield
    for check in (sentence_tf._torch_cuda, llama_server.list_devices):
        check.cache_clear()


@pytest.mark.parametrize(("available", "cuda_version", "why"), [
    (True, "13.0", None),
    (False, "13.0", "torch 2.13.0 sees no CUDA device"),
    (False, None, "torch 2.13.0 sees no CUDA device (a CPU build: scripts/setup.sh --dev on this "
                  "machine)"),
])
def test_torch_engines_ask_torch(monkeypatch: pytest.MonkeyPatch, fresh_checks: None,
                                 available: bool, cuda_version: str | None,
                                 why: str | None) -> None:
    torch = types.SimpleNamespace(
        __version__="2.13.0", version=types.SimpleNamespace(cuda=cuda_version),
        cuda=types.SimpleNamespace(is_available=lambda: available))
    monkeypatch.setitem(sys.modules, "torch", torch)
    for name in ("sentence-transformers", "cross-encoder"):
        sentence_tf._torch_cuda.cache_clear()
        assert backends.get(name).cuda() == why


def fake_server(tmp_path: Path, listing: str) -> Path:
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\nprintf '%s' '{listing}'\n")
    exe.chmod(0o755)
    return exe


H200 = "Available devices:\n  CUDA0: NVIDIA H200 (143156 MiB, 142500 MiB free)\n"


@pytest.mark.parametrize(("listing", "device", "why"), [
    (H200, "cuda:0", None),
    ("Available devices:\n  (none)\n", "cuda:0",
     "{exe} was built without CUDA, or sees no card (its --list-devices names none)"),
    (H200, "cuda:1", "{exe} lists CUDA0, not CUDA1"),
])
def test_runner_engines_ask_the_binarys_list_of_devices(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_checks: None, listing: str,
        device: str, why: str | None) -> None:
    exe = fake_server(tmp_path, listing)
    monkeypatch.setenv(llama_server.BINARY_ENV, str(exe))
    assert llama_server.runner_cuda(device) == (why and why.format(exe=exe))
    for name in ("llama-server", "llama-server-embed"):
        assert (backends.get(name).cuda() is None) == (listing == H200)


def test_a_missing_runner_binary_is_a_reason(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path, fresh_checks: None) -> None:
    monkeypatch.setenv(llama_server.BINARY_ENV, str(tmp_path / "nowhere"))
    why = backends.get("llama-server").cuda()
    assert why is not None and "llama-server not found" in why


@pytest.mark.parametrize(("device", "args"), [
    ("cpu", ["--device", "none"]),  # a CUDA build's default (-ngl auto) would offload
    ("cuda:1", ["--device", "CUDA1", "--n-gpu-layers", "all"]),
])
def test_the_runner_is_told_where_its_layers_go(device: str, args: list[str]) -> None:
    spec = LoadSpec(backend="llama-server", path=Path("m.gguf"), device=device,
                    context_length=512, max_batch=1)
    assert llama_server.LlamaServerBackend(spec)._device_args() == args


@pytest.mark.parametrize(("engine", "device", "gpu", "context"), [
    (llama_server.ENGINE, "cuda:0", None, True),  # a runner on a card: its own context
    (llama_server.EMBED_ENGINE, "cuda:1", None, True),
    (llama_server.ENGINE, "cpu", None, False),
    (llama_server.ENGINE, "cpu", True, True),  # the planner plans cards
    (sentence_tf.SENTENCE_TRANSFORMERS, "cuda:0", None, False),  # in the worker: the base
    (sentence_tf.CROSS_ENCODER, "cuda:0", True, False),
])
def test_a_runners_estimate_on_a_card_holds_its_own_cuda_context(
        engine: Engine, device: str, gpu: bool | None, context: bool) -> None:
    """A llama.cpp runner is a process of its own: on `cuda:N` its estimate adds the CUDA
    context that process opens (the planner's GPU_RUNTIME_BYTES); an in-process engine shares
    its worker's, counted once as the device's base."""
    sized = dataclasses.replace(engine, size=lambda facts, load, name, sequences: Breakdown(
        name=name, weights=100 << 20))
    spec = ModelSpec(name="m", tasks=[next(iter(engine.tasks))], backend=engine.name,
                     source="m.gguf", device=device)
    resolved = Resolved(spec=spec, engine=sized, facts=None,
                        load=LoadSpec(backend=engine.name, path=Path("m.gguf"), device=device,
                                      context_length=0))
    size = resolved.breakdown(gpu=gpu)
    assert size.total == (100 << 20) + (GPU_RUNTIME_BYTES if context else 0)
