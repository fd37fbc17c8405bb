"""`packserve bench peers`: packserve against Infinity (embeddings) and llama_cpp.server (chat),
same model files, same requests, same run, rounds alternating packserve and the peer.

The peers live in their own virtual environments under `--peers-dir` (default .venv-peers/):
`infinity/` with `infinity-emb[all]==0.0.78` (its pins conflict with packserve's) and `llama/`
with `llama-cpp-python[server]==0.3.36`. docs/benchmarks.md says how to install them. A peer
that is not installed is reported as "not installed", never silently skipped.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from packserve.bench.common import (
    CHAT_MODEL,
    EMBED_MODEL,
    Goal,
    Options,
    Report,
    median,
    model_path,
    packserve_argv,
    progress,
    ratio,
    run_server,
    sentences,
    write_config,
)
from packserve.bench.overhead import N_CTX, api_chat, api_embed_batches, chat_bodies, singles

INSTALL = "not installed: see docs/benchmarks.md, 'Installing the peers'"


def run(opts: Options) -> Report:
    rounds = 1 if opts.quick else 3
    batches = [sentences(32, seed=100 + i) for i in range(2 if opts.quick else 16)]
    single = sentences(32 if opts.quick else 256, seed=7)
    bodies = chat_bodies(1 if opts.quick else 4, 8 if opts.quick else 64, 3)
    infinity = opts.peers_dir / "infinity" / "bin" / "infinity_emb"
    llama = opts.peers_dir / "llama" / "bin" / "python"
    work = opts.out / "work"
    config = write_config(work / "peers.toml", opts)
    report = Report("peers")
    res: dict[str, object] = {"peers_dir": str(opts.peers_dir)}
    series: dict[str, list[float]] = {k: [] for k in (
        "packserve_batch32", "infinity_batch32", "packserve_single16", "infinity_single16",
        "packserve_chat1", "llama_server_chat1")}
    have_inf, have_llama = infinity.exists(), llama.exists() and _has_server(llama)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
           "DO_NOT_TRACK": "1"}
    os.environ.update({k: env[k] for k in ("HF_HUB_OFFLINE",)})
    with progress(opts, "peers", rounds * 2 + 1) as advance, run_server(
            packserve_argv("--config", str(config), "--models", f"{EMBED_MODEL},{CHAT_MODEL}"),
            log=work / "peers-packserve.log") as ps, ps.client() as pc:
        api_embed_batches(pc, batches[:1])
        api_chat(pc, chat_bodies(1, 4, 0), 1)
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
        if have_llama:
            gguf = str(model_path(CHAT_MODEL, opts))
            with run_server([str(llama), "-m", "llama_cpp.server", "--model", gguf, "--n_ctx",
                             str(N_CTX), "--use_mmap", "True", "--verbose", "False",
                             "--model_alias", CHAT_MODEL, "--host", "127.0.0.1"],
                            health="/v1/models", log=work / "peers-llama.log") as ls, \
                    ls.client() as lc:
                api_chat(lc, chat_bodies(1, 4, 0), 1)
                for r in range(rounds):
                    series["packserve_chat1"].append(api_chat(pc, bodies, 1))
                    series["llama_server_chat1"].append(api_chat(lc, bodies, 1))
                    advance(1, f"llama_cpp.server round {r + 1}")
        else:
            advance(rounds, "llama_cpp.server " + INSTALL)
    med = {k: (median(v) if v else None) for k, v in series.items()}
    res.update(infinity="installed" if have_inf else INSTALL,
               llama_cpp_server="installed" if have_llama else INSTALL,
               rounds=rounds, per_round=series, median=med,
               units="embeddings: sentences/s; chat: completion tokens/s")
    report.results = res
    note_inf = "" if have_inf else INSTALL
    note_llama = "" if have_llama else INSTALL
    report.goals = [
        Goal("peers: batch-32 embeddings, packserve / Infinity",
             ratio(med["packserve_batch32"], med["infinity_batch32"]), 1.0, ">=", note_inf),
        Goal("peers: single sentence x16 clients, packserve / Infinity",
             ratio(med["packserve_single16"], med["infinity_single16"]), 1.0, ">=", note_inf),
        Goal("peers: chat tokens/s one stream, packserve / llama_cpp.server",
             ratio(med["packserve_chat1"], med["llama_server_chat1"]), 0.95, ">=", note_llama),
    ]
    report.notes.append("peer goals are this project's own bar (no goal in the issue): parity "
                        "with Infinity, within 5% of llama_cpp.server")
    return report


def _has_server(python: Path) -> bool:
    return any((python.parent.parent / "lib").glob("python3*/site-packages/sse_starlette"))
