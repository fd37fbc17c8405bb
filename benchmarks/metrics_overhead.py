"""How much does metrics collection add to a request? A benchmark, not a test.

Measures, in one run on this machine:
  1. the telemetry work done per request (a start event, an end event, the HTTP response
     counter), timed over many synthetic requests in-process;
  2. the mean latency of single-sentence embedding requests to a real packserve server
     (all-minilm-l6-v2, sequential, over HTTP), started as a subprocess;
and prints the ratio. Run: .venv/bin/python -m benchmarks.metrics_overhead [--requests 200]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from packserve.config import ModelSpec
from packserve.core.backend import LoadSpec
from packserve.core.catalog import DeviceBudget, Entry
from packserve.core.events import RequestEvent, RequestStartEvent
from packserve.core.scheduler import Scheduler
from packserve.metrics.telemetry import Telemetry
from packserve.types import Task


def telemetry_seconds_per_request(n: int) -> float:
    spec = ModelSpec(name="m", tasks=[Task.EMBED], backend="fake", source="fake:1MiB")
    load = LoadSpec(backend="fake", path=Path("fake:1MiB"), device="cpu", context_length=0)
    scheduler = Scheduler([Entry(spec=spec, load=load, bytes_estimated=1 << 20)],
                          [DeviceBudget("cpu", 1 << 30, 0)], factory=None,  # type: ignore[arg-type]
                          probe=None, sinks=())  # type: ignore[arg-type]
    telemetry = Telemetry(scheduler, prices={"cpu": 1.0}, default_price=1.0, currency="EUR")
    start = RequestStartEvent(model="m", task="embed", device="cpu")
    end = RequestEvent(model="m", task="embed", device="cpu", queue_seconds=0.0001,
                       load_seconds=0.0, inference_seconds=0.004, status=200, outcome="ok",
                       prompt_tokens=12, started=True)
    t0 = time.perf_counter()
    for _ in range(n):
        telemetry.on_event(start)
        telemetry.on_event(end)
        telemetry.count_response("/v1/embeddings", 200)
    return (time.perf_counter() - t0) / n


def request_seconds(n: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("packserve")
    server = subprocess.Popen([str(exe), "serve", "--models", "all-minilm-l6-v2", "--port",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=120) as c:
            deadline = time.monotonic() + 180
            while True:
                try:
                    c.get("/healthz")
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            body = {"model": "all-minilm-l6-v2", "input": "a single short sentence"}
            c.post("/v1/embeddings", json=body).raise_for_status()  # load and warm up
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                c.post("/v1/embeddings", json=body).raise_for_status()
                times.append(time.perf_counter() - t0)
        return statistics.mean(times)
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--synthetic", type=int, default=100_000)
    args = parser.parse_args()
    per_request = telemetry_seconds_per_request(args.synthetic)
    latency = request_seconds(args.requests)
    print(f"telemetry work per request: {per_request * 1e6:.1f} µs "
          f"(mean of {args.synthetic} synthetic requests)")
    print(f"embedding request latency:  {latency * 1e3:.2f} ms "
          f"(mean of {args.requests} sequential requests, all-minilm-l6-v2, HTTP)")
    print(f"overhead: {per_request / latency * 100:.2f}% of a request")


if __name__ == "__main__":
    main()
