"""`python -m benchmarks reliability`: what the split into a front process and a worker
process costs, and what it buys, measured side by side on one real server (`packserve serve`)
in one run.

1. Memory: PSS (proportional set size, the sum of `Pss` in /proc/PID/smaps_rollup) of the front
   and of the worker, idle and with every model loaded by one request, while both run. The
   worker alone is what one process holding the models costs; the goal is (front + worker) /
   worker <= 1.10. Pages the two share (libpython, the page cache of .py files) are split
   between them in PSS, so the front's USS (its private pages) is reported too: that is what
   would go away with it.
2. Crash recovery: with MiniLM and SmolLM2 hot, a streaming chat runs and the worker gets
   SIGSEGV after a few tokens. Recovery is the time from the kill to the first 200 from MiniLM
   embeddings (hot before the crash); the goal is <= 5 s + MiniLM's load seconds (its
   /v1/residency load_seconds after recovery), which include importing its engine: a worker
   imports an engine's library in the first load that needs it (the engines' import times in
   a fresh interpreter, measured after the server has stopped, are reported alongside). The
   new worker's own start time comes from the front's log. Two closed
   loops of embedding requests run across the crash; requests sent against requests answered
   (any status) say whether any were lost.
3. The hop: batch-32 embeddings (the sentences `bench overhead` uses) through the front (TCP)
   against straight to the worker's Unix socket, alternating request by request (ABAB, the
   order swapped every pair) in each round; figures are medians over rounds. Also the latency
   added to a single-sentence request (median of the paired differences).
4. Drain: SIGTERM with one chat (max_tokens 64) in flight; seconds until the server process
   exits, against `drain_s`, and whether the chat got its 200.

The server logs at `info` (its default; the worker's start time is read from the front's
"worker N answering after X.XXs" line), so both processes also write uvicorn access lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    CATALOG,
    CHAT_MODEL,
    EMBED_MODEL,
    MIB,
    Goal,
    Options,
    Report,
    Server,
    median,
    packserve_argv,
    progress,
    ratio,
    request_body,
    run_server,
    write_config,
)
from benchmarks.cpu import cpu_seconds
from packserve.replay import sentences

CHAT = "/v1/chat/completions"
EMBED = "/v1/embeddings"
STORY = "Write a very long story about a lighthouse keeper, with many chapters."
KILL_AFTER_TOKENS = 8
RECOVERY_GRACE_S = 5.0  # the goal: recovery <= 5 s + the model's load time
BACKGROUND_CLIENTS = 2
ENGINE_LIBS = ("torch", "llama", "ggml", "onnx")  # the front must map none of these


# ----------------------------------------------------------------------- /proc


def smaps_rollup(pid: int) -> dict[str, int]:
    """The fields of /proc/PID/smaps_rollup, in bytes (Rss, Pss, Private_Dirty, ...)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * 1024
    return out


def process_memory(pid: int) -> dict[str, int]:
    s = smaps_rollup(pid)
    return {"pss_bytes": s.get("Pss", 0), "rss_bytes": s.get("Rss", 0),
            "uss_bytes": s.get("Private_Clean", 0) + s.get("Private_Dirty", 0),
            "pss_anon_bytes": s.get("Pss_Anon", 0), "pss_file_bytes": s.get("Pss_File", 0),
            "swap_pss_bytes": s.get("SwapPss", 0)}


def pss_by_mapping(pid: int, top: int = 8) -> list[tuple[str, int]]:
    """Where `pid`'s PSS sits, by mapped file (shared objects by name; the heap and anonymous
    memory, which hold the Python objects, as one row)."""
    by: dict[str, int] = defaultdict(int)
    name = "[anon]"
    header = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if header.match(line):
            parts = line.split(maxsplit=5)
            path = parts[5].strip() if len(parts) > 5 else ""
            name = ("heap and anonymous (Python objects)" if path in ("", "[heap]")
                    or path.startswith("[anon") else Path(path).name or path)
        elif line.startswith("Pss:"):
            by[name] += int(line.split()[1]) * 1024
    return sorted(by.items(), key=lambda kv: -kv[1])[:top]


def mapped_paths(pid: int) -> set[str]:
    paths: set[str] = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) > 5 and parts[5].startswith("/"):
            paths.add(parts[5].strip())
    return paths


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                for child in (task / "children").read_text().split():
                    out.extend([int(child), *descendants(int(child))])
    return out


# ----------------------------------------------------------------------- the server


def worker_view(c: httpx.Client) -> dict[str, Any]:
    view: dict[str, Any] = c.get("/healthz").json()["worker"]
    return view


def residency_row(c: httpx.Client, name: str) -> dict[str, Any]:
    for row in c.get("/v1/residency").json()["models"]:
        if row["name"] == name:
            return dict(row)
    raise KeyError(name)


def memory_snapshot(server: Server, c: httpx.Client) -> dict[str, Any]:
    """PSS/RSS/USS of the front, the worker and any other process of the server, now. What
    holds the models is the worker and its runners (its child processes); the split's cost is
    the whole server over that."""
    worker_pid = int(worker_view(c)["pid"])
    front = process_memory(server.pid)
    worker = process_memory(worker_pid)
    runners = descendants(worker_pid)
    others = [p for p in descendants(server.pid) if p != worker_pid and p not in runners]

    def pss(pids: list[int]) -> int:
        total = 0
        for p in pids:
            with contextlib.suppress(OSError):
                total += process_memory(p)["pss_bytes"]
        return total

    runners_pss, others_pss = pss(runners), pss(others)
    held = worker["pss_bytes"] + runners_pss
    total = front["pss_bytes"] + held + others_pss
    return {"front": front, "worker": worker, "worker_pid": worker_pid,
            "runners_pss_bytes": runners_pss, "other_processes_pss_bytes": others_pss,
            "total_pss_bytes": total, "total_over_worker": ratio(total, held)}


def mib(n: int) -> float:
    return round(n / MIB, 1)


def _memory_row(label: str, snap: dict[str, Any]) -> list[object]:
    front, worker = snap["front"], snap["worker"]
    return [label, mib(front["pss_bytes"]), mib(front["uss_bytes"]), mib(front["rss_bytes"]),
            mib(worker["pss_bytes"]), mib(worker["rss_bytes"]),
            mib(snap.get("runners_pss_bytes", 0)), mib(snap["total_pss_bytes"]),
            snap["total_over_worker"]]


class Tally:
    """Requests sent and answered (an HTTP response, any status), from any thread, with when
    each was sent and answered (perf_counter)."""

    def __init__(self) -> None:
        self.sent = 0
        self.answered = 0
        self.statuses: dict[int, int] = defaultdict(int)
        self.errors: list[str] = []
        self.spans: list[tuple[float, float, int | None]] = []  # sent, answered/failed, status
        self._lock = threading.Lock()

    def opened(self) -> float:
        with self._lock:
            self.sent += 1
        return time.perf_counter()

    def got(self, t0: float, status: int) -> None:
        with self._lock:
            self.answered += 1
            self.statuses[status] += 1
            self.spans.append((t0, time.perf_counter(), status))

    def failed(self, t0: float, exc: Exception) -> None:
        with self._lock:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            self.spans.append((t0, time.perf_counter(), None))

    def post(self, c: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response | None:
        t0 = self.opened()
        try:
            r = c.post(path, json=body)
        except httpx.TransportError as exc:
            self.failed(t0, exc)
            return None
        self.got(t0, r.status_code)
        return r

    def as_dict(self, t_kill: float) -> dict[str, Any]:
        across = [status for t0, t1, status in self.spans if t0 < t_kill < t1]
        return {"sent": self.sent, "answered": self.answered, "lost": self.sent - self.answered,
                "by_status": {str(k): v for k, v in sorted(self.statuses.items())},
                "sent_before_kill_answered_after": len(across),
                "their_statuses": sorted(str(s) for s in across),
                "transport_errors": self.errors[:10]}


# ----------------------------------------------------------------------- 1. memory


def load_all(c: httpx.Client, models: tuple[str, ...]) -> None:
    for m in models:
        path, body = request_body(m, max_tokens=4)
        c.post(path, json=body).raise_for_status()


# ----------------------------------------------------------------------- 3. the hop


@dataclass
class HopSeries:
    front_batch32: list[float] = field(default_factory=list)  # sentences/s per round
    direct_batch32: list[float] = field(default_factory=list)
    front_single_ms: list[float] = field(default_factory=list)  # median latency per round
    direct_single_ms: list[float] = field(default_factory=list)
    single_diff_ms: list[float] = field(default_factory=list)  # every pair, all rounds
    batch_pair_ratio: list[float] = field(default_factory=list)  # direct s / front s, per pair
    front_cpu_batch_s: float = 0.0  # the front's CPU time over the batch-32 requests it relayed
    front_cpu_single_s: float = 0.0


def _timed_post(c: httpx.Client, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    c.post(EMBED, json=body).raise_for_status()
    return time.perf_counter() - t0


def hop_round(front: httpx.Client, direct: httpx.Client, batches: list[list[str]],
              singles: list[str], series: HopSeries, front_pid: int) -> None:
    """One round: every batch through both paths, then every single sentence through both,
    alternating A/B request by request and swapping who goes first every pair."""
    seconds = {"front": 0.0, "direct": 0.0}
    cpu0 = cpu_seconds(front_pid)
    for i, batch in enumerate(batches):
        body = {"model": EMBED_MODEL, "input": batch}
        order = [("front", front), ("direct", direct)]
        pair: dict[str, float] = {}
        for side, c in order if i % 2 == 0 else reversed(order):
            pair[side] = _timed_post(c, body)
            seconds[side] += pair[side]
        series.batch_pair_ratio.append(pair["direct"] / pair["front"])
    cpu1 = cpu_seconds(front_pid)
    series.front_cpu_batch_s += cpu1 - cpu0
    n = sum(map(len, batches))
    series.front_batch32.append(n / seconds["front"])
    series.direct_batch32.append(n / seconds["direct"])
    lat: dict[str, list[float]] = {"front": [], "direct": []}
    for i, text in enumerate(singles):
        body = {"model": EMBED_MODEL, "input": text}
        order = [("front", front), ("direct", direct)]
        for side, c in order if i % 2 == 0 else reversed(order):
            lat[side].append(_timed_post(c, body) * 1000)
        series.single_diff_ms.append(lat["front"][-1] - lat["direct"][-1])
    series.front_cpu_single_s += cpu_seconds(front_pid) - cpu1
    series.front_single_ms.append(median(lat["front"]))
    series.direct_single_ms.append(median(lat["direct"]))


# ----------------------------------------------------------------------- 2. crash


def _content_tokens(line: str) -> int:
    if not line.startswith("data: {"):
        return 0
    with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
        delta = json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
        return 1 if delta.get("content") else 0
    return 0


def crash_recovery(server: Server, log: Path, log_from: int, *,
                   max_wait_s: float = 300.0) -> dict[str, Any]:
    tally = Tally()
    stop = threading.Event()
    killed = threading.Event()
    t_kill = [0.0]
    probe: dict[str, Any] = {}

    with server.client() as c:
        for m in (EMBED_MODEL, CHAT_MODEL):  # hot (again): one request each
            path, body = request_body(m, max_tokens=2)
            r = tally.post(c, path, body)
            if r is None or r.status_code != 200:
                raise RuntimeError(f"{m} did not answer before the crash")
        before = worker_view(c)
    worker_pid = int(before["pid"])

    def background(seed: int) -> None:  # closed loops of embeddings across the crash
        texts = sentences(64, seed=seed)
        with server.client() as bc:
            i = 0
            while not stop.is_set():
                tally.post(bc, EMBED, {"model": EMBED_MODEL, "input": texts[i % len(texts)]})
                i += 1
                time.sleep(0.01)

    def recovery_probe() -> None:  # from the kill: MiniLM embeddings until the first 200
        killed.wait()
        deadline = time.perf_counter() + max_wait_s
        tries = 0
        with server.client() as pc:
            while time.perf_counter() < deadline:
                tries += 1
                r = tally.post(pc, EMBED, {"model": EMBED_MODEL, "input": "Back already?"})
                if r is not None and r.status_code == 200:
                    probe["recovery_s"] = time.perf_counter() - t_kill[0]
                    break
                time.sleep(0.05)
        probe["tries"] = tries

    threads = [threading.Thread(target=recovery_probe, daemon=True),
               *(threading.Thread(target=background, args=(21 + i,), daemon=True)
                 for i in range(BACKGROUND_CLIENTS))]
    for t in threads:
        t.start()
    stream: dict[str, Any] = {"tokens_before_kill": 0}
    lines: list[str] = []
    body = {"model": CHAT_MODEL, "max_tokens": 512, "temperature": 0.8, "seed": 7,
            "stream": True, "messages": [{"role": "user", "content": STORY}]}
    try:
        with server.client() as c:
            t_sent = tally.opened()
            try:
                with c.stream("POST", CHAT, json=body) as r:
                    tally.got(t_sent, r.status_code)
                    stream["status"] = r.status_code
                    tokens = 0
                    for line in r.iter_lines():
                        if not line:
                            continue
                        lines.append(line)
                        tokens += _content_tokens(line)
                        if tokens >= KILL_AFTER_TOKENS and not killed.is_set():
                            stream["tokens_before_kill"] = tokens
                            t_kill[0] = time.perf_counter()
                            os.kill(worker_pid, signal.SIGSEGV)
                            killed.set()
                    stream["ended_after_kill_s"] = (time.perf_counter() - t_kill[0]
                                                    if killed.is_set() else None)
            except httpx.TransportError as exc:
                tally.failed(t_sent, exc)
                stream["error"] = f"{type(exc).__name__}: {exc}"
            if not killed.is_set():
                raise RuntimeError("the chat stream ended before the worker was killed")
        threads[0].join(max_wait_s + 10)
    finally:
        killed.set()
        stop.set()
        for t in threads:
            t.join(60)
    last_event = next((ln for ln in reversed(lines) if ln.startswith("data: {")), "")
    stream["ended_with_done"] = bool(lines) and lines[-1] == "data: [DONE]"
    stream["error_event"] = last_event[:400] if '"error"' in last_event else None
    if "recovery_s" not in probe:
        raise RuntimeError(f"MiniLM did not answer within {max_wait_s:.0f}s of the crash")

    with server.client() as c:
        after = worker_view(c)
        load_s = float(residency_row(c, EMBED_MODEL)["load_seconds"] or 0.0)
        # SmolLM2 is served again (its first request after the crash loads it).
        t0 = time.perf_counter()
        r = tally.post(c, CHAT, {"model": CHAT_MODEL, "max_tokens": 8, "temperature": 0,
                                 "messages": [{"role": "user", "content": "Hello again."}]})
        chat_after = {"status": None if r is None else r.status_code,
                      "seconds": time.perf_counter() - t0}
    text = log.read_bytes()[log_from:].decode("utf-8", errors="replace")
    starts = {int(g): float(s) for g, s in
              re.findall(r"worker (\d+) answering after ([0-9.]+)s", text)}
    crashes = [json.loads(ln) for ln in text.splitlines()
               if ln.startswith("{") and '"kind": "crash"' in ln]
    return {"worker_before": before, "worker_after": after, "stream": stream,
            "recovery_s": probe["recovery_s"], "probe_requests": probe.get("tries"),
            "minilm_load_s": load_s,
            "worker_start_s": starts.get(int(after["generation"])),
            "first_worker_start_s": starts.get(int(before["generation"])),
            "crash_event": crashes[-1] if crashes else None,
            "chat_after_recovery": chat_after, "requests": tally.as_dict(t_kill[0])}


# ----------------------------------------------------------------------- 4. drain


def drain(server: Server, drain_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"drain_s": drain_s}
    done: dict[str, Any] = {}
    t_term = [0.0]

    def chat() -> None:
        with server.client() as c:
            try:
                r = c.post(CHAT, json={"model": CHAT_MODEL, "max_tokens": 64, "temperature": 0,
                                       "messages": [{"role": "user", "content": STORY}]})
            except httpx.TransportError as exc:
                done["error"] = f"{type(exc).__name__}: {exc}"
                return
            done["status"] = r.status_code
            done["answered_after_sigterm_s"] = (time.perf_counter() - t_term[0]
                                                if t_term[0] else None)
            if r.status_code == 200:
                data = r.json()
                done["completion_tokens"] = data["usage"]["completion_tokens"]
                done["finish_reason"] = data["choices"][0]["finish_reason"]

    with server.client() as c:
        residency_row(c, CHAT_MODEL)  # answering
        thread = threading.Thread(target=chat, daemon=True)
        thread.start()
        deadline = time.perf_counter() + 60
        while residency_row(c, CHAT_MODEL)["in_flight"] < 1:
            if time.perf_counter() > deadline or not thread.is_alive():
                raise RuntimeError("the drain's chat was never seen in flight")
            time.sleep(0.01)
        t_term[0] = time.perf_counter()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        # While draining: not ready, and a new request is refused with 503 + Retry-After.
        try:
            ready = c.get("/readyz")
            r = c.post(EMBED, json={"model": EMBED_MODEL, "input": "Too late?"})
            out["during_drain"] = {"readyz": ready.status_code, "new_request": r.status_code,
                                   "retry_after": r.headers.get("retry-after")}
        except httpx.TransportError as exc:
            out["during_drain"] = {"error": f"{type(exc).__name__}: {exc}"}
    rc: int | None = None
    with contextlib.suppress(subprocess.TimeoutExpired):
        rc = server.proc.wait(timeout=drain_s + 60)
    out["exit_s"] = time.perf_counter() - t_term[0]
    out["exit_code"] = rc
    thread.join(30)
    out["in_flight_chat"] = done
    return out


# ----------------------------------------------------------------------- engine imports


AT_REST_MIB = 80  # issue 13's goal: a llama-only server idle, all its processes, PSS
AT_REST_HEALTHZ_S = 1.5  # and /healthz answering after a start with a populated data dir


def at_rest(config: Path, log: Path) -> dict[str, Any]:
    """A server with only the llama.cpp chat model, started on a data dir that already holds
    what a first start prepares: seconds from spawn to /healthz (polled every 0.1 s), and the
    PSS of every one of its processes once the worker is up, with no model loaded."""
    argv = packserve_argv("--config", str(config), "--models", CHAT_MODEL)
    with run_server(argv, health="/readyz", log=log):
        pass  # the first start: facts read and cached, files assembled
    t0 = time.perf_counter()
    with run_server(argv, health="/healthz", log=log) as server, server.client() as c:
        healthz_s = time.perf_counter() - t0
        deadline = time.monotonic() + 120
        while c.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # let the idle worker settle
        snap = memory_snapshot(server, c)
    return {"model": CHAT_MODEL, "healthz_s": healthz_s, "idle": snap}


def engine_import_seconds() -> dict[str, float]:
    """Seconds a fresh interpreter takes to import each engine's library, in order: the part
    of a model's first load_seconds in a new worker that is the engine's import."""
    from packserve import backends

    libraries = dict.fromkeys(backends.get(n).library for n in backends.names())
    libraries.pop("", None)
    code = ("import importlib, json, sys, time\nout = {}\nfor m in sys.argv[1:]:\n"
            "    t = time.perf_counter()\n    importlib.import_module(m)\n"
            "    out[m] = time.perf_counter() - t\nprint(json.dumps(out))")
    done = subprocess.run([sys.executable, "-c", code, *libraries], capture_output=True,
                          text=True, check=True, timeout=600)
    seconds: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return seconds


# ----------------------------------------------------------------------- the scenario


def run(opts: Options) -> Report:
    from packserve.config import ServerConfig

    quick = opts.quick
    models = (EMBED_MODEL, CHAT_MODEL) if quick else CATALOG
    rounds = 1 if quick else int(opts.extra.get("rounds", 3))
    n_batches, n_singles = (2, 8) if quick else (16, 64)
    batches = [sentences(32, seed=100 + i) for i in range(n_batches)]
    singles = sentences(n_singles, seed=7)
    drain_s = float(ServerConfig().drain_s)
    config = write_config(opts.out / "work" / "reliability.toml", opts, log_level="info")
    log = opts.out / "work" / "reliability-server.log"
    log_from = log.stat().st_size if log.exists() else 0
    report = Report("reliability")
    series = HopSeries()
    with progress(opts, "reliability", 2 + rounds + 2) as advance, run_server(
            packserve_argv("--config", str(config), "--models", ",".join(models)),
            health="/readyz", log=log) as server, server.client() as c:
        time.sleep(1.0)  # let the idle worker settle
        idle = memory_snapshot(server, c)
        advance(1, "idle memory")
        load_all(c, models)
        time.sleep(1.0)
        loaded = memory_snapshot(server, c)
        front_top = pss_by_mapping(server.pid)
        engines_in_front = sorted(p for p in mapped_paths(server.pid)
                                  if any(k in Path(p).name.lower() for k in ENGINE_LIBS))
        advance(1, "memory, all loaded")

        socket_path = environ(loaded["worker_pid"])["PACKSERVE_WORKER_SOCKET"]
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path),
                          base_url="http://packserve-worker", timeout=300) as direct:
            for cl in (c, direct):  # warm both paths
                _timed_post(cl, {"model": EMBED_MODEL, "input": batches[0]})
                _timed_post(cl, {"model": EMBED_MODEL, "input": singles[0]})
            for r in range(rounds):
                hop_round(c, direct, batches, singles, series, server.pid)
                advance(1, f"hop round {r + 1}")

        crash = crash_recovery(server, log, log_from)
        advance(1, "crash and recovery")
        drained = drain(server, drain_s)
        advance(1, "drain")
    rest = at_rest(config, log)
    imports = engine_import_seconds()  # with the server gone: a quiet machine

    # ---- figures
    front_b, direct_b = median(series.front_batch32), median(series.direct_batch32)
    hop_ratio = ratio(front_b, direct_b)  # ratio of medians, as `bench overhead` reports
    round_ratios = [f / d for f, d in zip(series.front_batch32, series.direct_batch32,
                                          strict=True)]
    added_ms = median(series.single_diff_ms)
    front_cpu_batch_ms = series.front_cpu_batch_s * 1000 / (rounds * n_batches)
    front_cpu_single_ms = series.front_cpu_single_s * 1000 / (rounds * n_singles)
    recovery_s = float(crash["recovery_s"])
    recovery_ratio = recovery_s / (RECOVERY_GRACE_S + crash["minilm_load_s"])
    req = crash["requests"]
    answered_ratio = ratio(req["answered"], req["sent"])
    inflight_ok = 1.0 if drained["in_flight_chat"].get("status") == 200 else 0.0
    exit_ratio = drained["exit_s"] / drain_s if drain_s else None

    mem_rows: list[list[object]] = []
    for label, snap in (("idle (no model loaded)", idle),
                        (f"{len(models)} models loaded", loaded)):
        mem_rows.append(_memory_row(label, snap))
    mem_rows.append(_memory_row(f"idle, {CHAT_MODEL} only (restart)", rest["idle"]))
    dd = drained.get("during_drain", {})
    fig_rows: list[list[object]] = [
        ["crash: kill -> first 200 from MiniLM (s)", round(recovery_s, 2)],
        ["crash: new worker's own start, spawn -> answering (s)", crash["worker_start_s"]],
        ["crash: first worker's start, for comparison (s)", crash["first_worker_start_s"]],
        ["crash: MiniLM load_seconds after recovery (s)", round(crash["minilm_load_s"], 2)],
        ["crash: engine imports in a fresh interpreter (s)",
         ", ".join(f"{k} {v:.2f}" for k, v in imports.items())],
        ["crash: stream ended (error event) after the kill (s)",
         None if crash["stream"].get("ended_after_kill_s") is None
         else round(crash["stream"]["ended_after_kill_s"], 3)],
        ["crash: requests sent / answered (any status)", f"{req['sent']} / {req['answered']}"],
        ["crash: requests sent before the kill and answered after",
         f"{req['sent_before_kill_answered_after']} ({', '.join(req['their_statuses'])})"],
        ["crash: answers by status", ", ".join(f"{k}: {v}" for k, v in req["by_status"].items())],
        ["hop: batch-32 sentences/s, front / direct",
         f"{front_b:.0f} / {direct_b:.0f}"],
        ["hop: batch-32 front / direct, per round; median of per-batch pairs",
         ", ".join(f"{x:.3f}" for x in round_ratios)
         + f"; {median(series.batch_pair_ratio):.3f}"],
        ["hop: single sentence median ms, front / direct",
         f"{median(series.front_single_ms):.2f} / {median(series.direct_single_ms):.2f}"],
        ["hop: added latency per request (ms, median of paired differences)",
         round(added_ms, 2)],
        ["hop: the front's CPU ms per relayed request, batch-32 / single",
         f"{front_cpu_batch_ms:.2f} / {front_cpu_single_ms:.2f}"],
        [f"at rest: spawn -> /healthz 200, {CHAT_MODEL} only, restart (s)",
         round(rest["healthz_s"], 2)],
        ["drain: SIGTERM -> process exit (s)", round(drained["exit_s"], 2)],
        ["drain: in-flight chat status, tokens",
         f"{drained['in_flight_chat'].get('status')}, "
         f"{drained['in_flight_chat'].get('completion_tokens')}"],
        ["drain: /readyz, new request, Retry-After while draining",
         f"{dd.get('readyz')}, {dd.get('new_request')}, {dd.get('retry_after')}"
         if "error" not in dd else dd["error"]],
    ]
    report.results = {
        "models": list(models),
        "memory": {"idle": idle, "loaded": loaded,
                   "front_pss_by_mapping": [{"mapping": k, "pss_bytes": v}
                                            for k, v in front_top],
                   "engine_libraries_mapped_by_front": engines_in_front,
                   "total_over_total_minus_front_uss": ratio(
                       loaded["total_pss_bytes"],
                       loaded["total_pss_bytes"] - loaded["front"]["uss_bytes"])},
        "crash": {**crash, "engine_import_s": imports,
                  "recovery_over_5s_plus_load": recovery_ratio},
        "hop": {"rounds": rounds, "batch32_batches": n_batches, "single_requests": n_singles,
                "order": "ABAB request by request, first side swapped every pair",
                "direct": "httpx over the worker's Unix socket (keep-alive); the front opens "
                          "one Unix connection per request",
                "per_round": {k: list(v) for k, v in vars(series).items()
                              if isinstance(v, list)
                              and k not in ("single_diff_ms", "batch_pair_ratio")},
                "front_cpu_ms_per_batch32_request": front_cpu_batch_ms,
                "front_cpu_ms_per_single_request": front_cpu_single_ms,
                "front_batch32_per_s": front_b, "direct_batch32_per_s": direct_b,
                "ratio": hop_ratio, "round_ratios": round_ratios,
                "median_of_round_ratios": median(round_ratios),
                "median_of_paired_batch_ratios": median(series.batch_pair_ratio),
                "added_latency_ms": added_ms},
        "drain": drained,
        "at_rest": rest,
        "tables": [
            {"columns": ["when", "front PSS MiB", "front USS MiB", "front RSS MiB",
                         "worker PSS MiB", "worker RSS MiB", "runners PSS MiB", "total PSS MiB",
                         "total / (worker + runners)"],
             "rows": mem_rows},
            {"columns": ["figure", "value"], "rows": fig_rows},
            {"columns": ["front PSS by mapping", "MiB"],
             "rows": [[k, mib(v)] for k, v in front_top]},
        ],
    }
    report.goals = [
        Goal("reliability: PSS with every model loaded, the whole server / (worker + runners)",
             loaded["total_over_worker"], 1.10, "<="),
        Goal(f"reliability: recovery after SIGSEGV / ({RECOVERY_GRACE_S:.0f} s + MiniLM load s)",
             recovery_ratio, 1.0, "<="),
        Goal("reliability: requests answered / sent across the crash", answered_ratio, 1.0,
             ">="),
        Goal("reliability: batch-32 embeddings/s, through the front / straight to the worker",
             hop_ratio, 0.95, ">="),
        Goal("reliability: drain, SIGTERM to exit / drain_s", exit_ratio, 1.0, "<="),
        Goal("reliability: drain, in-flight requests answered 200 / in flight", inflight_ok,
             1.0, ">="),
        Goal(f"at rest: idle PSS of a {CHAT_MODEL}-only server, all processes / "
             f"{AT_REST_MIB} MiB", rest["idle"]["total_pss_bytes"] / (AT_REST_MIB * MIB), 1.0,
             "<="),
        Goal(f"at rest: spawn -> /healthz after a restart / {AT_REST_HEALTHZ_S} s",
             rest["healthz_s"] / AT_REST_HEALTHZ_S, 1.0, "<="),
    ]
    report.notes += [
        "PSS splits the pages the front and the worker share (libpython, shared objects, page "
        "cache) between them, so the worker's PSS alone is a little under what one process "
        "holding the models would cost; the front's USS is what would go away with it.",
        f"front maps no engine library: "
        f"{'yes' if not engines_in_front else 'NO: ' + ', '.join(engines_in_front)}",
        "logging at info (the default): both processes write uvicorn access lines.",
    ]
    return report
