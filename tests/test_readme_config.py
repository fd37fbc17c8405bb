"""README's annotated config names every key the config accepts, and parses as a config."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from packserve.config import (
    DeviceConfig,
    ModelSpec,
    PoolConfig,
    PoolGroup,
    ServerConfig,
    SloConfig,
)

README = Path(__file__).resolve().parents[1] / "README.md"


def _annotated_config() -> dict[str, Any]:
    text = README.read_text("utf-8")
    block = re.search(r"```toml\n(\[server\].*?)```", text, re.S)
    assert block, "README has no annotated ```toml block starting with [server]"
    return tomllib.loads(block.group(1))


def _missing(model: type[BaseModel], table: dict[str, Any]) -> list[str]:
    return [name for name in model.model_fields if name not in table]


def test_readme_names_every_config_key() -> None:
    cfg = _annotated_config()
    server = cfg["server"]
    sections: list[tuple[str, type[BaseModel], dict[str, Any]]] = [
        ("[server]", ServerConfig, server),
        ("[server.slo]", SloConfig, server["slo"]),
        ("[devices.cpu]", DeviceConfig, cfg["devices"]["cpu"]),
        ("[[models]]", ModelSpec, cfg["models"][0]),
        ("[pool]", PoolConfig, cfg["pool"]),
        ("[[pool.dedicated]]", PoolGroup, cfg["pool"]["dedicated"][0]),
    ]
    missing = {where: keys for where, model, table in sections if (keys := _missing(model, table))}
    assert missing == {}, f"README's config example lacks keys: {missing}"


def test_readme_defaults_are_the_defaults() -> None:
    """Where README's example shows a default (a key not marked as an example), it is the one
    the config applies; only the keys below are shown with a non-default example value."""
    examples = {"model_roots", "max_concurrency", "max_memory", "max_input_tokens",
                "max_output_tokens", "slo_s", "threads", "keys_file", "dedicated",
                "hf_cache_budget"}
    cfg = _annotated_config()
    checks: list[tuple[type[BaseModel], dict[str, Any]]] = [
        (ServerConfig, {k: v for k, v in cfg["server"].items() if k != "slo"}),
        (SloConfig, cfg["server"]["slo"]),
        (DeviceConfig, cfg["devices"]["cpu"]),
        (PoolConfig, {k: v for k, v in cfg["pool"].items() if k != "dedicated"}),
    ]
    wrong = []
    for model, table in checks:
        defaults = model()
        for key, shown in table.items():
            if key in examples:
                continue
            actual = getattr(defaults, key)
            if isinstance(actual, BaseModel):
                continue
            if isinstance(shown, str) and not isinstance(actual, str):
                continue  # sizes written as "256MiB"
            if actual != shown:
                wrong.append(f"{model.__name__}.{key}: README {shown!r}, default {actual!r}")
    assert wrong == []
