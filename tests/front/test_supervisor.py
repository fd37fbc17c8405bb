"""The supervisor on its own, in this process, with a real worker process (fake engines)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

from packserve.config import load_config
from packserve.core import crashes
from packserve.front.supervisor import Supervisor
from tests.factories import fake_config, fake_model


def test_a_hung_worker_is_killed_charged_and_replaced(tmp_path: Path) -> None:
    config = load_config(fake_config(tmp_path))

    async def scenario() -> None:
        supervisor = Supervisor(config, ping_s=0.2, misses=3)
        await supervisor.start()
        try:
            worker = await supervisor.wait_up(120)
            assert worker is not None
            assert worker.pool.idle == 1  # the health checks' kept-alive connection
            os.kill(worker.pid, signal.SIGSTOP)  # answers nothing, never dies by itself
            crash = await asyncio.wait_for(asyncio.shield(worker.dead), 30)
            assert crash is not None and crash.cause == "SIGKILL"
            assert worker.pool.idle == 0  # closed with its worker
            replacement = await supervisor.wait_up(120)
            assert replacement is not None and replacement.pid != worker.pid
            assert replacement.pool is not worker.pool
            assert supervisor.view()["crashes"] == 1
        finally:
            await supervisor.stop()

    asyncio.run(scenario())


def test_a_worker_that_refuses_its_config_at_the_first_start_stops_the_server(
        tmp_path: Path) -> None:
    config = load_config(fake_config(tmp_path))
    # Valid to the front, refused by the worker: a device budget too small for the pins.
    bad = config.model_copy(update={"models": [
        m.model_copy(update={"pin": True}) for m in config.models]})
    bad = bad.model_copy(update={"devices": {"cpu": bad.devices["cpu"].model_copy(
        update={"memory_budget": 50 << 20})}})

    async def scenario() -> None:
        supervisor = Supervisor(bad)
        await supervisor.start()
        try:
            await asyncio.wait_for(supervisor.refused.wait(), 120)
            assert supervisor.config_error is not None
            assert await supervisor.wait_up(0) is None
        finally:
            await supervisor.stop()

    asyncio.run(scenario())


def test_a_quarantine_is_lifted_by_the_workers_report_of_an_operators_load(
        tmp_path: Path) -> None:
    """The supervisor owns quarantine: it hands it to the worker, and lifts it when the worker
    reports on its control pipe that an operator's load succeeded (`operator_loaded`), whoever
    relayed that load; here no front app does, only the supervisor's own client."""
    config = load_config(fake_config(tmp_path))
    reason = "engine crashed: SIGILL while serving chat"

    async def scenario() -> None:
        supervisor = Supervisor(config)
        # as three crashes within crash_window_s leave it
        supervisor.hold("gen", crashes.judge([0.0, 1.0, 2.0], 300.0), reason)
        await supervisor.start()
        try:
            worker = await supervisor.wait_up(120)
            assert worker is not None
            status, body = await worker.call("GET", "/v1/residency")
            states = {m["name"]: m["state"] for m in json.loads(body)["models"]}
            assert status == 200 and states["gen"] == "failed"  # the worker was handed it
            status, _ = await worker.call("POST", "/v1/residency/emb/load")
            assert status == 200
            assert supervisor.quarantined == {"gen": reason}  # another model's load
            status, body = await worker.call("POST", "/v1/residency/gen/load")
            assert status == 200, body
            # The report was written before that answer: the supervisor has read it by the
            # time any later answer from the worker comes back.
            status, _ = await worker.call("GET", "/healthz")
            assert status == 200
            assert supervisor.quarantined == {}
        finally:
            await supervisor.stop()

    asyncio.run(scenario())


def test_a_wedged_scheduler_is_restarted_and_only_the_hung_load_is_charged(
        tmp_path: Path) -> None:
    """Ollama #17408's lesson (issue 32): /healthz answered while the scheduler was stuck. Here
    a fake load that never returns holds its device's lock past load_timeout_s while a chat
    request runs: the deep probe says wedged, the worker is killed and replaced, the hung model
    alone is charged (not the generation that happened to run), and the others answer again."""
    config = load_config(fake_config(
        tmp_path, fake_model("hung", source="fake:16MiB?load_s=3600"), load_timeout_s=1.0))

    async def scenario() -> None:
        supervisor = Supervisor(config, ping_s=0.2, misses=1000)  # only the deep probe kills
        await supervisor.start()
        try:
            worker = await supervisor.wait_up(120)
            assert worker is not None
            chat = {"model": "gen", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "@@sleep=60"}]}
            running = asyncio.create_task(worker.call(
                "POST", "/v1/chat/completions", json.dumps(chat).encode()))
            hung = asyncio.create_task(worker.call(
                "POST", "/v1/embeddings", json.dumps({"model": "hung", "input": "x"}).encode()))
            crash = await asyncio.wait_for(asyncio.shield(worker.dead), 60)
            assert crash is not None
            assert crash.cause == "hung past load_timeout_s"
            assert crash.charged == ("hung",)  # not gen, whose request was running
            assert "gen" in {r.model for r in crash.running.values()}
            for task in (running, hung):
                with contextlib.suppress(Exception):
                    await task
            replacement = await supervisor.wait_up(120)
            assert replacement is not None and replacement.pid != worker.pid
            body = json.dumps({"model": "emb", "input": "x"}).encode()
            status, _ = await replacement.call("POST", "/v1/embeddings", body)
            assert status == 200
            status, text = await replacement.call("GET", "/internal/liveness")
            assert status == 200 and json.loads(text)["status"] == "ok"
        finally:
            await supervisor.stop()

    asyncio.run(scenario())


def test_runner_deaths_are_kept_for_the_next_worker_as_the_worker_counts_them(
        tmp_path: Path) -> None:
    """The worker reports each runner's death with its verdict (`exit` on the pipe): the
    supervisor keeps the deaths under each name of the load and holds the verdict for the next
    worker (PACKSERVE_DEATHS, PACKSERVE_QUARANTINE); what runs out is dropped from /healthz;
    an operator's load of the load forgets every name of it; a reload verdict (the worker's
    slate was clean: an operator's load had forgotten the deaths) ends what was held; a reload
    of the config forgets the names it removed or gave new weights."""
    config = load_config(fake_config(tmp_path))
    now = [0.0]

    def died(deaths: list[float]) -> crashes.Verdict:
        return crashes.judge(deaths, 300.0)

    async def scenario() -> None:
        supervisor = Supervisor(config, clock=lambda: now[0])
        supervisor._runner_exit("a+b", "SIGKILL", "idle", died([0.0]))
        assert supervisor._ages() == {"a": [0.0], "b": [0.0]} and supervisor._rules() == {}
        now[0] = 10.0
        supervisor._runner_exit("a+b", "SIGKILL", "idle", died([0.0, 10.0]))
        assert supervisor.view()["backing_off"] == {"a": 2.0, "b": 2.0}
        now[0] = 20.0
        assert supervisor.view()["backing_off"] == {} and supervisor._rules() == {}
        now[0] = 30.0
        supervisor._runner_exit("a+b", "SIGSEGV", "serving", died([0.0, 10.0, 30.0]))
        reason = "its engine process died 3 times within crash_window_s, last SIGSEGV while " \
                 "serving"
        assert supervisor.view()["quarantined"] == {"a": reason, "b": reason}
        assert supervisor._rules()["b"] == {"action": "quarantine", "for_s": 300.0,
                                            "reason": reason}
        assert supervisor._ages() == {"a": [30.0, 20.0, 0.0], "b": [30.0, 20.0, 0.0]}
        now[0] = 331.0  # the quarantine has run out: /healthz no longer lists it
        assert supervisor.view()["quarantined"] == {}
        now[0] = 340.0
        supervisor._runner_exit("a+b", "SIGKILL", "idle", died([330.0, 340.0]))
        supervisor._operator_loaded("a+b")
        assert supervisor._ages() == {} and supervisor._rules() == {}
        # an operator's load whose runner died loading: the worker's slate was clean
        supervisor._runner_exit("a+b", "SIGKILL", "idle", died([350.0, 360.0]))
        now[0] = 361.0
        supervisor._runner_exit("a+b", "SIGKILL", "loading", died([361.0]))
        assert supervisor._ages() == {"a": [0.0], "b": [0.0]} and supervisor._rules() == {}
        supervisor.forget(["b"], "a reload")
        assert supervisor._ages() == {"a": [0.0]}

    asyncio.run(scenario())
