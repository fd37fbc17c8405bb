"""Embedding throughput of packserve at git revisions REV... and of this checkout, side by side in
one run, against sentence-transformers called directly: the two embedding figures of `packserve
bench overhead` (batch-32 requests one after another; 16 concurrent clients sending one sentence
each, against the direct batch-32 throughput of the same sentences), for code changes whose
effect is smaller than the noise between two bench runs. Every server runs at once (idle but
for its turn) and the rounds alternate direct, then each server in turn; the ratios are of
medians over rounds.
docs/benchmarks.md quotes it.

    .venv/bin/python -m benchmarks.compare_embeddings de209d0 235e851 --rounds 6
"""

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.common import (
    EMBED_MODEL,
    Options,
    model_path,
    packserve_argv,
    run_server,
    write_config,
)
from benchmarks.overhead import Direct, api_embed_batches, singles
from packserve.replay import sentences


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revs", nargs="*", help="git revisions to compare with this checkout")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    here = Path(__file__).resolve().parent.parent
    work = Path(tempfile.mkdtemp(prefix="packserve-embed-"))
    data = Path(os.path.expanduser("~/.cache/packserve"))
    opts = Options(out=work, quick=False, data_dir=data, peers_dir=work)
    config = write_config(work / "embed.toml", opts)
    batches = [sentences(32, seed=100 + i) for i in range(16)]
    single = sentences(256, seed=7)
    sources = {}
    series: dict[str, list[float]] = {"direct": [],
                                      "direct, the single sentences at batch-32": []}
    user_path = os.environ.get("PYTHONPATH")
    try:
        for rev in args.revs:
            subprocess.run(["git", "-C", str(here), "worktree", "add", "-f", "-q",
                            str(work / rev), rev], check=True)
            sources[rev] = str(work / rev / "src")
        sources["this checkout"] = str(here / "src")
        with contextlib.ExitStack() as stack:
            servers = {}
            for label, src in sources.items():
                os.environ["PYTHONPATH"] = src  # the server and its worker import this code
                servers[label] = stack.enter_context(run_server(
                    packserve_argv("--config", str(config), "--models", EMBED_MODEL),
                    health="/readyz", log=work / f"{label.replace(' ', '-')}.log"))
            if user_path is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = user_path
            clients = {k: stack.enter_context(httpx.Client(base_url=s.url, timeout=300))
                       for k, s in servers.items()}
            direct = Direct()
            stack.callback(direct.close)
            direct.call(op="load_embed", path=str(model_path(EMBED_MODEL, opts)), max_batch=64)
            direct.call(op="embed", batches=batches[:2])
            for label, c in clients.items():  # loads and first-call allocations
                api_embed_batches(c, batches[:2])
                asyncio.run(singles(servers[label].url, single[:32], 16))
            for r in range(args.rounds):
                d = direct.call(op="embed", batches=batches)
                series["direct"].append(d["items"] / d["seconds"])
                # The clients' own sentences at batch-32: `bench overhead`'s measure for them.
                d = direct.call(op="embed", batches=[single[i:i + 32]
                                                     for i in range(0, len(single), 32)])
                series["direct, the single sentences at batch-32"].append(
                    d["items"] / d["seconds"])
                for label, c in clients.items():
                    series.setdefault(f"{label}: batch-32", []).append(
                        api_embed_batches(c, batches))
                    series.setdefault(f"{label}: 16 single-sentence clients", []).append(
                        asyncio.run(singles(servers[label].url, single, 16)))
                print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    finally:
        for rev in sources:
            if rev == "this checkout":
                continue
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force",
                            str(work / rev)], check=False)
    # Batch-32 against the direct batch-32 of the same batches; the single-sentence clients
    # against the direct batch-32 of their own sentences, as `bench overhead` measures them.
    ratios = {k: round(statistics.median(v) / statistics.median(
                  series["direct, the single sentences at batch-32" if "single" in k
                         else "direct"]), 3)
              for k, v in series.items() if not k.startswith("direct")}
    print(json.dumps({"rounds": args.rounds, "sentences_per_s": series,
                      "median_over_direct_batch32": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
