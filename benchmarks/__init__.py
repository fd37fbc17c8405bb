"""`python -m benchmarks SCENARIO`, from a checkout: packing, overhead, cold starts, a mixed
trace, peers, the front/worker split (reliability: memory, crash recovery, the hop, drain), a
soak (memory, descriptors and threads under mixed traffic with evictions, from several API keys),
a pool on Ray Serve (routers compared on mixed traces; the entry point's cost; needs
`packserve[pool]`), and, only when named, models of real size (sizes: estimates, warm copies
and first tokens at 1B-8B).

The benchmarks live beside the package, not in it: they start their own servers (with the
baseline victim policies of `benchmarks.baselines`), call engines directly and plot, which a
server install needs none of. What a user runs against their own server is `packserve bench
--url` (packserve.replay). One module per scenario; each has `run(Options) -> Report`. This
module parses the command line, runs the scenarios, and writes the JSON results, the plots and
the Markdown table. Benchmarks report; they are never timed tests.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

SCENARIOS = ("overhead", "packing", "coldstart", "trace", "peers", "reliability", "soak",
             "pool", "sim")
# Run only when named: models of real size, gigabytes written and an hour on two cores.
BY_NAME = ("sizes",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", choices=(*SCENARIOS, *BY_NAME, "all"),
                        help="what to measure (`all`: every one but sizes)")
    parser.add_argument("--quick", action="store_true",
                        help="every scenario at a tiny size (seconds, not minutes)")
    parser.add_argument("--out", default="benchmarks/results", help="results folder (JSON, PNG)")
    parser.add_argument("--docs", help="Markdown file the results table is appended to "
                        "(default OUT/benchmarks.md, beside the JSON; docs/benchmarks.md "
                        "holds the current results, edited by hand)")
    parser.add_argument("--data-dir", default="~/.cache/packserve",
                        help="packserve data dir for the servers it starts (assembled GGUFs)")
    parser.add_argument("--peers-dir", default=".venv-peers",
                        help="virtual environments of the peers (infinity/)")
    parser.add_argument("--rounds", type=int, default=3, help="overhead, reliability: ABAB rounds")
    parser.add_argument("--duration", type=float,
                        help="trace: seconds of arrivals per policy (default 120); soak: seconds "
                        "of traffic (default 600); pool: seconds of each trace per router "
                        "(default 30)")
    parser.add_argument("--rate", type=float, default=1.5, help="trace: mean requests/s")
    parser.add_argument("--alpha", type=float, default=0.9, help="trace: Zipf exponent")
    parser.add_argument("--cv", type=float, default=1.0,
                        help="trace: coefficient of variation of inter-arrivals (1 = Poisson; "
                        ">1 = bursty, Gamma)")
    parser.add_argument("--budget-fraction", type=float, default=0.75,
                        help="trace: memory budget as a fraction of the models' sum")
    parser.add_argument("--seed", type=int, default=1, help="trace, pool: random seed")
    parser.add_argument("--policies", help="trace: which victim policies to run, of "
                        "cost,lru,ray,ollama (default all four; --quick: cost,lru) and "
                        "cost_priority (packserve's with compute priority on), "
                        "cost_no_turn (packserve's without load turns)")
    parser.add_argument("--repeat", type=int, help="trace: runs per policy; the tables show "
                        "the median run (default 1)")
    parser.add_argument("--slo", default="embed=0.5,rerank=0.5,chat=4,complete=4",
                        help="trace, pool: per-type latency targets in seconds")
    parser.add_argument("--calibrate", action="store_const", const="1",
                        help="sim: measure the default catalog on this machine first")
    parser.add_argument("--validate", metavar="TRACE_JSON",
                        help="sim: replay a `bench trace` run's trace.json, sim beside real")
    parser.add_argument("--profile", action="store_const", const="1",
                        help="overhead: run each API scenario once more under py-spy and add "
                        "the top functions of the front and the worker to the results")
    parser.add_argument("--rows", choices=("full", "caches"),
                        help="sizes: every row and the mixed parts (full, the default), or "
                        "only the per-slot and 32k rows (caches)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


# What the benchmarks need beyond a server's install (requirements-dev.txt pins them).
NEEDS = ("aiohttp", "matplotlib", "openai")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=(__doc__ or "").split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        print(f"the benchmarks need {', '.join(missing)}: scripts/setup.sh --dev installs them "
              f"(requirements-dev.txt)", file=sys.stderr)
        return 2
    # Here, not at the top: the check above must run without them.
    from benchmarks.common import Options, console, write_results
    from benchmarks.report import append_markdown

    out = Path(args.out)
    docs = Path(args.docs) if args.docs else out / "benchmarks.md"
    extra = {k: str(getattr(args, k)) for k in ("rounds", "duration", "rate", "alpha", "cv",
                                                 "budget_fraction", "seed", "slo",
                                                 "policies", "repeat", "calibrate",
                                                 "validate", "profile", "rows")
             if getattr(args, k) is not None}  # unset: each scenario's own default
    opts = Options(out=out, quick=args.quick, data_dir=Path(args.data_dir).expanduser(),
                   peers_dir=Path(args.peers_dir).resolve(), progress=not args.no_progress,
                   extra=extra)
    rest = sys.argv[1:] if argv is None else list(argv)
    command = "python -m benchmarks " + shlex.join(rest)
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    failed = 0
    for name in scenarios:
        module = importlib.import_module(f"benchmarks.{name}")
        try:
            report = module.run(opts)
        except Exception as exc:  # one scenario failing must not lose the others' results
            console.print(f"[red]bench {name} failed: {type(exc).__name__}: {exc}[/]")
            failed += 1
            continue
        path = write_results(report, opts, command)
        append_markdown(docs, report, command)
        console.print(f"[green]{name}[/]: {path}")
        for g in report.goals:
            value = "n/a" if g.value is None else f"{g.value:.2f}"
            verdict = {True: "met", False: "MISSED", None: "not measured"}[g.met]
            console.print(f"  {g.name}: {value} (goal {g.op} {g.target}) {verdict}"
                          + (f"  [{g.note}]" if g.note else ""))
    return 1 if failed else 0
