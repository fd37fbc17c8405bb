"""The llama-server engine: each load is a runner process, its bytes are that process's, a
client that leaves stops its sequence, a runner that dies costs its own requests and its reaper
reports it once, and an unload leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from packserve import backends
from packserve.backends.llama_server import LlamaServerBackend, RunnerGone
from packserve.core.backend import EngineExit, GenerationParams, Message, TokenLogprob
from tests.factories import catalog_path

pytestmark = pytest.mark.real

GREEDY = GenerationParams(max_tokens=24, temperature=0.0)
HELLO = [Message(role="user", content="Name three colours of the rainbow.")]


def _backend(tmp_path: Path, name: str, parallel: int = 4,
             per_slot: bool = False) -> LlamaServerBackend:
    path = catalog_path(name, tmp_path)
    engine = backends.get("llama-server")
    backend = engine.build(engine.load_spec(path, "cpu", 1024, 64, {}, parallel=parallel,
                                             cache_per_slot=per_slot))
    assert isinstance(backend, LlamaServerBackend)
    return backend


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServerBackend]:
    backend = _backend(tmp_path_factory.mktemp("smollm2"), "smollm2-135m-instruct")
    backend.load()
    yield backend
    backend.unload()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_load_is_a_process_whose_bytes_are_the_model(smollm2: LlamaServerBackend) -> None:
    assert smollm2.pid is not None and _alive(smollm2.pid)
    # SmolLM2's Q4_1 weights are ~90 MiB; with its KV cache and buffers more, never less.
    assert 80 * 2**20 < smollm2.weight_bytes() < 1024 * 2**20


def test_a_chat_streams_and_counts_its_tokens(smollm2: LlamaServerBackend) -> None:
    pieces: list[str] = []

    def keep(text: str, _lp: Sequence[TokenLogprob]) -> bool:
        pieces.append(text)
        return True

    out = smollm2.chat(HELLO, GREEDY, keep)
    assert out.text and "".join(pieces) == out.text
    assert out.prompt_tokens > 5 and 0 < out.completion_tokens <= 24
    whole = smollm2.chat(HELLO, GREEDY)
    assert whole.text == out.text  # greedy: the same answer, streamed or not


def test_with_a_cache_per_slot_concurrent_greedy_chats_answer_as_lone_ones(
        tmp_path: Path) -> None:
    """Four sequences decoded together in one runner give the answer each gives alone when
    each has its own cache (`parallel_cache = "per_slot"`, flash attention); with the shared
    cache of the default they may drift (docs/engines.md measures how often)."""
    backend = _backend(tmp_path, "smollm2-135m-instruct", per_slot=True)
    backend.load()
    try:
        prompts = [[Message(role="user", content=f"Count from {n} to {n + 5}.")]
                   for n in range(4)]
        alone = [backend.chat(p, GREEDY).text for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: backend.chat(p, GREEDY).text, prompts))
        assert together == alone
    finally:
        backend.unload()


def test_logprobs_and_a_schema(smollm2: LlamaServerBackend) -> None:
    out = smollm2.chat(HELLO, GenerationParams(max_tokens=5, temperature=0.0, logprobs=2))
    assert out.logprobs is not None and len(out.logprobs) == out.completion_tokens
    assert all(t.logprob is not None and t.logprob <= 0 and len(t.top) == 2
               for t in out.logprobs)
    schema: dict[str, object] = {"type": "object", "properties": {"colour": {"type": "string"}},
              "required": ["colour"]}
    shaped = smollm2.chat(HELLO, GenerationParams(max_tokens=40, temperature=0.0,
                                                  json_schema=schema))
    assert isinstance(json.loads(shaped.text)["colour"], str)


def test_a_client_that_leaves_stops_its_sequence(smollm2: LlamaServerBackend) -> None:
    seen: list[str] = []

    def three(text: str, _lp: Sequence[TokenLogprob]) -> bool:
        seen.append(text)
        return len(seen) < 3

    out = smollm2.chat(HELLO, GenerationParams(max_tokens=200, temperature=0.0), three)
    assert len(seen) == 3 and out.text == "".join(seen)


# A chat template that shows the tools it is given, as a tool-calling model's does.
TOOLS_TEMPLATE = ("{% if tools %}{{ '<|im_start|>system\\nTools: ' }}{% for t in tools %}"
                  "{{ t | tojson }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
                  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                  "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_whether_the_template_shows_tools_is_llama_cpps_own_probe(
        smollm2: LlamaServerBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's template shows no tools (packserve's generic tool prompt is for such models);
    the same weights with a template that shows them do (llama.cpp's `chat_template_caps`, read
    once at load). The runner reads the template from the environment the worker gives it."""
    assert not smollm2.renders_tools()
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    monkeypatch.setenv("LLAMA_ARG_CHAT_TEMPLATE_FILE", str(template))
    backend = _backend(tmp_path, "smollm2-135m-instruct", parallel=1)
    backend.load()
    try:
        assert backend.renders_tools()
    finally:
        backend.unload()


def test_a_runner_that_dies_fails_its_request_and_its_reaper_reports_it_once(
        tmp_path: Path) -> None:
    """SIGKILL mid-generation (what the OOM killer does): the generation fails with a 503
    `engine_crashed`, the reaper reports the death once with its signal and the log's tail, and
    the runner is not started again behind the scheduler's back: the next request fails too,
    until the scheduler loads the model anew (tests/api/test_runner_deaths.py)."""
    backend = _backend(tmp_path, "gemma-3-270m", parallel=1)
    backend.load()
    reports: list[EngineExit] = []
    reported = threading.Event()

    def report(exit: EngineExit) -> None:
        reports.append(exit)
        reported.set()

    backend.watch(report)
    try:
        first = backend.pid
        assert first is not None
        started = threading.Event()
        errors: list[BaseException] = []

        def going(_text: str, _lp: Sequence[TokenLogprob]) -> bool:
            started.set()
            return True

        def long() -> None:
            try:
                backend.complete("Once upon a time",
                                 GenerationParams(max_tokens=2000, ignore_eos=True), going)
            except BaseException as exc:
                errors.append(exc)

        runner = threading.Thread(target=long)
        runner.start()
        assert started.wait(60)
        os.kill(first, signal.SIGKILL)
        runner.join(60)
        assert len(errors) == 1 and isinstance(errors[0], RunnerGone)
        assert errors[0].status == 503 and errors[0].code == "engine_crashed"
        assert reported.wait(10)
        (exit,) = reports
        assert (exit.pid, exit.signal, exit.status, exit.cause) == (first, "SIGKILL", None,
                                                                    "SIGKILL")
        assert exit.log == backend.log() and Path(exit.log).is_file()
        assert "llama-server" in Path(exit.log).read_text()  # its command line, first
        assert backend.exited(0) == exit and backend.dead()
        with pytest.raises(RunnerGone, match="SIGKILL"):  # not started again in place
            backend.complete("Once", GenerationParams(max_tokens=2))
    finally:
        backend.unload()
    assert len(reports) == 1


def test_an_unload_leaves_no_process(tmp_path: Path) -> None:
    backend = _backend(tmp_path, "gemma-3-270m", parallel=1)
    backend.load()
    pid = backend.pid
    assert pid is not None
    backend.unload()
    assert not _alive(pid) and backend.weight_bytes() == 0


def test_tokens_are_counted_as_the_runner_reads_them(smollm2: LlamaServerBackend) -> None:
    one, two = smollm2.count_tokens(["hello", "hello hello hello"])
    assert 0 < one < two
