"""Where llama.cpp's load of a GGUF spends its time: loads the file REPEATS times in a fresh
process (the model only: `llama_model_load_from_file` with default model params, before any
context) under `py-spy record --native`, then prints the median load time (slowed a little by
the sampling) and the share of the load's samples under each part of it. docs/reliability.md
("Patches") quotes it.

    .venv/bin/python -m benchmarks.profile_gguf_load \\
        ~/.cache/packserve/models/gemma-3-270m-q4_k_m.gguf
"""

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.cpu import py_spy

LOAD = "llama_model_load_from_file"
# Functions whose samples (with everything under them) say where a load goes.
PARTS = {
    "read the GGUF header and metadata": "gguf_init_from_file",
    "format metadata for the log (gguf_kv_to_str)": "gguf_kv_to_str",
    "build the vocabulary": "llama_vocab::impl::load",
    "map, read and repack the tensors": "load_tensors",
}

CHILD = """
import statistics, sys, time, llama_cpp
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
seconds = []
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter()
    model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
    seconds.append(time.perf_counter() - t0)
    assert model, "the model did not load"
    llama_cpp.llama_model_free(model)
print("median load seconds:", statistics.median(seconds))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    exe = py_spy()
    if exe is None:
        parser.error("py-spy is not installed (requirements.txt has it): run scripts/setup.sh")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "load.raw"
        child = subprocess.run(
            [exe, "record", "--native", "--rate", "500", "--format", "raw",
             "--output", str(raw), "--", sys.executable, "-c", CHILD, str(args.gguf),
             str(args.repeats)], check=True, capture_output=True, text=True)
        load_s = float(child.stdout.split("median load seconds:")[1].split()[0])
        under: Counter[str] = Counter()
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            if not any(LOAD in f for f in frames):
                continue
            under[LOAD] += int(count)
            for label, function in PARTS.items():
                if any(function in f for f in frames):
                    under[label] += int(count)
    total = under[LOAD]
    if total == 0:
        print("py-spy caught no sample inside the load", file=sys.stderr)
        return 1
    shares = {label: round(under[label] / total, 3) for label in PARTS}
    print(json.dumps({"gguf": str(args.gguf), "repeats": args.repeats,
                      "load_s_median_under_py_spy": round(load_s, 3), "samples": total,
                      "share_of_load": shares}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
