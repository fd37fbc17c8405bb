"""`python -m benchmarks overhead`: packserve's HTTP API against the same models called directly.

The direct side of MiniLM runs in its own process (`benchmarks.direct`: sentence-transformers),
so both sides pay for their own interpreter and neither steals the other's GIL. The direct side
of SmolLM2 is llama.cpp's own `llama-server` run on the same GGUF (`router.direct_argv`: every
usable core, the catalog's context, its default four slots), the binary packserve's runners
run, driven over HTTP by the same client code as packserve: streamed chats, completion tokens
(the stream's `usage`) over the client's wall time. Rounds alternate packserve and direct (ABAB)
in one run; the figures are medians over rounds and the goals are ratios of those medians.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks import router
from benchmarks.common import (
    CHAT_MODEL,
    EMBED_MODEL,
    Goal,
    Options,
    Report,
    checkout_env,
    median,
    model_path,
    packserve_argv,
    progress,
    ratio,
    run_server,
    write_config,
)
from benchmarks.cpu import CpuSnapshot, profiled, top_frames, worker_pid
from packserve.replay import sentences

CHAT_SLOTS = 4  # parallel slots of the chat model in this bench (the four streams)
N_CTX = 2048  # the catalog's context_length for SmolLM2


class Direct:
    """The direct-call worker process."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "benchmarks.direct"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, env=checkout_env())

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(cmd) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"direct worker died on {cmd['op']}")
        answer: dict[str, Any] = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError(f"direct worker: {answer}")
        return answer

    def close(self) -> None:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.close()  # end of input: the worker exits
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=30)
        self._proc.stdout.close()


def chat_bodies(n: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    return [{"model": CHAT_MODEL, "max_tokens": max_tokens, "temperature": 0, "seed": seed + i,
             "messages": [{"role": "user", "content": s}]}
            for i, s in enumerate(sentences(n, words=16, seed=seed))]


def api_embed_batches(c: httpx.Client, batches: list[list[str]], *, path: str = "/v1/embeddings",
                      model: str = EMBED_MODEL, encoding: str = "float") -> float:
    t0 = time.perf_counter()
    for b in batches:
        c.post(path, json={"model": model, "input": b, "encoding_format": encoding}
               ).raise_for_status()
    return sum(map(len, batches)) / (time.perf_counter() - t0)


async def singles(url: str, texts: list[str], clients: int, path: str = "/v1/embeddings",
                  model: str = EMBED_MODEL) -> float:
    """`clients` concurrent clients, each sending one sentence at a time: sentences/s.

    The clients are aiohttp's, not httpx's: on the same two cores as the server, httpx's
    AsyncClient spent several times aiohttp's CPU per request, CPU the server then lacked.
    `bench overhead` reports what the client spent (`cpu_ms_per_request`)."""
    import aiohttp

    queue = list(reversed(texts))
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while queue:
                text = queue.pop()
                async with session.post(path, json={"model": model, "input": text}) as r:
                    r.raise_for_status()
                    await r.read()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return len(texts) / (time.perf_counter() - t0)


def embedding_passes(c: httpx.Client, model: str = EMBED_MODEL) -> tuple[float, float]:
    """The server's count of embedding forward passes of `model` and their inputs so far (the
    batcher's histogram in /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(c.get("/metrics").text):
        if family.name != "packserve_embedding_batch_inputs":
            continue
        for sample in family.samples:
            suffix = sample.name.removeprefix(family.name)
            if suffix in ("_count", "_sum") and sample.labels.get("model") == model:
                found[suffix] = found.get(suffix, 0.0) + sample.value
    if len(found) < 2:  # the front could not read the worker's metrics: no figure, not 0
        raise RuntimeError(f"/metrics has no packserve_embedding_batch_inputs for {model}")
    return found["_count"], found["_sum"]


def api_chat(c: httpx.Client, bodies: list[dict[str, Any]], concurrency: int) -> float:
    """`bodies` as streamed chats to `c`'s /v1/chat/completions, `concurrency` at a time:
    completion tokens/s as the client sees them (the streams' `usage` over the wall time from
    the first request sent to the last stream's end). packserve and llama-server alike."""
    from concurrent.futures import ThreadPoolExecutor

    def one(body: dict[str, Any]) -> int:
        tokens: int | None = None
        with c.stream("POST", "/v1/chat/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                usage = json.loads(line.removeprefix("data: ")).get("usage")
                if usage:
                    tokens = int(usage["completion_tokens"])
        if tokens is None:
            raise RuntimeError(f"a streamed chat from {c.base_url} ended without its usage")
        return tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, bodies))
    return tokens / (time.perf_counter() - t0)


def profile_api(c: httpx.Client, url: str, front_pid: int, out: Path,
                batches: list[list[str]], single_texts: list[str],
                chat: list[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Each API scenario once more, outside the measured rounds, under py-spy: the top
    functions by self time of the front and of the worker, per scenario."""
    worker = worker_pid(front_pid)
    pids = {"front": front_pid, **({"worker": worker} if worker is not None else {})}
    runs: dict[str, Callable[[], object]] = {
        "batch32": lambda: api_embed_batches(c, batches),
        "single16": lambda: asyncio.run(singles(url, single_texts, 16)),
        "chat1": lambda: api_chat(c, chat, 1),
    }
    tables: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name, go in runs.items():
        with profiled(pids, out / name) as files:
            go()
        tables[name] = {proc: top_frames(path) for proc, path in files.items()}
    return tables


def profile_markdown(profile: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """The profile as Markdown tables: per scenario and process, the top functions."""
    lines = ["py-spy, each API scenario run once more after the measured rounds (self time, "
             "share of the process's samples at 250 Hz; idle threads and waits in epoll left "
             "out):"]
    for scenario, procs in profile.items():
        for proc, rows in procs.items():
            lines += ["", f"`{scenario}`, {proc}:", "", "| share | samples | function |",
                      "|---:|---:|---|"]
            lines += [f"| {r['share']:.1%} | {r['samples']} | `{r['function']}` |" for r in rows]
    return "\n".join(lines)


def run(opts: Options) -> Report:
    rounds = 1 if opts.quick else int(opts.extra.get("rounds", 3))
    n_batches = 2 if opts.quick else 16
    n_singles = 32 if opts.quick else 256
    n_chat, n_chat4, max_tokens = (1, 4, 8) if opts.quick else (4, 8, 64)
    batches = [sentences(32, seed=100 + i) for i in range(n_batches)]
    single_texts = sentences(n_singles, seed=7)
    # The chat model with parallel slots (opt-in, `parallel`): four streams share its steps.
    config = write_config(opts.out / "work" / "overhead.toml", opts,
                          model_extra={CHAT_MODEL: f"parallel = {CHAT_SLOTS}"})
    # And one stream as the catalog serves it by default (one sequence at a time, the prompt
    # read on every core), from a second server that holds only the chat model.
    plain = write_config(opts.out / "work" / "overhead-plain.toml", opts)
    series: dict[str, list[float]] = {k: [] for k in (
        "api_batch32", "api_batch32_base64", "direct_batch32", "api_single16",
        "direct_single_batch32", "direct_single_at_pass", "api_chat1", "api_chat1_plain",
        "direct_chat1", "api_chat4", "direct_chat4")}
    # CPU ms per request of the client, the front, the worker's loop and its engine threads
    cpu: dict[str, list[dict[str, float]]] = {"batch32": [], "single16": [], "chat1": []}
    passes: list[float] = []  # mean inputs per forward pass of the single-sentence clients
    report = Report("overhead")
    profile: dict[str, dict[str, list[dict[str, Any]]]] = {}
    steps = rounds * 11 + 2
    # SmolLM2's direct side: llama-server on the same GGUF (raises Unavailable, saying why)
    direct_chat = router.direct_argv(router.binary(), model_path(CHAT_MODEL, opts), N_CTX,
                                     "--alias", CHAT_MODEL)
    direct = Direct()
    try:
        with progress(opts, "overhead", steps) as advance, run_server(
                packserve_argv("--config", str(config), "--models",
                               f"{EMBED_MODEL},{CHAT_MODEL}"),
                health="/readyz",  # its one-time work done before the second server starts
                log=opts.out / "work" / "overhead-server.log") as server, \
                server.client() as c, run_server(
                    packserve_argv("--config", str(plain), "--models", CHAT_MODEL),
                    health="/readyz",
                    log=opts.out / "work" / "overhead-plain-server.log") as plain_server, \
                plain_server.client() as plain_c, run_server(
                    direct_chat, health="/health",
                    log=opts.out / "work" / "overhead-llama-server.log") as direct_llama, \
                direct_llama.client() as direct_c:
            direct.call(op="load_embed", path=str(model_path(EMBED_MODEL, opts)), max_batch=64)
            # Warm both sides: loads, first-call allocations.
            api_embed_batches(c, batches[:1])
            api_chat(c, chat_bodies(1, 4, 0), 1)
            api_chat(plain_c, chat_bodies(1, 4, 0), 1)
            direct.call(op="embed", batches=batches[:1])
            api_chat(direct_c, chat_bodies(1, 4, 0), 1)
            advance(2, "warm")
            for r in range(rounds):
                cpu0 = CpuSnapshot.take(server.pid)
                series["api_batch32"].append(api_embed_batches(c, batches))
                cpu["batch32"].append(cpu0.per_request_ms(CpuSnapshot.take(server.pid),
                                                          n_batches))
                advance(1, f"round {r + 1}: batch-32 api")
                series["api_batch32_base64"].append(
                    api_embed_batches(c, batches, encoding="base64"))
                advance(1, f"round {r + 1}: batch-32 api, base64")
                d = direct.call(op="embed", batches=batches)
                series["direct_batch32"].append(d["items"] / d["seconds"])
                advance(1, f"round {r + 1}: batch-32 direct")
                cpu0 = CpuSnapshot.take(server.pid)
                count0, inputs0 = embedding_passes(c)
                series["api_single16"].append(asyncio.run(singles(server.url, single_texts, 16)))
                cpu["single16"].append(cpu0.per_request_ms(CpuSnapshot.take(server.pid),
                                                           n_singles))
                count1, inputs1 = embedding_passes(c)
                passes.append((inputs1 - inputs0) / max(1.0, count1 - count0))
                advance(1, f"round {r + 1}: single x16 api")
                d = direct.call(op="embed", batches=[single_texts[i:i + 32]
                                                     for i in range(0, n_singles, 32)])
                series["direct_single_batch32"].append(d["items"] / d["seconds"])
                advance(1, f"round {r + 1}: same sentences, direct batch-32")
                # The engine alone at the pass size packserve's batcher reached: what the
                # passes cost, apart from the HTTP path around them.
                k = max(1, round(passes[-1]))
                d = direct.call(op="embed", batches=[single_texts[i:i + k]
                                                     for i in range(0, n_singles, k)])
                series["direct_single_at_pass"].append(d["items"] / d["seconds"])
                advance(1, f"round {r + 1}: same sentences, direct in passes of {k}")
                bodies1 = chat_bodies(n_chat, max_tokens, 1000 * r)
                cpu0 = CpuSnapshot.take(server.pid)
                series["api_chat1"].append(api_chat(c, bodies1, 1))
                cpu["chat1"].append(cpu0.per_request_ms(CpuSnapshot.take(server.pid), n_chat))
                advance(1, f"round {r + 1}: chat x1 api")
                series["api_chat1_plain"].append(api_chat(plain_c, bodies1, 1))
                advance(1, f"round {r + 1}: chat x1 api, no parallel slots")
                series["direct_chat1"].append(api_chat(direct_c, bodies1, 1))
                advance(1, f"round {r + 1}: chat x1 direct")
                bodies4 = chat_bodies(n_chat4, max_tokens, 1000 * r + 500)
                series["api_chat4"].append(api_chat(c, bodies4, 4))
                advance(1, f"round {r + 1}: chat x4 api")
                series["direct_chat4"].append(api_chat(direct_c, bodies4, 4))
                advance(1, f"round {r + 1}: chat x4 direct")
            if opts.extra.get("profile"):
                profile = profile_api(c, server.url, server.pid, opts.out / "work" / "profile",
                                      batches, single_texts, chat_bodies(n_chat, max_tokens, 9))
    finally:
        direct.close()
    med = {k: median(v) for k, v in series.items()}
    if profile:
        report.notes.append(profile_markdown(profile))
    report.results = {
        "rounds": rounds, "order": "ABAB: packserve then direct, per measurement, per round",
        "sizes": {"batch32_batches": n_batches, "single_requests": n_singles, "clients": 16,
                  "chat_requests_x1": n_chat, "chat_requests_x4": n_chat4,
                  "max_tokens": max_tokens},
        "units": "embeddings: sentences/s; chat: completion tokens/s, streamed, as the "
                 "client sees them",
        "direct": {"embed": "sentence-transformers in its own process (benchmarks.direct)",
                   "chat": " ".join(direct_chat)},
        "per_round": series, "median": med,
        "single16_inputs_per_pass": passes,
        # Where the CPU went, per request (medians over rounds): the benchmark's client (on the
        # server's cores; the direct side has none), the front, the worker's event loop, and
        # the worker's other threads (engine calls). `--profile` adds py-spy's top functions.
        "cpu_ms_per_request": {k: {part: median([r[part] for r in v]) for part in v[0]}
                               for k, v in cpu.items() if v},
        "profile": profile,
        "ratios": {
            "embed_batch32": ratio(med["api_batch32"], med["direct_batch32"]),
            "embed_batch32_base64_vs_float": ratio(med["api_batch32_base64"],
                                                   med["api_batch32"]),
            "embed_single16_vs_direct_batch32": ratio(med["api_single16"],
                                                      med["direct_single_batch32"]),
            # The same gap in two parts: the engine in passes as small as the batcher's, and
            # the HTTP path around them.
            "direct_at_pass_vs_batch32": ratio(med["direct_single_at_pass"],
                                               med["direct_single_batch32"]),
            "embed_single16_vs_direct_at_pass": ratio(med["api_single16"],
                                                      med["direct_single_at_pass"]),
            "chat_1_stream": ratio(med["api_chat1_plain"], med["direct_chat1"]),
            "chat_1_stream_parallel_slots": ratio(med["api_chat1"], med["direct_chat1"]),
            "chat_4_streams": ratio(med["api_chat4"], med["direct_chat4"]),
            # Parallel decode: four concurrent chats against one stream, both through packserve
            # in the same round, and the same for llama-server run directly (its four slots).
            "chat_4_streams_vs_1_stream": ratio(med["api_chat4"], med["api_chat1"]),
            "direct_chat_4_streams_vs_1_stream": ratio(med["direct_chat4"],
                                                       med["direct_chat1"]),
        },
    }
    rt = report.results["ratios"]
    if passes and rt["direct_at_pass_vs_batch32"] and rt["embed_single16_vs_direct_at_pass"]:
        report.notes.append(
            f"16 single-sentence clients: {median(passes):.1f} inputs per forward pass (median "
            f"of rounds); the engine alone in passes of that size reaches "
            f"{rt['direct_at_pass_vs_batch32']:.2f}x its batch-32 throughput, and the API "
            f"{rt['embed_single16_vs_direct_at_pass']:.2f}x of that")
    report.goals = [
        Goal("overhead: batch-32 embeddings, API / direct", rt["embed_batch32"], 0.95, ">="),
        Goal("overhead: batch-32 embeddings, base64 / float, API",
             rt["embed_batch32_base64_vs_float"], 1.0, ">="),
        Goal("overhead: single sentence x16 clients, API / direct batch-32",
             rt["embed_single16_vs_direct_batch32"], 0.8, ">="),
        Goal("overhead: chat tokens/s one stream, API / direct", rt["chat_1_stream"], 0.95,
             ">="),
        Goal(f"overhead: chat tokens/s one stream, API with parallel = {CHAT_SLOTS} / direct",
             rt["chat_1_stream_parallel_slots"], 0.95, ">="),
        Goal("overhead: chat tokens/s four streams, API / direct (no goal set; >= 0.95 shown)",
             rt["chat_4_streams"], 0.95, ">="),
        Goal("overhead: chat tokens/s four concurrent streams / one stream, API",
             rt["chat_4_streams_vs_1_stream"], 2.0, ">="),
    ]
    return report
