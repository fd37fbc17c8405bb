"""`packserve plan`: arguments, inputs (a config or an ad-hoc model), the report.

The arithmetic lives in `sizing` and `plan`; this module only gathers inputs and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from packserve.planner import catalog, plan, sizing
from packserve.planner.sizing import Breakdown, ModelShape, Workload
from packserve.units import format_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("what to size (a config, or one ad-hoc model)")
    src.add_argument("--config", help="packserve config; without --params: the built-in catalog")
    src.add_argument("--params", help="ad-hoc model size, e.g. 7B, 70B, 135M")
    src.add_argument("--precision", help="fp32|fp16|bf16|fp8|int8|int4|nf4|q4_k_m|q8_0|... "
                                         "(default fp16; bf16 for training a --config model)")
    src.add_argument("--family", help="a well-known family for the architecture, e.g. "
                                      "llama-3.1-70b (see planner/data/families.toml)")
    src.add_argument("--layers", type=int, help="override the architecture: layers")
    src.add_argument("--kv-heads", type=int, help="override the architecture: KV heads")
    src.add_argument("--head-dim", type=int, help="override the architecture: head size")
    work = p.add_argument_group("workload")
    work.add_argument("--task", choices=sizing.TASKS, default="inference")
    work.add_argument("--context", type=int, help="tokens per sequence (default 4096; a "
                                                  "config model: its context_length)")
    work.add_argument("--concurrency", type=int, help="concurrent sequences (default 1; a "
                                                      "config model: its parallel slots)")
    work.add_argument("--batch", type=int, default=1, help="training micro-batch")
    work.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction,
                      default=True, help="training: recompute activations (default on)")
    work.add_argument("--lora-rank", type=int, default=16)
    work.add_argument("--optimizer", choices=("adam", "adam-fp32", "adam-8bit"), default="adam")
    cost = p.add_argument_group("cost")
    cost.add_argument("--gpu", help="only this card (a name from planner/data/gpus.toml)")
    cost.add_argument("--prices", help="a prices TOML shaped like planner/data/prices.toml")
    cost.add_argument("--price-per-hour", type=float, help="override the price per GPU-hour")
    cost.add_argument("--flat-monthly", type=float, help="override the flat monthly rent per GPU")
    cost.add_argument("--tokens-per-second", type=float,
                      help="throughput, for the cost per million tokens (measure it: "
                      "docs/benchmarks.md)")
    cost.add_argument("--purchase-price", type=float, help="price to buy the machine, for the "
                                                           "rent-versus-buy break-even")
    cost.add_argument("--hours-per-day", type=float, default=24.0,
                      help="daily hours of use for the break-even (default 24)")
    cost.add_argument("--kwh-price", type=float, default=0.0,
                      help="electricity per kWh when owning (default 0)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


@dataclass(frozen=True)
class Inputs:
    models: tuple[Breakdown, ...]
    workload: Workload
    notes: tuple[str, ...]


def adhoc_model(args: argparse.Namespace, families: dict[str, catalog.Family]) -> ModelShape:
    n_params = sizing.parse_params(args.params)
    if args.family:
        if args.family not in families:
            raise ValueError(f"unknown family {args.family!r} (known: {', '.join(families)})")
        fam = families[args.family]
    else:
        fam = catalog.typical_family(n_params, families)
    arch = fam.arch
    arch = replace(arch, n_layers=args.layers or arch.n_layers,
                   n_kv_heads=args.kv_heads or arch.n_kv_heads,
                   head_dim=args.head_dim or arch.head_dim)
    precision = (args.precision or "fp16").lower()
    sizing.bits_per_weight(precision)  # refuse unknown precisions early
    label = f"{args.params} {precision}" + (f" ({args.family})" if args.family else "")
    return ModelShape(name=label, n_params=n_params, precision=precision, arch=arch)


def workload(args: argparse.Namespace, context: int | None = None) -> Workload:
    return Workload(task=args.task, context=args.context or context or 4096,
                    sequences=args.concurrency or 1, batch=args.batch,
                    gradient_checkpointing=args.gradient_checkpointing,
                    lora_rank=args.lora_rank, optimizer=args.optimizer)


def gather(args: argparse.Namespace) -> Inputs:
    families = catalog.load_families()
    if args.params:
        shape = adhoc_model(args, families)
        fam = (args.family or catalog.typical_family(shape.n_params, families).name)
        work = workload(args)
        note = (f"architecture from the {fam} family ({families[fam].source})"
                + ("" if args.family else ", the typical family nearest in size"))
        return Inputs(models=(sizing.size_model(shape, work),), workload=work, notes=(note,))
    return config_inputs(args)


def config_inputs(args: argparse.Namespace) -> Inputs:
    """Every model of a config, sized by the code the server's admission uses. Catalog names
    that share one load (`LoadSpec.key`, as the server counts them) count once."""
    from packserve.config import load_config
    from packserve.core.footprint import shape_of
    from packserve.server import as_written, resolve_models

    seen: dict[str, str] = {}
    models: list[Breakdown] = []
    notes: list[str] = []
    for r in resolve_models(load_config(args.config), device=as_written):
        name, context = r.spec.name, args.context or r.load.context_length
        if r.facts is None:
            notes.append(f"{name}: {r.engine.name} engine reads no weight files, not sized")
            continue
        key = replace(r.load, context_length=context).key
        if key in seen:
            notes.append(f"{name}: shares one load with {seen[key]} (counted once)")
            continue
        seen[key] = name
        if args.task == "inference":
            models.append(r.breakdown(context=context, sequences=args.concurrency, gpu=True))
        else:
            shape = replace(shape_of(r.facts, name), stored_bytes=0,
                            precision=(args.precision or "bf16").lower())
            models.append(sizing.size_model(shape, workload(args, r.load.context_length or None)))
    return Inputs(models=tuple(models), workload=workload(args), notes=tuple(notes))


def prices(args: argparse.Namespace) -> catalog.PriceList:
    listed = catalog.load_prices(Path(args.prices) if args.prices else None)
    table = dict(listed.prices)
    config_price = _config_price(args) if not args.params else None
    hourly = args.price_per_hour if args.price_per_hour is not None else config_price
    for gpu in catalog.load_gpus():
        old = table.get(gpu.name)
        if hourly is not None or args.flat_monthly is not None:
            table[gpu.name] = catalog.Price(
                hourly=hourly if hourly is not None else (old.hourly if old else 0.0),
                flat_monthly=(args.flat_monthly if args.flat_monthly is not None
                              else old.flat_monthly if old else None))
    return replace(listed, prices=table)


def _config_price(args: argparse.Namespace) -> float | None:
    """`price_per_hour` set explicitly on a cuda device of the config, if any."""
    if not args.config:
        return None
    from packserve.config import load_config

    config = load_config(args.config)
    for name, dev in config.devices.items():
        if name.startswith("cuda") and "price_per_hour" in dev.model_fields_set:
            value = getattr(dev, "price_per_hour", None)
            if isinstance(value, int | float):
                return float(value)
    return None


def build_report(args: argparse.Namespace) -> dict[str, object]:
    inputs = gather(args)
    gpus = catalog.load_gpus()
    if args.gpu:
        gpus = [g for g in gpus if g.name.lower() == args.gpu.lower()]
        if not gpus:
            raise ValueError(f"unknown GPU {args.gpu!r} (known: "
                             f"{', '.join(g.name for g in catalog.load_gpus())})")
    price_list = prices(args)
    training = inputs.workload.task != "inference"
    models_total = sum(m.total for m in inputs.models)
    rows = []
    for gpu in gpus:
        fit = plan.fit_gpu(gpu, inputs.models, training)
        cost = plan.price_fit(fit, price_list.prices.get(gpu.name), price_list.currency,
                              tokens_per_second=args.tokens_per_second,
                              purchase=args.purchase_price, hours_per_day=args.hours_per_day,
                              kwh_price=args.kwh_price)
        rows.append({
            "name": gpu.name, "memory_bytes": gpu.memory_bytes, "count": fit.count,
            "split_models": list(fit.split_models), "nvlink_needed": fit.nvlink_needed,
            "nvlink": gpu.nvlink, "interconnect": gpu.interconnect,
            "bandwidth_gbs": gpu.bandwidth_gbs, "power_w": gpu.power_w * fit.count,
            "host_ram_bytes": fit.host_ram_bytes, "cpu_cores": fit.cpu_cores,
            "cost": None if cost is None else {
                "currency": cost.currency, "price_per_gpu_hour": cost.price_per_gpu_hour,
                "per_hour": round(cost.cost_per_hour, 4),
                "per_million_tokens": _round(cost.cost_per_million_tokens),
                "break_even_months": _round(cost.break_even_months),
                "flat_rate_beats_per_second_above_hours_per_day":
                    _round(cost.flat_rate_hours_per_day)},
        })
    w = inputs.workload
    return {
        "workload": {"task": w.task, "context": w.context, "concurrency": w.sequences,
                     "batch": w.batch, "gradient_checkpointing": w.gradient_checkpointing},
        "models": [{
            "name": m.name, "weights_bytes": m.weights, "kv_cache_bytes": m.kv_cache,
            "activations_bytes": m.activations, "overhead_bytes": m.overhead,
            "gradients_bytes": m.gradients, "optimizer_bytes": m.optimizer,
            "total_bytes": m.total, "assumptions": list(m.assumptions)} for m in inputs.models],
        "runtime_bytes": sizing.GPU_RUNTIME_BYTES,
        "total_bytes": models_total + sizing.GPU_RUNTIME_BYTES,
        "gpus": rows,
        "host": {
            "host_ram_rule": f"at least {plan.HOST_RAM_PER_GPU_MEMORY}x the total GPU memory",
            "cpu_cores_per_gpu": plan.CPU_CORES_PER_GPU,
            "nvme_bytes": plan.nvme_bytes(inputs.models, training),
            "nvme": "local NVMe with several GB/s of reads for weights"
                    + (" and checkpoints" if training else ""),
        },
        "prices": {"currency": price_list.currency, "as_of": price_list.as_of,
                   "sources": list(price_list.sources)},
        "notes": [
            *inputs.notes,
            f"runtime_bytes: {format_bytes(sizing.GPU_RUNTIME_BYTES, compact=True)} of CUDA "
            f"context per GPU",
            plan.usable_rule(training)],
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def run_plan(args: argparse.Namespace) -> int:
    from packserve.errors import ConfigError

    try:
        report = build_report(args)
    except (ValueError, ConfigError) as exc:
        print(f"packserve plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def _gb(n: object) -> str:
    """A cell of the report: "-" where there is nothing, else decimal GB as cards are sold."""
    return format_bytes(n, decimal=True, compact=True) if isinstance(n, int) and n else "-"


def print_report(report: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 130)
    w = report["workload"]
    assert isinstance(w, dict)
    console.print(f"[bold]plan[/]: {w['task']}, context {w['context']}, "
                  f"concurrency {w['concurrency']}"
                  + (f", batch {w['batch']}, gradient checkpointing "
                     f"{'on' if w['gradient_checkpointing'] else 'off'}"
                     if w["task"] != "inference" else ""))
    models = report["models"]
    assert isinstance(models, list)
    keys = ["weights_bytes", "kv_cache_bytes", "activations_bytes", "overhead_bytes",
            "gradients_bytes", "optimizer_bytes", "total_bytes"]
    if w["task"] == "inference":
        keys = [k for k in keys if k not in ("gradients_bytes", "optimizer_bytes")]
    t = Table("MODEL", *(k.removesuffix("_bytes").replace("_", " ").upper() for k in keys))
    blank = [""] * (len(keys) - 1)
    for m in models:
        t.add_row(m["name"], *(_gb(m[k]) for k in keys))
    t.add_row("CUDA context (per GPU)", *blank[:-1], "", _gb(report["runtime_bytes"]))
    t.add_row("[bold]total[/]", *blank, f"[bold]{_gb(report['total_bytes'])}[/]")
    console.print(t)
    g = Table("GPU", "MEMORY", "COUNT", "NVLINK", "HOST RAM", "CORES", "PER HOUR",
              "PER 1M TOK", "BREAK-EVEN", "FLAT RATE >")
    for row in report["gpus"]:  # type: ignore[attr-defined]
        cost = row["cost"] or {}
        cur = cost.get("currency", "")
        nv = ("needed" if row["nvlink"] else "needed, PCIe only") \
            if row["nvlink_needed"] else "-"
        g.add_row(row["name"], _gb(row["memory_bytes"]), str(row["count"]), nv,
                  _gb(row["host_ram_bytes"]), str(row["cpu_cores"]),
                  f"{cost['per_hour']:.2f} {cur}" if cost else "-",
                  f"{cost['per_million_tokens']:.2f} {cur}"
                  if cost.get("per_million_tokens") is not None else "-",
                  f"{cost['break_even_months']:.1f} mo"
                  if cost.get("break_even_months") is not None else "-",
                  f"{cost['flat_rate_beats_per_second_above_hours_per_day']:.1f} h/day"
                  if cost.get("flat_rate_beats_per_second_above_hours_per_day") is not None
                  else "-")
    console.print(g)
    host = report["host"]
    prices_ = report["prices"]
    assert isinstance(host, dict) and isinstance(prices_, dict)
    console.print(f"host: RAM {host['host_ram_rule']}, {host['cpu_cores_per_gpu']} CPU cores per "
                  f"GPU, {host['nvme']} (at least {_gb(host['nvme_bytes'])})")
    console.print(f"prices: {prices_['currency']} per GPU-hour as of {prices_['as_of']}, "
                  f"indicative (override with --price-per-hour or --prices)")
    for m in models:
        for a in m["assumptions"]:
            console.print(f"  assumption: {a}")
    for n in report["notes"]:  # type: ignore[attr-defined]
        console.print(f"  note: {n}")
