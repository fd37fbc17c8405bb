"""A chat prompt of a few hundred tokens through the real SmolLM2 (issue 8, section 1).

llama.cpp's AMX kernels (compiled in by a GGML_NATIVE build on a Xeon with AMX) die with SIGILL
on the OpenMP threads that process a multi-token batch: a one-token prompt passes, a prompt of a
few hundred tokens (one batch of several hundred rows) does not. If the installed build has
them, this test takes the test process down; tests/test_engine_build.py says why beforehand.
"""

from __future__ import annotations

import pytest

from benchmarks.engine_build import TEXT  # real prose, ~400 tokens for SmolLM2
from tests.factories import Running

pytestmark = pytest.mark.real

CHAT = "smollm2-135m-instruct"


def test_a_chat_prompt_of_several_hundred_tokens_is_answered(default_server: Running) -> None:
    body = {"model": CHAT, "temperature": 0, "max_tokens": 48, "messages": [
        {"role": "user", "content": f"{TEXT}\nIn one sentence, what is this text about?"}]}
    with default_server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert choice["message"]["content"].strip()
    assert choice["finish_reason"] in {"stop", "length"}
    assert out["usage"]["prompt_tokens"] >= 300, out["usage"]
    assert 0 < out["usage"]["completion_tokens"] <= 48
