"""What an engine is, declared once next to the engine. `packserve.backends` keeps the registry.

The config validates `backend = NAME` and the tasks against it; the server resolves sources,
builds load specs and estimates footprints through it; the planner and the audit size and key
loads through it; the scheduler builds backends with it. Nothing else names an engine.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from packserve.core.backend import Backend, LoadSpec
from packserve.modelfiles import ModelFacts, check_header
from packserve.planner.sizing import Breakdown
from packserve.types import Task

# (what the model's files say, the load, the name for the breakdown, concurrent sequences)
Sizer = Callable[[ModelFacts | None, LoadSpec, str, int], Breakdown]

# Entry settings that change what an engine loads, when the engine uses them.
LOAD_OPTIONS = frozenset({"trust_remote_code", "allow_pickle"})


def any_source(path: Path) -> str | None:
    """Accept whatever the source resolved to."""
    return None


def cpu_only() -> str | None:
    """Engines that run on the CPU only (the fake engine)."""
    return "it runs on the CPU only"


def always_mapped(facts: ModelFacts | None, device: str) -> bool:
    return True


def no_context(requested: int | None, facts: ModelFacts | None) -> int:
    """Engines without a KV cache: the entry's `context_length`, else 0 (the model's own)."""
    return requested or 0


@dataclass(frozen=True)
class Engine:
    """One engine, as the rest of packserve sees it.

    - `build` makes the backend for one load; it runs on the event loop, so it does no I/O and
      imports nothing heavy (the backend's `prepare()` imports `library`, in a worker thread).
    - `check_source` says why a resolved source cannot be loaded by this engine (a GGUF engine
      given a directory), or None; the config is refused at start with that reason.
    - `context` is the KV-cache length a load gets: the entry's `context_length`, or the
      engine's default for this model.
    - `size` estimates what one load holds, by kind, from the model's own files (`facts` is
      None when `reads_files` is False). The scheduler admits by its total until it has measured.
    - `load_options`: which of LOAD_OPTIONS change what this engine loads; the others are
      ignored for it, so they do not split one load into two.
    - `reads_files` is False for an engine whose `source` is not a path (the fake engine):
      it has no headers to check, nothing to hash, and the planner does not size it.
    - `library` is the module `prepare()` imports, after setting `environment` (variables the
      library reads at import, set only where the operator has not set them).
    - `convert`, when set, turns a resolved source into what the engine reads, once (a
      sentence-transformers folder into a GGUF file under the models directory, `DATA_DIR/
      models`), telling `announce` first when it has work to do; it returns the path to load.
    - `default_parallel`: sequences one load decodes together in one batch when the entry does
      not say (`parallel`); 0 for an engine that does not (the entry may not set `parallel`).
      An entry's default concurrency is at least its `parallel`, so the slots can fill.
    - `sampling`: the generation fields beyond OpenAI's own (`api.schemas.EXTENSIONS`) that this
      engine honours; a request that sets another is refused with a 400 naming it, before any
      load. `token_ids`: it takes inputs given as token ids of the model's own vocabulary
      (embeddings' `input`, completions' `prompt`).
    - `cuda` says why this engine, as installed here, cannot run a model on a CUDA device, or
      None when it can (its build has GPU support and sees a device). Called at start, only
      where NVIDIA's driver is there, to resolve `device = "auto"`: a model goes to the GPU only
      where its load can succeed there. It may import the engine's library (what a load would
      do anyway) and should cache its answer.
    - `maps_weights` says whether a load on `device` maps the weights file (the default) or
      reads it into the engine's own memory (`LoadSpec.mapped`), from what the file says.
    - `own_process`: each load runs in a process of its own (a runner). On a CUDA device that
      process holds a CUDA context of its own, which the load's bytes include: its estimate
      adds one (`Resolved.breakdown`), where an in-process engine shares its worker's.
    """

    name: str
    tasks: frozenset[Task]
    default_concurrency: int
    build: Callable[[LoadSpec], Backend]
    size: Sizer
    check_source: Callable[[Path], str | None] = any_source
    context: Callable[[int | None, ModelFacts | None], int] = no_context
    load_options: frozenset[str] = frozenset()
    reads_files: bool = True
    library: str = ""
    environment: Mapping[str, str] = field(default_factory=dict)
    default_parallel: int = 0
    convert: Callable[[Path, Path, Callable[[str], None] | None], Path] | None = None
    sampling: frozenset[str] = frozenset()
    token_ids: bool = False
    cuda: Callable[[], str | None] = cpu_only
    own_process: bool = False
    maps_weights: Callable[[ModelFacts | None, str], bool] = always_mapped

    def __post_init__(self) -> None:
        unknown = self.load_options - LOAD_OPTIONS
        if unknown:
            raise ValueError(f"engine {self.name}: unknown load options {sorted(unknown)}")

    def prepare(self) -> None:
        """Set the engine's `environment` (unless the operator set it) and import its library
        (seconds for torch): once, before the first load is measured."""
        for name, value in self.environment.items():
            os.environ.setdefault(name, value)
        if self.library:
            importlib.import_module(self.library)

    def check_weights(self, load: LoadSpec) -> None:
        """The check before every load: the weight files' headers (ConfigError naming the file)."""
        if self.reads_files:
            check_header(load.path)

    def load_spec(self, path: Path, device: str, context: int, max_batch: int,
                  options: dict[str, bool], threads: int = 0, parallel: int = 0,
                  cache_per_slot: bool = False, facts: ModelFacts | None = None) -> LoadSpec:
        """The load an entry asks for; options this engine ignores are left out of it.
        `parallel` 0: the engine's default; `facts`: what the weights file says of itself."""
        def option(name: str) -> bool:
            return name in self.load_options and options.get(name, False)

        return LoadSpec(backend=self.name, path=path, device=device, context_length=context,
                        max_batch=max_batch, threads=threads,
                        trust_remote_code=option("trust_remote_code"),
                        allow_pickle=option("allow_pickle"),
                        parallel=(parallel or self.default_parallel) if self.default_parallel
                        else 1, cache_per_slot=cache_per_slot and bool(self.default_parallel),
                        mapped=self.maps_weights(facts, device))
