"""Compute goes to the tightest deadline, through the real server and real models: a long
completion on Gemma (in the worker: `llama-cpp`) hands its turn to embeddings between tokens
(core.compute)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.factories import Running, default_config, serve

EMBEDDER, COMPLETE = "all-minilm-l6-v2", "gemma-3-270m"


@pytest.fixture(scope="module")
def prioritised(models_dir: Path) -> Iterator[Running]:
    config = default_config(models_dir)
    # Per-token turns are the in-process engine's: a llama-server runner decodes on its own.
    config = config.model_copy(update={
        "server": config.server.model_copy(update={"compute_priority": True}),
        "models": [m.model_copy(update={"backend": "llama-cpp"}) if m.backend == "llama-server"
                   else m for m in config.models]})
    with serve(config) as running:
        yield running


def _waited(metrics: str, model: str, task: str) -> float:
    m = re.search(rf'^packserve_compute_wait_seconds_total\{{model="{model}",task="{task}"\}} '
                  r"(\S+)$", metrics, re.M)
    return float(m.group(1)) if m else 0.0


def test_embeddings_cut_in_between_the_tokens_of_a_long_completion(
        prioritised: Running) -> None:
    with prioritised.client() as c:
        for model, body in ((EMBEDDER, {"input": "warm"}), (COMPLETE, {"prompt": "1,",
                                                                        "max_tokens": 1})):
            path = "/v1/embeddings" if model == EMBEDDER else "/v1/completions"
            assert c.post(path, json={"model": model, **body}).status_code == 200
        before = _waited(c.get("/metrics").text, COMPLETE, "complete")

    first_piece = threading.Event()
    pieces: list[str] = []

    def stream() -> None:
        with prioritised.client() as c, c.stream(
                "POST", "/v1/completions",
                json={"model": COMPLETE, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 160,
                      "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
                    first_piece.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert first_piece.wait(60)
    with prioritised.client() as c:
        codes = [c.post("/v1/embeddings", json={"model": EMBEDDER,
                                                "input": [f"sentence {i}"] * 8}).status_code
                 for i in range(4)]
    streamer.join(120)
    assert codes == [200] * 4
    assert len(pieces) > 20  # it went on generating after the embeddings
    with prioritised.client() as c:
        after = _waited(c.get("/metrics").text, COMPLETE, "complete")
    # The completion held the turn when the first embedding arrived: it handed it over at its
    # next token and waited for it back, which only an earlier deadline can cause.
    assert after > before
