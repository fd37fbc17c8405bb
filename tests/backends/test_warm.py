"""The real engines' warm state: `release_weights()` gives most of a load's memory back and
keeps the engine objects; `restore_weights()` brings the same model back, answering exactly as
before. Memory is read as the scheduler reads it: the process's resident size after a trim, or a
runner's own resident set (`weight_bytes`)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest

from packserve import backends
from packserve.backends.llama_server import (
    RESTORE_SHARE,
    LlamaEmbedBackend,
    LlamaServerBackend,
    RunnerBackend,
    WarmState,
)
from packserve.backends.runner import UnixHTTP
from packserve.config import load_config
from packserve.core.backend import Backend, EngineDied, Generated, GenerationParams, Message
from packserve.core.memory import SystemProbe
from packserve.sources import resolve_source
from tests.factories import catalog_path

pytestmark = pytest.mark.real


def _load(tmp_path: Path, name: str, parallel: int = 1) -> Backend:
    spec = next(m for m in load_config(None).models if m.name == name)
    path = resolve_source(spec.source, base_dir=tmp_path, models_dir=tmp_path / "models",
                          roots=None)
    # The in-process engine's warm state: sentence-transformers' for MiniLM (its source is the
    # safetensors). The runners' are tested below.
    engine = backends.get({"llama-server-embed": "sentence-transformers"}.get(spec.backend,
                                                                              spec.backend))
    backend = engine.build(engine.load_spec(path, "cpu", 1024, 64, {}, parallel=parallel))
    backend.prepare()
    backend.load()
    return backend


def _released(backend: Backend) -> int:
    """Release the weights; the bytes that went back to the OS."""
    probe = SystemProbe()
    probe.release("cpu")
    before = probe.used_bytes("cpu")
    assert backend.release_weights()
    probe.release("cpu")
    return before - probe.used_bytes("cpu")


def test_minilm_gives_its_weights_back_and_embeds_the_same_after_a_restore(
        tmp_path: Path) -> None:
    backend = _load(tmp_path, "all-minilm-l6-v2")
    try:
        texts = ["a cat sat on the mat", "the weather is fine"]
        before = backend.embed(texts).vectors
        scores = backend.rerank("cat", ["a cat", "a car"]).scores
        weights = backend.weight_bytes()
        # The pass started a trace of the encoder (backends/sentence_tf.py), whose own
        # allocations would land between the two readings below; a release comes to an idle
        # model, long after its trace.
        assert backend.graph_settled.wait(120)  # type: ignore[attr-defined]
        # transformers maps the safetensors file: only the pages a pass read are resident
        # (a few rows of the 47 MiB token-embedding table), and those are what goes back
        assert _released(backend) > weights // 3
        assert backend.weight_bytes() == 0
        assert all(p.is_meta for p in backend._model.parameters())  # type: ignore[attr-defined]
        backend.restore_weights()
        assert (backend.embed(texts).vectors == before).all()
        assert backend.weight_bytes() == weights
        assert backend.release_weights()  # and again
        backend.restore_weights()
        assert backend.rerank("cat", ["a cat", "a car"]).scores == pytest.approx(scores)
    finally:
        backend.unload()


def _runner(tmp_path: Path, name: str) -> RunnerBackend:
    """The default catalog's runner of `name`, loaded."""
    engine = backends.get(next(m for m in load_config(None).models if m.name == name).backend)
    backend = engine.build(engine.load_spec(catalog_path(name, tmp_path, converted=True), "cpu",
                                            256 if engine.convert else 1024, 64, {}))
    assert isinstance(backend, RunnerBackend)
    backend.load()
    return backend


def _answer(backend: RunnerBackend) -> object:
    if isinstance(backend, LlamaEmbedBackend):
        return backend.embed(["a cat sat on the mat", "the weather is fine"]).vectors.tolist()
    return backend.chat([Message(role="user", content="Name three colours.")],
                        GenerationParams(max_tokens=16, temperature=0)).text


@pytest.mark.parametrize(("name", "state"), [("smollm2-135m-instruct", WarmState.PAGES),
                                           ("all-minilm-l6-v2", WarmState.PAGES),
                                           ("smollm2-135m-instruct", WarmState.SLEEP)])
def test_a_runner_goes_warm_in_its_own_process_and_answers_the_same(
        tmp_path: Path, name: str, state: WarmState) -> None:
    """PAGES: the weights file's pages leave its resident set; its buffers and code stay.
    SLEEP (scripts/patches/llama-server-sleep.patch, a card's warm state, run here on the
    CPU): the model, caches and buffers are freed and the process kept; /health and /props
    answer without waking it; the wake loads the model again."""
    if state is WarmState.SLEEP:
        backend: RunnerBackend = _sleeper(catalog_path(name, tmp_path))
    else:
        backend = _runner(tmp_path, name)
    assert backend.warm_state is state  # on the CPU a mapped file's runner gives pages back
    try:
        before = _answer(backend)
        pid, hot = backend.pid, backend.weight_bytes()
        for _ in range(2):
            assert backend.release_weights()
            warm = backend.weight_bytes()
            assert 0 < warm < hot * (0.5 if state is WarmState.SLEEP else 0.75), (warm, hot)
            assert backend.pid == pid and not backend.dead()
            if state is WarmState.SLEEP:
                assert _get(backend, "/health") == {"status": "ok"}
                assert _get(backend, "/props")["is_sleeping"] is True  # asked, not woken
            backend.restore_weights()
            if state is WarmState.SLEEP:
                assert _get(backend, "/props")["is_sleeping"] is False
            else:
                assert backend.weight_bytes() > warm + (hot - warm) // 2  # read back in
            assert _answer(backend) == before
    finally:
        backend.unload()
    assert backend.dead()


def test_a_runner_that_died_while_warm_is_not_restored(tmp_path: Path) -> None:
    backend = _runner(tmp_path, "smollm2-135m-instruct")
    try:
        assert backend.release_weights()
        assert backend.pid is not None
        os.kill(backend.pid, signal.SIGKILL)
        assert backend.exited(10) is not None  # reaped
        with pytest.raises(EngineDied) as died:  # the scheduler counts it, loads it anew
            backend.restore_weights()
        assert died.value.exit.cause == "SIGKILL" and died.value.doing == "warm"
    finally:
        backend.unload()


def test_a_runner_that_died_hot_is_a_death_when_it_is_sent_to_warm(tmp_path: Path) -> None:
    """Killed idle, its reaper's report not yet handled by the scheduler: the eviction that
    sends it to warm finds it gone and says so, for the scheduler to count (doing "idle")."""
    backend = _runner(tmp_path, "smollm2-135m-instruct")
    try:
        assert backend.pid is not None
        os.kill(backend.pid, signal.SIGKILL)
        assert backend.exited(10) is not None  # reaped
        with pytest.raises(EngineDied) as died:
            backend.release_weights()
        assert died.value.exit.cause == "SIGKILL" and died.value.doing == "idle"
    finally:
        backend.unload()


class _Sleeps(LlamaServerBackend):
    """A runner whose warm state is the sleeping state, as on a card (on the CPU it is not:
    docs/gpu.md has why), so that the patched routes run on every run here."""

    @property
    def warm_state(self) -> WarmState | None:
        return WarmState.SLEEP


def _sleeper(path: Path) -> _Sleeps:
    """A runner of SmolLM2's file at `path` that sleeps when it goes warm, loaded."""
    backend = _Sleeps(backends.get("llama-server").load_spec(path, "cpu", 1024, 64, {}))
    backend.load()
    return backend


def _get(backend: RunnerBackend, path: str) -> dict[str, object]:
    conn = UnixHTTP(str(backend.child.socket), timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = json.loads(response.read())
        assert response.status == 200, body
        return dict(body)
    finally:
        conn.close()


def test_a_wake_that_cannot_load_the_model_is_the_runners_death(tmp_path: Path) -> None:
    """The weights file is gone when the runner wakes: llama-server's reload fails and it
    aborts (upstream's behaviour, kept), and the restore says it died, for the scheduler to
    count; nothing hangs."""
    source = catalog_path("smollm2-135m-instruct", tmp_path)
    path = tmp_path / "copy" / source.name
    path.parent.mkdir()
    shutil.copyfile(source, path)
    backend = _sleeper(path)
    try:
        assert backend.release_weights()
        path.unlink()
        with pytest.raises(EngineDied) as died:
            backend.restore_weights()
        assert died.value.exit.cause == "SIGABRT" and died.value.doing == "waking", died.value.exit
        log = Path(died.value.exit.log).read_text()  # the tail is ggml's backtrace
        assert "failed to reload model after sleeping" in log
    finally:
        backend.unload()


def test_a_wake_that_does_not_end_in_time_is_a_hung_death(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wake waits at most load_timeout_s, as a start does: past it the runner is killed
    and the restore says it hung, for the scheduler to count."""
    backend = _sleeper(catalog_path("smollm2-135m-instruct", tmp_path))
    try:
        assert backend.release_weights()
        # no wake is that quick (the host is every runner's here: put back after the test)
        monkeypatch.setattr(backend.host, "start_timeout_s", 0.001)
        with pytest.raises(EngineDied) as died:
            backend.restore_weights()
        assert died.value.exit.hung and died.value.exit.cause == "hung"
        assert backend.dead()
    finally:
        backend.unload()


def test_each_device_has_its_warm_state_and_its_expected_restore(tmp_path: Path) -> None:
    """A card's runner sleeps, a CPU runner of a mapped file gives its pages back, one of a
    file read into memory has no warm state; what the victim policy expects a restore to cost
    (a share of a load's seconds) follows, and no warm state parks anything in host RAM."""
    engine = backends.get("llama-server")
    path = catalog_path("smollm2-135m-instruct", tmp_path)
    spec = engine.load_spec(path, "cpu", 1024, 64, {})
    for load, state, share in ((dataclasses.replace(spec, device="cuda:0"), WarmState.SLEEP,
                                RESTORE_SHARE[WarmState.SLEEP]),
                               (spec, WarmState.PAGES, RESTORE_SHARE[WarmState.PAGES]),
                               (dataclasses.replace(spec, mapped=False), None, None)):
        backend = engine.build(load)
        assert isinstance(backend, RunnerBackend)
        assert (backend.warm_state, backend.restore_share()) == (state, share)
        assert not backend.parks_on_host()
    assert RESTORE_SHARE[WarmState.PAGES] < RESTORE_SHARE[WarmState.SLEEP] < 1


def test_requests_in_flight_hold_off_a_sleep_and_every_one_is_answered(tmp_path: Path) -> None:
    """Sleeps and wakes while requests keep arriving (tokenizing reads the model's vocabulary
    outside the task queue): a request that got in holds the sleep off until it ends, and one
    that comes to a sleeping runner wakes it. The runner never dies, and every count is the
    same."""
    backend = _sleeper(catalog_path("smollm2-135m-instruct", tmp_path))
    text = "the quick brown fox jumps over the lazy dog " * 200
    want = backend.count_tokens([text])
    stop = threading.Event()
    counts: list[list[int]] = []

    def ask() -> None:
        while not stop.is_set():
            counts.append(backend.count_tokens([text]))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        for _ in range(6):
            assert backend.release_weights()
            backend.restore_weights()
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        alive = not backend.dead()
        backend.unload()
    assert alive
    assert counts and all(c == want for c in counts), (len(counts), want)


def test_a_stream_holds_off_a_sleep_and_a_request_wakes_a_sleeping_runner(
        tmp_path: Path) -> None:
    """A sleep asked for while a stream runs is refused (409) once its timeout passes, and the
    stream ends whole; a request that reaches a runner asleep (none should: the scheduler wakes
    it first) wakes it and is answered."""
    backend = _sleeper(catalog_path("smollm2-135m-instruct", tmp_path))
    chat = [Message(role="user", content="Write a long story about a cat.")]
    streaming = threading.Event()
    got: list[Generated] = []

    def started(piece: str, logprobs: object) -> bool:
        streaming.set()
        return True

    def stream() -> None:  # 256 tokens: ~2.4 s here, far past the sleep's 0.05 s timeout
        got.append(backend.chat(chat, GenerationParams(max_tokens=256, temperature=0,
                                                       ignore_eos=True), on_text=started))

    thread = threading.Thread(target=stream)
    try:
        thread.start()
        assert streaming.wait(30)
        with pytest.raises(ValueError, match="409"):
            backend.sleep(busy_s=0.05)
        thread.join(60)
        assert got and got[0].completion_tokens == 256
        assert backend.sleep()
        assert _get(backend, "/props")["is_sleeping"] is True
        assert _answer(backend)  # woken by the request itself
        assert _get(backend, "/props")["is_sleeping"] is False
    finally:
        thread.join(60)
        backend.unload()
