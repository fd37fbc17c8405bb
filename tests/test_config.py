"""The config reader: the built-in catalog, sizes, refusals that say where and why, overrides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import packserve.config as config_module
from packserve.config import Config, ModelSpec, load_config
from packserve.errors import ConfigError
from packserve.units import parse_bytes
from tests.factories import fake_model

GiB = 2**30
MiB = 2**20


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "packserve.toml"
    path.write_text(text, "utf-8")
    return path


# ---------------------------------------------------------------- the built-in catalog


def test_default_catalog_loads() -> None:
    config = load_config(None)
    assert isinstance(config, Config)
    assert len(config.models) == 5
    assert config.server.host == "127.0.0.1"
    assert config.server.port == 8000
    names = [m.name for m in config.models]
    assert len(set(names)) == 5


def test_default_catalog_takes_overrides() -> None:
    config = load_config(None, host="0.0.0.0", port=9001, open_to_anyone=True)
    assert config.server.host == "0.0.0.0" and config.server.open_to_anyone
    assert config.server.port == 9001


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize(("text", "expected"), [
    ("6GiB", 6 * GiB),
    ("512MiB", 512 * MiB),
    ("1.5GB", 1_500_000_000),
    ("1000000", 1_000_000),
    (4096, 4096),
    (0, 0),
])
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "", "6 potatoes", "GiB", -1, "-5MiB", True, None, [1]])
def test_parse_bytes_refuses(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_bytes(bad)


# ---------------------------------------------------------------- refusals


def _line_of(text: str, needle: str, occurrence: int = 1) -> int:
    """1-based line number of the `occurrence`-th line that contains `needle`."""
    seen = 0
    for i, row in enumerate(text.splitlines(), start=1):
        if needle in row:
            seen += 1
            if seen == occurrence:
                return i
    raise AssertionError(f"{needle!r} not in the test's TOML")


# (id, toml text, key the message names, (needle, occurrence) that locates the line, reason)
BAD_CONFIGS = [
    pytest.param(
        fake_model("a", 'colour = "red"'),
        "models[0].colour", ("colour", 1), "extra inputs are not permitted",
        id="unknown-key-in-model"),
    pytest.param(
        fake_model("a") + fake_model("b", "max_queue = -3"),
        "models[1].max_queue", ("max_queue", 1), "greater than or equal to 0",
        id="negative-max-queue"),
    pytest.param(
        fake_model("chatty", tasks='["embed"]', backend="llama-server", source="x.gguf"),
        "models[0]", ("[[models]]", 1), "cannot do embed",
        id="task-backend-cannot-do"),
    pytest.param(
        fake_model("a", 'device = "gpu0"'),
        "models[0].device", ("device", 1), "must be cpu, cuda, cuda:N or auto",
        id="bad-device"),
    pytest.param(
        fake_model("twin") + fake_model("twin", tasks='["chat"]'),
        "models[1].name", ('name = "twin"', 2), "unique",
        id="duplicate-model-names"),
    pytest.param(
        '[server]\nhost = "127.0.0.1"\nport = = 8000\n',
        "", ("port", 1), "not valid toml",
        id="invalid-toml"),
    pytest.param(
        '[server]\nhost = "127.0.0.1"\nport = "eighty"\n',
        "server.port", ("port", 1), "valid integer",
        id="port-wrong-type"),
    pytest.param(
        '[devices.cpu]\nmemory_budget = "4GiB"\nheadroom = "lots"\n',
        "devices.cpu.headroom", ("headroom", 1), "'lots' is not a size",
        id="headroom-lots"),
]


@pytest.mark.parametrize(("text", "key", "where", "reason"), BAD_CONFIGS)
def test_bad_config_names_key_line_and_reason(
    tmp_path: Path, text: str, key: str, where: tuple[str, int], reason: str,
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = info.value.message
    assert str(info.value) == message
    line = _line_of(text, *where)
    # The file and line: `path:LINE` or, for TOML syntax errors, tomllib's "(at line N".
    located = f"{path}:{line}" in message or (
        str(path) in message and re.search(rf"\bline {line}\b", message) is not None)
    assert located, f"expected {path}:{line} in {message!r}"
    assert key in message
    assert reason.lower() in message.lower()


def test_unreadable_config_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(missing)


def test_every_problem_is_reported(tmp_path: Path) -> None:
    text = fake_model("a", "max_queue = -1", 'device = "tpu"')
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert "models[0].max_queue" in info.value.message
    assert "models[0].device" in info.value.message


# ---------------------------------------------------------------- CLI overrides


TWO_DEVICES = (
    '[server]\nhost = "127.0.0.1"\nport = 8000\n'
    '[devices.cpu]\nmemory_budget = "8GiB"\n'
    '[devices.cuda]\nmemory_budget = "auto"\n'
    + fake_model("emb", 'device = "cpu"')
    + fake_model("chat", tasks='["chat"]', source="fake:32MiB")
    + fake_model("gpu", 'device = "cuda"', source="fake:16MiB")
)


def test_host_and_port_override(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, TWO_DEVICES), host="::1", port=9123)
    assert config.server.host == "::1"
    assert config.server.port == 9123


def test_port_override_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"server\.port"):
        load_config(write(tmp_path, TWO_DEVICES), port=70000)


def test_memory_budget_override_sets_every_device(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, TWO_DEVICES), memory_budget="2GiB")
    assert set(config.devices) == {"cpu", "cuda:0"}
    assert all(d.memory_budget == 2 * GiB for d in config.devices.values())


def test_memory_budget_override_covers_cpu_when_no_devices_are_declared(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, fake_model("a")), memory_budget="2GiB")
    assert config.device_config("cpu").memory_budget == 2 * GiB


def test_memory_budget_override_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="memory_budget"):
        load_config(write(tmp_path, TWO_DEVICES), memory_budget="plenty")


def test_only_models_filters(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, TWO_DEVICES), only_models=["chat", "emb"])
    assert sorted(m.name for m in config.models) == ["chat", "emb"]


def test_only_models_unknown_name_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, TWO_DEVICES), only_models=["emb", "nope"])
    message = info.value.message
    assert "nope" in message
    for known in ("emb", "chat", "gpu"):
        assert known in message


# ---------------------------------------------------------------- normalisation and defaults


def test_cuda_normalises_to_cuda_0(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, TWO_DEVICES))
    by_name = {m.name: m for m in config.models}
    assert by_name["gpu"].device == "cuda:0"
    assert by_name["emb"].device == "cpu"
    assert by_name["chat"].device == "auto"
    assert "cuda:0" in config.devices
    assert "cuda" not in config.devices


def spec(backend: str, tasks: list[str], **extra: object) -> ModelSpec:
    return ModelSpec.model_validate(
        {"name": "m", "tasks": tasks, "backend": backend, "source": "x", **extra})


@pytest.mark.parametrize(("backend", "tasks", "expected"), [
    ("llama-server", ["chat"], 4),  # its parallel slots: four unless the entry asks
    ("sentence-transformers", ["embed"], 32),
    ("cross-encoder", ["rerank"], 32),
])
def test_concurrency_defaults_per_backend(backend: str, tasks: list[str], expected: int) -> None:
    assert spec(backend, tasks).concurrency == expected


def test_concurrency_explicit_wins() -> None:
    assert spec("llama-server", ["chat"], max_concurrency=3).concurrency == 3
    assert spec("llama-server", ["chat"], parallel=8).concurrency == 8
    assert spec("llama-server", ["chat"], parallel=8, max_concurrency=2).concurrency == 2


def test_the_removed_in_process_engine_is_read_as_the_runner(
        caplog: pytest.LogCaptureFixture) -> None:
    """`backend = "llama-cpp"` (the in-process engine, removed) keeps a config working: it is
    the llama-server engine, on the same GGUF file, and the log says so."""
    config_module._say_alias.cache_clear()  # said once per process
    with caplog.at_level("WARNING", logger="packserve.config"):
        got = spec("llama-cpp", ["chat", "complete"])
    assert got.backend == "llama-server" and got.concurrency == 4
    assert any("'llama-cpp' is read as 'llama-server'" in r.getMessage() for r in caplog.records)


def test_parallel_is_refused_for_engines_that_decode_no_sequences() -> None:
    with pytest.raises(ValueError, match="parallel"):
        spec("sentence-transformers", ["embed"], parallel=2)
    with pytest.raises(ValueError, match="parallel"):
        spec("sentence-transformers", ["embed"], parallel_cache="per_slot")


def test_default_catalog_concurrency() -> None:
    by_backend = {m.backend: m.concurrency for m in load_config(None).models}
    assert by_backend["llama-server"] == 4  # its parallel slots: four unless the entry asks
    assert by_backend["llama-server-embed"] == 32  # batched requests, 4 slots in the runner
