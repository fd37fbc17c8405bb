"""`python -m benchmarks peers`: packserve against Infinity (embeddings) and llama.cpp's own
multi-model server, `llama-server` in router mode (chat, completion, embeddings), on the same
model files, with the same requests, in the same run, rounds alternating packserve and the peer.

Infinity lives in its own virtual environment under `--peers-dir` (default .venv-peers/):
`infinity/` with `infinity-emb[all]==0.0.78` (its pins conflict with packserve's). The router is
the `llama-server` that scripts/setup.sh builds into the virtual environment from the llama.cpp
source packserve uses (`benchmarks.router`), serving SmolLM2 and Gemma 3 270M from the GGUFs
packserve serves and MiniLM from the GGUF packserve converts from its safetensors and serves.
docs/benchmarks.md says how to install them. A peer, or a model of it, that cannot run is
reported as "not installed" or "not available" with the reason, never silently skipped.

Against the router, both servers are driven through their OpenAI endpoints by the `openai`
SDK, one code path, with the catalog's names: per round (the order flips each round), one
streamed chat (decode tokens/s after the first token; time to the first content token), four
concurrent chats (completion tokens/s over wall time) and a hot mixed cycle (chat ->
completion -> one embedding, sequential; p50 per request). Medians over rounds, the worst
round beside them. PSS of both servers' processes, both up, after the warm-up and the rounds.
Then the same cycle with every request switching model: packserve at a budget where one
generation model fits at a time against a second router at `--models-max 1`, p50 and p90 of
the client's time per request over every round.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from benchmarks import router
from benchmarks.common import (
    CHAT_MODEL,
    COMPLETE_MODEL,
    EMBED_MODEL,
    MIB,
    Goal,
    Options,
    Report,
    Server,
    logged_events,
    median,
    model_path,
    packserve_argv,
    progress,
    quantile,
    ratio,
    run_server,
    write_config,
)
from benchmarks.overhead import api_embed_batches, singles
from packserve.replay import sentences

if TYPE_CHECKING:
    from openai import OpenAI
    from openai.types.chat import ChatCompletionMessageParam

_T = TypeVar("_T")
INSTALL = "not installed: see docs/peers.md"
ROUTER = "llama-server router"
SIDES = ("packserve", "router")
# (key, label, unit, higher is better)
ROWS = (
    ("stream1_decode_tps", "one streamed chat: decode tokens/s after the first token",
     "tokens/s", True),
    ("chat4_tps", "four concurrent chats: completion tokens/s", "tokens/s", True),
    ("ttft_ms", "one streamed chat: time to the first content token", "ms", False),
    ("mixed_p50_ms", "hot mixed cycle (chat, completion, embedding): p50 per request", "ms",
     False),
)


def run(opts: Options) -> Report:
    rounds = 1 if opts.quick else max(3, int(opts.extra.get("rounds", 3)))
    batches = [sentences(32, seed=100 + i) for i in range(2 if opts.quick else 16)]
    single = sentences(32 if opts.quick else 256, seed=7)
    infinity = opts.peers_dir / "infinity" / "bin" / "infinity_emb"
    work = opts.out / "work"
    config = write_config(work / "peers.toml", opts)
    report = Report("peers")
    res: dict[str, Any] = {"peers_dir": str(opts.peers_dir)}
    series: dict[str, list[float]] = {k: [] for k in (
        "packserve_batch32", "infinity_batch32", "packserve_single16", "infinity_single16")}
    have_inf = infinity.exists()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
           "DO_NOT_TRACK": "1"}
    os.environ.update({k: env[k] for k in ("HF_HUB_OFFLINE",)})
    with progress(opts, "peers", rounds * 2 + 2) as advance, run_server(
            packserve_argv("--config", str(config), "--models",
                           f"{EMBED_MODEL},{CHAT_MODEL},{COMPLETE_MODEL}"),
            log=work / "peers-packserve.log") as ps, ps.client() as pc:
        api_embed_batches(pc, batches[:1])
        advance(1, "packserve warm")
        if have_inf:
            mpath = str(model_path(EMBED_MODEL, opts))
            with run_server([str(infinity), "v2", "--model-id", mpath, "--engine", "torch",
                             "--device", "cpu", "--no-bettertransformer",
                             "--served-model-name", EMBED_MODEL],
                            health="/models", log=work / "peers-infinity.log") as inf, \
                    inf.client() as ic:
                api_embed_batches(ic, batches[:1], path="/embeddings")
                for r in range(rounds):
                    series["packserve_batch32"].append(api_embed_batches(pc, batches))
                    series["infinity_batch32"].append(
                        api_embed_batches(ic, batches, path="/embeddings"))
                    series["packserve_single16"].append(asyncio.run(singles(ps.url, single, 16)))
                    series["infinity_single16"].append(
                        asyncio.run(singles(inf.url, single, 16, path="/embeddings")))
                    advance(1, f"infinity round {r + 1}")
        else:
            advance(rounds, "infinity " + INSTALL)
        versus = _versus_router(opts, ps, rounds, advance)
    med = {k: (median(v) if v else None) for k, v in series.items()}
    res.update(infinity="installed" if have_inf else INSTALL, rounds=rounds, per_round=series,
               median=med, units="embeddings: sentences/s", router=versus)
    report.results = res
    note_inf = "" if have_inf else INSTALL
    vr = versus["ratios"]
    note_router = versus["not_available"] or ""
    note_mixed = note_router or versus["embed_not_available"] or ""
    report.goals = [
        Goal("peers: batch-32 embeddings, packserve / Infinity",
             ratio(med["packserve_batch32"], med["infinity_batch32"]), 1.0, ">=", note_inf),
        Goal("peers: single sentence x16 clients, packserve / Infinity",
             ratio(med["packserve_single16"], med["infinity_single16"]), 1.0, ">=", note_inf),
        Goal(f"peers: one streamed chat, decode tokens/s, packserve / {ROUTER}",
             vr["stream1_decode_tps"], 1.0, ">=", note_router),
        Goal(f"peers: four concurrent chats, completion tokens/s, packserve / {ROUTER}",
             vr["chat4_tps"], 1.0, ">=", note_router),
        Goal(f"peers: time to first token, one stream, packserve / {ROUTER}",
             vr["ttft_ms"], 1.0, "<=", note_router),
        Goal(f"peers: hot mixed cycle p50 per request, packserve / {ROUTER}",
             vr["mixed_p50_ms"], 1.0, "<=", note_mixed),
        Goal(f"peers: PSS of every process after the rounds, packserve / {ROUTER}",
             (versus.get("memory") or {}).get("ratio", {}).get("after_rounds"), 1.0, "<=",
             note_mixed),
        Goal(f"peers: every request switches model, p50, packserve / {ROUTER} --models-max 1",
             vr.get("switch_p50_ms"), 0.5, "<=", note_mixed),
        Goal(f"peers: every request switches model, p90, packserve / {ROUTER} --models-max 1",
             vr.get("switch_p90_ms"), 1.0, "<=", note_mixed),
    ]
    report.results["tables"] = versus["tables"]
    report.notes.append("Infinity goals are this project's own bar (no goal in the issue): "
                        f"parity; the {ROUTER} goals are the issue's")
    report.notes += versus["notes"]
    report.notes.append("packserve's llama.cpp models: backend = \"llama-server\"")
    return report


# ----------------------------------------------------------------------- against the router


def _versus_router(opts: Options, ps: Server, rounds: int,
                   advance: Callable[..., None]) -> dict[str, Any]:
    """Start the router beside the running packserve `ps`, warm both, read both servers' PSS,
    then run `rounds` alternating rounds. Everything the report needs, under one dict."""
    work = opts.out / "work"
    out: dict[str, Any] = {"not_available": None, "embed_not_available": None,
                           "ratios": dict.fromkeys(k for k, *_ in ROWS), "tables": [],
                           "notes": []}
    sizes = {"rounds": rounds, "stream1_max_tokens": 32 if opts.quick else 128,
             "chat4_max_tokens": 24 if opts.quick else 96,
             "mixed_cycles": 3 if opts.quick else 20, "mixed_max_tokens": 8}
    out["sizes"] = {**sizes, "order": "per measurement, packserve then the router in odd "
                    "rounds, the router then packserve in even ones"}
    try:
        server = router.binary()
    except router.Unavailable as exc:
        out["not_available"] = str(exc)
        advance(rounds + 1, f"{ROUTER} {exc}")
        return out
    presets: dict[str, dict[str, str]] = {
        CHAT_MODEL: {"model": str(model_path(CHAT_MODEL, opts))},
        COMPLETE_MODEL: {"model": str(model_path(COMPLETE_MODEL, opts))},
    }
    try:
        gguf = router.embed_gguf(model_path(EMBED_MODEL, opts), opts.data_dir / "models")
        presets[EMBED_MODEL] = {"model": str(gguf), "embeddings": "true", "pooling": "mean"}
        out["embed_gguf"] = str(gguf)
    except router.Unavailable as exc:
        out["embed_not_available"] = f"not available: {exc}"
        out["notes"].append(f"{ROUTER}: MiniLM {out['embed_not_available']}; the mixed cycle "
                            "and the memory comparison need it")
    preset = router.write_preset(work / "peers-router.ini", presets)
    out.update(binary=str(server), preset=preset.read_text("utf-8"), threads=router.threads(),
               models_max=router.MODELS_MAX)
    have_embed = EMBED_MODEL in presets
    log = work / "peers-router.log"
    with contextlib.ExitStack() as stack:
        try:
            rs = stack.enter_context(run_server(router.argv(server, preset,
                                                            work / "llama-cache"),
                                                health="/health", log=log))
        except RuntimeError as exc:  # run_server stopped it: a peer that cannot start
            out["not_available"] = f"not available: {ROUTER} did not start: {exc}"
            advance(rounds + 1, f"{ROUTER} did not start")
            return out
        clients = {"packserve": _client(ps.url), "router": _client(rs.url)}
        prompts = sentences(4, words=16, seed=5)
        for side in SIDES:  # loads every model on both: the router starts its children now
            c = clients[side]
            _on(side, _stream, c, prompts[0], 4)
            _on(side, _complete, c, prompts[1], 4)
            if side == "packserve" or have_embed:
                _on(side, _embed, c, prompts[2])
        advance(1, f"{ROUTER} warm")
        pids = {"packserve": ps.pid, "router": rs.pid}
        memory = {"after_warm_up": {side: router.pss(pids[side]) for side in SIDES}}
        per_round: dict[str, dict[str, list[float]]] = {
            side: {k: [] for k, *_ in ROWS} for side in SIDES}
        per_type: dict[str, dict[str, list[float]]] = {
            side: {"chat": [], "complete": [], "embed": []} for side in SIDES}
        for r in range(rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            prompt = sentences(1, words=16, seed=1000 + r)[0]
            for side in order:
                tps, ttft = _on(side, _stream, clients[side], prompt,
                                sizes["stream1_max_tokens"])
                per_round[side]["stream1_decode_tps"].append(tps)
                per_round[side]["ttft_ms"].append(ttft)
            four = sentences(4, words=16, seed=2000 + r)
            for side in order:
                per_round[side]["chat4_tps"].append(_on(
                    side, _concurrent_chats, clients[side], four, sizes["chat4_max_tokens"]))
            if have_embed:
                texts = sentences(3 * sizes["mixed_cycles"], words=16, seed=3000 + r)
                for side in order:
                    lat = _on(side, _mixed_cycle, clients[side], texts,
                              sizes["mixed_max_tokens"])
                    per_round[side]["mixed_p50_ms"].append(
                        median([v for vs in lat.values() for v in vs]))
                    for kind, vs in lat.items():
                        per_type[side][kind] += vs
            advance(1, f"{ROUTER} round {r + 1}")
        memory["after_rounds"] = {side: router.pss(pids[side]) for side in SIDES}
        for c in clients.values():
            c.close()
    _summarise(out, per_round, per_type, memory, have_embed)
    if have_embed:
        out["switching"] = _switching(opts, server, preset, rounds, sizes["mixed_cycles"])
        out["ratios"]["switch_p50_ms"] = out["switching"]["ratio_p50"]
        out["ratios"]["switch_p90_ms"] = out["switching"]["ratio_p90"]
        out["tables"].append(out["switching"]["table"])
        out["tables"].append(out["switching"]["profile"]["table"])
    return out


# packserve's budget in the switching rows: Gemma (the largest, ~340 MiB) fits alone, no two
# of the three generation-sized models fit together, so each request loads its model.
SWITCH_BUDGET = "350MiB"


def _switching(opts: Options, server: Path, preset: Path, rounds: int, cycles: int
               ) -> dict[str, Any]:
    """Every request switches model: chat -> completion -> embedding, `cycles` times a round,
    packserve at SWITCH_BUDGET with no headroom (its default warm tier on) and a router at
    `--models-max 1` (a new child per switch), rounds alternating. The client's time from
    request to answer, p50 and p90 over every round; packserve's evictions are counted (at
    this budget MiniLM fits beside SmolLM2, so a chat after an embedding may keep it)."""
    work = opts.out / "work"
    config = write_config(work / "peers-switch.toml", opts, memory_budget=SWITCH_BUDGET,
                          headroom="0", log_level="info")  # its events: where a switch goes
    log = work / "peers-switch-packserve.log"
    lat: dict[str, list[float]] = {side: [] for side in SIDES}
    with run_server(packserve_argv("--config", str(config), "--models",
                                   f"{EMBED_MODEL},{CHAT_MODEL},{COMPLETE_MODEL}"),
                    log=log) as ps, \
            run_server(router.argv(server, preset, work / "llama-cache-switch", models_max=1),
                       health="/health", log=work / "peers-switch-router.log") as rs:
        clients = {"packserve": _client(ps.url), "router": _client(rs.url)}
        for side in SIDES:  # first loads (and MiniLM's conversion) out of the figures
            _on(side, _mixed_cycle, clients[side], sentences(3, words=16, seed=9), 8)
        measured_from = log.stat().st_size
        for r in range(rounds):
            texts = sentences(3 * cycles, words=16, seed=4000 + r)
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                done = _on(side, _mixed_cycle, clients[side], texts, 8)
                lat[side] += [v for vs in done.values() for v in vs]
        with ps.client() as http:
            text = http.get("/metrics").text
        for c in clients.values():
            c.close()
    evictions = int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("packserve_model_events_total{")
                        and 'event="evict' in line))
    pct = {side: {q: quantile(v, q) for q in (0.5, 0.9)} for side, v in lat.items()}
    r50 = ratio(pct["packserve"][0.5], pct["router"][0.5])
    r90 = ratio(pct["packserve"][0.9], pct["router"][0.9])
    rows: list[list[object]] = [
        ["every request switches model (chat, completion, embedding): p50 (ms)",
         pct["packserve"][0.5], None, pct["router"][0.5], None, _x(r50)],
        ["every request switches model: p90 (ms)", pct["packserve"][0.9], None,
         pct["router"][0.9], None, _x(r90)]]
    profile = switch_profile(log, measured_from)
    return {"budget": SWITCH_BUDGET, "router_models_max": 1, "requests": len(lat["packserve"]),
            "packserve_evictions": evictions, "latency_ms": lat, "quantiles_ms": pct,
            "ratio_p50": r50, "ratio_p90": r90, "profile": profile,
            "table": {"columns": ["row", "packserve", "", ROUTER + " (--models-max 1)", "",
                                  "packserve / router"], "rows": rows}}


def switch_profile(log: Path, offset: int) -> dict[str, Any]:
    """Where packserve's switches went, from its event log over the rounds: per model, how
    many times it came from cold and from warm and their median seconds, and how many times it
    left to warm and to cold and their median seconds."""
    rows: list[list[object]] = []
    by_model: dict[str, dict[str, list[float]]] = {}
    for e in logged_events(log, offset):
        if e.get("kind") == "load":
            kind = f"from {e.get('tier_from')}"
        elif e.get("kind") == "evict":
            kind = f"to {e.get('tier_to')}"
        else:
            continue
        model = str(e.get("model")).split("+")[0]
        by_model.setdefault(model, {}).setdefault(kind, []).append(float(e["seconds"]))
    for model, kinds in sorted(by_model.items()):
        rows.append([model] + [cell for kind in ("from cold", "from warm", "to warm", "to cold")
                               for cell in (len(kinds.get(kind, [])),
                                            median(kinds[kind]) if kind in kinds else None)])
    return {"seconds": by_model, "table": {
        "columns": ["model", "loads from cold", "median s", "restores from warm", "median s",
                    "evictions to warm", "median s", "evictions to cold", "median s"],
        "rows": rows}}


def _summarise(out: dict[str, Any], per_round: dict[str, dict[str, list[float]]],
               per_type: dict[str, dict[str, list[float]]],
               memory: dict[str, dict[str, dict[str, int]]], have_embed: bool) -> None:
    med = {side: {k: (median(v) if v else None) for k, v in rows.items()}
           for side, rows in per_round.items()}
    worst = {side: {k: ((min(v) if higher else max(v)) if v else None)
                    for (k, _, _, higher), v in ((row, rows[row[0]]) for row in ROWS)}
             for side, rows in per_round.items()}
    out["ratios"] = {k: ratio(med["packserve"][k], med["router"][k]) for k, *_ in ROWS}
    out.update(per_round=per_round, median=med, worst=worst,
               mixed_p50_ms_by_type={side: {kind: (median(v) if v else None)
                                            for kind, v in kinds.items()}
                                     for side, kinds in per_type.items()})
    rows: list[list[object]] = []
    for key, label, unit, _ in ROWS:
        rows.append([f"{label} ({unit})", med["packserve"][key], worst["packserve"][key],
                     med["router"][key], worst["router"][key], _x(out["ratios"][key])])
    if have_embed:
        for kind in ("chat", "complete", "embed"):
            p = out["mixed_p50_ms_by_type"]["packserve"][kind]
            q = out["mixed_p50_ms_by_type"]["router"][kind]
            rows.append([f"  mixed cycle, {kind} requests: p50 over all rounds (ms)", p, None,
                         q, None, _x(ratio(p, q))])
    mem = {when: {side: sum(procs.values()) for side, procs in sides.items()}
           for when, sides in memory.items()}
    out["memory"] = {"pss_bytes": mem, "processes": memory,
                     "ratio": {when: ratio(v["packserve"], v["router"])
                               for when, v in mem.items()}}
    if have_embed:  # the same three models resident on both sides: comparable
        for when, v in mem.items():
            rows.append([f"PSS of every process, both servers up, {when.replace('_', ' ')} "
                         "(MiB)", v["packserve"] / MIB, None, v["router"] / MIB, None,
                         _x(out["memory"]["ratio"][when])])
    out["tables"] = [{"columns": ["row", "packserve median", "packserve worst round",
                                  f"{ROUTER} median", f"{ROUTER} worst round",
                                  "packserve / router"], "rows": rows}]
    out["notes"].append(
        f"{ROUTER}: decode tokens/s = (completion tokens from `usage` - 1) / (end of the stream "
        "- first content chunk); four chats: sum of `usage.completion_tokens` / wall time; "
        "worst round: the lowest rate or the highest latency; PSS: sum of Pss in "
        "/proc/PID/smaps_rollup over the server's process and all its descendants, both "
        "servers up at once, each model having answered")


def _x(v: float | None) -> str | None:
    return None if v is None else f"{v:.2f}x"


# ----------------------------------------------------------------------- the client side


def _on(side: str, fn: Callable[..., _T], *args: Any) -> _T:
    """`fn(*args)`, its failure told with the server it was sent to (and the transport's
    own error: the SDK says only "Connection error.")."""
    try:
        return fn(*args)
    except Exception as exc:
        cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
        raise RuntimeError(f"{side}: {fn.__name__.lstrip('_')}: {type(exc).__name__}: "
                           f"{exc}{cause}") from exc


def _client(url: str) -> OpenAI:
    """The SDK's client without retries, so that a failed request fails the run, and with a
    new connection per request. The router closes its client's connection after each request
    it proxies while its headers say keep-alive, so a request sent on the next was now and then
    refused ("Server disconnected without sending a response"). packserve gets the same client:
    one local TCP connect per request, a fraction of a millisecond, on both sides."""
    import httpx2
    from openai import DefaultHttpxClient, OpenAI

    limits = httpx2.Limits(max_connections=64, max_keepalive_connections=0)
    return OpenAI(base_url=url + "/v1", api_key="unused", timeout=300.0, max_retries=0,
                  http_client=DefaultHttpxClient(limits=limits))


def _messages(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


def _stream(c: OpenAI, prompt: str, max_tokens: int) -> tuple[float, float]:
    """One streamed chat: (decode tokens/s after the first token, ms to the first content)."""
    t0 = time.perf_counter()
    first: float | None = None
    tokens = 0
    stream = c.chat.completions.create(
        model=CHAT_MODEL, messages=_messages(prompt),
        max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and any(ch.delta.content for ch in chunk.choices):
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    if first is None or tokens < 1:
        raise RuntimeError(f"a streamed chat from {c.base_url} had no content or no usage")
    return (tokens - 1) / max(end - first, 1e-9), (first - t0) * 1000


def _concurrent_chats(c: OpenAI, prompts: list[str], max_tokens: int) -> float:
    def one(text: str) -> int:
        r = c.chat.completions.create(model=CHAT_MODEL, messages=_messages(text),
                                      max_tokens=max_tokens, temperature=0)
        assert r.usage is not None
        return r.usage.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - t0)


def _complete(c: OpenAI, prompt: str, max_tokens: int) -> None:
    c.completions.create(model=COMPLETE_MODEL, prompt=prompt, max_tokens=max_tokens,
                         temperature=0)


def _embed(c: OpenAI, text: str) -> None:
    r = c.embeddings.create(model=EMBED_MODEL, input=text, encoding_format="float")
    if not r.data or not r.data[0].embedding:
        raise RuntimeError(f"no embedding from {c.base_url}")


def _mixed_cycle(c: OpenAI, texts: list[str], max_tokens: int) -> dict[str, list[float]]:
    """chat -> completion -> embedding, sequential, len(texts) // 3 times: ms per request."""
    lat: dict[str, list[float]] = {"chat": [], "complete": [], "embed": []}
    for i in range(0, len(texts) - 2, 3):
        t0 = time.perf_counter()
        c.chat.completions.create(model=CHAT_MODEL, messages=_messages(texts[i]),
                                  max_tokens=max_tokens, temperature=0)
        t1 = time.perf_counter()
        _complete(c, texts[i + 1], max_tokens)
        t2 = time.perf_counter()
        _embed(c, texts[i + 2])
        t3 = time.perf_counter()
        for kind, a, b in (("chat", t0, t1), ("complete", t1, t2), ("embed", t2, t3)):
            lat[kind].append((b - a) * 1000)
    return lat
