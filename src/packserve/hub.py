"""Models from the Hugging Face Hub: `source = "hf:OWNER/REPO[@REV][/PATH/FILE.gguf]"`.

- `hf:OWNER/REPO`: the safetensors model at the repo's root (with its config and tokenizer
  files), or the repo's one GGUF file when it holds no safetensors model; a repo with several
  GGUF files must name one (the config check lists them).
- `hf:OWNER/REPO/PATH/FILE.gguf`: that file; for a split GGUF (`NAME-00001-of-0000N.gguf`) its
  first part, the other parts fetched with it.
- `@REV` after the repo: a branch, tag or commit (default `main`).

Files go to `DATA_DIR/models/hf/OWNER/REPO/REV/`, as the repo lays them out, through
`huggingface_hub` (its endpoint from `HF_ENDPOINT`, a token from `HF_TOKEN` for gated or private
repos). Each file is written to a `.part` file under `hf/.partial/` (kept across an interrupted
download, which resumes where it stopped), checked against what the Hub lists for it (size;
sha256 for LFS files, the git blob id for the others) and only then moved into place, so a
file in the model folder is always whole. A source is complete once its marker
(`REV/.packserve/*.json`) is written, after its last file: only then does it count as on disk.

Pickles, code and other engines' weights are never fetched (`.bin`, `.pt`, `.py`, ONNX, ...):
the safe-by-default rules hold for the Hub as for local folders.

Sizing before downloading (`remote_facts`): a GGUF file's metadata is read from its first bytes
(ranged reads, doubled until the header fits) into a sparse file of the file's size that the
`gguf` package parses; a safetensors model's headers (8 bytes, then the JSON) and its
`config.json`. The weights themselves are never read for sizing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote, unquote

from packserve import atomic
from packserve.core.backend import LoadSpec
from packserve.errors import ConfigError
from packserve.modelfiles import (
    ModelFacts,
    gguf_arch,
    gguf_facts,
    gguf_tensors,
    repacked_of,
    safetensors_facts,
)

log = logging.getLogger("packserve.hub")

HF_PREFIX = "hf:"
DEFAULT_REVISION = "main"
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
# Never fetched from a root model: pickles, code, and weights for other engines.
_SKIPPED = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".h5", ".msgpack", ".onnx",
            ".onnx_data", ".ot", ".tflite", ".mlmodel", ".py", ".gguf", ".joblib", ".npz")
_MARKERS = ".packserve"
# The operator's HF_HUB_OFFLINE, as packserve started (this module is imported at start, before
# any engine): the sentence-transformers engines set it in the process to keep their library
# off any hub, and huggingface_hub reads it once, at import, for everything in the process.
_OPERATOR_OFFLINE = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "on"}
_HEAD_START = 1 << 20  # the first ranged read of a GGUF header (doubled until it fits)
_HEAD_MAX = 512 << 20

# Progress of one download: bytes done, bytes in all.
Progress = Callable[[int, int], None]


class HubError(ConfigError):
    """A Hub source that cannot be listed, sized or fetched; the message names the repo."""


@dataclass(frozen=True)
class HubSource:
    """A parsed `hf:` source."""

    repo: str  # OWNER/REPO
    revision: str
    file: str  # a path in the repo, or "" for the repo's root model

    def __str__(self) -> str:
        rev = "" if self.revision == DEFAULT_REVISION else f"@{self.revision}"
        return f"{HF_PREFIX}{self.repo}{rev}{'/' + self.file if self.file else ''}"


def parse(source: str) -> HubSource | None:
    """The `hf:` source `source` names, None when it is not one. Raises ConfigError when it is
    one but malformed."""
    if not source.startswith(HF_PREFIX):
        return None
    parts = source.removeprefix(HF_PREFIX).split("/")
    if len(parts) < 2:
        raise ConfigError(f"source {source!r}: write hf:OWNER/REPO, hf:OWNER/REPO/FILE.gguf "
                          f"or hf:OWNER/REPO@REVISION/...")
    owner, repo = parts[0], parts[1]
    revision = DEFAULT_REVISION
    if "@" in repo:
        repo, revision = repo.split("@", 1)
    file = "/".join(parts[2:])
    if not (_NAME_RE.match(owner) and _NAME_RE.match(repo)) or ".." in owner + repo:
        raise ConfigError(f"source {source!r}: {owner}/{repo} is not a Hub repo id")
    if not revision or not re.fullmatch(r"[A-Za-z0-9._/-]{1,200}", revision) \
            or ".." in revision:
        raise ConfigError(f"source {source!r}: {revision!r} is not a revision")
    if file and (not file.endswith(".gguf") or any(p in ("", ".", "..") for p in parts[2:])):
        raise ConfigError(f"source {source!r}: a file named in a Hub source must be a .gguf "
                          f"file (name none for the repo's safetensors model)")
    return HubSource(repo=f"{owner}/{repo}", revision=revision, file=file)


@dataclass(frozen=True)
class HubFile:
    """One file as the Hub lists it."""

    name: str
    size: int
    sha256: str | None  # LFS files
    blob_id: str | None  # the git blob id (sha1 of "blob SIZE\\0" + content)


@dataclass(frozen=True)
class Plan:
    """What a source fetches: the files, and which of them (or their folder) is the model."""

    source: HubSource
    commit: str
    files: tuple[HubFile, ...]
    model: str  # the path to load, relative to the revision's folder ("" for the folder)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def split_parts(name: str, listed: Iterable[str]) -> list[str]:
    """`name` and, when it is the first part of a split GGUF, its other parts (all of them
    must be listed)."""
    m = _SPLIT_RE.match(name.rsplit("/", 1)[-1])
    if m is None:
        return [name]
    folder = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
    count = int(m["count"])
    parts = [f"{folder}{m['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = sorted(set(parts) - set(listed))
    if missing:
        raise ConfigError(f"{name} is part of a split GGUF whose parts {', '.join(missing)} "
                          f"are not in the repo")
    return parts


def choose(source: HubSource, commit: str, files: Sequence[HubFile]) -> Plan:
    """The files `source` fetches from a repo listing `files`. Raises HubError."""
    by_name = {f.name: f for f in files}
    if source.file:
        if source.file not in by_name:
            raise HubError(f"{source}: the repo has no file {source.file} at revision "
                           f"{source.revision}")
        m = _SPLIT_RE.match(source.file.rsplit("/", 1)[-1])
        if m is not None and m["part"] != "00001":
            raise HubError(f"{source}: name the first part of a split GGUF (-00001-of-"
                           f"{m['count']}.gguf); the others are fetched with it")
        try:
            parts = split_parts(source.file, by_name)
        except ConfigError as exc:
            raise HubError(f"{source}: {exc.message}") from exc
        return Plan(source, commit, tuple(by_name[p] for p in parts), source.file)
    root = [f for f in files if "/" not in f.name]
    if any(f.name.endswith(".safetensors") for f in root) and "config.json" in by_name:
        wanted = [f for f in files if not f.name.lower().endswith(_SKIPPED)
                  and not f.name.startswith(".") and f.name.count("/") <= 1]
        return Plan(source, commit, tuple(wanted), "")
    ggufs = sorted(f.name for f in files if f.name.endswith(".gguf") and _first(f.name))
    if len(ggufs) == 1:
        return choose(HubSource(source.repo, source.revision, ggufs[0]), commit, files)
    if ggufs:
        raise HubError(f"{source}: the repo holds {len(ggufs)} GGUF files; name one, e.g. "
                       f"{source}/{ggufs[0]} (they are: {', '.join(ggufs)})")
    raise HubError(f"{source}: the repo holds neither a safetensors model at its root "
                   f"(*.safetensors with config.json) nor a GGUF file")


def _first(name: str) -> bool:
    """Whether `name` is a whole GGUF file or the first part of a split one."""
    m = _SPLIT_RE.match(name.rsplit("/", 1)[-1])
    return m is None or m["part"] == "00001"


@dataclass(frozen=True)
class Access:
    """Where the Hub is and who asks: `HF_ENDPOINT` and `HF_TOKEN`, read when a Hub source is
    first used (huggingface_hub reads the endpoint once, at import)."""

    endpoint: str
    token: str | None

    @classmethod
    def from_env(cls) -> Access:
        return cls(endpoint=os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/"),
                   token=os.environ.get("HF_TOKEN") or None)


class Hub:
    """Lists, sizes, fetches and prunes Hub sources under `models_dir/hf`. Thread-safe: a
    download runs in a worker thread, and two sources sharing files wait for each other."""

    def __init__(self, models_dir: Path, access: Access | None = None) -> None:
        self.root = models_dir / "hf"
        self.access = access or Access.from_env()
        self._lock = threading.Lock()
        self._fetching: dict[Path, threading.Lock] = {}
        self._plans: dict[HubSource, Plan] = {}

    # ------------------------------------------------------------------ places

    def folder(self, source: HubSource) -> Path:
        """The revision's folder: the repo's files as the repo lays them out."""
        return self.root.joinpath(*source.repo.split("/"), quote(source.revision, safe=""))

    def source_of(self, path: Path) -> HubSource | None:
        """The source whose model path is `path` (a folder or a file this Hub places), or None:
        the inverse of `model_path` for sources that name their file (`canonical`)."""
        if not path.is_relative_to(self.root):
            return None
        parts = path.relative_to(self.root).parts
        if len(parts) < 3 or parts[0].startswith("."):
            return None
        return HubSource(f"{parts[0]}/{parts[1]}", unquote(parts[2]), "/".join(parts[3:]))

    def canonical(self, source: HubSource) -> HubSource:
        """`source` naming the file it loads: `hf:OWNER/REPO` of a repo whose model is one GGUF
        file becomes `hf:OWNER/REPO/FILE.gguf` (from its marker, else the Hub's listing)."""
        if source.file:
            return source
        try:  # resolved before: offline starts need no listing
            alias = json.loads(self._marker(source).read_text("utf-8")).get("alias")
        except (OSError, ValueError):
            alias = None
        if isinstance(alias, str):
            return HubSource(source.repo, source.revision, alias)
        model = self.plan(source).model
        if not model:
            return source
        marker = self._marker(source)
        marker.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(marker, json.dumps({"source": str(source), "alias": model}))
        return HubSource(source.repo, source.revision, model)

    def _marker(self, source: HubSource) -> Path:
        return self.folder(source) / _MARKERS / f"{quote(source.file or '_root', safe='')}.json"

    def present(self, source: HubSource) -> Path | None:
        """The model path of `source` when it is wholly on disk (its marker written), else None."""
        try:
            marker = json.loads(self._marker(source).read_text("utf-8"))
        except (OSError, ValueError):
            return None
        if "model" not in marker:  # an alias (`canonical`), not a download
            return None
        path = self.folder(source) / str(marker["model"])
        return path if path.exists() else None

    def touch(self, source: HubSource) -> None:
        """Mark `source`'s folder used now (pruning keeps the most recently used)."""
        with contextlib.suppress(OSError):
            os.utime(self._marker(source))

    # ------------------------------------------------------------------ the Hub's word

    def plan(self, source: HubSource) -> Plan:
        """What `source` fetches, listed by the Hub (remembered for this process). Raises
        HubError naming the repo and the reason."""
        with self._lock:
            known = self._plans.get(source)
        if known is not None:
            return known
        _online()
        from huggingface_hub import HfApi

        api = HfApi(endpoint=self.access.endpoint, token=self.access.token or False)
        try:
            info = api.model_info(source.repo, revision=source.revision, files_metadata=True)
        except Exception as exc:
            raise self._error(source, exc) from exc
        files = tuple(HubFile(name=s.rfilename, size=int(s.size or (s.lfs.size if s.lfs else 0)),
                              sha256=s.lfs.sha256 if s.lfs else None, blob_id=s.blob_id)
                      for s in info.siblings or ())
        plan = choose(source, info.sha or source.revision, files)
        with self._lock:
            self._plans[source] = plan
        return plan

    def model_path(self, source: HubSource) -> Path:
        """Where `source`'s model is (or will be) on disk: from its marker, else the Hub's
        listing. Raises HubError."""
        return self.present(source) or self.folder(source) / self.plan(source).model

    def _error(self, source: HubSource, exc: Exception) -> HubError:
        """`exc`, raised by huggingface_hub or the network for `source`, said for an operator."""
        import httpx2
        from huggingface_hub import errors

        where = self.access.endpoint
        if isinstance(exc, errors.GatedRepoError):
            why = ("the repo is gated and HF_TOKEN is not set: accept its terms on the Hub and "
                   "set HF_TOKEN" if self.access.token is None else
                   "the repo is gated and the token in HF_TOKEN has no access to it (accept its "
                   "terms on the Hub with that account)")
        elif isinstance(exc, errors.RepositoryNotFoundError):
            why = (f"no such repo on {where}"
                   + (" (or it is private: set HF_TOKEN)" if self.access.token is None else ""))
        elif isinstance(exc, errors.RevisionNotFoundError):
            why = f"no revision {source.revision!r} in the repo"
        elif isinstance(exc, errors.RemoteEntryNotFoundError):
            why = "a file it lists is not there"
        elif isinstance(exc, errors.HfHubHTTPError):
            why = f"{where} answered HTTP {exc.response.status_code}"
        elif isinstance(exc, httpx2.TransportError | errors.OfflineModeIsEnabled | OSError):
            why = f"cannot reach {where} ({type(exc).__name__}: {exc})"
        else:
            why = f"{type(exc).__name__}: {exc}"
        return HubError(f"{source}: {why}")

    def _url(self, plan: Plan, name: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(plan.source.repo, name, revision=plan.commit,
                          endpoint=self.access.endpoint)

    def _headers(self) -> dict[str, str]:
        # Not in huggingface_hub's public API (checked against 2.4.0, the pinned version): the
        # headers its own downloads send (user agent, token).
        from huggingface_hub.utils._headers import build_hf_headers

        headers = build_hf_headers(token=self.access.token or False)
        headers["Accept-Encoding"] = "identity"
        return headers

    def _read(self, plan: Plan, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of `name`: one ranged GET."""
        _online()
        from huggingface_hub import get_session, hf_raise_for_status

        try:
            response = get_session().get(self._url(plan, name), timeout=60, headers={
                **self._headers(), "Range": f"bytes={start}-{end - 1}"})
            hf_raise_for_status(response)
        except Exception as exc:
            raise self._error(plan.source, exc) from exc
        if response.status_code != 206:  # a whole weights file is not what sizing may read
            raise HubError(f"{plan.source}: {self.access.endpoint} ignored a ranged read of "
                           f"{name} (HTTP {response.status_code})")
        return response.content[:end - start]

    # ------------------------------------------------------------------ sizing

    def remote_facts(self, source: HubSource) -> ModelFacts:
        """What `source`'s model says about itself, from ranged reads of its headers: nothing
        is downloaded. Raises HubError."""
        plan = self.plan(source)
        path = self.folder(source) / plan.model
        try:
            if plan.model.endswith(".gguf"):
                return self._gguf_facts(plan, path)
            return self._safetensors_facts(plan, path)
        except HubError:
            raise
        except Exception as exc:  # a corrupt header surfaces as many exception types
            raise HubError(f"{source}: cannot read its model header: {exc}") from exc

    def _gguf_facts(self, plan: Plan, path: Path) -> ModelFacts:
        from gguf import GGUFReader

        facts: ModelFacts | None = None
        weight_bytes = n_params = 0
        tensors: list[tuple[str, str, list[int], int]] = []
        for file in plan.files:  # every part of a split GGUF holds some of the tensors
            length = min(_HEAD_START, file.size)
            with tempfile.TemporaryDirectory(prefix="packserve-hub-") as tmp:
                sparse = Path(tmp) / Path(file.name).name
                while True:
                    with sparse.open("wb") as f:
                        f.truncate(file.size)  # a sparse file: the tensors read as zeros
                        f.write(self._read(plan, file.name, 0, length))
                    try:
                        reader = GGUFReader(str(sparse))
                        if reader.data_offset <= length:
                            break  # every header byte the parser read was real
                    except Exception:
                        if length >= file.size:
                            raise
                    if length >= min(file.size, _HEAD_MAX):
                        raise HubError(f"{plan.source}: the GGUF header of {file.name} is over "
                                       f"{_HEAD_MAX >> 20} MiB")
                    length = min(length * 2, file.size)
                weight_bytes += sum(int(t.n_bytes) for t in reader.tensors)
                n_params += sum(int(t.n_elements) for t in reader.tensors)
                tensors += gguf_tensors(reader)
                if facts is None:
                    facts, arch = gguf_facts(reader, sparse), gguf_arch(reader)
        assert facts is not None
        # the repacked share over every part's tensors, as a load of the whole file sees them
        return _with(facts, path=path, weight_bytes=weight_bytes, n_params=n_params,
                     file_bytes=plan.total_bytes,
                     **repacked_of(tensors, arch))

    def _safetensors_facts(self, plan: Plan, path: Path) -> ModelFacts:
        headers: list[dict[str, Any]] = []
        weights = [f for f in plan.files if "/" not in f.name and f.name.endswith(".safetensors")]
        for file in weights:
            length = int.from_bytes(self._read(plan, file.name, 0, 8), "little")
            if not 0 < length <= min(100 << 20, file.size - 8):
                raise HubError(f"{plan.source}: {file.name} has a corrupt safetensors header "
                               f"(it claims {length} bytes)")
            headers.append(json.loads(self._read(plan, file.name, 8, 8 + length)))
        config: dict[str, object] = {}
        if any(f.name == "config.json" for f in plan.files):
            config = json.loads(self._whole(plan, "config.json"))
        return safetensors_facts(path, headers, sum(f.size for f in weights), config)

    def _whole(self, plan: Plan, name: str) -> bytes:
        _online()
        from huggingface_hub import get_session, hf_raise_for_status

        try:
            response = get_session().get(self._url(plan, name), timeout=60,
                                         headers=self._headers())
            hf_raise_for_status(response)
        except Exception as exc:
            raise self._error(plan.source, exc) from exc
        return response.content

    # ------------------------------------------------------------------ fetching

    def fetch(self, source: HubSource, progress: Progress | None = None) -> Path:
        """Download what `source` needs unless it is on disk, resuming `.part` files, checking
        every file and writing the marker last; returns the model path. Blocking: run it in a
        worker thread. Raises HubError naming the repo and the reason."""
        done = self.present(source)
        if done is not None:
            self.touch(source)
            return done
        folder = self.folder(source)
        with self._lock:
            lock = self._fetching.setdefault(folder, threading.Lock())
        with lock:  # another source of the same revision may be fetching the same files
            done = self.present(source)
            if done is not None:
                return done
            plan = self.plan(source)
            staging = self.root / ".partial" / folder.relative_to(self.root)
            total = plan.total_bytes
            finished = sum(f.size for f in plan.files if self._placed(folder, f))
            for file in plan.files:
                if self._placed(folder, file):
                    continue
                base = finished

                def step(n: int, base: int = base) -> None:
                    if progress is not None:
                        progress(base + n, total)

                self._fetch_file(plan, file, staging / f"{file.name}.part", folder, step)
                finished += file.size
            if progress is not None:
                progress(total, total)
            named = HubSource(source.repo, source.revision, plan.model)
            for done_source in {source, named} if plan.model.endswith(".gguf") else {source}:
                marker = self._marker(done_source)
                marker.parent.mkdir(parents=True, exist_ok=True)
                atomic.write_text(marker, json.dumps({
                    "source": str(done_source), "commit": plan.commit, "model": plan.model,
                    "files": [f.name for f in plan.files], "bytes": total,
                    "fetched_at": time.time()}, indent=1))
            shutil.rmtree(staging, ignore_errors=True)
            log.info("fetched %s (%d files, %d bytes) into %s", source, len(plan.files), total,
                     folder)
            return folder / plan.model

    @staticmethod
    def _placed(folder: Path, file: HubFile) -> bool:
        """Whether `file` is in place (files get there only once checked)."""
        try:
            return (folder / file.name).stat().st_size == file.size
        except OSError:
            return False

    def _fetch_file(self, plan: Plan, file: HubFile, part: Path, folder: Path,
                    step: Callable[[int], None]) -> None:
        _online()
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils.tqdm import silent_tqdm

        part.parent.mkdir(parents=True, exist_ok=True)
        have = part.stat().st_size if part.exists() else 0
        if have > file.size:  # not this file's bytes: start again
            part.unlink()
            have = 0
        seen = [have]

        class Counter(silent_tqdm):
            def update(self, n: int | float | None = 1) -> None:
                seen[0] += int(n or 0)
                step(seen[0])

        step(have)
        try:
            with part.open("ab") as f:
                http_get(self._url(plan, file.name), f, resume_size=have,
                         headers=self._headers(), expected_size=file.size,
                         displayed_filename=file.name, tqdm_class=cast(Any, Counter))
        except Exception as exc:  # the .part file stays: the next try resumes from it
            raise self._error(plan.source, exc) from exc
        problem = _check(part, file)
        if problem is not None:
            part.unlink(missing_ok=True)
            raise HubError(f"{plan.source}: {file.name} failed its check: {problem}; the "
                           f"download was removed and the next load fetches it again")
        target = folder / file.name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, target)

    # ------------------------------------------------------------------ pruning

    def downloaded(self) -> list[tuple[Path, int, float]]:
        """Every revision folder on disk: its path, bytes and when it was last used."""
        out = []
        for markers in self.root.glob(f"*/*/*/{_MARKERS}"):
            folder = markers.parent
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            used = max((p.stat().st_mtime for p in markers.glob("*.json")), default=0.0)
            out.append((folder, size, used))
        return out

    def prune(self, budget: int, keep: Iterable[HubSource]) -> list[Path]:
        """Delete the least recently used revision folders not in `keep` until the downloads
        fit `budget` bytes; returns what it deleted."""
        kept = {self.folder(s) for s in keep}
        folders = sorted(self.downloaded(), key=lambda row: row[2])
        total = sum(size for _, size, _ in folders)
        gone = []
        for folder, size, _ in folders:
            if total <= budget:
                break
            if folder in kept:
                continue
            log.info("pruning %s (%d bytes): hf_cache_budget is %d bytes", folder, size, budget)
            shutil.rmtree(folder, ignore_errors=True)
            total -= size
            gone.append(folder)
        return gone


def _check(path: Path, file: HubFile) -> str | None:
    """Why the downloaded `path` is not the file the Hub lists, or None."""
    size = path.stat().st_size
    if size != file.size:
        return f"{size} bytes where the Hub lists {file.size}"
    if file.sha256 is not None:
        digest = hashlib.sha256()
        expected = file.sha256
    elif file.blob_id is not None:
        digest = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
        expected = file.blob_id
    else:
        return None
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    got = digest.hexdigest()
    kind = "sha256" if file.sha256 is not None else "git blob id"
    return None if got == expected else f"{kind} {got} where the Hub lists {expected}"


def _with(facts: ModelFacts, **changes: object) -> ModelFacts:
    return dataclasses.replace(facts, **changes)  # type: ignore[arg-type]


class HubFetcher:
    """The scheduler's `Fetcher` (packserve.core.fetch) for loads whose path lies under the
    Hub's folder: each such path names its source (`Hub.source_of`)."""

    def __init__(self, hub: Hub, after: Callable[[], None] | None = None) -> None:
        self._hub = hub
        self._after = after  # after each download (pruning to hf_cache_budget)

    def missing(self, load: LoadSpec) -> str | None:
        source = self._hub.source_of(load.path)
        if source is None:
            return None
        if self._hub.present(source) is not None:
            self._hub.touch(source)
            return None
        return str(source)

    def fetch(self, load: LoadSpec, progress: Callable[[int, int], None]) -> None:
        source = self._hub.source_of(load.path)
        if source is not None:
            self._hub.fetch(source, progress)
            if self._after is not None:
                self._after()


def _online() -> None:
    """Let packserve's own Hub client reach the Hub it is pointed at, whatever an engine set in
    the process's environment; offline only if the operator said so (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = _OPERATOR_OFFLINE
