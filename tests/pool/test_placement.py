"""Placement in a pool of fake-engine replicas on a one-node Ray cluster: pins on every replica
of their group, dedicated replicas, one more copy for a model whose queue stays deep, idle
extra copies dropped, embeddings sent again when their replica dies, and autoscaling within
the config's bounds, each replica on a card of its own (`replica_gpus`; the node declares four
to Ray, none is there). Fake engines declare their sizes, so every byte is known."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.factories import Served, fake_model, pool_process, ray_cluster

WAIT_S = 120.0  # a bound on waiting for the pool to show a state; never a timing assertion
SHARED, DEDICATED = "packserve-shared", "packserve-dedicated-0"


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("placement")
    with ray_cluster(nodes=1, cpus=4, gpus=4) as cluster:
        config = tmp / "pool.toml"
        config.write_text(f"""
[server]
data_dir = "{tmp / 'data'}"
drain_s = 2
[devices.cpu]
memory_budget = "1GiB"
headroom = "0B"
[pool]
address = "{cluster.address}"
min_replicas = 2
max_replicas = 2
replica_cpus = 0
replica_gpus = 1
stats_period_s = 0.2
copy_queue_depth = 1
copy_after_s = 0.5
copy_idle_s = 3
upscale_delay_s = 1
target_queue = 1
[[pool.dedicated]]
models = ["solo"]
min_replicas = 1
max_replicas = 2
""" + fake_model("emb", "max_concurrency = 1") + fake_model("pinned", "pin = true",
                                                                 source="fake:32MiB")
            + fake_model("solo", "max_concurrency = 1", source="fake:32MiB"), "utf-8")
        with pool_process(config, tmp) as served:
            yield served


def _view(pool: Served) -> list[dict[str, Any]]:
    replicas: list[dict[str, Any]] = httpx.get(f"{pool.url}/v1/pool", timeout=10).json()[
        "replicas"]
    return replicas


def _wait_for(pool: Served, what: str, check: Any) -> list[dict[str, Any]]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        view = _view(pool)
        if check(view):
            return view
        time.sleep(0.1)
    raise AssertionError(f"the pool never showed {what}: {_view(pool)}")


def test_each_replica_has_a_card_of_its_own(pool: Served) -> None:
    """`replica_gpus = 1`: Ray gives each replica one of the node's cards (its
    CUDA_VISIBLE_DEVICES, which the replica's packserve process inherits), never one twice."""
    view = _wait_for(pool, "three replicas", lambda v: len(v) == 3)
    cards = [tuple(r["gpus"]) for r in view]
    assert all(len(c) == 1 for c in cards) and len(set(cards)) == 3, cards


def _hot_on(view: list[dict[str, Any]], model: str) -> list[str]:
    return [r["replica"] for r in view for m in r["models"]
            if m["name"] == model and m["state"] == "hot"]


def _embed(pool: Served, model: str, text: str) -> httpx.Response:
    r = httpx.post(f"{pool.url}/v1/embeddings", json={"model": model, "input": text},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_pins_are_held_by_every_replica_of_their_group(pool: Served) -> None:
    view = _wait_for(pool, "the pin hot on both shared replicas",
                     lambda v: len(_hot_on(v, "pinned")) == 2)
    shared = [r for r in view if r["group"] == SHARED]
    dedicated = [r for r in view if r["group"] == DEDICATED]
    assert len(shared) == 2 and len(dedicated) == 1
    assert all(m["pinned"] for r in shared for m in r["models"] if m["name"] == "pinned")
    assert [m["name"] for m in dedicated[0]["models"]] == ["solo"]


def test_a_dedicated_model_is_served_by_its_own_replicas(pool: Served) -> None:
    dedicated = {r["replica"] for r in _view(pool) if r["group"] == DEDICATED}
    assert _embed(pool, "solo", "alone").headers["x-packserve-replica"] in dedicated
    # ...and the shared replicas do not know it: nothing else can be sent there.
    assert all(m["name"] != "solo" for r in _view(pool) if r["group"] == SHARED
               for m in r["models"])


def test_a_model_deep_on_its_replica_gets_one_more_copy_then_drops_it(pool: Served) -> None:
    first = _embed(pool, "emb", "warm").headers["x-packserve-replica"]
    _wait_for(pool, "emb hot", lambda v: _hot_on(v, "emb") == [first])
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        futures = []
        for i in range(8):  # slow requests arriving over ~1.6 s: emb's one slot stays busy
            futures.append(ex.submit(_embed, pool, "emb", f"slow {i} @@sleep=1.5"))
            time.sleep(0.2)
        # Watched while the requests run: once they end, the copy may be dropped before a
        # look afterwards (copy_idle_s), on a busy machine.
        copies = 0
        while not all(f.done() for f in futures):
            copies = max(copies, len(_hot_on(_view(pool), "emb")))
            time.sleep(0.1)
        served_by = {f.result().headers["x-packserve-replica"] for f in futures}
    assert len(served_by) == 2, served_by  # a second copy took part
    assert copies == 2
    # Idle for copy_idle_s, the extra copy is unloaded; the most recently used one stays.
    view = _wait_for(pool, "one copy of emb again", lambda v: len(_hot_on(v, "emb")) == 1)
    assert len(_hot_on(view, "pinned")) == 2  # a pin is never an extra copy to drop


def _kill(group: str, replica: str) -> None:
    import ray

    ray.kill(ray.get_actor(f"SERVE_REPLICA::{group}#{group}#{replica}", namespace="serve"),
             no_restart=True)


def _running_emb(pool: Served) -> str | None:
    """The shared replica whose node runs a request of emb now, asked of each node: the pool
    view is each replica's last report, which may predate a request just sent and still count
    one that has ended (the previous test's)."""
    for r in _view(pool):
        if r["group"] != SHARED:
            continue
        try:  # a replica killed by an earlier test may still be listed: do not wait on it
            live = httpx.get(f"{pool.url}/v1/residency", params={"replica": r["replica"]},
                             timeout=2)
        except httpx.TimeoutException:
            continue
        if live.status_code == 200 and any(m["name"] == "emb" and m["in_flight"]
                                           for m in live.json()["models"]):
            return str(r["replica"])
    return None


def _killed_mid_request(pool: Served, text: str,
                        kill: Callable[[str], object]) -> tuple[str, httpx.Response]:
    """Send an embedding of emb (`text` makes it slow), `kill` the replica it runs on once its
    node runs it; that replica and the answer. Earlier requests of emb have all ended, so the
    node that runs one now runs this one: the replica has accepted it. A replica killed before
    that (on a stale report) is routed around by Ray Serve itself: no packserve retry."""
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        future = ex.submit(_embed, pool, "emb", text)
        deadline = time.monotonic() + WAIT_S
        while (victim := _running_emb(pool)) is None:
            assert not future.done(), f"the request ended before a node ran it: {future.result()}"
            assert time.monotonic() < deadline, f"no node ran the request: {_view(pool)}"
            time.sleep(0.1)
        kill(victim)
        return victim, future.result(timeout=WAIT_S)


def test_an_embedding_lost_with_its_replica_is_sent_again(pool: Served) -> None:
    victim, answer = _killed_mid_request(pool, "lost @@sleep=2",
                                         lambda replica: _kill(SHARED, replica))
    assert answer.headers["x-packserve-replica"] != victim
    metrics = httpx.get(f"{pool.url}/metrics", timeout=30).text
    assert 'packserve_pool_replica_lost_total{model="emb",outcome="retried"}' in metrics


def test_a_busy_dedicated_group_scales_out_within_its_bounds(pool: Served) -> None:
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        futures = [ex.submit(_embed, pool, "solo", f"busy {i} @@sleep=4") for i in range(6)]
        _wait_for(pool, "a second dedicated replica", lambda v: sum(
            r["group"] == DEDICATED for r in v) == 2)
        for f in futures:
            f.result(timeout=WAIT_S)
    assert sum(r["group"] == DEDICATED for r in _view(pool)) <= 2  # max_replicas


def test_the_status_page_shows_every_replica_in_a_browser(pool: Served) -> None:
    from playwright.sync_api import sync_playwright

    from tests.metrics.test_status_page import CHROMIUM, FLAGS

    replicas = {r["replica"] for r in _view(pool)}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            tab = browser.new_page()
            tab.goto(pool.url + "/")
            tab.wait_for_function(f"document.querySelectorAll('table.models').length >= "
                                  f"{len(replicas)}", timeout=15_000)
            text = tab.inner_text("#replicas")
        finally:
            browser.close()
    assert all(r in text for r in replicas)
    assert "pinned" in text and "solo" in text and "MiB used of" in text


def test_admin_routes_act_on_a_group_or_on_one_replica(pool: Served) -> None:
    shared = sorted(r["replica"] for r in _view(pool) if r["group"] == SHARED)
    plans = httpx.get(f"{pool.url}/v1/residency/plan", params={"model": "emb"},
                      timeout=60).json()
    assert sorted(plans["replicas"]) == shared
    assert all("verdict" in p for p in plans["replicas"].values())
    loaded = httpx.post(f"{pool.url}/v1/residency/emb/load", timeout=60)
    assert loaded.status_code == 200 and loaded.json()["state"] == "hot"
    assert loaded.headers["x-packserve-replica"] in shared  # where a request would go
    gone = httpx.post(f"{pool.url}/v1/residency/emb/unload", timeout=60).json()
    assert sorted(gone["replicas"]) == shared
    assert {a["state"] for a in gone["replicas"].values()} == {"cold"}
    one = httpx.get(f"{pool.url}/v1/residency", params={"replica": shared[0]}, timeout=60)
    assert one.headers["x-packserve-replica"] == shared[0]
    assert {m["name"] for m in one.json()["models"]} == {"emb", "pinned"}
    missing = httpx.get(f"{pool.url}/v1/residency", params={"replica": "nope"}, timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "replica_not_found"


def _pid_of(actor: Any) -> int:
    return os.getpid()


def _node_pid(group: str, replica: str) -> int:
    """The pid of the packserve node (its front) that a replica started."""
    import ray

    actor = ray.get_actor(f"SERVE_REPLICA::{group}#{group}#{replica}", namespace="serve")
    parent = int(ray.get(actor.__ray_call__.remote(_pid_of), timeout=60))  # type: ignore[call-overload]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"packserve.pool.child" in cmdline:
            return int(proc.name)
    raise AssertionError(f"no node process under replica {replica} (pid {parent})")


def _retried(pool: Served) -> float:
    for line in httpx.get(f"{pool.url}/metrics", timeout=30).text.splitlines():
        if line.startswith('packserve_pool_replica_lost_total{model="emb",outcome="retried"}'):
            return float(line.split()[-1])
    return 0.0


def test_an_embedding_whose_node_dies_is_sent_to_another_replica(pool: Served) -> None:
    # The node is killed while the request runs on it, so the request is certainly routed to
    # the dying replica. Killed before it is sent, Ray Serve's health check (every 2 s) can
    # see the replica unhealthy first and route the request elsewhere with no retry at all.
    before = _retried(pool)
    # The replica lives, its node does not.
    first, answer = _killed_mid_request(
        pool, "there @@sleep=3", lambda replica: os.kill(_node_pid(SHARED, replica),
                                                         signal.SIGKILL))
    assert answer.headers["x-packserve-replica"] != first
    assert _retried(pool) == before + 1
    # Ray Serve's health check sees the node gone and replaces the replica.
    _wait_for(pool, "the replica replaced", lambda v: first not in {r["replica"] for r in v})
