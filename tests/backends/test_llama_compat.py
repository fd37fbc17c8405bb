"""What the llama.cpp engine assumes of llama-cpp-python (backends.llama_compat) holds for the
installed version, and an assumption that breaks fails by the name of its item."""

from __future__ import annotations

from typing import Any

import pytest
from llama_cpp import Llama, _internals
from llama_cpp import llama_cpp as low

from packserve.backends import llama_compat
from packserve.backends.llama_compat import LlamaCompatError


def test_every_item_holds_for_the_installed_llama_cpp_python() -> None:
    llama_compat.check()  # on a failure: the items to re-read, by name


def test_every_item_has_a_probe() -> None:
    items = set(llama_compat.__all__) - {"CHECKED", "LlamaCompatError", "check"}
    assert items == set(llama_compat._PROBES)


def _init_sampler_edited(self: Any, **settings: Any) -> Any:
    return None  # upstream rewrote the chain


@pytest.mark.parametrize(("owner", "name", "replacement", "items", "says"), [
    pytest.param(_internals.LlamaContext, "kv_cache_seq_rm", None, ["drop_cells"],
                 "LlamaContext has no kv_cache_seq_rm", id="method gone"),
    # PENALTY_LAST_N: the copied chain's window is read in _init_sampler too
    pytest.param(Llama, "_init_sampler", _init_sampler_edited,
                 ["sampler_chain", "PENALTY_LAST_N"], "Llama._init_sampler changed",
                 id="copied code changed"),
    pytest.param(low, "llama_context_default_params", None, ["context_fields"],
                 "has no llama_context_default_params", id="patched function gone"),
    pytest.param(_internals.LlamaSampler, "sample", lambda self, context, i=-1: 0, ["sample"],
                 "takes no ctx, idx", id="signature changed"),
])
def test_a_broken_assumption_fails_by_its_items_name(
        monkeypatch: pytest.MonkeyPatch, owner: object, name: str, replacement: object,
        items: list[str], says: str) -> None:
    if replacement is None:
        monkeypatch.delattr(owner, name)
    else:
        monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(LlamaCompatError) as failure:
        llama_compat.check()
    message = str(failure.value)
    assert f"breaks {len(items)} item(s)" in message  # those items, no other
    assert all(f"\n  {item}: " in message for item in items), message
    assert says in message


def test_the_context_fields_patch_is_undone_after_a_build() -> None:
    real = low.llama_context_default_params
    with llama_compat.context_fields({"n_seq_max": 3}):
        assert low.llama_context_default_params().n_seq_max == 3
    assert low.llama_context_default_params is real
