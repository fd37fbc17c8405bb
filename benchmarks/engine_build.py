"""Tokens/s of one llama.cpp build against another: the portable `llama-server` that
scripts/setup.sh builds into .venv (AVX2/FMA/F16C/BMI2, no AVX-512, no AMX) against a native one
(GGML_NATIVE) of the same source, patches and other flags.

Driven by benchmarks/engine_build.sh, which builds the native binary once, runs `measure` for
each binary alternately, each round in fresh server processes, then `report`. A standalone
script, the standard library only (no packserve, no engine binding: it times the binary it is
given), so run it by path:

    python benchmarks/engine_build.py measure --label native --server PATH/llama-server \\
        --model smollm2=PATH.gguf [--model gemma=PATH.gguf] >> runs.jsonl
    python benchmarks/engine_build.py report runs.jsonl \\
        --out benchmarks/results/engine-build.json

`measure` starts the binary on each model in turn (one slot, `--threads N --threads-batch N`,
CPU only, the catalog's 2048-token context, no prompt cache), sends one short completion to
warm it (first touch of the weights and buffers), then one /completion of `--prompt-tokens`
token ids (real prose, tokenized by that server's /tokenize) generating `--gen-tokens` tokens,
greedy (temperature 0; an end-of-text token does not stop it), and prints one JSON line with
llama-server's own `timings` of that request: prompt processing (`prompt_per_second`: one batch
of the prompt) and generation (`predicted_per_second`: the one-token decodes with their
sampling, as the server generates). `report` takes the median of the rounds of each build and
the ratio portable / native. A ratio of two medians measured alternately on one machine is the
figure that means something; absolute tokens/s on a shared machine move by ±20%.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
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
CTX = 2048  # the catalog's context_length for the llama models
START_TIMEOUT_S = 300.0


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode("utf-8"),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        answer: dict[str, Any] = json.loads(r.read())
    return answer


def server_argv(server: str, model: str, threads: int, port: int) -> list[str]:
    """The same settings for every build: one slot, every thread for the prompt and the decode,
    the CPU only (a CUDA build of the portable binary too), no prompt cache in RAM, no trial
    load to fit the context."""
    return [server, "--model", model, "--ctx-size", str(CTX), "--parallel", "1",
            "--threads", str(threads), "--threads-batch", str(threads), "--device", "none",
            "--cache-ram", "0", "--fit", "off", "--no-webui", "--host", "127.0.0.1",
            "--port", str(port)]


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}: "
                               f"{log.read_text('utf-8', 'replace')[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):  # not listening yet, or 503 while loading
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"llama-server was not ready within {START_TIMEOUT_S:.0f}s")
        time.sleep(0.05)


def system_info(server: str, threads: int) -> str:
    """llama.cpp's `system_info` line of a build (what it compiled in: `AVX2 = 1 | ...`), or ""
    when it prints none. llama-server logs it at trace verbosity only, before it loads its
    model: a start at `-lv 4` on no model prints it and exits, so the timed starts log at their
    default verbosity."""
    done = subprocess.run([server, "-lv", "4", "--threads", str(threads), "--device", "none",
                           "--model", os.devnull, "--host", "127.0.0.1",
                           "--port", str(_free_port())],
                          capture_output=True, text=True, timeout=120, check=False,
                          stdin=subprocess.DEVNULL)
    for line in (done.stdout + done.stderr).splitlines():
        if "system_info:" in line:
            return line.split("system_info:", 1)[1].strip()
    return ""


def measure_model(server: str, path: str, *, threads: int, prompt_tokens: int,
                  gen_tokens: int) -> dict[str, Any]:
    """Start `server` on `path`, warm it, time one prompt and its generation; stop it."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="engine-build-") as tmp:
        log = Path(tmp) / "server.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(server_argv(server, path, threads, port),
                                    stdin=subprocess.DEVNULL, stdout=sink, stderr=sink)
        try:
            _wait_ready(proc, url, log)
            first: list[int] = _post(url + "/tokenize", {"content": TEXT,
                                                         "add_special": True})["tokens"]
            more: list[int] = _post(url + "/tokenize", {"content": TEXT,
                                                        "add_special": False})["tokens"]
            tokens = list(first)
            while len(tokens) < prompt_tokens:
                tokens += more
            prompt = tokens[:prompt_tokens]

            def complete(ids: list[int], n: int) -> tuple[dict[str, Any], float]:
                t0 = time.perf_counter()
                answer = _post(url + "/completion", {
                    "prompt": ids, "n_predict": n, "temperature": 0.0, "seed": 0,
                    "ignore_eos": True, "cache_prompt": False, "stream": False})
                return answer, time.perf_counter() - t0

            complete(prompt[:min(64, prompt_tokens)], 8)  # warm-up
            answer, wall = complete(prompt, gen_tokens)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
    t = answer["timings"]
    return {
        "pp_tokens": int(t["prompt_n"]), "pp_seconds": t["prompt_ms"] / 1000.0,
        "pp_tps": float(t["prompt_per_second"]),
        "tg_tokens": int(t["predicted_n"]), "tg_seconds": t["predicted_ms"] / 1000.0,
        "tg_tps": float(t["predicted_per_second"]),
        "wall_seconds": wall,  # the client's, from the request to the answer
        "generated": str(answer.get("content", ""))[:200],
    }


def version(server: str) -> str:
    """`llama-server --version`, on one line."""
    done = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=60,
                          check=False, stdin=subprocess.DEVNULL)
    return " ".join((done.stdout + done.stderr).split())


def cmd_measure(args: argparse.Namespace) -> int:
    models: dict[str, Any] = {}
    for item in args.model:
        name, _, path = item.partition("=")
        models[name] = measure_model(args.server, path, threads=args.threads,
                                     prompt_tokens=args.prompt_tokens,
                                     gen_tokens=args.gen_tokens)
    record = {
        "label": args.label, "round": args.round, "threads": args.threads,
        "binary": str(Path(args.server).resolve()), "version": version(args.server),
        "system_info": system_info(args.server, args.threads),
        "loadavg": os.getloadavg(), "models": models,
    }
    print(json.dumps(record), flush=True)
    return 0


METRICS = (("pp_tps", "prompt processing"), ("tg_tps", "generation"))


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
    source = f" from {result['source']}" if result["source"] else ""
    lines = [
        f"Measured {result['date'][:10]} on {m['cpu']} ({m['cores']} cores; CPU flags: {flags}),"
        f" llama-server{source}, {result['threads']} threads,"
        f" {result['rounds']} alternating rounds, each build in a fresh process"
        f" (`{result['command']}`). Median tokens/s, llama-server's own timings"
        f" (slowest-fastest round):",
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
                        "binary": by_label[label]["binary"],
                        "version": by_label[label]["version"]}
    result = {
        "scenario": "engine-build", "command": args.command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(), "source": args.source,
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
    m = sub.add_parser("measure", help="time one llama-server binary; one JSON line")
    m.add_argument("--label", required=True, help="name of this build in the results")
    m.add_argument("--server", required=True, help="the llama-server binary to time")
    m.add_argument("--model", action="append", required=True, metavar="NAME=PATH",
                   help="a GGUF file to time (repeatable)")
    m.add_argument("--round", type=int, default=0)
    m.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="--threads and --threads-batch (default: every usable core)")
    m.add_argument("--prompt-tokens", type=int, default=256)
    m.add_argument("--gen-tokens", type=int, default=128)
    r = sub.add_parser("report", help="medians and ratios of the runs; JSON + Markdown")
    r.add_argument("runs", help="the JSON lines written by `measure`")
    r.add_argument("--out", required=True, help="JSON results file")
    r.add_argument("--markdown", help="also write the Markdown table here")
    r.add_argument("--portable", default="portable", help="label of the portable build")
    r.add_argument("--native", default="native", help="label of the native build")
    r.add_argument("--portable-flags", default="", help="its cmake flags, for the record")
    r.add_argument("--native-flags", default="", help="its cmake flags, for the record")
    r.add_argument("--source", default="", help="the llama.cpp source both were built from")
    r.add_argument("--command", default="benchmarks/engine_build.sh")
    args = parser.parse_args(argv)
    return cmd_measure(args) if args.cmd == "measure" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
