"""llama.cpp finds the same special tokens in the default models' vocabularies with
packserve's patched build as with the unpatched one, read from the runner that serves them.

`scripts/patches/llama-cpp-python-special-token-scan.patch` skips the special-token names'
comparisons for tokens whose text cannot start one; a mistake there loses a token found by its
text (SmolLM2's `<reponame>`, its FIM repository token and an end-of-generation token, is one)
or marks one it should not. Both vocabularies' special names start with `<`: the other first
bytes the patch keeps are checked by setup.sh's guard. The golden values are what the unpatched
llama.cpp of llama-cpp-python 0.3.36 reported for each file (its `llama_vocab_*` calls, before
packserve's in-process engine was removed). Each is read here from the runner that serves the
model: the vocabulary's size and its BOS and EOS tokens by its own routes, and each
end-of-generation token by what it does: an answer whose first token is forced (`logit_bias`)
to one ends there, while one forced to a control token that ends nothing goes on to `max_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from packserve import backends
from packserve.backends.llama_server import LlamaServerBackend
from packserve.config import load_config
from packserve.core.backend import GenerationParams
from tests.factories import catalog_path

pytestmark = pytest.mark.real

@dataclass(frozen=True)
class Vocabulary:
    """What the unpatched build reported for one model's vocabulary."""

    tokens: int
    bos: tuple[int, str]  # id, text
    eos: tuple[int, str]
    eog: tuple[int, ...]  # the end-of-generation tokens
    not_eog: int  # a control token that is not one of them


EXPECTED = {
    "smollm2-135m-instruct": Vocabulary(tokens=49152, bos=(1, "<|im_start|>"),
                                        eos=(2, "<|im_end|>"), eog=(0, 2, 4), not_eog=1),
    "gemma-3-270m": Vocabulary(tokens=262144, bos=(2, "<bos>"), eos=(1, "<eos>"),
                               eog=(1, 106, 212), not_eog=2),
}


def _forced(runner: LlamaServerBackend, token: int) -> tuple[str, int]:
    """The finish reason and token count of an answer whose every token is pushed to `token`."""
    params = GenerationParams(max_tokens=3, temperature=0, logit_bias=((token, 100.0),))
    out = runner.complete("Hello", params)
    return out.finish_reason, out.completion_tokens


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_the_vocabulary_has_the_special_tokens_of_the_unpatched_build(
        model: str, models_dir: Path) -> None:
    want = EXPECTED[model]
    spec = next(m for m in load_config(None).models if m.name == model)
    engine = backends.get(spec.backend)
    runner = engine.build(engine.load_spec(catalog_path(model, models_dir), "cpu", 512, 64, {},
                                           parallel=1))
    assert isinstance(runner, LlamaServerBackend)
    runner.load()
    try:
        assert runner.n_vocab == want.tokens
        props = runner._get("/props")
        for key, (token, text) in (("bos", want.bos), ("eos", want.eos)):
            assert props[f"{key}_token"] == text, props
            assert runner._post_json("/tokenize", {"content": text, "add_special": False,
                                                   "parse_special": True})["tokens"] == [token]
        ends = {token: _forced(runner, token) for token in want.eog}
        assert all(reason == "stop" and used <= 1 for reason, used in ends.values()), ends
        assert _forced(runner, want.not_eog) == ("length", 3)
    finally:
        runner.unload()
