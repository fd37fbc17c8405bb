"""`python -m benchmarks sizes`: packserve at the sizes people serve (issue 41).

Models of real shape with random weights (`scripts/gpu/tiny_models.py`: Llama-3.2-1B and 3B in
Q4_0 and Q8_0, Llama-3.1-8B in Q4_0), written once into `DATA_DIR/random-models`, each served
alone by a fresh `packserve serve` with an empty footprint store, so that its estimate is the
header's arithmetic and nothing remembered. For each model, context and cache mode:

- the estimate (`bytes_estimated` of `/v1/residency` before the load: the planner's figure
  too) against the runner's resident set (VmRSS) after the load and after a request whose
  prompt fills the context (up to 8k; at 32k and with `--quick`: 256 tokens), and its error;
- what its warm copy keeps (the runner's resident set after an offload, against hot), or that
  it has none (a file read into memory: its offload unloads it);
- what the client waits for one token: hot, after a restore from warm, and after a load from
  the page cache (an unload first), ROUNDS rounds; then once with the file's pages dropped;
- at 2k (1B and 3B) prefill and decode tokens/s beside llama-server run with the runner's own
  arguments (`sizes_mix.versus_direct`).

Then every request switching between the two 3B files against llama.cpp's router at
`--models-max 1`, and the 1B Q8_0, 3B Q8_0 and 8B Q4_0 at 8k competing for 10 GiB
(`sizes_mix.switching`, `sizes_mix.competing`); `--quick` runs both at the 1B's size.

Answers are noise (random weights): requests send token ids and generate with `ignore_eos`.
The random vocabulary loads faster than Llama 3's real one (its pieces are plain). Not here:
`--no-repack` (measured by hand, docs/tuning.md) and the buffers llama.cpp logs at 32k (the
32k rows check the estimate against the resident set after the load).
"""

from __future__ import annotations

import functools
import importlib.util
import random
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from benchmarks import sizes_mix
from benchmarks.common import (
    CHECKOUT,
    GIB,
    MIB,
    Goal,
    Options,
    Report,
    console,
    median,
    packserve_argv,
    rss_bytes,
    run_server,
)
from benchmarks.runner_deaths import find_runner

SCENARIO = "sizes"
# (catalog name of scripts/gpu/tiny_models.py, context, cache): a prompt that fills the context
# up to 8k (8k only for the 1B: prefill is slow on two cores), a short one at 32k; the cache
# "shared" (the default: the slots share one of the context) or "per_slot" (each its own).
# --quick: the 1B Q4_0 at 2k with a short prompt; `--rows caches`: the per-slot and 32k rows.
CACHES = (("random-llama-3.2-1b-q8_0", 2048, "per_slot"),
          ("random-llama-3.2-1b-q8_0", 32768, "shared"),
          ("random-llama-3.2-3b-q4_0", 32768, "shared"))
FULL = (("random-llama-3.2-1b-q4_0", 2048, "shared"), ("random-llama-3.2-1b-q4_0", 8192, "shared"),
        ("random-llama-3.2-1b-q8_0", 2048, "shared"), ("random-llama-3.2-1b-q8_0", 8192, "shared"),
        ("random-llama-3.2-3b-q4_0", 2048, "shared"), ("random-llama-3.2-3b-q8_0", 2048, "shared"),
        ("random-llama-3.1-8b-q4_0", 2048, "shared"), *CACHES)
QUICK = (("random-llama-3.2-1b-q4_0", 2048, "shared"),)
QUICK_PROMPT = 256
LONGEST_FILLED = 8192  # contexts above it get a QUICK_PROMPT: the estimate is checked after load
ROUNDS = 3  # of every first-token wait and of the runs beside llama-server (--quick: 1)
PEER, QUICK_PEER = (256, 64), (64, 16)  # (prompt, decode) tokens beside llama-server
# every request switches between these two (a budget that holds one), against the router
SWITCH = ("random-llama-3.2-3b-q4_0", "random-llama-3.2-3b-q8_0")
QUICK_SWITCH = ("random-llama-3.2-1b-q4_0", "random-llama-3.2-1b-q8_0")
SWITCH_CYCLES = 6  # requests a side each round
# (models, context, budget, requests) competing for one budget; 0: the larger and half the
# smaller estimate
COMPETE = (("random-llama-3.2-1b-q8_0", "random-llama-3.2-3b-q8_0",
            "random-llama-3.1-8b-q4_0"), 8192, 10 << 30, 30)
QUICK_COMPETE = (("random-llama-3.2-1b-q4_0", "random-llama-3.2-1b-q8_0"), 2048, 0, 6)
ESTIMATE_BOUND = 0.10  # the goal: within ±10% of the resident set
WARM_SMALL = 0.20  # a warm copy this small of its hot bytes must restore fast
FIRST_TOKEN_IDS = sizes_mix.FIRST_ID
SHORT_PROMPT = 16  # tokens of the prompts whose first token is timed


@functools.cache
def tiny_models() -> ModuleType:
    """scripts/gpu/tiny_models.py, which is a script beside the GPU check, not a package."""
    path = CHECKOUT / "scripts" / "gpu" / "tiny_models.py"
    spec = importlib.util.spec_from_file_location("tiny_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _row(c: httpx.Client, name: str) -> dict[str, Any]:
    rows = c.get("/v1/residency").raise_for_status().json()["models"]
    row: dict[str, Any] = next(r for r in rows if r["name"] == name)
    return row


def measure(name: str, gguf: Path, context: int, prompt: int, work: Path, *, rounds: int,
            peer: tuple[int, int] | None, peer_rounds: int, cache: str = "shared"
            ) -> dict[str, Any]:
    """One model at one context, on a fresh server with an empty footprint store: the
    estimate against the resident set, what a warm copy keeps, `rounds` rounds of first-token
    waits (hot, restored, loaded from the page cache), one cold load with the file's pages
    dropped, and with `peer` (prompt, decode tokens) prefill and decode beside llama-server
    run with the runner's own arguments."""
    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    config = sizes_mix.config(work / f"{name}-{context}-{cache}.toml", data, [(name, gguf)],
                              context, "auto", "256MiB", cache=cache, log_level="warning")
    rng = random.Random(context)
    vocab = tiny_models().REAL_SHAPES[name].shape.vocab
    ids = [rng.randrange(FIRST_TOKEN_IDS, vocab) for _ in range(prompt)]

    def short() -> list[int]:
        return [rng.randrange(FIRST_TOKEN_IDS, vocab) for _ in range(SHORT_PROMPT)]

    log = work / f"{name}-{context}-{cache}.log"
    with run_server(packserve_argv("--config", str(config)), health="/readyz",
                    log=log) as server, server.client(timeout=1800) as c:
        estimate = int(_row(c, name)["bytes_estimated"])
        t0 = time.monotonic()
        c.post(f"/v1/residency/{name}/load").raise_for_status()
        load_s = time.monotonic() - t0
        runner, _ = find_runner(server.pid, gguf)
        argv = sizes_mix.runner_argv(runner)
        mapped = "--load-mode" not in argv
        after_load = rss_bytes(runner)
        prefill_s = sizes_mix.complete(c, name, ids, 1)
        after_request = rss_bytes(runner)
        warm: int | None = None
        went = ""
        timed: list[dict[str, float | None]] = []
        for _ in range(rounds):
            # each first token from a prompt of its own: the slot's cache holds the last one,
            # and a hot or restored runner would reuse it where a new one cannot
            hot_s = sizes_mix.complete(c, name, short(), 1)
            # a model read into memory (mostly repacked: backends.gguf.maps_weights) has no
            # warm copy, and its offload unloads it
            went = c.post(f"/v1/residency/{name}/offload").raise_for_status().json()["state"]
            if went == "warm" and warm is None:
                warm = rss_bytes(find_runner(server.pid, gguf)[0])
            restore_s = sizes_mix.complete(c, name, short(), 1) if went == "warm" else None
            c.post(f"/v1/residency/{name}/unload").raise_for_status()
            reload_s = sizes_mix.complete(c, name, short(), 1)
            timed.append({"hot_s": hot_s, "restored_s": restore_s,
                          "page_cache_load_s": reload_s})
        c.post(f"/v1/residency/{name}/unload").raise_for_status()
        cached_after_drop = sizes_mix.drop_from_page_cache(gguf)
        cold_s = sizes_mix.complete(c, name, short(), 1)
        direct = None if peer is None else sizes_mix.versus_direct(
            c, name, argv, vocab, peer_rounds, *peer, work / f"{name}-{context}-direct.log")
    resident = max(after_load, after_request)
    return {"model": name, "context": context, "cache": cache, "prompt_tokens": prompt,
            "file_bytes": gguf.stat().st_size, "estimate_bytes": estimate,
            "resident_after_load_bytes": after_load,
            "resident_after_request_bytes": after_request,
            "estimate_over_resident": estimate / resident,
            "mapped": mapped, "offload_to": went, "warm_bytes": warm,
            "warm_keeps": None if warm is None else warm / after_request,
            "load_s": load_s, "prefill_s": prefill_s, "rounds": timed,
            "first_token_hot_s": median([t["hot_s"] for t in timed if t["hot_s"] is not None]),
            "first_token_after_restore_s": None if warm is None else median(
                [t["restored_s"] for t in timed if t["restored_s"] is not None]),
            "first_token_after_page_cache_load_s": median(
                [t["page_cache_load_s"] for t in timed if t["page_cache_load_s"] is not None]),
            "restore_over_load_worst": None if warm is None else max(
                (t["restored_s"] or 0) / (t["page_cache_load_s"] or 1) for t in timed),
            "cached_share_after_drop": cached_after_drop,
            "first_token_after_cold_load_s": cold_s, "versus_direct": direct}


def run(opts: Options) -> Report:
    only = opts.extra.get("rows", "full")
    plan = QUICK if opts.quick else CACHES if only == "caches" else FULL
    work = opts.out / "work" / SCENARIO
    work.mkdir(parents=True, exist_ok=True)
    folder = opts.data_dir / "random-models"
    models = tiny_models()
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    rounds = 1 if opts.quick else ROUNDS
    peer = QUICK_PEER if opts.quick else PEER
    for name, context, cache in plan:
        gguf = models.ensure_real_shape(name, folder, say=console.print)
        prompt = QUICK_PROMPT if opts.quick or context > LONGEST_FILLED else context - 64
        console.print(f"[bold]sizes[/]: {name} at {context} tokens ({cache} cache), a "
                      f"{prompt}-token prompt")
        try:
            row = measure(name, gguf, context, prompt, work, rounds=rounds, cache=cache,
                          peer=peer if (context, cache) == (2048, "shared")
                          and "-8b-" not in name else None, peer_rounds=rounds)
        except Exception as exc:  # one model failing must not lose the others' rows
            failed.append({"model": name, "context": context,
                           "error": f"{type(exc).__name__}: {exc}"})
            console.print(f"[red]  failed: {failed[-1]['error']}[/]")
            continue
        rows.append(row)
        _say(row)
    mixed: dict[str, Any] = {}
    parts = () if only == "caches" else (("switching", _switching), ("competing", _competing))
    for part, go in parts:
        console.print(f"[bold]sizes[/]: {part}")
        try:
            mixed[part] = go(opts, work, folder)
        except Exception as exc:  # reported with the rows, never lost
            failed.append({"model": part, "context": 0,
                           "error": f"{type(exc).__name__}: {exc}"})
            console.print(f"[red]  failed: {failed[-1]['error']}[/]")
    if not rows:
        raise RuntimeError(f"every model failed: {failed}")
    return Report(scenario=SCENARIO, results={"rows": rows, "failed": failed, **mixed},
                  goals=_goals(rows, mixed), notes=[
        "random weights of real shapes (scripts/gpu/tiny_models.py); the random vocabulary "
        "loads faster than Llama 3's real one",
        "resident: the runner's VmRSS (its weights' file pages where it maps the file, its "
        "repacked copies, KV cache and buffers); estimate: bytes_estimated before the first "
        "load, no measurement remembered",
        f"first token: the whole wait of a one-token completion of a {SHORT_PROMPT}-token "
        f"prompt of its own (none in the slot's cache), as the client sees it; {rounds} "
        "round(s) of hot, restored and page-cache load, medians in the row, every round kept; "
        "the cold load after posix_fadvise(DONTNEED) of the file (cached_share_after_drop: "
        "what mincore still found cached)",
        "versus_direct: llama-server run with the runner's own command line (its socket "
        "swapped for a TCP port) on the same file and cores, streamed, rounds alternating",
        *(f"FAILED: {f['model']} at {f['context']}: {f['error']}" for f in failed)])


def _say(row: dict[str, Any]) -> None:
    resident = max(row["resident_after_load_bytes"], row["resident_after_request_bytes"])
    keeps = "no warm copy (read into memory)" if row["warm_keeps"] is None else \
        f"warm keeps {row['warm_keeps']:.0%}"
    restored = "-" if row["first_token_after_restore_s"] is None else \
        f"{row['first_token_after_restore_s']:.2f}"
    console.print(f"  estimate {row['estimate_bytes'] / MIB:,.0f} MiB, resident "
                  f"{resident / MIB:,.0f} MiB ({row['estimate_over_resident']:.2f}); "
                  f"{keeps}; first token hot / restored / page cache / cold "
                  f"{row['first_token_hot_s']:.2f} / {restored} / "
                  f"{row['first_token_after_page_cache_load_s']:.2f} / "
                  f"{row['first_token_after_cold_load_s']:.2f} s")
    direct = row["versus_direct"]
    if direct is not None:
        console.print(f"  beside llama-server with the runner's arguments: prefill "
                      f"{direct['prefill_ratio']:.2f}x, decode {direct['decode_ratio']:.2f}x")


def _switching(opts: Options, work: Path, folder: Path) -> dict[str, Any]:
    pair = QUICK_SWITCH if opts.quick else SWITCH
    files = [(name, tiny_models().ensure_real_shape(name, folder, say=console.print))
             for name in pair]
    vocab = tiny_models().REAL_SHAPES[pair[0]].shape.vocab
    out = sizes_mix.switching(work, files, vocab, 2048, rounds=1 if opts.quick else ROUNDS,
                              cycles=2 if opts.quick else SWITCH_CYCLES)
    console.print(f"  p50 {out['ratio_p50']:.2f}x, p90 {out['ratio_p90']:.2f}x the router's "
                  f"at --models-max 1 ({out['tiers']})")
    return out


def _competing(opts: Options, work: Path, folder: Path) -> dict[str, Any]:
    names, context, budget, requests = (QUICK_COMPETE if opts.quick else COMPETE)
    files = [(name, tiny_models().ensure_real_shape(name, folder, say=console.print))
             for name in names]
    vocab = tiny_models().REAL_SHAPES[names[0]].shape.vocab
    if budget == 0:  # the larger fits with half the smaller: they cannot both be hot
        est = sizes_mix.estimates(work, files, context)
        budget = max(est.values()) + min(est.values()) // 2
    out = sizes_mix.competing(work, files, vocab, context, budget, requests,
                              weights=list(range(len(names), 0, -1)))
    console.print(f"  {requests} requests under {budget / GIB:.1f} GiB: runners at most "
                  f"{out['rss_max_bytes'] / GIB:.2f} GiB, accounted at most "
                  f"{out['accounted_max_bytes'] / GIB:.2f} GiB; {len(out['errors'])} errors, "
                  f"{out['crashes']:.0f} crashes ({out['tiers']})")
    return out


def _goals(rows: list[dict[str, Any]], mixed: dict[str, Any]) -> list[Goal]:
    low = min(rows, key=lambda r: r["estimate_over_resident"])
    high = max(rows, key=lambda r: r["estimate_over_resident"])
    goals = [Goal(name="sizes: estimate / resident set, the lowest of every model and context",
                  value=low["estimate_over_resident"], target=1 - ESTIMATE_BOUND, op=">=",
                  note=f"{low['model']} at {low['context']} ({low['cache']})"),
             Goal(name="sizes: estimate / resident set, the highest",
                  value=high["estimate_over_resident"], target=1 + ESTIMATE_BOUND, op="<=",
                  note=f"{high['model']} at {high['context']} ({high['cache']})")]
    # where a warm copy keeps at most a fifth of its hot bytes, a restore answers in at most
    # half the time of a load from the page cache (issue 41): the worst round of any
    small = [r for r in rows if r["warm_keeps"] is not None and r["warm_keeps"] <= WARM_SMALL]
    worst = max(small, default=None, key=lambda r: r["restore_over_load_worst"])
    goals.append(Goal(
        name="sizes: restore / load from the page cache, first token, the worst round of any "
             f"warm copy that keeps <= {WARM_SMALL:.0%}",
        value=None if worst is None else worst["restore_over_load_worst"], target=0.5,
        op="<=", note="no warm copy that small" if worst is None else
        f"{worst['model']} at {worst['context']}"))
    direct = [r for r in rows if r["versus_direct"] is not None]
    for key, what in (("prefill_ratio", "prefill"), ("decode_ratio", "decode")):
        worst_d = min(direct, default=None, key=lambda r: r["versus_direct"][key] or 0)
        goals.append(Goal(
            name=f"sizes: {what} tokens/s / llama-server's with the runner's arguments, the "
                 "lowest model's median",
            value=None if worst_d is None else worst_d["versus_direct"][key], target=0.97,
            op=">=", note="" if worst_d is None else worst_d["model"]))
    switch = mixed.get("switching")
    for q, target in (("p50", 0.5), ("p90", 1.0)):
        goals.append(Goal(
            name=f"sizes: every request switches between two files, {q}, packserve / the "
                 "router at --models-max 1",
            value=None if switch is None else switch[f"ratio_{q}"], target=target, op="<=",
            note="" if switch is None else " and ".join(switch["models"])))
    compete = mixed.get("competing")
    over = None if compete is None else max(compete["rss_max_bytes"],
                                            compete["accounted_max_bytes"]) / \
        compete["budget_bytes"]
    goals.append(Goal(name="sizes: models competing for one budget, the most the runners or "
                           "the scheduler held / the budget", value=over, target=1.0, op="<=",
                      note="" if compete is None else
                      f"{len(compete['errors'])} errors, {compete['crashes']:.0f} crashes"))
    return goals
