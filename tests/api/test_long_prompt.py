"""A chat prompt of a few hundred tokens through the real SmolLM2 (issue 8, section 1).

llama.cpp's AMX kernels (compiled in by a GGML_NATIVE build on a Xeon with AMX) die with SIGILL
on the OpenMP threads that process a multi-token batch: a one-token prompt passes, a prompt of a
few hundred tokens (one batch of several hundred rows) does not. If the installed build has
them, this test takes the test process down; tests/test_engine_build.py says why beforehand.
"""

from __future__ import annotations

import pytest

from tests.helpers import Running

pytestmark = pytest.mark.real

CHAT = "smollm2-135m-instruct"

TEXT = """\
The lighthouse at the end of the northern breakwater was built in 1871, after two winters in
which fishing boats returning at dusk had struck the rocks below the harbour wall. Its first
keeper, a former ship's carpenter named Thomas Hale, lived in a two-room cottage at the foot of
the tower with his wife and three children. Every evening he climbed the ninety-four steps with
a can of paraffin, trimmed the wicks, polished the brass and the great glass lens, and wound the
clockwork that turned the light once every twenty seconds. In storms he stayed in the lantern
room all night, because spray could crack the hot glass and a dark light was worse than none.

The keepers kept a log. It records the weather at every watch, the ships that passed, the oil
burned and the days the relief boat could not land. In February 1899 the log has no entry for
eleven days: the cottage was cut off by ice, and the family lived on salted fish and the flour
they had stored in autumn. The light was never out. When the relief boat finally reached them,
the keeper's only request was for more paraffin and a new pair of boots.

Electricity came to the harbour in 1936, and with it an electric lamp that needed no wick. The
clockwork stayed until 1962, when a motor replaced it. The last keeper left in 1989, when the
light was automated and monitored by radio from a station forty miles away. Today the cottage is
a small museum. Visitors can read the logbooks, climb the steps and look out over the water
where the fishing fleet, much smaller now, still comes home at dusk. The lens, made in Paris,
still turns above them, and on clear nights its beam can be seen twenty-two miles out at sea.
"""


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
