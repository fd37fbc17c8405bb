"""The `packserve` command: serve, keys, ps, pool, plan, audit and bench."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from packserve.errors import ConfigError
from packserve.logs import configure_logging
from packserve.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

    from packserve.auth import KeyRing
    from packserve.config import Config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="packserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the models of a config (default: built-in catalog)")
    serve.add_argument("--config", help="TOML config file (default: the built-in catalog)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--memory-budget", help="budget for every device, e.g. 2GiB or auto")
    serve.add_argument("--models", help="serve only these catalog names, comma-separated")
    serve.add_argument("--open-to-anyone", action="store_true",
                       help="listen on a non-local --host without API keys: anyone who reaches "
                            "the port can call every model and every admin route")

    keys = sub.add_parser("keys", help="mint, list and revoke API keys (the file holds digests)")
    keys.add_argument("action", choices=("create", "list", "revoke"))
    keys.add_argument("name", nargs="?", help="the key's name (create, revoke)")
    keys.add_argument("--models", default="*",
                      help="models the key may call: names or globs, comma-separated (default *)")
    keys.add_argument("--admin", action="store_true",
                      help="the key may load, unload, offload, pin, unpin and reload")
    keys.add_argument("--rps", type=float, help="limit: requests per second")
    keys.add_argument("--concurrency", type=int, help="limit: requests at once")
    keys.add_argument("--tokens-per-minute", type=int, help="limit: tokens per minute")
    keys.add_argument("--weight", type=float, default=1.0,
                      help="share of a busy model's queue against other keys (default 1)")
    keys.add_argument("--config", help="the config whose server.keys_file to use")
    keys.add_argument("--file", help="the keys file (default: the config's keys_file)")

    ps = sub.add_parser("ps", help="print the residency table of a running server")
    ps.add_argument("--url", default="http://127.0.0.1:8000", help="server address")
    ps.add_argument("--pool", action="store_true",
                    help="the server is a pool's entry point: one table per replica")
    ps.add_argument("--api-key", help="an admin key, when the server has keys (or "
                    "PACKSERVE_API_KEY)")

    logs = sub.add_parser("logs", help="print the last lines of a model's engine log (its "
                          "runner's, kept after it dies) and its last crash, from a running "
                          "server")
    logs.add_argument("model", help="the catalog name")
    logs.add_argument("-n", "--lines", type=int, default=50, help="how many lines (default 50)")
    logs.add_argument("--url", default="http://127.0.0.1:8000", help="server address")
    logs.add_argument("--api-key", help="an admin key, when the server has keys (or "
                      "PACKSERVE_API_KEY)")

    pull = sub.add_parser("pull", help="download a Hub model (an hf: source) ahead of its "
                          "first load, with a progress bar")
    pull.add_argument("name", help="a model of the config, or an hf: source")
    pull.add_argument("--config", help="TOML config file (default: the built-in catalog)")

    pool = sub.add_parser("pool", help="serve a pool of packserve replicas on Ray Serve "
                          "(pip install packserve[pool])")
    pool.add_argument("--config", help="TOML config file with a [pool] section "
                      "(default: the built-in catalog, two replicas on a local Ray)")
    pool.add_argument("--host", help="entry point address (default 127.0.0.1)")
    pool.add_argument("--port", type=int, help="entry point port (default 8000)")
    pool.add_argument("--memory-budget", help="each replica's budget for every device")
    pool.add_argument("--address", help="Ray cluster address (default: the config's "
                      "pool.address; empty starts a local Ray)")
    pool.add_argument("--open-to-anyone", action="store_true",
                      help="listen on a non-local --host without API keys")

    # `plan` and `audit` live in their own modules (packserve.planner.cli, packserve.audit).
    from packserve import audit
    from packserve.planner import cli as plan_cli

    plan_cli.add_arguments(sub.add_parser("plan", help="size memory, GPUs and cost"))
    audit.add_arguments(sub.add_parser("audit", help="who holds memory, duplicates, what fits"))

    bench = sub.add_parser("bench", help="replay a trace against a running server (packserve "
                           "or any OpenAI-compatible one): latency and SLOs per model type")
    bench.add_argument("scenario", nargs="?", help=argparse.SUPPRESS)  # moved: python -m benchmarks
    bench.add_argument("--url", help="the server (required), e.g. http://127.0.0.1:8000")
    bench.add_argument("--trace", help="replay the trace a results file records: `python -m "
                       "benchmarks trace`'s trace.json, or this command's --out")
    bench.add_argument("--rate", type=float, help="mean requests per second (default 1.5)")
    bench.add_argument("--duration", type=float, help="seconds of arrivals (default 120)")
    bench.add_argument("--cv", type=float, help="coefficient of variation of inter-arrivals: "
                       "1 Poisson (default), above 1 bursty (Gamma)")
    bench.add_argument("--alpha", type=float, help="Zipf exponent of model popularity "
                       "(default 0.9)")
    bench.add_argument("--seed", type=int, help="random seed: the same one, the same trace "
                       "(default 1)")
    bench.add_argument("--models", help="the models to ask, most popular first, "
                       "comma-separated (default: every model /v1/models lists, in its order)")
    bench.add_argument("--tasks", help="NAME=TASK,...: the task to send a model that "
                       "/v1/models lists without one (default chat)")
    bench.add_argument("--slo", help="latency targets in seconds per type, e.g. "
                       "embed=0.5,chat=4 (default packserve's [server.slo] defaults)")
    bench.add_argument("--out", help="write the results (JSON) to this file")
    bench.add_argument("--api-key", help="a key, when the server has keys (or "
                       "PACKSERVE_API_KEY)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")

    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(bench, args, argv)
    if args.command == "plan":
        return plan_cli.run_plan(args)
    if args.command == "audit":
        return audit.run_audit(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "keys":
        return _keys(args)
    if args.command == "pool":
        return _pool(args)
    if args.command == "pull":
        return _pull(args)
    if args.command == "logs":
        return _logs(args)
    return _ps(args)


def _logs(args: argparse.Namespace) -> int:
    import os
    import urllib.parse

    import httpx

    base = args.url.rstrip("/")
    key = args.api_key or os.environ.get("PACKSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.get(f"{base}/v1/residency/{urllib.parse.quote(args.model)}/log",
                             params={"lines": args.lines}, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        print(f"packserve logs: cannot read {args.url}: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        message = response.json().get("error", {}).get("message", response.text) \
            if response.headers.get("content-type", "").startswith("application/json") \
            else response.text
        print(f"packserve logs: {response.status_code}: {message}", file=sys.stderr)
        return 1
    data = response.json()
    crash = data.get("last_crash")
    if crash is not None:
        print(f"# last crash: {crash['cause']} (pid {crash['pid']}): {crash['verdict']}")
    if data.get("log") is None:
        print(f"# {args.model} ({data['state']}) has no engine log: it runs in the worker, "
              f"or has not been loaded since the server started")
        return 0
    print(f"# {data['log']}")
    for line in data["lines"]:
        print(line)
    return 0


def _pull(args: argparse.Namespace) -> int:
    """Fetch a Hub source into DATA_DIR/models/hf as a first load would, drawing its progress."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from packserve.config import load_config
    from packserve.hub import Hub, parse

    try:
        config = load_config(args.config)
        named = [m.source for m in config.models if m.name == args.name]
        source = parse(named[0] if named else args.name)
        if source is None:
            print(f"packserve pull: {args.name} is "
                  + (f"not a Hub model (source {named[0]!r})" if named else
                     "neither a model of the config nor an hf: source"), file=sys.stderr)
            return 2
        hub = Hub(config.data_path / "models")
        source = hub.canonical(source)
        with Progress("[bold]{task.description}", BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), TimeRemainingColumn()) as bar:
            task = bar.add_task(str(source), total=None)
            path = hub.fetch(source, lambda done, total: bar.update(task, completed=done,
                                                                     total=total))
    except ConfigError as exc:
        print(f"packserve pull: {exc.message}", file=sys.stderr)
        return 1
    print(f"{source}: {path}")
    return 0


def _pool(args: argparse.Namespace) -> int:
    from packserve.config import load_config

    def read() -> Config:
        config = load_config(args.config, host=args.host, port=args.port,
                             memory_budget=args.memory_budget,
                             open_to_anyone=args.open_to_anyone)
        if args.address is None:
            return config
        return config.model_copy(update={
            "pool": config.pool.model_copy(update={"address": args.address})})

    opened = _open(read, "the pool's entry point")
    if opened is None:
        return 2
    config, keys = opened
    try:
        from packserve.pool.run import run_pool
    except ImportError as exc:
        print(f"packserve pool needs Ray Serve: pip install 'packserve[pool]' ({exc})",
              file=sys.stderr)
        return 2
    return run_pool(config, keys)


def _open(read: Callable[[], Config], who: str) -> tuple[Config, KeyRing | None] | None:
    """Read the config and its keys (None after printing why not), set up logging, and warn
    when `who` listens beyond localhost without keys. Shared by serve and pool."""
    from packserve.auth import KeyRing

    try:
        config = read()
        keys = KeyRing(config.keys_path) if config.keys_path is not None else None
    except ConfigError as exc:
        print(f"packserve: {exc.message}", file=sys.stderr)
        return None
    configure_logging(config.server.log_level)
    if keys is None and config.server.open_to_anyone:
        logging.getLogger("packserve").warning(
            "%s listens on %s with no API keys: anyone who reaches port %d can call every "
            "model and every admin route", who, config.server.host, config.server.port)
    return config, keys


def _serve(args: argparse.Namespace) -> int:
    from packserve.config import load_config

    only = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None

    def read() -> Config:
        return load_config(args.config, host=args.host, port=args.port,
                           memory_budget=args.memory_budget, only_models=only,
                           open_to_anyone=args.open_to_anyone)

    opened = _open(read, "packserve")
    if opened is None:
        return 2
    config, keys = opened
    from packserve.front.app import run_front

    return asyncio.run(run_front(config, reload=read, keys=keys))


def _keys(args: argparse.Namespace) -> int:
    from pathlib import Path

    from packserve import auth
    from packserve.config import load_config

    try:
        if args.file:
            path = Path(args.file)
        else:
            path_or_none = load_config(args.config).keys_path
            if path_or_none is None:
                raise ConfigError("no keys file: pass --file PATH, or --config with "
                                  "server.keys_file set")
            path = path_or_none
        if args.action != "list" and not args.name:
            raise ConfigError(f"packserve keys {args.action} needs a NAME")
        if args.action == "create":
            models = [m.strip() for m in args.models.split(",") if m.strip()]
            key = auth.mint(path, args.name, models, args.admin,
                            requests_per_second=args.rps, concurrent_requests=args.concurrency,
                            tokens_per_minute=args.tokens_per_minute, weight=args.weight)
            print(key)
            print(f"packserve keys: {args.name!r} added to {path} (only its digest is kept: "
                  f"this is the one time the key is shown)", file=sys.stderr)
        elif args.action == "revoke":
            auth.revoke(path, args.name)
            print(f"packserve keys: {args.name!r} revoked in {path}; a running server stops "
                  f"accepting it within a second", file=sys.stderr)
        else:
            for k in auth.parse_keys(path.read_text("utf-8"), str(path)):
                limits = ",".join(f"{n}={v:g}" for n, v in (
                    ("rps", k.requests_per_second), ("concurrency", k.concurrent_requests),
                    ("tokens_per_minute", k.tokens_per_minute), ("weight", k.weight))
                    if v is not None and not (n == "weight" and v == 1.0)) or "-"
                print(f"{k.name}\t{'admin' if k.admin else 'key'}\t{','.join(k.models)}\t"
                      f"{limits}")
    except ConfigError as exc:
        print(f"packserve keys: {exc.message}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"packserve keys: {exc}", file=sys.stderr)
        return 2
    return 0


_GENERATE = {"rate": 1.5, "duration": 120.0, "cv": 1.0, "alpha": 0.9, "seed": 1}


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace,
           argv: Sequence[str] | None) -> int:
    import json
    import os
    import shlex
    from pathlib import Path

    # Here, not at the top: `serve` runs this module and needs neither (httpx, numpy, rich).
    from rich.console import Console
    from rich.progress import Progress

    from packserve import replay

    if args.scenario:
        parser.error(f"the benchmark scenarios ({args.scenario}) run from a checkout: "
                     f".venv/bin/python -m benchmarks {args.scenario} (docs/benchmarks.md); "
                     f"packserve bench --url URL replays a trace against a running server")
    if not args.url:
        parser.error("--url is required: the server to replay a trace against")
    given = [f"--{k}" for k in _GENERATE if getattr(args, k) is not None]
    if args.trace and given:
        parser.error(f"--trace replays a recorded trace; {', '.join(given)} would not apply")
    key = args.api_key or os.environ.get("PACKSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        if args.trace:
            spec = replay.read_spec(Path(args.trace))
        else:
            g = {k: v if getattr(args, k) is None else getattr(args, k)
                 for k, v in _GENERATE.items()}
            models = tuple(m.strip() for m in (args.models or "").split(",") if m.strip())
            spec = replay.TraceSpec(seed=int(g["seed"]), duration_s=g["duration"],
                                    rate_per_s=g["rate"], zipf_alpha=g["alpha"],
                                    interarrival_cv=g["cv"], popularity=models)
        slo = replay.slo_targets(args.slo)
        tasks = replay.task_overrides(args.tasks)
        with Progress(console=Console(stderr=True), disable=args.no_progress,
                      transient=True) as bar:
            task = bar.add_task("replaying", total=None)
            report = replay.run(args.url.rstrip("/"), spec, tasks=tasks, slo=slo,
                                headers=headers,
                                progress=lambda done, total: bar.update(task, completed=done,
                                                                        total=total))
    except replay.ReplayError as exc:
        print(f"packserve bench: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # the requests in flight are abandoned with the event loop
        print("packserve bench: interrupted, no report", file=sys.stderr)
        return 130
    print("\n".join(report.lines()))
    if args.out:
        rest = sys.argv[1:] if argv is None else list(argv)
        out = Path(args.out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report.as_json("packserve " + shlex.join(rest)),
                                      indent=1) + "\n", "utf-8")
        except OSError as exc:
            print(f"packserve bench: cannot write {out}: {exc}", file=sys.stderr)
            return 1
        print(f"results: {out}")
    answered = any(o.status == 200 for o in report.outcomes)
    return 0 if answered or not report.outcomes else 1


def _ps(args: argparse.Namespace) -> int:
    import os

    # Here, not at the top: `serve` runs this module and needs neither (rich alone: ~2 MiB).
    import httpx
    from rich.console import Console
    from rich.table import Table

    base = args.url.rstrip("/")
    key = args.api_key or os.environ.get("PACKSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        if args.pool:
            return _ps_pool(console, httpx.get(f"{base}/v1/pool", headers=headers,
                                               timeout=10).raise_for_status().json())
        data = httpx.get(f"{base}/v1/residency", headers=headers,
                         timeout=10).raise_for_status().json()
        summary = httpx.get(f"{base}/v1/metrics/summary", headers=headers,
                            timeout=10).raise_for_status().json()
    except httpx.HTTPError as exc:
        print(f"packserve ps: cannot read {args.url}: {exc}", file=sys.stderr)
        return 1
    for d in summary["devices"]:
        console.print(
            f"[bold]{d['name']}[/]: {format_bytes(d['used_bytes'], compact=True)} used of "
            f"{format_bytes(d['budget_bytes'], compact=True)} budget; headroom "
            f"{format_bytes(d['headroom_bytes'], compact=True)} now, "
            f"{format_bytes(d['headroom_min_bytes'], compact=True)} lowest in "
            f"{summary['window_seconds']:.0f}s")
    p95: dict[str, float] = {}
    for row in summary["latency"]["by_model"]:
        p95[row["model"]] = max(p95.get(row["model"], 0.0), row["p95_seconds"])
    table = Table("MODEL", "TASKS", "STATE", "DEVICE", "PIN", "ESTIMATED", "MEASURED",
                  "IN FLIGHT", "QUEUED", "P95", "LAST USED", "LOAD S", "ERROR")
    now = time.time()
    for m in data["models"]:
        last = f"{now - m['last_used']:.0f}s ago" if m["last_used"] else "-"
        measured = m["bytes_measured"]
        state = m["state"]
        if state == "warm" and m.get("bytes_warm") is not None:
            state = f"warm ({format_bytes(m['bytes_warm'], compact=True)})"
        download = m.get("download")
        if download is not None:  # waiting for its weights: how far the download is
            total = download["total_bytes"]
            state = (f"downloading {format_bytes(download['done_bytes'], compact=True)}/"
                     f"{format_bytes(total, compact=True)}" if total else "downloading")
        table.add_row(m["name"], ",".join(m["tasks"]), state, m["device"],
                      "yes" if m["pinned"] else "",
                      format_bytes(m["bytes_estimated"], compact=True),
                      format_bytes(measured, compact=True) if measured else "-",
                      str(m["in_flight"]), str(m["queued"]),
                      f"{p95[m['name']] * 1000:.0f} ms" if m["name"] in p95 else "-", last,
                      f"{m['load_seconds']:.2f}" if m["load_seconds"] else "-",
                      m["error"] or "")
    console.print(table)
    return 0


def _ps_pool(console: Console, pool: dict[str, Any]) -> int:
    """One table per replica of a pool (GET /v1/pool on its entry point)."""
    from rich.table import Table

    console.print(f"[bold]{len(pool['replicas'])} replicas[/]")
    for rep in pool["replicas"]:
        devices = "; ".join(
            f"{d['name']} {format_bytes(d['used_bytes'], compact=True)} used of "
            f"{format_bytes(d['budget_bytes'], compact=True)}" for d in rep["devices"])
        console.print(f"[bold]replica {rep['replica']}[/] ({rep['group']}, node "
                      f"{rep['node'][:12]}): {devices or 'no report yet'}")
        table = Table("MODEL", "STATE", "PIN", "BYTES", "IN FLIGHT", "QUEUED", "LOAD S",
                      "PLAN")
        for m in rep["models"]:
            table.add_row(m["name"], m["state"], "yes" if m["pinned"] else "",
                          format_bytes(m["bytes"], compact=True), str(m["in_flight"]),
                          str(m["queued"]), f"{m['load_s']:.2f}" if m["load_s"] else "-",
                          m["verdict"])
        console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
