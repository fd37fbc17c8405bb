"""Parallel decode in the llama.cpp backend (backends.llama_batch): several sequences of one
load in one batch, each with its own sampling, stop strings and grammar, and the same greedy
answer as when it runs alone."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from packserve import backends
from packserve.backends.llama import LlamaCppBackend
from packserve.backends.llama_batch import _held, _incomplete_utf8, _stop_at
from packserve.config import load_config
from packserve.core.backend import GenerationParams, Message, TokenLogprob
from packserve.server import resolve_models
from tests.factories import catalog_path

CHAT = "smollm2-135m-instruct"


def test_held_back_text_is_the_longest_start_of_a_stop_string() -> None:
    assert _held(b"the end is ne", (b"near", b"x")) == 2
    assert _held(b"the end", (b"near",)) == 0
    assert _held(b"ab", (b"abc", b"b")) == 2  # "ab" may still become "abc"


def test_the_earliest_stop_string_wins() -> None:
    assert _stop_at(b"one two three", (b"three", b"two")) == 4
    assert _stop_at(b"one", (b"two", b"")) is None


def test_a_split_utf8_character_is_held() -> None:
    e_acute = "é".encode()
    assert _incomplete_utf8(b"caf" + e_acute[:1])
    assert not _incomplete_utf8(b"caf" + e_acute)
    assert _incomplete_utf8("€".encode()[:2]) and not _incomplete_utf8("€".encode())


def test_the_footprint_counts_each_slots_cache_and_logits(tmp_path: Path) -> None:
    config = load_config(None, only_models=[CHAT])
    config = config.model_copy(update={"server": config.server.model_copy(
        update={"data_dir": str(tmp_path)})})
    assert backends.get("llama-cpp").default_parallel == 1  # opt-in, per model
    config.models[0] = config.models[0].model_copy(update={"parallel": 4})
    (shared,) = resolve_models(config)
    assert shared.load.parallel == 4
    alone = shared.breakdown(sequences=1)
    assert shared.breakdown().kv_cache == alone.kv_cache  # one cache for every slot
    assert shared.breakdown().total > alone.total  # and a row of logits each
    config.models[0] = config.models[0].model_copy(update={"parallel_cache": "per_slot"})
    (per_slot,) = resolve_models(config)
    assert per_slot.load.key != shared.load.key
    assert per_slot.breakdown().kv_cache == shared.load.parallel * alone.kv_cache


def _load(tmp_path: Path, parallel: int, context: int = 2048,
          per_slot: bool = False) -> LlamaCppBackend:
    path = catalog_path(CHAT, tmp_path)
    engine = backends.get("llama-cpp")
    backend = engine.build(engine.load_spec(path, "cpu", context, 1, {}, parallel=parallel,
                                            cache_per_slot=per_slot))
    assert isinstance(backend, LlamaCppBackend)
    backend.prepare()
    backend.load()
    return backend


@pytest.fixture(scope="module")
def batched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppBackend]:
    """Four slots sharing one KV cache: the default."""
    backend = _load(tmp_path_factory.mktemp("llama-batch"), parallel=4)
    try:
        yield backend
    finally:
        backend.unload()


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppBackend]:
    """Four slots, each with its own KV cache: a sequence's logits do not depend on the
    others in its batch, so greedy answers are exactly those of each alone."""
    backend = _load(tmp_path_factory.mktemp("llama-batch"), parallel=4, per_slot=True)
    try:
        yield backend
    finally:
        backend.unload()


ASKS: list[tuple[str, GenerationParams]] = [
    ("List three fruits, one per line.", GenerationParams(max_tokens=40, temperature=0,
                                                          stop=("\n3",))),
    ("Count from one to ten.", GenerationParams(max_tokens=40, temperature=0,
                                                stop=("\n5",))),
    ("Write one sentence about the moon.", GenerationParams(max_tokens=40, temperature=0,
                                                            stop=("!",))),
    ("Give the name and age of: Bo is 31.", GenerationParams(max_tokens=40, temperature=0,
                                                             json_object=True)),
]

Answer = tuple[str, int, int, str]  # text, prompt tokens, completion tokens, finish


def _chat(backend: LlamaCppBackend, text: str, params: GenerationParams,
          pieces: list[str] | None = None) -> Answer:
    def on_text(piece: str, logprobs: Sequence[TokenLogprob]) -> bool:
        assert pieces is not None
        pieces.append(piece)
        return True

    out = backend.chat([Message("user", text)], params,
                       on_text if pieces is not None else None)
    return out.text, out.prompt_tokens, out.completion_tokens, out.finish_reason


def _together(backend: LlamaCppBackend, asks: Sequence[tuple[str, GenerationParams]]
              ) -> tuple[list[Answer], list[list[str]]]:
    """`asks` as concurrent streams, started together; their answers and streamed pieces."""
    streamed: list[list[str]] = [[] for _ in asks]
    start = threading.Barrier(len(asks))

    def one(i: int) -> Answer:
        start.wait(timeout=60)
        return _chat(backend, asks[i][0], asks[i][1], streamed[i])

    with ThreadPoolExecutor(len(asks)) as pool:
        return list(pool.map(one, range(len(asks)))), streamed


def _check_apart(answers: Sequence[Answer], streamed: Sequence[Sequence[str]]) -> None:
    """Each answer kept its own stop strings and grammar, and its stream says what it says."""
    for (text, _, made, finish), pieces, (_, params) in zip(answers, streamed, ASKS,
                                                             strict=True):
        assert "".join(pieces) == text
        assert not any(s in text for s in params.stop)
        assert 0 < made <= 40 and finish in ("stop", "length")
    assert answers[1][3] == "stop"  # at "\n5": "1. 1\n2. 2\n3. 3\n4. 4"
    json.loads(answers[3][0])  # the grammar held this one, beside the free ones


@pytest.mark.real
def test_four_concurrent_streams_answer_exactly_as_each_alone(exact: LlamaCppBackend) -> None:
    alone = [_chat(exact, text, params) for text, params in ASKS]
    together, streamed = _together(exact, ASKS)
    assert together == alone
    _check_apart(together, streamed)


@pytest.mark.real
def test_four_streams_sharing_one_cache_keep_their_own_stops_and_grammar(
        batched: LlamaCppBackend) -> None:
    alone = [_chat(batched, text, params) for text, params in ASKS]
    together, streamed = _together(batched, ASKS)
    _check_apart(together, streamed)
    # Greedy answers may part after some tokens (llama.cpp's default attention rounds a token
    # computed beside others differently from one computed alone); the prompts are the same.
    assert [t[1] for t in together] == [a[1] for a in alone]


@pytest.mark.real
def test_the_one_sequence_path_gets_the_whole_shared_cache(batched: LlamaCppBackend) -> None:
    """Streams leave their prompts cached in their slots; a one-sequence call (echo scoring,
    here) runs with every slot's cells dropped, as the decoder's record of them says."""
    import llama_cpp

    _together(batched, ASKS)
    decoder = batched._decoder
    assert decoder is not None
    memory = llama_cpp.llama_get_memory(batched._llm.ctx)
    assert max(llama_cpp.llama_memory_seq_pos_max(memory, s) for s in range(4)) >= 0
    with decoder.exclusive():
        assert [llama_cpp.llama_memory_seq_pos_max(memory, s) for s in range(4)] == [-1] * 4


@pytest.mark.real
def test_one_at_a_time_answers_are_llama_cpp_pythons_own(tmp_path: Path) -> None:
    # A fresh load: a prefix cached while other sequences shared its batches carries their
    # rounding (see the module doc of llama_batch), and would be reused here.
    batched, serial = _load(tmp_path, parallel=4), _load(tmp_path, parallel=1)
    try:
        for _ in range(2):  # the second time, from the slots' cached prefixes
            for text, params in ASKS:
                assert _chat(batched, text, params) == _chat(serial, text, params)
        long = GenerationParams(max_tokens=12, temperature=0)
        for backend in (batched, serial):
            _, prompt, made, finish = _chat(backend, "Tell me a long story.", long)
            assert (made, finish) == (12, "length") and prompt > 12
        done = [b.complete("The capital of France is",
                           GenerationParams(max_tokens=4, temperature=0))
                for b in (batched, serial)]
        assert done[0] == done[1]
    finally:
        batched.unload()
        serial.unload()


@pytest.mark.real
def test_a_client_that_leaves_frees_its_slot(batched: LlamaCppBackend) -> None:
    seen: list[str] = []

    def leave(piece: str, logprobs: Sequence[TokenLogprob]) -> bool:
        seen.append(piece)
        return len(seen) < 2

    out = batched.chat([Message("user", "Tell me a long story.")],
                       GenerationParams(max_tokens=200, temperature=0), leave)
    assert out.finish_reason == "stop" and out.completion_tokens < 20
    assert batched._decoder is not None and batched._decoder.busy_slots == 0


@pytest.mark.real
def test_a_callback_that_raises_frees_its_slot_before_the_error_goes_on(
        batched: LlamaCppBackend) -> None:
    seen: list[str] = []

    def broken(piece: str, logprobs: Sequence[TokenLogprob]) -> bool:
        seen.append(piece)
        raise ConnectionError("the client's socket broke")

    with pytest.raises(ConnectionError):
        batched.chat([Message("user", "Tell me a long story.")],
                     GenerationParams(max_tokens=200, temperature=0), broken)
    assert len(seen) == 1  # told once, then dropped
    assert batched._decoder is not None and batched._decoder.busy_slots == 0


@pytest.mark.real
def test_sampled_answers_follow_their_seeds(exact: LlamaCppBackend) -> None:
    params = [GenerationParams(max_tokens=16, temperature=0.9, seed=s) for s in (1, 2, 1, 2)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: _chat(exact, "Name a colour.", p), params))
    assert outs[0] == outs[2] and outs[1] == outs[3]


@pytest.mark.real
def test_echo_scoring_and_logprobs_run_beside_batches(exact: LlamaCppBackend) -> None:
    scored = exact.complete("The cat sat", GenerationParams(max_tokens=0, echo=True,
                                                            logprobs=1))
    assert scored.prompt_logprobs and scored.prompt_logprobs[-1].logprob is not None
    alone = [_chat(exact, text, params) for text, params in ASKS[:2]]
    with ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(_chat, exact, text, params) for text, params in ASKS[:2]]
        lp = exact.chat([Message("user", "Say yes.")],
                        GenerationParams(max_tokens=4, temperature=0, logprobs=2))
        echo = pool.submit(exact.complete, "The cat sat",
                           GenerationParams(max_tokens=0, echo=True, logprobs=1)).result()
        assert [j.result() for j in jobs] == alone
    assert lp.logprobs is not None and len(lp.logprobs) == lp.completion_tokens
    assert all(len(t.top) == 2 for t in lp.logprobs)
    assert echo.prompt_logprobs == scored.prompt_logprobs


@pytest.mark.real
def test_a_full_shared_cache_preempts_and_every_answer_completes(tmp_path: Path) -> None:
    small = _load(tmp_path, parallel=4, context=256)
    try:
        params = GenerationParams(max_tokens=150, temperature=0)
        texts = ["Tell me a long story.", "Describe the sea at length.",
                 "Explain how rain forms.", "Write a long poem."]
        alone = [_chat(small, t, params) for t in texts]
        together, streamed = _together(small, [(t, params) for t in texts])
        assert small._decoder is not None and small._decoder.preempted > 0
        for (text, prompt, made, finish), pieces, before in zip(together, streamed, alone,
                                                                strict=True):
            assert "".join(pieces) == text and prompt == before[1]
            assert 0 < made <= 150 and finish in ("stop", "length")
    finally:
        small.unload()
