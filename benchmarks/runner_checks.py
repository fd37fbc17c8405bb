"""Measurements of llama-server runners that docs/engines.md quotes.

    .venv/bin/python -m benchmarks.runner_checks drift    # greedy answers: together vs alone
    .venv/bin/python -m benchmarks.runner_checks start    # where a runner's start goes
    .venv/bin/python -m benchmarks.runner_checks embed    # MiniLM's runner: bytes, a rerank
    .venv/bin/python -m benchmarks.runner_checks warm     # the warm tier: bytes, release, restore
    .venv/bin/python -m benchmarks.runner_checks contention [NAME=VALUE ...]
                                              # two busy runners on the same cores
    .venv/bin/python -m benchmarks.runner_checks load-modes  # Q4_0: mapped, read, no repack
    .venv/bin/python -m benchmarks.runner_checks sleep   # each warm state, per quantisation
    .venv/bin/python -m benchmarks.runner_checks patch-cost BASELINE  # the sleep patch's cost

`drift`: SmolLM2 in one runner with four slots; eight prompts answered alone (greedy, 48
tokens), then three times four at once; how many answers are identical, with the shared cache
and with a cache per slot. `contention`: two runners of SmolLM2 (every core each), three chats
of 128 tokens each, alone and both at once, in each environment given (a variable set for the
runners: `OMP_WAIT_POLICY=passive`, `GOMP_SPINCOUNT=10000`; `threads=1`, the runners' thread
count, every core by default; `turns`, each chat held as the server holds a request, so that the
runners take turns (backends.runner.Turns); an empty argument, nothing set; default:
nothing set, OMP_WAIT_POLICY=passive, then turns). `load-modes`: llama-server alone with a
runner's arguments on Llama-3.2-1B's and 3B's shapes in Q4_0 (random weights,
`scripts/gpu/tiny_models.py`, in ~/.cache/packserve/random-models), the file mapped, read into
memory (`--load-mode none`) and mapped without repacking (`--no-repack`): its resident set
after a 200-token prompt and 32 tokens, and llama.cpp's own prefill and decode rates (docs/
tuning.md). `sleep`: per quantisation (the default catalog's SmolLM2 Q4_1 and Gemma Q4_K_M,
Llama-3.2-1B's shape in Q8_0 and Q4_0, the Q4_0 both mapped and read as packserve reads it),
what a runner holds hot (after an answer), with its file's pages given back (mapped files) and
asleep (llama-server's sleeping state), and the seconds of a restore, a wake and a new runner,
each from the page cache (docs/gpu.md, "The warm tier on a GPU"). `patch-cost`: what the
sleep patch costs a request (it counts every request that uses the model, under the task
queue's mutex): SmolLM2 in a runner of setup's llama-server against one of BASELINE, a
llama-server built from the same source, flags and other patches without
scripts/patches/llama-server-sleep.patch (docs/reliability.md says how to build it), five rounds
alternating the two, each in fresh processes; as the client sees them, the milliseconds of a
token count (/tokenize) and of a one-token completion one at a time, the requests/s of four
clients at once, and the tokens/s of a 128-token greedy stream. Prints what it measured;
asserts nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packserve import backends
from packserve.backends.llama_server import LlamaServerBackend
from packserve.config import ModelSpec, load_config
from packserve.core.backend import GenerationParams, Message
from packserve.sources import resolve_source

PROMPTS = ["Count from 2 to 7.", "Name three colours.", "What is the capital of France?",
           "Write a haiku about rain.", "Explain gravity in one sentence.", "List four fruits.",
           "Say hello in Spanish.", "What is 12 times 3?"]


def catalog_weights(name: str, folder: Path) -> tuple[ModelSpec, Path]:
    """A default-catalog entry and the file its engine serves (MiniLM converted to GGUF)."""
    spec = next(m for m in load_config(None).models if m.name == name)
    path = resolve_source(spec.source, base_dir=folder, models_dir=folder / "models",
                          roots=None)
    convert = backends.get(spec.backend).convert
    return spec, convert(path, folder / "models", None) if convert is not None else path


def runner(per_slot: bool = False, parallel: int = 4, threads: int = 0) -> LlamaServerBackend:
    spec = next(m for m in load_config(None).models if m.name == "smollm2-135m-instruct")
    folder = Path(tempfile.mkdtemp())
    path = resolve_source(spec.source, base_dir=folder, models_dir=folder, roots=None)
    engine = backends.get("llama-server")
    backend = engine.build(engine.load_spec(path, "cpu", 2048, 64, {}, threads=threads,
                                            parallel=parallel, cache_per_slot=per_slot))
    assert isinstance(backend, LlamaServerBackend)
    backend.load()
    return backend


def drift() -> None:
    greedy = GenerationParams(max_tokens=48, temperature=0.0)
    chats = [[Message(role="user", content=p)] for p in PROMPTS]
    for per_slot in (False, True):
        backend = runner(per_slot)
        try:
            def answer(chat: list[Message], b: LlamaServerBackend = backend) -> str:
                return b.chat(chat, greedy).text

            alone = [answer(c) for c in chats]
            same = total = 0
            for _ in range(3):
                with ThreadPoolExecutor(4) as pool:
                    together = list(pool.map(answer, chats))
                same += sum(a == t for a, t in zip(alone, together, strict=True))
                total += len(chats)
            cache = "a cache per slot" if per_slot else "one shared cache"
            print(f"{cache}: {same}/{total} answers identical to the lone answer; "
                  f"PSS {backend.weight_bytes() / 2**20:.0f} MiB")
        finally:
            backend.unload()


def contention() -> None:
    chat = [Message(role="user", content="Write a long story about a dragon.")]
    params = GenerationParams(max_tokens=128, temperature=0.0)

    def rate(backend: LlamaServerBackend, out: list[float], turns: bool) -> None:
        t0, tokens = time.perf_counter(), 0
        for _ in range(3):
            # each chat as the server would hold it: due in 4 s (chat's SLO) when turns are on
            with backend.working(time.monotonic() + 4.0, 4.0) if turns \
                    else contextlib.nullcontext():
                tokens += backend.chat(chat, params).completion_tokens
        out.append(tokens / (time.perf_counter() - t0))

    settings = sys.argv[2:] or ["", "OMP_WAIT_POLICY=passive", "turns"]
    for setting in settings:
        for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
            os.environ.pop(name, None)
        cores = 0
        name, _, value = setting.partition("=")
        turns = setting == "turns"
        if name == "threads" or turns:
            cores = int(value or 0)
        elif setting:
            os.environ[name] = value
        pair = [runner(parallel=1, threads=cores), runner(parallel=1, threads=cores)]
        try:
            alone: list[float] = []
            rate(pair[0], alone, turns)
            both: list[float] = []
            threads = [threading.Thread(target=rate, args=(b, both, turns)) for b in pair]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            print(f"{setting or '(llama.cpp default)'}: alone {alone[0]:.0f} "
                  f"tokens/s; two at once {' + '.join(f'{r:.0f}' for r in both)} tokens/s")
        finally:
            for b in pair:
                b.unload()


def start() -> None:
    """Where a runner's start goes, per default-catalog GGUF: seconds from spawn to /health
    200 (what a switch waits for), with llama-server's trial load that fits the context to
    free memory (`--fit on`, its default) and without (packserve's), and seconds from SIGTERM
    to exit; the median of three each."""
    import statistics
    import subprocess

    from packserve.backends.llama_server import binary
    from packserve.backends.runner import UnixHTTP

    folder = Path(tempfile.mkdtemp())
    for name in ("all-minilm-l6-v2", "smollm2-135m-instruct", "gemma-3-270m"):
        spec, path = catalog_weights(name, folder)
        mode = ["--embeddings", "--ctx-size", "1024"] if "embed" in spec.backend else \
            ["--ctx-size", "2048", "--kv-unified", "--jinja", "--cache-ram", "0"]
        for fit in ("on", "off"):
            ready, exits = [], []
            for _ in range(3):
                sock = folder / "runner.sock"
                sock.unlink(missing_ok=True)
                t0 = time.perf_counter()
                proc = subprocess.Popen(
                    [str(binary()), "--model", str(path), "--host", str(sock), "--parallel",
                     "4", "--no-webui", "--no-slots", "--offline", "--fit", fit,
                     "--log-verbosity", "2", *mode], stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)
                while True:
                    with contextlib.suppress(OSError):
                        conn = UnixHTTP(str(sock), timeout=5)
                        conn.request("GET", "/health")
                        if conn.getresponse().status == 200:
                            break
                    time.sleep(0.005)
                ready.append(time.perf_counter() - t0)
                t1 = time.perf_counter()
                proc.terminate()
                proc.wait()
                exits.append(time.perf_counter() - t1)
            print(f"{name}: --fit {fit}: ready in {statistics.median(ready):.3f} s, exits in "
                  f"{statistics.median(exits):.3f} s")


def embed() -> None:
    """MiniLM's embedding runner: resident MiB after its load and after long inputs (its
    compute buffers, touched by requests), and the median time of a rerank of 16 documents."""
    import statistics

    from packserve.replay import sentences

    folder = Path(tempfile.mkdtemp())
    spec, path = catalog_weights("all-minilm-l6-v2", folder)
    engine = backends.get(spec.backend)
    backend = engine.build(engine.load_spec(path, "cpu", 256, 64, {}))
    backend.load()
    try:
        loaded = backend.weight_bytes()
        docs = sentences(16, words=40, seed=3)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            backend.rerank("what is it", docs)
            times.append(time.perf_counter() - t0)
        backend.embed(["word " * 250] * 8)
        print(f"after load {loaded / 2**20:.0f} MiB; after long inputs "
              f"{backend.weight_bytes() / 2**20:.0f} MiB; rerank of 16 documents "
              f"{statistics.median(times) * 1000:.0f} ms")
    finally:
        backend.unload()


def warm() -> None:
    """The runners' warm tier, per default-catalog GGUF: resident MiB hot (after an answer) and
    warm, seconds to release and to restore the weights' pages, and to start a runner anew
    (spawn to serving, as a cold load does); the median of three each."""
    import statistics

    from packserve.backends.llama_server import RunnerBackend

    folder = Path(tempfile.mkdtemp())
    for name in ("all-minilm-l6-v2", "smollm2-135m-instruct", "gemma-3-270m"):
        spec, path = catalog_weights(name, folder)
        engine = backends.get(spec.backend)
        starts, releases, restores, hot, warm_bytes = [], [], [], [], []
        for _ in range(3):
            backend = engine.build(engine.load_spec(path, "cpu", spec.context_length or 2048,
                                                    64, {}))
            assert isinstance(backend, RunnerBackend)
            t0 = time.perf_counter()
            backend.load()
            starts.append(time.perf_counter() - t0)
            if "embed" in spec.backend:
                backend.embed(["a sentence to embed"])
            else:
                backend.complete("Once upon a time", GenerationParams(max_tokens=4))
            hot.append(backend.weight_bytes())
            t0 = time.perf_counter()
            assert backend.release_weights()
            releases.append(time.perf_counter() - t0)
            warm_bytes.append(backend.weight_bytes())
            t0 = time.perf_counter()
            backend.restore_weights()
            restores.append(time.perf_counter() - t0)
            backend.unload()
        med = statistics.median
        print(f"{name}: hot {med(hot) / 2**20:.0f} MiB, warm {med(warm_bytes) / 2**20:.0f} MiB; "
              f"release {med(releases) * 1000:.1f} ms, restore {med(restores) * 1000:.1f} ms, "
              f"a new runner {med(starts) * 1000:.0f} ms")


def load_modes() -> None:
    import random

    import httpx

    from benchmarks.common import rss_bytes, run_server
    from benchmarks.sizes import tiny_models
    from packserve.backends.llama_server import binary

    folder = Path.home() / ".cache" / "packserve" / "random-models"
    n = str(len(os.sched_getaffinity(0)))
    for name in ("random-llama-3.2-1b-q4_0", "random-llama-3.2-3b-q4_0"):
        gguf = tiny_models().ensure_real_shape(name, folder, say=print)
        for mode in ([], ["--load-mode", "none"], ["--no-repack"]):
            argv = [str(binary()), "--model", str(gguf), "--host", "127.0.0.1", "--parallel",
                    "1", "--threads", n, "--threads-batch", n, "--no-webui", "--offline",
                    "--fit", "off", "--log-verbosity", "2", "--device", "none", "-c", "2048",
                    *mode]
            with run_server(argv, health="/health") as server, \
                    httpx.Client(base_url=server.url, timeout=600) as c:
                ids = [random.randrange(300, 128256) for _ in range(200)]
                timings = c.post("/completion", json={
                    "prompt": ids, "n_predict": 32, "ignore_eos": True,
                    "cache_prompt": False}).raise_for_status().json()["timings"]
                print(f"{name} {' '.join(mode) or '(mapped)'}: resident "
                      f"{rss_bytes(server.pid) / 2**20:,.0f} MiB, prefill "
                      f"{timings['prompt_per_second']:.1f} tokens/s, decode "
                      f"{timings['predicted_per_second']:.1f} tokens/s")


def sleep() -> None:
    import dataclasses
    import statistics

    from benchmarks.sizes import tiny_models
    from packserve.backends.llama_server import RunnerBackend

    folder = Path(tempfile.mkdtemp())
    randoms = Path.home() / ".cache" / "packserve" / "random-models"
    files = {"smollm2-135m Q4_1": catalog_weights("smollm2-135m-instruct", folder)[1],
             "gemma-3-270m Q4_K_M": catalog_weights("gemma-3-270m", folder)[1]}
    for name in ("random-llama-3.2-1b-q8_0", "random-llama-3.2-1b-q4_0"):
        files[f"llama-3.2-1b {name.rsplit('-', 1)[1].upper()}"] = \
            tiny_models().ensure_real_shape(name, randoms, say=print)
    engine = backends.get("llama-server")
    mib = 2**20
    for label, path in files.items():
        spec = engine.load_spec(path, "cpu", 2048, 64, {})
        modes = [spec.mapped, not spec.mapped] if label.endswith("Q4_0") else [spec.mapped]
        for mapped in modes:
            load = dataclasses.replace(spec, mapped=mapped)
            rows: dict[str, list[float]] = {}
            for round_ in range(4):  # the first reads the file into the page cache: not kept
                backend = engine.build(load)
                assert isinstance(backend, RunnerBackend)
                t0 = time.perf_counter()
                backend.load()
                seen = {"start_s": time.perf_counter() - t0}
                backend.complete("Once upon a time", GenerationParams(max_tokens=4))
                seen["hot"] = backend.weight_bytes()
                if mapped:
                    backend.pages("release")
                    seen["pages"] = backend.weight_bytes()
                    t0 = time.perf_counter()
                    backend.pages("restore")
                    seen["restore_s"] = time.perf_counter() - t0
                assert backend.sleep()
                seen["asleep"] = backend.weight_bytes()
                t0 = time.perf_counter()
                backend.wake()
                seen["wake_s"] = time.perf_counter() - t0
                backend.complete("Once upon a time", GenerationParams(max_tokens=4))
                backend.unload()
                for key, value in seen.items() if round_ else ():
                    rows.setdefault(key, []).append(value)
            med = {k: statistics.median(v) for k, v in rows.items()}
            pages = (f"pages given back {med['pages'] / mib:,.0f} MiB "
                     f"(restore {med['restore_s'] * 1000:.0f} ms), " if mapped else "")
            print(f"{label} {'mapped' if mapped else 'read'}: hot {med['hot'] / mib:,.0f} MiB, "
                  f"{pages}asleep {med['asleep'] / mib:,.0f} MiB; wake "
                  f"{med['wake_s'] * 1000:.0f} ms, a new runner {med['start_s'] * 1000:.0f} ms "
                  f"(wake / new {med['wake_s'] / med['start_s']:.2f})", flush=True)


def patch_cost() -> None:
    import functools
    import statistics

    from packserve.backends.llama_server import BINARY_ENV, binary

    builds = {"with the sleep patch": binary(), "without": Path(sys.argv[2]).resolve()}
    one = GenerationParams(max_tokens=1, temperature=0.0)
    long = GenerationParams(max_tokens=128, temperature=0.0, ignore_eos=True)

    def per_call(call: Callable[[], object], n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        return (time.perf_counter() - t0) / n

    rows: dict[str, dict[str, list[float]]] = {name: {} for name in builds}
    names = list(builds)
    for round_ in range(5):
        for name in names if round_ % 2 == 0 else names[::-1]:
            os.environ[BINARY_ENV] = str(builds[name])
            backend = runner()
            try:
                backend.complete("Once upon a time", one)  # first touch of weights and buffers
                seen = rows[name]
                seen.setdefault("tokenize_ms", []).append(1000 * per_call(
                    functools.partial(backend.count_tokens, ["Once upon a time"]), 200))
                seen.setdefault("complete_ms", []).append(1000 * per_call(
                    functools.partial(backend.complete, "Once upon a time", one), 100))
                t0 = time.perf_counter()
                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(lambda _, b=backend: b.complete("Once upon a time", one),
                                  range(200)))
                seen.setdefault("four_rps", []).append(200 / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                tokens = backend.complete("Once upon a time", long).completion_tokens
                seen.setdefault("stream_tps", []).append(tokens / (time.perf_counter() - t0))
            finally:
                backend.unload()
    os.environ.pop(BINARY_ENV)
    labels = {"tokenize_ms": "a token count, ms", "complete_ms": "a one-token completion, ms",
              "four_rps": "four clients, requests/s", "stream_tps": "128-token stream, tokens/s"}
    med = {name: {k: statistics.median(v) for k, v in seen.items()}
           for name, seen in rows.items()}
    print("| measure | " + " | ".join(names) + " | with / without |")
    print("|---|" + "---:|" * (len(names) + 1))
    for key, label in labels.items():
        a, b = (med[n][key] for n in names)
        print(f"| {label} | {a:.2f} | {b:.2f} | {a / b:.2f} |")
    print("every round:", {n: {k: [round(x, 2) for x in v] for k, v in r.items()}
                           for n, r in rows.items()})


if __name__ == "__main__":
    {"drift": drift, "contention": contention, "start": start, "embed": embed,
     "warm": warm, "load-modes": load_modes, "sleep": sleep,
     "patch-cost": patch_cost}[sys.argv[1]]()
