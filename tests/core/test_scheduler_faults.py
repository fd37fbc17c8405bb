"""The scheduler's faults (issue 8): client aborts, failed loads and writes, corrupt files, pins
that fail, a busy device, hidden states, quarantine and reloads. CPU, fake engines, no sleeping.

Each test names the fault it injects and counts what it must not lose: requests, bytes, loads.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import save_file

from packserve.core.catalog import DeviceBudget, ReconfigureReport
from packserve.core.events import (
    EvictEvent,
    LoadEvent,
    LoadFailedEvent,
    LoadStartEvent,
    OperatorLoadEvent,
    RequestEvent,
    RequestStartEvent,
    log_event,
)
from packserve.core.loader import FootprintStore, is_memory_failure
from packserve.core.policy import ResidentView, VictimPolicy, choose_victims, lru_by_bytes
from packserve.core.status import PinStatus
from packserve.errors import (
    ConfigError,
    ModelNotFound,
    ModelUnavailable,
    NeverFits,
    PinsDoNotFit,
)
from packserve.metrics.telemetry import Telemetry
from packserve.modelfiles import check_header
from packserve.types import State, Task
from tests.factories import (
    MIB,
    TIMEOUT,
    Sleeper,
    backend_of,
    drain,
    entry,
    file_entry,
    harness,
    hold,
    use,
)

# Coroutine tests run on asyncio through anyio's pytest plugin, each bounded in time.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(4 * TIMEOUT)]


def ended(events: list[RequestEvent], model: str) -> list[tuple[int, str]]:
    return [(e.status, e.outcome) for e in events if e.model == model]


# ------------------------------------------------------------------------- cancellation


async def test_request_gone_while_its_load_waits_for_memory_loads_and_evicts_nothing() -> None:
    h = harness([entry("a"), entry("b")], budget_mib=150)
    s = h.scheduler
    holder = await hold(s, "a")
    b = asyncio.create_task(use(s, "b"))
    await drain()  # b's load waits for a's memory
    assert h.state("b") is State.ADMITTING

    b.cancel()  # its client disconnects
    with pytest.raises(asyncio.CancelledError):
        await b
    await drain()
    assert h.state("b") is State.COLD
    assert ended(h.events.of(RequestEvent), "b") == [(499, "client_closed")]

    await holder.release()  # a goes idle: an orphaned load would now evict it
    await drain()
    assert h.events.of(EvictEvent) == []
    assert h.events.names(LoadEvent) == ["a"]
    assert len(h.built) == 1
    assert h.used == 100 * MIB == h.loaded_bytes()

    await use(s, "b")  # a later request loads it normally
    assert (h.state("a"), h.state("b")) == (State.COLD, State.HOT)
    await s.close()


async def test_request_gone_while_waiting_for_the_device_lock_loads_nothing() -> None:
    h = harness([entry("a"), entry("b")], budget_mib=1024)
    s = h.scheduler
    h.control.gate.clear()
    try:
        a = asyncio.create_task(use(s, "a"))
        assert await asyncio.to_thread(h.building.wait, TIMEOUT)  # a's engine holds the lock
        b = asyncio.create_task(use(s, "b"))
        await drain()
        assert h.state("b") is State.ADMITTING
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        await drain()
        assert h.state("b") is State.COLD
    finally:
        h.control.gate.set()
    await asyncio.wait_for(a, TIMEOUT)
    await drain()
    assert h.events.names(LoadEvent) == ["a"]
    assert [e.model for e in h.events.of(LoadStartEvent)] == ["a"]
    assert len(h.built) == 1
    await s.close()


async def test_load_abandoned_between_evictions_stops_evicting() -> None:
    h = harness([entry("a"), entry("d"), entry("b", 200)], budget_mib=250)
    s = h.scheduler
    await use(s, "a")
    h.clock.advance(1)
    await use(s, "d")
    assert s.plan("b").victims == ("a", "d")

    h.control.unload_gate.clear()
    try:
        b = asyncio.create_task(use(s, "b"))
        await drain()
        assert h.state("a") is State.UNLOADING  # the first eviction is under way
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
    finally:
        h.control.unload_gate.set()
    await h.events.wait_for(lambda e: isinstance(e, EvictEvent))
    await drain()
    assert h.events.names(EvictEvent) == ["a"]  # d was not evicted for nobody
    assert (h.state("a"), h.state("d"), h.state("b")) == (State.COLD, State.HOT, State.COLD)
    assert h.events.names(LoadEvent) == ["a", "d"]
    assert h.used == 100 * MIB == h.loaded_bytes()
    await s.close()


async def test_waiter_gone_during_the_engine_load_leaves_it_to_finish_and_publish() -> None:
    h = harness([entry("m")], budget_mib=1024)
    s = h.scheduler
    h.control.gate.clear()
    try:
        gone = asyncio.create_task(use(s, "m", request_id="gone"))
        stays = asyncio.create_task(use(s, "m", request_id="stays"))
        assert await asyncio.to_thread(h.building.wait, TIMEOUT)
        assert h.state("m") is State.LOADING
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert h.state("m") is State.LOADING  # the engine call runs on
        assert h.used == 100 * MIB  # its bytes stay reserved
    finally:
        h.control.gate.set()
    backend = backend_of(await asyncio.wait_for(stays, TIMEOUT))
    assert backend is h.built[0]
    assert h.state("m") is State.HOT

    # The same with nobody left at all: the load still ends published, not leaked.
    await s.unload("m")
    h.control.gate.clear()
    try:
        alone = asyncio.create_task(use(s, "m"))
        await h.events.wait_for(lambda e: isinstance(e, LoadStartEvent)
                                and len(h.events.of(LoadStartEvent)) == 2)
        alone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await alone
    finally:
        h.control.gate.set()
    await h.events.wait_for(lambda e: isinstance(e, LoadEvent)
                            and len(h.events.of(LoadEvent)) == 2)
    assert h.state("m") is State.HOT
    assert h.used == 100 * MIB == h.loaded_bytes()
    assert h.status("m").in_flight == 0
    await use(s, "m")  # served by the published load: no third one
    assert len(h.built) == 2
    outcomes = {e.request_id: e.status for e in h.events.of(RequestEvent)}
    assert outcomes["gone"] == 499 and outcomes["stays"] == 200
    await s.close()


async def test_cancelled_requests_count_as_499_client_closed_in_events_and_metrics() -> None:
    h = harness([entry("m", max_concurrency=1)], budget_mib=1024)
    s = h.scheduler
    telemetry = Telemetry(s, prices={}, default_price=1.0, currency="EUR")
    s.add_sink(telemetry.on_event)
    holder = await hold(s, "m", request_id="holding")
    queued = asyncio.create_task(use(s, "m", request_id="queued"))
    await drain()
    assert h.status("m").queued == 1
    queued.cancel()  # gone while waiting for a slot
    holder.task.cancel()  # gone while holding the lease
    for task in (queued, holder.task):
        with pytest.raises(asyncio.CancelledError):
            await task
    by_id = {e.request_id: e for e in h.events.of(RequestEvent)}
    assert (by_id["holding"].status, by_id["holding"].outcome) == (499, "client_closed")
    assert by_id["holding"].started
    assert (by_id["queued"].status, by_id["queued"].outcome) == (499, "client_closed")
    assert not by_id["queued"].started
    assert (h.status("m").in_flight, h.status("m").queued) == (0, 0)

    samples = {(x.name, x.labels.get("code")): x.value
               for f in text_string_to_metric_families(telemetry.render().decode())
               for x in f.samples}
    assert samples[("packserve_requests_total", "499")] == 2
    assert ("packserve_requests_total", "500") not in samples
    await use(s, "m")  # the slot was given back
    await s.close()


# ------------------------------------------------------------------------- ids and events


async def test_request_id_travels_in_request_events_and_the_event_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = harness([entry("m")], budget_mib=1024)
    s = h.scheduler
    s.add_sink(log_event)
    with caplog.at_level(logging.INFO, logger="packserve.events"):
        await use(s, "m", request_id="req-ok")
        holder = await hold(s, "m", request_id="req-gone")
        holder.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await holder.task
    (start, _) = h.events.of(RequestStartEvent)
    assert start.request_id == "req-ok"
    assert [e.request_id for e in h.events.of(RequestEvent)] == ["req-ok", "req-gone"]

    lines = [json.loads(r.getMessage()) for r in caplog.records]
    kinds = [(line["kind"], line.get("request_id")) for line in lines]
    # Load starts and residency events are logged; of requests, only aborts and failures.
    assert kinds == [("load_start", None), ("load", None), ("request", "req-gone")]
    assert lines[2]["status"] == 499 and lines[2]["outcome"] == "client_closed"
    await s.close()


async def test_every_load_start_ends_with_one_load_or_failure_event() -> None:
    h = harness([entry("ok"), entry("bad")], budget_mib=1024)
    s = h.scheduler
    h.control.gate.clear()
    try:
        task = asyncio.create_task(use(s, "ok"))
        assert await asyncio.to_thread(h.building.wait, TIMEOUT)
        assert [e.kind for e in h.events.events] == ["load_start"]  # emitted before it ran
    finally:
        h.control.gate.set()
    await asyncio.wait_for(task, TIMEOUT)
    h.control.fail_next = 1
    h.control.failure = lambda name: RuntimeError(f"{name}: unsupported architecture")
    with pytest.raises(ModelUnavailable):
        await use(s, "bad")
    residency = [(e.kind, e.model) for e in h.events.events if e.kind != "request"
                 and e.kind != "request_start"]
    assert residency == [("load_start", "ok"), ("load", "ok"),
                         ("load_start", "bad"), ("failure", "bad")]
    await s.close()


# ------------------------------------------------------------------------- quarantine


CRASH = "engine crashed: SIGILL while serving chat"


async def test_quarantine_refuses_requests_with_the_reason_until_an_operator_loads() -> None:
    h = harness([entry("q"), entry("other")], budget_mib=1024)
    s = h.scheduler
    s.quarantine("q", CRASH)
    assert h.state("q") is State.FAILED
    assert h.status("q").error == CRASH

    h.clock.advance(100_000)  # no cooldown ends a quarantine
    with pytest.raises(ModelUnavailable) as caught:
        await use(s, "q")
    assert caught.value.status == 503
    assert "q" in caught.value.message and CRASH in caught.value.message
    assert caught.value.retry_after_s >= 1
    assert h.built == []
    await use(s, "other")  # nobody else is affected

    await s.load("q")  # the operator's action clears it
    assert h.state("q") is State.HOT
    assert h.status("q").error is None
    await use(s, "q")
    await s.close()


async def test_a_quarantined_shared_loads_503_names_the_model_asked_for() -> None:
    h = harness([entry("a", weights="w"), entry("b", weights="w")], budget_mib=1024)
    s = h.scheduler
    s.quarantine("a", CRASH)
    with pytest.raises(ModelUnavailable) as caught:
        await use(s, "b")
    assert caught.value.message.startswith("model b (one load with a) is quarantined: ")
    await s.close()


async def test_an_operators_load_is_reported_once_it_succeeded_and_never_when_it_failed() -> None:
    """The front lifts its quarantine on OperatorLoadEvent alone (packserve.front.supervisor):
    a failed operator load must not emit it, nor a load a request caused."""
    h = harness([entry("q"), entry("other")], budget_mib=1024)
    s = h.scheduler
    s.quarantine("q", CRASH)
    h.control.fail_next = 1
    h.control.failure = lambda name: ValueError(f"Failed to load model from file: {name}")
    with pytest.raises(ModelUnavailable):
        await s.load("q")
    assert h.events.of(OperatorLoadEvent) == []
    await use(s, "other")  # loaded for a request, not by an operator
    assert h.events.of(OperatorLoadEvent) == []

    await s.load("q")
    assert h.state("q") is State.HOT
    assert h.events.of(OperatorLoadEvent) == [OperatorLoadEvent(model="q", device="cpu",
                                                                load="q")]
    await s.load("q")  # already hot: the operator's load still succeeded
    assert [e.model for e in h.events.of(OperatorLoadEvent)] == ["q", "q"]
    await s.close()


async def test_quarantine_of_a_hot_model_lets_its_requests_finish_then_unloads_it() -> None:
    h = harness([entry("q")], budget_mib=1024)
    s = h.scheduler
    holder = await hold(s, "q")
    s.quarantine("q", CRASH)
    with pytest.raises(ModelUnavailable):
        await use(s, "q")
    assert h.state("q") is State.HOT  # its request in flight keeps the engine

    await holder.release()
    evict = await h.events.wait_for(lambda e: isinstance(e, EvictEvent))
    assert isinstance(evict, EvictEvent) and CRASH in evict.reason
    await drain()
    assert h.state("q") is State.FAILED
    assert h.used == 0 == h.loaded_bytes()
    # The new request was refused; the one in flight finished normally.
    assert ended(h.events.of(RequestEvent), "q") == [(503, "ModelUnavailable"), (200, "ok")]
    await s.close()


# ------------------------------------------------------------------------- footprint store


async def test_a_failed_footprint_write_is_logged_and_the_load_stays_good(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the data dir should be")

    h = harness([entry("idle"), entry("m")], budget_mib=1024,
                store=FootprintStore(blocker / "footprints.json"))
    s = h.scheduler
    with caplog.at_level(logging.WARNING, logger="packserve.scheduler"):
        await use(s, "idle")
        await use(s, "m")
    assert (h.state("idle"), h.state("m")) == (State.HOT, State.HOT)
    assert h.status("m").bytes_measured == 100 * MIB
    assert h.events.of(LoadFailedEvent) == [] and h.events.of(EvictEvent) == []
    assert h.used == 200 * MIB == h.loaded_bytes()
    assert any("could not save measured footprints" in r.getMessage()
               for r in caplog.records)
    await s.close()


def test_concurrent_footprint_puts_from_threads_keep_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "data" / "footprints.json"
    store = FootprintStore(path)
    specs = [entry(f"m{i}").load for i in range(64)]
    start = threading.Barrier(8)

    def writer(part: int) -> None:
        start.wait(TIMEOUT)
        for i in range(part, len(specs), 8):
            store.put(specs[i], (i + 1) * MIB)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    saved = json.loads(path.read_text("utf-8"))
    assert {k: v["bytes"] for k, v in saved.items()} == {
        s.key: (i + 1) * MIB for i, s in enumerate(specs)}
    assert sorted(p.name for p in path.parent.iterdir()) == ["footprints.json"]  # no tmp left


# ------------------------------------------------------------------------- file headers


def _gguf(version: int = 3, tensors: int = 1, metadata: int = 1) -> bytes:
    return (b"GGUF" + version.to_bytes(4, "little") + tensors.to_bytes(8, "little")
            + metadata.to_bytes(8, "little") + bytes(64))


def _safetensors(tmp: Path) -> Path:
    file = tmp / "model.safetensors"
    save_file({"w": np.ones((4, 4), dtype=np.float32)}, str(file))
    return file


@pytest.mark.parametrize(("content", "error"), [
    pytest.param(_gguf(3), None, id="gguf-v3"),
    pytest.param(_gguf(2), None, id="gguf-v2"),
    pytest.param(b"<html>404 Not Found</html>" + bytes(32), "not a GGUF file", id="html-page"),
    pytest.param(b"GGUF\x03\x00", "not a GGUF file", id="truncated-header"),
    pytest.param(_gguf(1), "version 1", id="gguf-v1-unsupported"),
    pytest.param(_gguf(99), "version 99", id="gguf-future-version"),
    pytest.param(_gguf(3, tensors=1 << 40), "corrupt GGUF header", id="absurd-tensor-count"),
])
def test_check_header_gguf(tmp_path: Path, content: bytes, error: str | None) -> None:
    file = tmp_path / "model.gguf"
    file.write_bytes(content)
    if error is None:
        check_header(file)
    else:
        with pytest.raises(ConfigError, match=error):
            check_header(file)


def test_check_header_safetensors_files_and_directories(tmp_path: Path) -> None:
    good = _safetensors(tmp_path)
    check_header(good)
    check_header(tmp_path)  # a model directory: its safetensors files
    data = good.read_bytes()

    cases = {
        "truncated": (data[:-8], "truncated"),
        "header-longer-than-file": (
            (1 << 20).to_bytes(8, "little") + data[8:], "corrupt safetensors header"),
        "not-json": (data[:8] + b"\xff" * (len(data) - 8), "not JSON"),
        "empty": (b"", "corrupt safetensors header"),
    }
    for name, (content, error) in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(ConfigError, match=error):
            check_header(bad)
        with pytest.raises(ConfigError, match=error):
            check_header(tmp_path)  # the directory is as bad as its worst file
        bad.unlink()

    other = tmp_path / "tokenizer.json"
    other.write_text("{}")
    check_header(other)  # not weights: left to the engine
    with pytest.raises(ConfigError, match="does not exist"):
        check_header(tmp_path / "gone.gguf")


async def test_a_corrupt_gguf_fails_at_once_without_retry_or_eviction(tmp_path: Path) -> None:
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"<html>rate limited</html>")  # a failed download, saved as weights
    fine = tmp_path / "fine.gguf"
    fine.write_bytes(_gguf(3))

    h = harness([entry("idle"), file_entry("broken", corrupt), file_entry("fine", fine)],
                budget_mib=200, check_files=True)
    s = h.scheduler
    await use(s, "idle")
    h.clock.advance(1)
    with pytest.raises(ModelUnavailable) as caught:
        await use(s, "broken", Task.CHAT)
    assert "broken" in caught.value.message and "not a GGUF file" in caught.value.message
    assert h.state("broken") is State.FAILED
    assert "not a GGUF file" in (h.status("broken").error or "")
    assert [f.will_retry for f in h.events.of(LoadFailedEvent)] == [False]
    assert [e.model for e in h.events.of(LoadStartEvent)] == ["idle"]  # no engine call
    assert h.events.of(EvictEvent) == []
    assert len(h.built) == 1 and h.state("idle") is State.HOT

    await use(s, "fine", Task.CHAT)  # a sound header passes the same check
    assert h.state("fine") is State.HOT
    await s.close()


# ------------------------------------------------------------------------- retry predicate


@pytest.mark.parametrize(("exc", "expected"), [
    pytest.param(MemoryError(), True, id="MemoryError"),
    pytest.param(OSError(errno.ENOMEM, "Cannot allocate memory"), True, id="ENOMEM"),
    pytest.param(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True,
                 id="cuda-oom"),
    pytest.param(RuntimeError("ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate "
                              "buffer of size 1073741824"), True, id="ggml-alloc"),
    pytest.param(ValueError("Unable to allocate 3.2 GiB for an array"), True, id="numpy"),
    pytest.param(RuntimeError("DefaultCPUAllocator: can't allocate memory"), True, id="torch"),
    pytest.param(ValueError("Failed to load model from file: x.gguf"), False, id="llama-refuses"),
    pytest.param(RuntimeError("unknown model architecture: 'llamx'"), False, id="bad-arch"),
    pytest.param(FileNotFoundError(errno.ENOENT, "No such file"), False, id="missing-file"),
    pytest.param(ConfigError("not a GGUF file"), False, id="corrupt"),
])
def test_is_memory_failure(exc: BaseException, expected: bool) -> None:
    assert is_memory_failure(exc) is expected


def test_is_memory_failure_looks_down_the_chain() -> None:
    try:
        try:
            raise MemoryError
        except MemoryError as inner:
            raise RuntimeError("engine load failed") from inner
    except RuntimeError as outer:
        assert is_memory_failure(outer)


async def test_a_failure_memory_cannot_cause_is_not_retried_and_evicts_nothing() -> None:
    h = harness([entry("idle"), entry("m")], budget_mib=1024)
    s = h.scheduler
    await use(s, "idle")
    h.control.fail_next = 1
    h.control.failure = lambda name: ValueError(f"Failed to load model from file: {name}")
    with pytest.raises(ModelUnavailable) as caught:
        await use(s, "m")
    assert "failed to load: ValueError" in caught.value.message
    assert [f.will_retry for f in h.events.of(LoadFailedEvent)] == [False]
    assert h.events.of(EvictEvent) == []
    assert len(h.built) == 2  # idle, and m's one attempt
    assert (h.state("idle"), h.state("m")) == (State.HOT, State.FAILED)
    await s.close()


def _most_recent_first(residents: Sequence[ResidentView], need: int, free: int,
                       ) -> tuple[str, ...] | None:
    return choose_victims(residents, need, free, order=lambda r: (-r.last_used,))


@pytest.mark.parametrize(("policy", "evicted"), [
    pytest.param(None, ["a"], id="packserve-lru"),
    pytest.param(_most_recent_first, ["c"], id="custom-policy"),
    pytest.param({"cpu": _most_recent_first}, ["c"], id="custom-policy-for-this-device"),
    pytest.param({"cuda:0": _most_recent_first}, ["a"], id="custom-policy-elsewhere"),
])
async def test_out_of_memory_retry_evicts_through_the_policy_only_as_needed(
    policy: VictimPolicy | Mapping[str, VictimPolicy] | None, evicted: list[str],
) -> None:
    h = harness([entry("a"), entry("b"), entry("c"), entry("m")], budget_mib=1024,
                victim_policy=policy or lru_by_bytes)
    s = h.scheduler
    for name in "abc":
        await use(s, name)
        h.clock.advance(1)
    h.control.fail_next = 1  # MemoryError: memory may help

    await use(s, "m")
    assert [f.will_retry for f in h.events.of(LoadFailedEvent)] == [True]
    # m's footprint (100 MiB) freed once more, chosen by the policy: one model, not all.
    assert h.events.names(EvictEvent) == evicted
    assert all(e.reason == "free memory to retry m" for e in h.events.of(EvictEvent))
    assert h.state("m") is State.HOT
    assert sum(h.state(n) is State.HOT for n in "abc") == 2
    await s.close()


# ------------------------------------------------------------------------- pins


async def test_a_pin_whose_load_fails_is_rolled_back() -> None:
    sleeper = Sleeper()
    # `capped` is estimated within its max_memory quota but measures over it once loaded.
    h = harness([entry("m"), entry("capped", 50, declared_mib=100, max_memory=80 * MIB)],
                budget_mib=200, sleep=sleeper)
    s = h.scheduler
    h.control.fail_next = 2  # the load and its retry
    with pytest.raises(ModelUnavailable):
        await s.pin("m")
    assert h.status("m").pinned is False
    assert s.ready().ready  # not a pin, so not waited for

    with pytest.raises(NeverFits):
        await s.pin("capped")
    assert h.status("capped").pinned is False

    await s.pin("m")  # once the fault is gone the operator pins it
    assert h.status("m").pinned and h.state("m") is State.HOT
    assert sleeper.delays == []  # nothing retried behind the operator's back
    await s.close()


async def test_a_pin_that_fails_at_start_is_retried_with_backoff_and_ready_says_why() -> None:
    sleeper = Sleeper()
    h = harness([entry("p", pin=True), entry("free")], budget_mib=1024, sleep=sleeper)
    s = h.scheduler
    h.control.fail_next = 1
    h.control.failure = lambda name: RuntimeError(f"{name}: device not ready")

    await s.start()  # the server comes up, not ready
    assert h.state("p") is State.FAILED
    readiness = s.ready()
    assert not readiness.ready and readiness.not_loaded == ["p"]
    (pin,) = readiness.pins
    assert pin.state is State.FAILED and "device not ready" in (pin.error or "")
    assert pin.next_retry_s == 1.0
    await use(s, "free")  # serving meanwhile

    h.control.fail_next = 2  # the first two retries fail too
    for attempt, delay in enumerate((1.0, 2.0, 4.0), start=1):
        await sleeper.asleep(attempt)
        assert sleeper.delays[-1] == delay
        assert s.ready().pins[0].next_retry_s == delay
        sleeper.wake()
    await h.events.wait_for(lambda e: isinstance(e, LoadEvent) and e.model == "p")
    await drain()
    assert h.state("p") is State.HOT
    assert s.ready().ready
    assert sleeper.delays == [1.0, 2.0, 4.0]  # no retry after success
    # Retries keep their own pace: the 30 s failure cooldown (clock frozen) did not block.
    assert [f.will_retry for f in h.events.of(LoadFailedEvent)] == [False] * 3
    await s.close()


async def test_pin_retries_stop_when_the_model_is_unpinned() -> None:
    sleeper = Sleeper()
    h = harness([entry("p", pin=True)], budget_mib=1024, sleep=sleeper)
    s = h.scheduler
    h.control.fail_next = 1
    h.control.failure = lambda name: RuntimeError("nope")
    await s.start()
    await sleeper.asleep(1)
    s.unpin("p")
    sleeper.wake()
    await drain()
    assert len(h.built) == 1 and sleeper.delays == [1.0]
    assert s.ready().ready
    await s.close()


# ------------------------------------------------------------------------- a busy device


async def test_waiting_for_the_device_lock_is_bounded_by_load_wait_s() -> None:
    h = harness([entry("a"), entry("b"), entry("c")], budget_mib=1024, real_clock=True,
                load_wait_s=0.05)
    s = h.scheduler
    await use(s, "c")
    h.built.clear()
    h.building.clear()
    h.control.gate.clear()
    try:
        a = asyncio.create_task(use(s, "a"))
        assert await asyncio.to_thread(h.building.wait, TIMEOUT)  # a's engine holds cpu
        with pytest.raises(ModelUnavailable) as load:
            await use(s, "b")
        with pytest.raises(ModelUnavailable) as unload:
            await s.unload("c")  # an admin unload is not blocked for ever either
    finally:
        h.control.gate.set()
    for caught, name in ((load, "model b"), (unload, "unloading c")):
        assert caught.value.status == 503
        assert name in caught.value.message and "0.05s" in caught.value.message
        assert caught.value.headers == {"Retry-After": str(caught.value.retry_after_s)}
    assert h.state("b") is State.COLD
    await asyncio.wait_for(a, TIMEOUT)
    await use(s, "b")
    await s.unload("c")
    assert h.state("c") is State.COLD
    await s.close()


async def test_loads_and_unloads_do_not_wait_for_a_busy_inference_pool() -> None:
    h = harness([entry("a"), entry("b")], budget_mib=1024)
    s = h.scheduler
    await use(s, "a")
    loop = asyncio.get_running_loop()
    busy = threading.Event()
    # More blocked "inference" calls than the default pool has threads (at most 32).
    inference = [loop.run_in_executor(None, busy.wait, TIMEOUT) for _ in range(40)]
    try:
        await asyncio.wait_for(s.unload("a"), TIMEOUT)
        await asyncio.wait_for(use(s, "b"), TIMEOUT)
    finally:
        busy.set()
    await asyncio.gather(*inference)
    assert (h.state("a"), h.state("b")) == (State.COLD, State.HOT)
    await s.close()


# ------------------------------------------------------------------------- explicit states


async def test_admitting_loading_unloading_are_visible_with_their_memory() -> None:
    h = harness([entry("x"), entry("w")], budget_mib=1024)
    s = h.scheduler
    h.control.gate.clear()
    try:
        x = asyncio.create_task(use(s, "x"))
        assert await asyncio.to_thread(h.building.wait, TIMEOUT)
        w = asyncio.create_task(use(s, "w"))  # waits for the device lock x's load holds
        await drain()
        assert (h.status("x").state, h.status("w").state) == (State.LOADING, State.ADMITTING)
        assert h.used == 100 * MIB  # LOADING holds its reservation; ADMITTING nothing
    finally:
        h.control.gate.set()
    await asyncio.wait_for(asyncio.gather(x, w), TIMEOUT)
    assert (h.status("x").state, h.status("w").state) == (State.HOT, State.HOT)

    h.control.unload_gate.clear()
    try:
        unloading = asyncio.create_task(s.unload("x"))
        await drain()
        assert h.status("x").state is State.UNLOADING
        assert h.used == 200 * MIB  # still held until the engine lets go
        again = asyncio.create_task(use(s, "x"))  # waits; never gets the dying backend
        await drain()
        assert not again.done()
    finally:
        h.control.unload_gate.set()
    await asyncio.wait_for(unloading, TIMEOUT)
    backend = backend_of(await asyncio.wait_for(again, TIMEOUT))
    assert backend is h.built[-1] and len(h.built) == 3
    assert h.status("x").state is State.HOT
    assert h.used == 200 * MIB == h.loaded_bytes()
    await s.close()


# ------------------------------------------------------------------------- reconfigure


async def test_reconfigure_adds_removes_and_changes_quotas_without_dropping_a_request() -> None:
    h = harness([entry("keep", max_concurrency=1), entry("gone", max_concurrency=1)],
                budget_mib=1024)
    s = h.scheduler
    keep_held = await hold(s, "keep")
    keep_queued = asyncio.create_task(use(s, "keep"))
    gone_held = await hold(s, "gone")
    gone_queued = asyncio.create_task(use(s, "gone"))
    await drain()
    assert (h.status("keep").queued, h.status("gone").queued) == (1, 1)

    report = await s.reconfigure([entry("keep", max_concurrency=2),
                                  entry("new", pin=True)])
    assert report == ReconfigureReport(added=("new",), removed=("gone",), changed=("keep",))
    assert s.model_names() == ["keep", "new"]
    await asyncio.wait_for(keep_queued, TIMEOUT)  # the larger quota started it at once
    assert h.state("new") is State.HOT and s.ready().ready  # new pins are loaded
    with pytest.raises(ModelNotFound):
        await use(s, "gone")  # gone for new requests at once

    assert h.events.of(EvictEvent) == []  # its requests still use it
    await gone_held.release()
    await asyncio.wait_for(gone_queued, TIMEOUT)  # the queued one ran too
    evict = await h.events.wait_for(lambda e: isinstance(e, EvictEvent))
    assert isinstance(evict, EvictEvent)
    assert (evict.model, evict.reason) == ("gone", "removed from the config")
    await keep_held.release()
    await drain()
    assert h.used == 200 * MIB == h.loaded_bytes()  # keep and new
    # Every request accepted was answered (the 404 was refused before it was accepted).
    assert [e.status for e in h.events.of(RequestEvent)] == [200] * 4
    await s.close()


async def test_reconfigure_new_weights_are_a_remove_and_add_under_the_same_name() -> None:
    h = harness([entry("m", context_length=0)], budget_mib=1024)
    s = h.scheduler
    old = await hold(s, "m")
    report = await s.reconfigure([entry("m", context_length=512)])
    assert report == ReconfigureReport(added=(), removed=(), changed=("m",), new_weights=("m",))

    backend = backend_of(await use(s, "m"))  # new requests get the new weights
    assert backend is h.built[1] and backend.spec.context_length == 512
    assert h.used == 200 * MIB  # the old weights serve their request meanwhile
    await old.release()
    evict = await h.events.wait_for(lambda e: isinstance(e, EvictEvent))
    assert isinstance(evict, EvictEvent) and evict.reason == "removed from the config"
    await drain()
    assert h.used == 100 * MIB == h.loaded_bytes()
    assert [e.status for e in h.events.of(RequestEvent)] == [200, 200]
    await s.close()


async def test_reconfigure_keeps_shared_weights_while_a_sharer_stays() -> None:
    h = harness([entry("x", weights="w"), entry("y", weights="w")], budget_mib=1024)
    s = h.scheduler
    await use(s, "y")
    report = await s.reconfigure([entry("x", weights="w")])
    assert report.removed == ("y",)
    await drain()
    assert h.state("x") is State.HOT and h.events.of(EvictEvent) == []
    assert h.status("x").shares_weights_with == ()
    await use(s, "x")
    assert len(h.built) == 1
    await s.close()


async def test_reconfigure_refuses_device_changes_and_pins_that_do_not_fit_changing_nothing(
        ) -> None:
    h = harness([entry("a"), entry("b")], budget_mib=250)
    s = h.scheduler
    await use(s, "a")
    h.clock.advance(1)
    await use(s, "b")
    before = s.models()
    with pytest.raises(ConfigError, match="devices cannot be added or removed"):
        await s.reconfigure([entry("a")], [DeviceBudget("cpu", 250 * MIB, 0),
                                           DeviceBudget("cuda:0", 1 << 30, 0)])
    with pytest.raises(PinsDoNotFit):
        await s.reconfigure([entry("a", pin=True), entry("c", 200, pin=True)])
    assert s.models() == before

    # A smaller budget applies at once: idle models leave, by the policy, until it fits.
    report = await s.reconfigure([entry("a"), entry("b")],
                                 [DeviceBudget("cpu", 150 * MIB, 0)])
    assert report == ReconfigureReport(added=(), removed=(), changed=())
    assert s.devices()[0].budget_bytes == 150 * MIB
    assert h.events.names(EvictEvent) == ["a"]
    assert h.used == 100 * MIB
    await s.close()


async def test_reconfigure_retries_a_new_pin_that_fails() -> None:
    sleeper = Sleeper()
    h = harness([entry("a")], budget_mib=1024, sleep=sleeper)
    s = h.scheduler
    h.control.fail_next = 1
    h.control.failure = lambda name: RuntimeError("not yet")
    await s.reconfigure([entry("a", pin=True)])
    assert s.ready().pins == (PinStatus(model="a", state=State.FAILED,
                                        error="model a failed to load: RuntimeError: not yet",
                                        next_retry_s=1.0),)
    await sleeper.asleep(1)
    sleeper.wake()
    await h.events.wait_for(lambda e: isinstance(e, LoadEvent))
    await drain()
    assert s.ready().ready
    await s.close()


# ------------------------------------------------------------------------- shutdown


async def test_close_gives_up_loads_waiting_for_memory_and_unloads_everything() -> None:
    h = harness([entry("a"), entry("b")], budget_mib=150)
    s = h.scheduler
    holder = await hold(s, "a")
    b = asyncio.create_task(use(s, "b"))
    await drain()
    holder.task.cancel()  # the server stops: its requests are cancelled
    await s.close()
    with pytest.raises(ModelUnavailable, match="shutting down"):
        await b
    assert h.state("b") is State.COLD and h.state("a") is State.COLD
    assert h.loaded_bytes() == 0 and len(h.built) == 1
