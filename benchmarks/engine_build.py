"""Tokens/s of one llama.cpp build against another: the portable build that scripts/setup.sh
makes (AVX2/FMA/F16C/BMI2, no AVX-512, no AMX) against a native one (GGML_NATIVE).

Driven by benchmarks/engine_build.sh, which builds both wheels, installs each in its own
virtual environment and runs `measure` under each, alternately, then `report`. A standalone
script: it imports llama_cpp and the standard library only, not packserve (the native
environment holds llama-cpp-python alone), so run it by path:

    VENV/bin/python benchmarks/engine_build.py measure --label native \\
        --model smollm2=PATH.gguf [--model gemma=PATH.gguf] >> runs.jsonl
    python benchmarks/engine_build.py report runs.jsonl \\
        --out benchmarks/results/engine-build.json

`measure` prints one JSON line: per model, prompt processing (one batch of `--prompt-tokens`
tokens, wall clock of the decode) and generation (`--gen-tokens` tokens after that prompt, one
at a time, greedy: temperature 0, wall clock including the sampling, as a server generates),
after one warm-up pass. `report` takes the median of the rounds of each build and the ratio
portable / native. A ratio of two medians measured alternately on one machine is the figure
that means something; absolute tokens/s on a shared machine move by ±20%.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# Real prose, longer than any prompt asked for (repeated if a tokenizer needs more).
TEXT = """\
The lighthouse at the end of the northern breakwater was built in 1871, after two winters in
which fishing boats returning at dusk had struck the rocks below the harbour wall. Its first
keeper, a former ship's carpenter named Thomas Hale, lived in a two-room cottage at the foot of
the tower with his wife and three children. Every evening he climbed the ninety-four steps with
a can of paraffin, trimmed the wicks, polished the brass and the great glass lens, and wound the
clockwork that turned the light once every twenty seconds. In storms he stayed in the lantern
room all night, because spray could crack the hot glass and a dark light was worse than none.
The keepers kept a log. It records the weather at every watch, the ships that passed, the oil
burned and the days the relief boat could not land. In February 1899 the log has no entry for
eleven days: the cottage was cut off by ice, and the family lived on salted fish and the flour
they had stored in autumn. The light was never out. When the relief boat finally reached them,
the keeper's only request was for more paraffin and a new pair of boots. Electricity came to
the harbour in 1936, and with it an electric lamp that needed no wick. The clockwork stayed
until 1962, when a motor replaced it. The last keeper left in 1989, when the light was automated
and monitored by radio from a station forty miles away. Today the cottage is a small museum.
Visitors can read the logbooks, climb the steps and look out over the water where the fishing
fleet, much smaller now, still comes home at dusk.
"""

# CPU flags that decide what a build may use, as /proc/cpuinfo spells them.
CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw",
             "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def machine() -> dict[str, Any]:
    """CPU model, core count and the ISA flags that matter to a llama.cpp build."""
    model, flags = "", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text("utf-8").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model or platform.processor() or "?", "cores": os.cpu_count(),
            "flags": {f: f in flags for f in CPU_FLAGS}, "os": platform.platform(),
            "python": platform.python_version()}


def measure_model(path: str, *, threads: int, prompt_tokens: int, gen_tokens: int
                  ) -> dict[str, Any]:
    import llama_cpp

    llm: Any = llama_cpp.Llama(model_path=path, n_ctx=2048, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, use_mmap=False, verbose=False, seed=0)
    try:
        tokens: list[int] = llm.tokenize(TEXT.encode("utf-8"), add_bos=True)
        while len(tokens) < prompt_tokens:
            tokens += tokens[1:]
        prompt = tokens[:prompt_tokens]

        def one_pass(n_prompt: int, n_gen: int) -> tuple[float, float, str]:
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prompt[:n_prompt])
            t1 = time.perf_counter()
            out: list[int] = []
            for _ in range(n_gen):  # greedy; an end-of-text token does not stop the timing
                token = llm.sample(temp=0.0)
                out.append(token)
                llm.eval([token])
            t2 = time.perf_counter()
            return t1 - t0, t2 - t1, llm.detokenize(out).decode("utf-8", "replace")

        one_pass(min(64, prompt_tokens), 8)  # warm-up: first-touch of weights and buffers
        llama_cpp.llama_perf_context_reset(llm.ctx)
        pp_s, tg_s, text = one_pass(prompt_tokens, gen_tokens)
        perf = llama_cpp.llama_perf_context(llm.ctx)
        return {
            "pp_tokens": prompt_tokens, "pp_seconds": pp_s, "pp_tps": prompt_tokens / pp_s,
            "tg_tokens": gen_tokens, "tg_seconds": tg_s, "tg_tps": gen_tokens / tg_s,
            # llama.cpp's own timer of the one-token decodes, without sampling and Python
            "tg_engine_tps": (1000.0 * perf.n_eval / perf.t_eval_ms
                              if perf.t_eval_ms > 0 else None),
            "generated": text[:200],
        }
    finally:
        llm.close()


def cmd_measure(args: argparse.Namespace) -> int:
    import llama_cpp

    models: dict[str, Any] = {}
    for item in args.model:
        name, _, path = item.partition("=")
        models[name] = measure_model(path, threads=args.threads,
                                     prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens)
    record = {
        "label": args.label, "round": args.round, "threads": args.threads,
        "llama_cpp_python": llama_cpp.__version__,
        "library": str(Path(llama_cpp.__file__).parent / "lib"),
        "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
        "loadavg": os.getloadavg(), "models": models,
    }
    print(json.dumps(record), flush=True)
    return 0


METRICS = (("pp_tps", "prompt processing"), ("tg_tps", "generation"),
           ("tg_engine_tps", "generation, llama.cpp's decode timer"))


def summarize(runs: list[dict[str, Any]], portable: str, native: str) -> dict[str, Any]:
    """Per model and metric: the values of each build, their medians and the ratio."""
    out: dict[str, Any] = {}
    for model in dict.fromkeys(m for r in runs for m in r["models"]):  # in the order measured
        rows: dict[str, Any] = {}
        for key, _ in METRICS:
            values = {label: [r["models"][model][key] for r in runs
                              if r["label"] == label and model in r["models"]
                              and r["models"][model].get(key) is not None]
                      for label in (portable, native)}
            medians = {label: statistics.median(v) if v else None for label, v in values.items()}
            p, n = medians[portable], medians[native]
            rows[key] = {"values": values, "median": medians,
                         "ratio": p / n if p is not None and n else None}
        first = next(r for r in runs if model in r["models"])["models"][model]
        out[model] = {"pp_tokens": first["pp_tokens"], "tg_tokens": first["tg_tokens"], **rows}
    return out


def markdown(result: dict[str, Any]) -> str:
    p, n = result["builds"]["portable"]["label"], result["builds"]["native"]["label"]
    m = result["machine"]
    flags = ", ".join(f for f, on in m["flags"].items() if on)
    lines = [
        f"Measured {result['date'][:10]} on {m['cpu']} ({m['cores']} cores; CPU flags: {flags}),"
        f" llama-cpp-python {result['llama_cpp_python']}, {result['threads']} threads,"
        f" {result['rounds']} alternating rounds, each build in a fresh process"
        f" (`{result['command']}`). Median tokens/s (slowest-fastest round):",
        "",
        "| model | tokens/s | portable | native | portable / native |",
        "|---|---|---:|---:|---:|",
    ]

    def cell(row: dict[str, Any], label: str) -> str:
        v = row["values"][label]
        return f"{row['median'][label]:.1f} ({min(v):.0f}-{max(v):.0f})"

    for model, rows in result["models"].items():
        for key, what in METRICS:
            row = rows[key]
            if row["ratio"] is None:
                continue
            size = rows["pp_tokens"] if key == "pp_tps" else rows["tg_tokens"]
            lines.append(f"| {model} | {what}, {size} tokens | {cell(row, p)} | {cell(row, n)}"
                         f" | {row['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def cmd_report(args: argparse.Namespace) -> int:
    runs = [json.loads(line) for line in Path(args.runs).read_text("utf-8").splitlines()
            if line.strip()]
    by_label = {r["label"]: r for r in runs}
    missing = {args.portable, args.native} - set(by_label)
    if missing:
        print(f"no runs labelled {sorted(missing)} in {args.runs}", file=sys.stderr)
        return 1
    builds = {}
    for role, label, flags in (("portable", args.portable, args.portable_flags),
                               ("native", args.native, args.native_flags)):
        builds[role] = {"label": label, "cmake_args": flags,
                        "system_info": by_label[label]["system_info"],
                        "library": by_label[label]["library"]}
    result = {
        "scenario": "engine-build", "command": args.command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(), "llama_cpp_python": runs[0]["llama_cpp_python"],
        "threads": runs[0]["threads"], "rounds": len(runs) // 2, "builds": builds,
        "models": summarize(runs, args.portable, args.native), "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", "utf-8")
    text = markdown(result)
    if args.markdown:
        Path(args.markdown).write_text(text, "utf-8")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time the llama_cpp of this interpreter; one JSON line")
    m.add_argument("--label", required=True, help="name of this build in the results")
    m.add_argument("--model", action="append", required=True, metavar="NAME=PATH",
                   help="a GGUF file to time (repeatable)")
    m.add_argument("--round", type=int, default=0)
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--prompt-tokens", type=int, default=256)
    m.add_argument("--gen-tokens", type=int, default=128)
    r = sub.add_parser("report", help="medians and ratios of the runs; JSON + Markdown")
    r.add_argument("runs", help="the JSON lines written by `measure`")
    r.add_argument("--out", required=True, help="JSON results file")
    r.add_argument("--markdown", help="also write the Markdown table here")
    r.add_argument("--portable", default="portable", help="label of the portable build")
    r.add_argument("--native", default="native", help="label of the native build")
    r.add_argument("--portable-flags", default="", help="its CMAKE_ARGS, for the record")
    r.add_argument("--native-flags", default="", help="its CMAKE_ARGS, for the record")
    r.add_argument("--command", default="benchmarks/engine_build.sh")
    args = parser.parse_args(argv)
    return cmd_measure(args) if args.cmd == "measure" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
