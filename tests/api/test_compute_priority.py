"""Compute goes to the tightest deadline, through the real server and the default catalog's
runners: while a long completion streams from Gemma's runner (4 s SLO), embeddings (0.5 s) take
the cores, and Gemma's runner is stopped for them (`[server] runner_turns`, on by default:
backends.runner.Turns), then goes on generating."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.factories import Running, default_config, serve
from tests.factories.processes import runner_of

pytestmark = pytest.mark.real

EMBEDDER, COMPLETE = "all-minilm-l6-v2", "gemma-3-270m"


@pytest.fixture(scope="module")
def server(models_dir: Path) -> Iterator[Running]:
    with serve(default_config(models_dir, only_models=[EMBEDDER, COMPLETE])) as running:
        yield running


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_embeddings_stop_a_long_completion_for_their_turn(server: Running) -> None:
    with server.client() as c:
        for model, body in ((EMBEDDER, {"input": "warm"}), (COMPLETE, {"prompt": "1,",
                                                                        "max_tokens": 1})):
            path = "/v1/embeddings" if model == EMBEDDER else "/v1/completions"
            assert c.post(path, json={"model": model, **body}).status_code == 200
    gemma = runner_of("gemma")

    first_piece, done = threading.Event(), threading.Event()
    pieces: list[str] = []
    seen_stopped: list[bool] = []

    def stream() -> None:
        with server.client() as c, c.stream(
                "POST", "/v1/completions",
                json={"model": COMPLETE, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 160,
                      "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
                    first_piece.set()

    def watch() -> None:  # the kernel's word on Gemma's runner while the embeddings run
        while not done.is_set():
            seen_stopped.append(_stopped(gemma))

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert first_piece.wait(60)
    watcher = threading.Thread(target=watch)
    watcher.start()
    with server.client() as c:
        codes = [c.post("/v1/embeddings", json={"model": EMBEDDER,
                                                "input": [f"sentence {i}"] * 8}).status_code
                 for i in range(4)]
    done.set()
    watcher.join()
    streamer.join(120)
    assert codes == [200] * 4
    assert any(seen_stopped), f"Gemma's runner was never stopped in {len(seen_stopped)} looks"
    assert len(pieces) > 20  # it went on generating after the embeddings
