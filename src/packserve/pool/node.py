"""One pool replica: a whole packserve node under Ray Serve.

Ray Serve runs one `Node` per replica (packserve.pool.app deploys it). The replica starts a
packserve node, front and worker processes as `packserve serve` runs them (crash containment
included), on loopback and a free port, with its own scheduler on its own device budget, and
relays to it what the entry point sends. Every `stats_period_s` Ray Serve asks it for its
routing stats (`record_routing_stats`): what its node holds, how busy each model is, and what
its node's own dry-run plan would evict to load each model; Ray Serve hands them to the
router in the entry point, so routing needs no round trip per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve

from packserve.api.asgi import error_body
from packserve.api.edge import HOP_RESPONSE
from packserve.config import Config

# The node's front answers /healthz within a second or two of starting; its worker (and the
# pins) may take longer, which /readyz says.
START_S = 120.0
_SERVICE_EWMA = 0.2  # weight of the newest request in a model's mean service time


@dataclass(frozen=True)
class Relay:
    """One client request as the entry point sends it to a replica."""

    method: str
    target: str  # path and query
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes = b""
    model: str = ""  # the model it asks for ("" for a view such as /v1/models)
    replica: str = ""  # send it to this replica only (admin, per-replica views)
    avoid: tuple[str, ...] = ()  # replicas whose node was down for an earlier try


@dataclass(frozen=True)
class ReplicaReply:
    """A node's answer (a stream's first item: the body follows as bytes)."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes = b""
    replica: str = ""
    node_down: bool = False  # the replica lives but its node does not answer


class _RayModel:
    """What Ray Serve's own multiplexing (`router = "ray"`, a bench baseline) holds for a model:
    Ray unloads it by count, least recently used first, whatever its bytes."""

    def __init__(self, node: Node, model: str) -> None:
        self.node, self.model, self.gone = node, model, False

    def __del__(self) -> None:  # Ray Serve's unload hook; also run by the GC, hence `gone`
        if not self.gone:
            self.gone = True
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{self.node.url}/v1/residency/{self.model}/unload", timeout=60)


class Node:
    """A Ray Serve replica that runs a packserve node and relays requests to it."""

    def __init__(self, config_json: str, ray_models: int = 0) -> None:
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        # The cards Ray gave it (`replica_gpus`): its CUDA_VISIBLE_DEVICES, which the node's
        # packserve process inherits, so they are its cuda:0, cuda:1, ...
        self.gpus = [str(g) for g in ray.get_gpu_ids()]
        config = Config.model_validate_json(config_json)
        port = _free_port()
        server = config.server.model_copy(update={
            "host": "127.0.0.1", "port": port, "keys_file": "", "open_to_anyone": False,
            "operator_views": "open", "access_log": False})
        self.config = config.model_copy(update={"server": server})
        self.url = f"http://127.0.0.1:{port}"
        self._dir = Path(tempfile.mkdtemp(prefix="packserve-replica-"))
        path = self._dir / "config.json"
        path.write_text(self.config.model_dump_json(), "utf-8")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "packserve.pool.child", str(path), str(os.getpid())])
        self._client = httpx.AsyncClient(base_url=self.url,
                                         timeout=httpx.Timeout(None, connect=10))
        self._concurrency = {m.name: m.concurrency for m in config.models}
        self._service: dict[str, float] = {}
        self._ray_load = None
        if ray_models:
            async def load(model: str) -> _RayModel:
                await self._client.post(f"/v1/residency/{model}/load")
                return _RayModel(self, model)
            self._ray_load = serve.multiplexed(max_num_models_per_replica=ray_models)(load)
        self._wait_started()

    def _wait_started(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"packserve node of replica {self.replica} exited with "
                                   f"{self._proc.returncode} while starting")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"packserve node of replica {self.replica} did not answer within "
                           f"{START_S:.0f}s")

    # ------------------------------------------------------------------ requests

    async def relay(self, req: Relay) -> ReplicaReply:
        """Send `req` to the node and return its whole answer."""
        await self._multiplexed(req)
        t0 = time.monotonic()
        try:
            r = await self._client.request(req.method, req.target, headers=list(req.headers),
                                           content=req.body)
        except httpx.TransportError as exc:
            return self._down(exc)
        self._served(req.model, time.monotonic() - t0, r.status_code)
        return ReplicaReply(r.status_code, _headers(r), r.content, self.replica)

    def _down(self, exc: Exception) -> ReplicaReply:
        """The answer when the node does not answer (it exited, or is restarting)."""
        rc = self._proc.poll()
        state = f"exited with {rc}" if rc is not None else "not answering"
        body = json.dumps(error_body(
            f"the packserve node of pool replica {self.replica} is {state} "
            f"({type(exc).__name__}); Ray Serve replaces a replica whose node exited",
            "model_unavailable", code="node_unavailable")).encode()
        return ReplicaReply(503, ((b"content-type", b"application/json"), (b"retry-after", b"1")),
                     body, self.replica, node_down=True)

    async def relay_stream(self, req: Relay) -> AsyncIterator[ReplicaReply | bytes]:
        """Send `req` to the node and yield its answer's head, then its body as it comes."""
        await self._multiplexed(req)
        t0 = time.monotonic()
        request = self._client.build_request(req.method, req.target,
                                             headers=list(req.headers), content=req.body)
        try:
            r = await self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            yield self._down(exc)
            return
        try:
            yield ReplicaReply(r.status_code, _headers(r), b"", self.replica)
            async for chunk in r.aiter_raw():
                if chunk:
                    yield chunk
        finally:
            await r.aclose()
        self._served(req.model, time.monotonic() - t0, r.status_code)

    async def _multiplexed(self, req: Relay) -> None:
        if self._ray_load is not None and req.model and req.model in self._concurrency:
            await self._ray_load(req.model)

    def _served(self, model: str, seconds: float, status: int) -> None:
        if model and status == 200:
            old = self._service.get(model)
            self._service[model] = seconds if old is None else \
                old + _SERVICE_EWMA * (seconds - old)

    # ------------------------------------------------------------------ Ray Serve hooks

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router needs, per model this replica serves: state, load, the node's
        dry-run plan (verdict, and the reload seconds and bytes of the victims it names)."""
        residency, plans = await asyncio.gather(
            self._client.get("/v1/residency", timeout=10),
            self._client.get("/v1/residency/plans", timeout=10))
        rows = {m["name"]: m for m in residency.json()["models"]}
        by_label = {name: row for row in rows.values()
                    for name in (row["name"], *row["shares_weights_with"])}
        models: dict[str, dict[str, Any]] = {}
        for plan in plans.json()["plans"]:
            row = rows[plan["model"]]
            victims = [by_label[v.split("+")[0]] for v in plan["victims"]
                       if v.split("+")[0] in by_label]
            models[row["name"]] = {
                "state": row["state"], "concurrency": self._concurrency.get(row["name"], 1),
                "in_flight": row["in_flight"], "queued": row["queued"],
                "bytes": row["bytes_measured"] or row["bytes_estimated"],
                "pinned": row["pinned"], "load_s": row["load_seconds"],
                "service_s": self._service.get(row["name"]), "last_used": row["last_used"],
                "verdict": plan["verdict"],
                "evict_s": sum(v["load_seconds"] or 0.0 for v in victims),
                "evict_bytes": sum(v["bytes_measured"] or v["bytes_estimated"]
                                   for v in victims)}
        devices = residency.json()["devices"]
        free = max((d["capacity_bytes"] - d["used_bytes"] for d in devices), default=0)
        return {"node": self.node, "gpus": self.gpus, "free_bytes": free, "models": models,
                "devices": devices, "at": time.time()}

    async def check_health(self) -> None:
        """Ray Serve replaces a replica whose node has exited."""
        if self._proc.poll() is not None:
            raise RuntimeError(f"packserve node of replica {self.replica} exited with "
                               f"{self._proc.returncode}")

    def __del__(self) -> None:
        """Ray Serve's graceful stop: the node drains (server.drain_s), then exits."""
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.config.server.drain_s + 10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)


def _headers(r: httpx.Response) -> tuple[tuple[bytes, bytes], ...]:
    return tuple((k, v) for k, v in r.headers.raw if k.lower() not in HOP_RESPONSE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
